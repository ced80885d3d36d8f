"""Data parallelism on this machine: request throughput at dp=1 vs dp=N, one server each.

Starts ``llmserve serve`` twice (``--data-parallel-size 1`` and ``N``, float32, each
on a free loopback port), then sends the same batch of concurrent completions to each
in interleaved rounds (dp=1, dp=N, dp=1, ...), so drift on a shared machine hits both
alike. Reports medians of output tokens/s and the dp=N / dp=1 ratio, and how the
dp=N front spread the requests (``llmserve_router:requests_total`` per replica).

Each replica gets ``cores // N`` OpenMP threads, so on a 2-core box dp=2 is two
1-thread engines against one 2-thread engine: expect little gain, as only the
batching changes (two half-size batches, run side by side). Example::

    python benchmarks/data_parallel.py --dp 2 --concurrency 8 --output-len 32 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import httpx

MODEL = "smollm2-135m-instruct"


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def start(dp: int, log_path: str) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "llmserve.entrypoints.cli", "serve", "--port", "0",
           "--dtype", "float32", "--kv-cache-memory", "128MiB", "--max-model-len", "1024",
           "--disable-uvicorn-access-log", "--data-parallel-size", str(dp)]
    log = open(log_path, "w")  # noqa: SIM115 (held by the child)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + 900
    url = None
    while time.monotonic() < deadline:
        m = re.search(r"listening on (http://127\.0\.0\.1:\d+)", _read(log_path))
        if m and url is None:
            url = m.group(1)
        if url:
            try:
                if httpx.get(url + "/health", timeout=10).status_code == 200:
                    return proc, url
            except httpx.TransportError:
                pass
        if proc.poll() is not None:
            break
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"dp={dp} server did not start:\n{_read(log_path)[-3000:]}")


def one_round(url: str, prompts: list[str], output_len: int) -> tuple[float, int]:
    tokens = [0] * len(prompts)

    def call(i: int) -> None:
        r = httpx.post(url + "/v1/completions", timeout=600, json={
            "model": MODEL, "prompt": prompts[i], "max_tokens": output_len,
            "temperature": 0, "ignore_eos": True})
        r.raise_for_status()
        tokens[i] = r.json()["usage"]["completion_tokens"]
    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(prompts))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0, sum(tokens)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="llmserve-dp-bench-")
    servers = {name: start(dp, os.path.join(tmp, f"{name}.log"))
               for name, dp in (("dp1", 1), (f"dp{args.dp}", args.dp))}
    try:
        prompts = [f"Write a short story about a robot named R{i}." for i in
                   range(args.concurrency)]
        for _, url in servers.values():  # warm-up
            one_round(url, prompts[:2], 2)
        samples: dict[str, list[tuple[float, int]]] = {n: [] for n in servers}
        for _ in range(args.rounds):
            for name, (_, url) in servers.items():
                samples[name].append(one_round(url, prompts, args.output_len))
        report = {"concurrency": args.concurrency, "output_len": args.output_len,
                  "rounds": args.rounds, "cores": os.cpu_count(),
                  "load_average": [round(x, 1) for x in os.getloadavg()]}
        for name, rows in samples.items():
            report[name] = {"tokens_per_s": round(statistics.median(t / s for s, t in rows), 2),
                            "round_s": round(statistics.median(s for s, _ in rows), 2)}
        report["throughput_ratio"] = round(report[f"dp{args.dp}"]["tokens_per_s"]
                                           / report["dp1"]["tokens_per_s"], 2)
        text = httpx.get(servers[f"dp{args.dp}"][1] + "/metrics", timeout=30).text
        report["requests_per_replica"] = {
            m.group(1): float(m.group(2)) for m in re.finditer(
                r'^llmserve_router:requests_total\{worker="(dp\d+)"\} (\S+)', text, re.M)}
        print(json.dumps(report, indent=2))
    finally:
        for proc, _ in servers.values():
            proc.terminate()
        for proc, _ in servers.values():
            proc.wait(60)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
