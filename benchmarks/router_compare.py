"""Router benchmark (issue 12): 1 worker vs 2 workers, cache-aware vs round robin.

One prefix-heavy workload (``llmserve bench serve --dataset-name prefix-repetition``)
is sent through ``llmserve router`` to three set-ups, in interleaved rounds so that
drift on a shared machine hits all of them alike:

* ``1w``         one worker with all the threads and all the KV memory;
* ``2w-rr``      two workers, each with half the threads and half the KV memory,
                 ``--policy round_robin``;
* ``2w-cache``   the same two workers, ``--policy cache_aware`` (the default).

The KV memory per worker is sized so that one worker's prefix cache holds about
half of the workload's prefixes: round robin makes each worker compute (and evict)
every prefix, cache-aware routing gives each worker its own half. Reported per
set-up: request and output-token throughput, TTFT median / p99, and the prefix-cache
hit rate summed over the workers' ``llmserve:prefix_cache_{hits,queries}_total``.
The ratios to ``1w`` are printed and written as JSON.

    .venv/bin/python benchmarks/router_compare.py [--rounds 2] [--num-prompts 96]
        [--num-prefixes 16] [--prefix-len 512] [--threads 2] [--out FILE.json]

Each round starts fresh workers (empty caches). Cross-worker TTFT with and without
the shared KV store is ``benchmarks/kv_store_ttft.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

CLI = [sys.executable, "-m", "llmserve.entrypoints.cli"]
BYTES_PER_TOKEN = 30 * 3 * 64 * 2 * 2  # default model, bf16 K and V: 23,040 B/token


class Proc:
    """A CLI process whose log announces its URL (``pattern``'s group 1)."""

    def __init__(self, args: list[str], pattern: str, env: dict | None = None) -> None:
        fd, self.log_path = tempfile.mkstemp(prefix="router-bench-", suffix=".log")
        with os.fdopen(fd, "w") as log:
            self.proc = subprocess.Popen(CLI + args, stdout=log, stderr=subprocess.STDOUT,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1",
                                              **(env or {})})
        self.pattern, self.url = pattern, ""

    def wait_ready(self, timeout: float = 300) -> Proc:
        deadline = time.monotonic() + timeout
        while True:
            if not self.url:
                with open(self.log_path, encoding="utf-8", errors="replace") as f:
                    m = re.search(self.pattern, f.read())
                self.url = m.group(1) if m else ""
            if self.url:
                try:
                    if httpx.get(self.url + "/health", timeout=10).status_code == 200:
                        return self
                except httpx.TransportError:
                    pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise SystemExit(f"{self.proc.args} did not start; log: {self.log_path}")
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def counter(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def run_setup(name: str, args: argparse.Namespace) -> dict:
    n_workers = 1 if name == "1w" else 2
    policy = "round_robin" if name == "2w-rr" else "cache_aware"
    # total KV memory: room for half the prefixes per 2-worker worker, plus the running
    # sequences; the single worker gets the sum (same memory, same threads in total)
    per_worker_tokens = (args.num_prefixes // 2 * args.prefix_len
                         + args.max_concurrency // 2 * (args.prefix_len + args.suffix_len
                                                        + args.output_len))
    kv_mib = per_worker_tokens * BYTES_PER_TOKEN * (2 // n_workers) // 2**20 + 1
    threads = max(1, args.threads // n_workers)
    workers = [Proc(["serve", "--port", "0", "--kv-cache-memory", f"{kv_mib}MiB",
                     "--disable-uvicorn-access-log"],
                    r"listening on (http://127\.0\.0\.1:\d+)",
                    env={"OMP_NUM_THREADS": str(threads)}) for _ in range(n_workers)]
    router = None
    try:
        for w in workers:
            w.wait_ready()
        rargs = ["router", "--port", "0", "--policy", policy, "--health-interval", "0.5"]
        for w in workers:
            rargs += ["--worker", w.url]
        router = Proc(rargs, r"router: listening on (http://127\.0\.0\.1:\d+)").wait_ready()
        out = tempfile.mktemp(suffix=".json")
        cmd = CLI + ["bench", "serve", "--base-url", router.url, "--disable-tqdm",
                     "--dataset-name", "prefix-repetition", "--num-prompts",
                     str(args.num_prompts), "--prefix-repetition-prefix-len",
                     str(args.prefix_len), "--prefix-repetition-suffix-len",
                     str(args.suffix_len), "--prefix-repetition-num-prefixes",
                     str(args.num_prefixes), "--prefix-repetition-output-len",
                     str(args.output_len), "--max-concurrency", str(args.max_concurrency),
                     "--ignore-eos", "--seed", str(args.seed), "--save-result", out]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        with open(out) as f:
            res = json.load(f)
        hits = sum(counter(w.url, "llmserve:prefix_cache_hits_total") for w in workers)
        queries = sum(counter(w.url, "llmserve:prefix_cache_queries_total") for w in workers)
    finally:
        for p in ([router] if router else []) + workers:
            p.stop()
    return {"setup": name, "workers": n_workers, "policy": policy, "threads": threads,
            "kv_cache_mib": kv_mib, "request_throughput": res["request_throughput"],
            "output_throughput": res["output_throughput"],
            "median_ttft_ms": res["median_ttft_ms"], "p99_ttft_ms": res["p99_ttft_ms"],
            "prefix_cache_hit_rate": hits / queries if queries else 0.0,
            "completed": res["completed"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--num-prompts", type=int, default=96)
    ap.add_argument("--num-prefixes", type=int, default=16)
    ap.add_argument("--prefix-len", type=int, default=512)
    ap.add_argument("--suffix-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--max-concurrency", type=int, default=8)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    setups = ["1w", "2w-rr", "2w-cache"]
    rows: list[dict] = []
    for r in range(args.rounds):
        order = setups if r % 2 == 0 else setups[::-1]
        for name in order:
            row = run_setup(name, args)
            row["round"] = r
            rows.append(row)
            print(json.dumps(row), flush=True)

    summary = {}
    for name in setups:
        mine = [x for x in rows if x["setup"] == name]
        summary[name] = {k: statistics.median(x[k] for x in mine)
                         for k in ("request_throughput", "output_throughput",
                                   "median_ttft_ms", "p99_ttft_ms", "prefix_cache_hit_rate")}
    base = summary["1w"]
    print(f"\n{'setup':<10}{'req/s':>8}{'tok/s':>8}{'TTFT p50':>10}{'TTFT p99':>10}"
          f"{'hit rate':>10}{'req/s vs 1w':>13}{'TTFT vs 1w':>12}")
    for name, s in summary.items():
        print(f"{name:<10}{s['request_throughput']:>8.2f}{s['output_throughput']:>8.1f}"
              f"{s['median_ttft_ms']:>10.0f}{s['p99_ttft_ms']:>10.0f}"
              f"{s['prefix_cache_hit_rate']:>10.2f}"
              f"{s['request_throughput'] / base['request_throughput']:>13.2f}"
              f"{s['median_ttft_ms'] / base['median_ttft_ms']:>12.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "machine": platform.processor() or platform.machine(),
                       "loadavg": os.getloadavg(), "rows": rows, "summary": summary}, f,
                      indent=1)


if __name__ == "__main__":
    main()
