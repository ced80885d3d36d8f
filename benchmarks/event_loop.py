"""Does a large request block the server's event loop? And does admission hold under a
burst? Against a real ``llmserve serve`` process on loopback (float32, default model):

1. ``/health`` latency while a 4 MB completion prompt is in flight (it ends in a 400:
   the prompt is far longer than the context, but only tokenization can tell);
2. with ``--api-key``: the latency of an authenticated 1-token completion while an
   *unauthenticated* 4 MB ``/tokenize`` is in flight;
3. ``--max-num-seqs 4 --max-waiting-requests 8``: five bursts of 80 concurrent long
   streamed completions; how many got 200 and 503 each (exact admission: 12 / 68).

The big request runs in a thread; probes run until its answer is back. ``--src DIR``
runs the server from another checkout's ``src`` (e.g. the commit before the fix), so
one script measures before and after; ``--json PATH`` writes the results.

    .venv/bin/python benchmarks/event_loop.py
    git worktree add /tmp/before <commit> && \\
        .venv/bin/python benchmarks/event_loop.py --src /tmp/before/src
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEY = "sk-bench"
BIG = ("The quick brown fox jumps over the lazy dog. " * 100_000)[:4_000_000]


def start(src: str, *extra: str) -> tuple[subprocess.Popen, str]:
    fd, log_path = tempfile.mkstemp(prefix="llmserve-bench-", suffix=".log")
    env = {**os.environ, "PYTHONPATH": src, "PYTHONUNBUFFERED": "1"}
    with os.fdopen(fd, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "llmserve.entrypoints.cli", "serve",
                                 "--port", "0", "--dtype", "float32", "--kv-cache-memory",
                                 "256MiB", "--disable-uvicorn-access-log", *extra],
                                stdout=log, stderr=subprocess.STDOUT, env=env)

    def read_log() -> str:
        with open(log_path, encoding="utf-8", errors="replace") as f:
            return f.read()

    deadline = time.monotonic() + 600
    url = None
    while time.monotonic() < deadline and proc.poll() is None:
        m = re.search(r"listening on (http://127\.0\.0\.1:\d+)", read_log())
        if m:
            url = m.group(1)
            try:
                if httpx.get(url + "/health", timeout=10).status_code == 200:
                    return proc, url
            except httpx.TransportError:
                pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"server did not start:\n{read_log()}")


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    proc.wait(timeout=60)


def probe_during(url: str, path: str, payload: dict, probe) -> dict:
    """POST the big ``payload`` from a thread; run ``probe()`` (returns seconds) until
    its answer is back."""
    answer: list = []

    def big() -> None:
        try:
            answer.append(httpx.post(url + path, json=payload, timeout=600).status_code)
        except httpx.TransportError as e:
            answer.append(repr(e))

    t0 = time.perf_counter()
    thread = threading.Thread(target=big)
    thread.start()
    lat = []
    while thread.is_alive():
        lat.append(probe())
        time.sleep(0.02)
    thread.join()
    return {"big_status": answer[0], "big_s": round(time.perf_counter() - t0, 3),
            "probes": len(lat), "probe_max_s": round(max(lat, default=0.0), 3),
            "probe_median_s": round(sorted(lat)[len(lat) // 2], 3) if lat else None}


def timed(fn) -> float:
    t = time.perf_counter()
    r = fn()
    assert r.status_code == 200, r.text
    return time.perf_counter() - t


def bursts(url: str, n: int, size: int) -> list[tuple[int, int]]:
    body = {"prompt": "The capital of France is", "max_tokens": 2000, "ignore_eos": True,
            "temperature": 0, "stream": True}

    async def one(client, admitted):
        async with client.stream("POST", url + "/v1/completions", json=body,
                                 headers={"Authorization": f"Bearer {KEY}"}) as r:
            if r.status_code == 200:
                admitted.append(1)
                async for _ in r.aiter_lines():
                    pass
            return r.status_code

    async def burst():
        admitted: list[int] = []
        limits = httpx.Limits(max_connections=size + 10, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=600, limits=limits) as client:
            tasks = [asyncio.create_task(one(client, admitted)) for _ in range(size)]
            while sum(t.done() for t in tasks) + len(admitted) < size:
                await asyncio.sleep(0.05)
            await asyncio.sleep(1.0)  # anything still to be decided
            codes = [t.result() for t in tasks if t.done()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            return len(admitted), codes.count(503)

    out = []
    for _ in range(n):
        out.append(asyncio.run(burst()))
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # let the aborts land
            m = httpx.get(url + "/metrics", timeout=30,
                          headers={"Authorization": f"Bearer {KEY}"}).text
            if re.search(r"num_requests_running\{[^}]*\} 0\.0", m) and \
                    re.search(r"num_requests_waiting\{[^}]*\} 0\.0", m):
                break
            time.sleep(0.1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--src", default=os.path.join(ROOT, "src"),
                    help="the llmserve src directory the server runs from")
    ap.add_argument("--bursts", type=int, default=5)
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()
    results: dict = {"src": args.src}

    proc, url = start(args.src)
    try:
        results["health_idle_s"] = round(min(
            timed(lambda: httpx.get(url + "/health", timeout=600)) for _ in range(20)), 4)
        results["health_during_4mb_completion"] = probe_during(
            url, "/v1/completions", {"prompt": BIG, "max_tokens": 1},
            lambda: timed(lambda: httpx.get(url + "/health", timeout=600)))
    finally:
        stop(proc)
    print(json.dumps(results, indent=1), flush=True)

    proc, url = start(args.src, "--api-key", KEY, "--max-num-seqs", "4",
                      "--max-waiting-requests", "8")
    auth = {"Authorization": f"Bearer {KEY}"}
    small = {"prompt": "The capital of France is", "max_tokens": 1, "temperature": 0}
    try:
        complete = lambda: timed(lambda: httpx.post(  # noqa: E731
            url + "/v1/completions", json=small, headers=auth, timeout=600))
        results["completion_idle_s"] = round(min(complete() for _ in range(5)), 4)
        results["completion_during_unauth_4mb_tokenize"] = probe_during(  # no key
            url, "/tokenize", {"prompt": BIG}, complete)
        results["bursts_200_503"] = bursts(url, args.bursts, 80)
    finally:
        stop(proc)
    print(json.dumps(results, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
