"""Quantized KV pages (issue 15 item 1): int8 / fp8_e4m3 KV against bfloat16 KV.

Default model (SmolLM2-135M, gguf-hybrid, bfloat16 activations, 2 threads), one set of
weights shared by three engines that differ only in ``kv_cache_dtype``:

    throughput   W3-style decode: 64 concurrent sequences with 64..512-token prompts
                 (random ids, seed 0), then pure decode steps; the engines' steps are
                 interleaved (A B C A B C ...) so machine drift hits all alike; output
                 tokens/s = 64 / median step time. Plus one end-to-end W3 pass per dtype
                 (prefill + --output-len new tokens, wall time), interleaved too.
    capacity     the pool each dtype gets from the same --kv-cache-memory, and how many
                 2K-token sequences (2048 + 1 tokens each) it holds at once.
    perplexity   of a long text (docs/*.md, the first --ppl-tokens tokens) from the
                 engine's prompt_logprobs, per dtype; relative change vs bfloat16.

    .venv/bin/python benchmarks/kv_cache_dtype.py            # ~10 min on 2 idle cores
    .venv/bin/python benchmarks/kv_cache_dtype.py --quick    # a smoke run

Writes docs/benchmarks/kv_cache_dtype.json. Targets (issue 15): throughput >= 1.3x,
capacity 2x, perplexity within 1% (int8) / 2% (fp8) of bfloat16 KV.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import random
import statistics
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DTYPES = ("bfloat16", "int8", "fp8_e4m3")


def build_engines(kv_cache_memory: str, max_model_len: int):
    """One engine per KV dtype on one set of weights: {dtype: LLMEngine}."""
    from llmserve.engine.arg_utils import EngineArgs
    from llmserve.engine.kv_quality import kv_dtype_variants
    from llmserve.engine.llm_engine import LLMEngine

    first = LLMEngine.from_engine_args(EngineArgs(
        dtype="bfloat16", quantization="gguf-hybrid", enable_prefix_caching=False,
        max_num_seqs=64, kv_cache_memory=kv_cache_memory, max_model_len=max_model_len,
        kv_cache_dtype=DTYPES[0]))
    return {DTYPES[0]: first, **kv_dtype_variants(first, list(DTYPES[1:]))}


def _start(engine, tag: str, prompts: list[list[int]], max_tokens: int) -> list[str]:
    from llmserve.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for req_id, p in zip(ids, prompts):
        engine.add_request(req_id, {"prompt_token_ids": p}, params)
    return ids


def decode_throughput(engines: dict, prompts: list[list[int]], rounds: int,
                      steps_per_round: int) -> dict:
    """Median pure-decode step time of each engine, steps interleaved between engines."""
    times: dict[str, list[float]] = {kv: [] for kv in engines}
    for kv, engine in engines.items():  # prefill everything first (untimed)
        _start(engine, f"tp-{kv}", prompts, rounds * steps_per_round + 64)
        sched = engine.scheduler
        while any(r.num_computed_tokens < r.num_prompt_tokens
                  for r in list(sched.running) + list(sched.waiting)):
            engine.step()
    for _ in range(rounds):
        for kv, engine in engines.items():
            for _ in range(steps_per_round):
                t = time.perf_counter()
                engine.step()
                times[kv].append(time.perf_counter() - t)
                assert len(engine.scheduler.running) == len(prompts), "a request ended"
    out = {}
    for kv, engine in engines.items():
        engine.abort_request([f"tp-{kv}-{i}" for i in range(len(prompts))])
        while engine.has_unfinished_requests():
            engine.step()
        step = statistics.median(times[kv])
        out[kv] = {"step_ms": round(step * 1e3, 2), "decode_tok_s": round(len(prompts) / step, 1),
                   "steps": len(times[kv])}
    return out


def w3_end_to_end(engines: dict, prompts: list[list[int]], output_len: int) -> dict:
    """One W3 pass per engine (prefill + output_len tokens each), the engines' steps
    interleaved (A B C A B C ...) so machine drift hits all alike; each engine's time is
    the sum of its own step times."""
    out = {kv: {"busy": 0.0, "tokens": 0} for kv in engines}
    for kv, engine in engines.items():
        _start(engine, f"w3-{kv}", prompts, output_len)
    live = dict(engines)
    while live:
        for kv, engine in list(live.items()):
            t = time.perf_counter()
            finished = [o for o in engine.step() if o.finished]
            out[kv]["busy"] += time.perf_counter() - t
            out[kv]["tokens"] += sum(len(o.outputs[0].token_ids) for o in finished)
            if not engine.has_unfinished_requests():
                del live[kv]
    return {kv: {"wall_s": round(r["busy"], 2), "output_tok_s": round(r["tokens"] / r["busy"], 1)}
            for kv, r in out.items()}


def capacity(engines: dict, context: int) -> dict:
    out = {}
    for kv, engine in engines.items():
        bs = engine.config.cache_config.block_size
        per_seq = -(-(context + 1) // bs)
        out[kv] = {"bytes_per_token": engine.kv_bytes_per_token,
                   "num_blocks": engine.num_blocks,
                   f"max_seqs_at_{context}": (engine.num_blocks - 1) // per_seq}
    return out


def perplexity(engines: dict, num_tokens: int) -> dict:
    from llmserve.sampling_params import SamplingParams

    parts = []
    for path in sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))):
        with open(path) as f:
            parts.append(f.read())
    text = "\n\n".join(parts)
    out = {}
    for kv, engine in engines.items():
        ids = engine.tokenizer.encode(text)[:num_tokens]
        req = f"ppl-{kv}"
        engine.add_request(req, {"prompt_token_ids": ids},
                           SamplingParams(max_tokens=1, prompt_logprobs=0))
        result = None
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    result = o
        nll = [-d[tok].logprob for tok, d in zip(ids[1:], result.prompt_logprobs[1:])]
        out[kv] = {"ppl": round(math.exp(sum(nll) / len(nll)), 4), "tokens": len(nll)}
    base = out[DTYPES[0]]["ppl"]
    for kv in out:
        out[kv]["vs_bf16_pct"] = round((out[kv]["ppl"] / base - 1) * 100, 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--kv-cache-memory", default="1GiB")
    ap.add_argument("--output-len", type=int, default=None)
    ap.add_argument("--ppl-tokens", type=int, default=None)
    ap.add_argument("--num-seqs", type=int, default=None, help="concurrent sequences (64)")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved decode rounds")
    ap.add_argument("--skip-w3", action="store_true", help="no end-to-end W3 pass")
    ap.add_argument("--output", default=os.path.join(ROOT, "docs", "benchmarks",
                                                     "kv_cache_dtype.json"))
    args = ap.parse_args()
    import torch

    torch.set_num_threads(2)
    quick = args.quick
    output_len = args.output_len or (16 if quick else 128)
    ppl_tokens = args.ppl_tokens or (512 if quick else 2048)
    engines = build_engines(args.kv_cache_memory, max(4096, ppl_tokens + 8))
    rng = random.Random(0)
    num = args.num_seqs or (16 if quick else 64)
    prompts = [[rng.randrange(1000, 40000) for _ in range(rng.randint(64, 512))]
               for _ in range(num)]
    res = {"model": engines[DTYPES[0]].config.model, "threads": 2, "num_seqs": num,
           "capacity": capacity(engines, 2048)}
    print("capacity", json.dumps(res["capacity"]))
    res["decode"] = decode_throughput(engines, prompts, args.rounds or (2 if quick else 4),
                                      4 if quick else 8)
    print("decode", json.dumps(res["decode"]))
    res["perplexity"] = perplexity(engines, ppl_tokens)
    print("perplexity", json.dumps(res["perplexity"]))
    if not args.skip_w3:
        res["w3"] = w3_end_to_end(engines, prompts, output_len)
        print("w3", json.dumps(res["w3"]))
    b = DTYPES[0]
    res["ratios_vs_bf16"] = {kv: {
        "decode_tok_s": round(res["decode"][kv]["decode_tok_s"] / res["decode"][b]["decode_tok_s"], 3),
        "max_seqs_at_2048": round(res["capacity"][kv]["max_seqs_at_2048"] /
                                  res["capacity"][b]["max_seqs_at_2048"], 3)}
        for kv in DTYPES[1:]}
    if "w3" in res:
        for kv in DTYPES[1:]:
            res["ratios_vs_bf16"][kv]["w3_output_tok_s"] = round(
                res["w3"][kv]["output_tok_s"] / res["w3"][b]["output_tok_s"], 3)
    print("ratios", json.dumps(res["ratios_vs_bf16"]))
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(res, f, indent=2)
    print("wrote", args.output)


if __name__ == "__main__":
    main()
