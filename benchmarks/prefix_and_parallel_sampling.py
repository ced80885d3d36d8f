"""Prefix caching and shared-prompt parallel sampling, measured in one run.

P1: TTFT of a request that shares a 1,000-token prefix with an earlier one,
    prefix caching on (cached) vs off (uncached); median of --repeats runs,
    interleaved.
P2: offline throughput of n = 4 sampled completions of one prompt as ONE
    request (prompt KV computed once, shared copy-on-write) vs four separate
    requests (prefix caching off, so each computes the prompt).

    .venv/bin/python benchmarks/prefix_and_parallel_sampling.py [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

from llmserve import LLM, SamplingParams
from llmserve.engine.llm_engine import LLMEngine


def variant(base: LLM, **cache) -> LLM:
    cfg = base.engine.config
    cfg = dataclasses.replace(cfg, cache_config=dataclasses.replace(cfg.cache_config, **cache))
    return LLM.from_engine(LLMEngine(cfg, base.engine.tokenizer, base.engine.runner.model))


def ttft(llm: LLM, prompt: list[int]) -> float:
    out = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]
    return out.metrics.time_to_first_token


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prompt-len", type=int, default=512, help="P2 prompt tokens")
    ap.add_argument("--max-tokens", type=int, default=64, help="P2 tokens per sample")
    args = ap.parse_args()
    base = LLM(dtype=args.dtype, kv_cache_memory="1GiB")
    cached = variant(base, enable_prefix_caching=True)
    uncached = variant(base, enable_prefix_caching=False)
    tok = base.get_tokenizer()
    prefix = tok.encode("Background: the museum opens at nine and closes at six. " * 90)[:1000]
    cached.generate({"prompt_token_ids": prefix + [30]}, SamplingParams(max_tokens=1),
                    use_tqdm=False)  # fill the cache with the shared prefix
    c_times, u_times = [], []
    for i in range(args.repeats):
        question = tok.encode(f" Question {i}: when does it close?")
        c_times.append(ttft(cached, prefix + question))
        u_times.append(ttft(uncached, prefix + question))
    c, u = statistics.median(c_times), statistics.median(u_times)
    print(f"P1 TTFT, 1,000-token shared prefix ({args.dtype}): cached {c * 1e3:.1f} ms, "
          f"uncached {u * 1e3:.1f} ms, speed-up {u / c:.1f}x")

    prompt = tok.encode("Write a story about a robot. " * 200)[:args.prompt_len]
    one = SamplingParams(n=4, temperature=0.8, seed=0, max_tokens=args.max_tokens,
                         ignore_eos=True)
    sep = [SamplingParams(temperature=0.8, seed=i, max_tokens=args.max_tokens, ignore_eos=True)
           for i in range(4)]
    results = {}
    for name in ("n=4", "4 requests", "n=4 ", "4 requests "):
        t0 = time.perf_counter()
        if name.startswith("n=4"):
            outs = uncached.generate({"prompt_token_ids": prompt}, one, use_tqdm=False)
            ntok = sum(len(c.token_ids) for c in outs[0].outputs)
        else:
            outs = uncached.generate([{"prompt_token_ids": prompt}] * 4, sep, use_tqdm=False)
            ntok = sum(len(o.outputs[0].token_ids) for o in outs)
        dt = time.perf_counter() - t0
        results.setdefault(name.strip(), []).append(ntok / dt)
    n4 = max(results["n=4"])
    sep4 = max(results["4 requests"])
    print(f"P2 {args.prompt_len}-token prompt, 4 x {args.max_tokens} tokens ({args.dtype}): "
          f"n=4 {n4:.1f} tok/s, four requests {sep4:.1f} tok/s, ratio {n4 / sep4:.2f}x")


if __name__ == "__main__":
    main()
