"""Added latency of ``llmserve gateway`` per request: the same worker called directly and
through one gateway replica (key with rpm, tpm and quota set, so every limit script and
the /tokenize call run), alternating, ``max_tokens=1`` chat requests, sequential.

Usage: ``PYTHONPATH=src python benchmarks/gateway_overhead.py [--requests 40]``. Prints
median and p99 end-to-end latency of both paths and of their per-pair difference (ms).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import httpx  # noqa: E402
from tests.gateway_procs import MASTER_KEY, start_gateway, start_redis  # noqa: E402
from tests.test_server import start_server, stop_server  # noqa: E402


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=40)
    args = ap.parse_args()
    worker = start_server()
    redis = start_redis()
    gw = start_gateway(worker.url, redis.url)
    try:
        key = httpx.post(gw.url + "/admin/keys", headers={"Authorization": f"Bearer {MASTER_KEY}"},
                         json={"rpm": 100000, "tpm": 10**8, "daily_token_quota": 10**9}).json()["key"]
        body = {"model": "smollm2-135m-instruct", "max_tokens": 1, "temperature": 0,
                "messages": [{"role": "user", "content": "Say hi."}]}
        direct, via, diff = [], [], []
        with httpx.Client(timeout=300) as c:
            for i in range(args.requests + 3):
                t = time.perf_counter()
                assert c.post(worker.url + "/v1/chat/completions", json=body).status_code == 200
                d = time.perf_counter() - t
                t = time.perf_counter()
                assert c.post(gw.url + "/v1/chat/completions", json=body,
                              headers={"Authorization": f"Bearer {key}"}).status_code == 200
                g = time.perf_counter() - t
                if i >= 3:  # warm-up
                    direct.append(d * 1e3)
                    via.append(g * 1e3)
                    diff.append((g - d) * 1e3)
        for name, xs in (("direct", direct), ("gateway", via), ("added", diff)):
            print(f"{name:8s} median {statistics.median(xs):8.1f} ms   p99 {pct(xs, 0.99):8.1f} ms"
                  f"   (n={len(xs)})")
        print(f"load average: {os.getloadavg()}")
    finally:
        gw.stop()
        redis.stop()
        stop_server(worker)


if __name__ == "__main__":
    main()
