"""H2O decode: block scores from the C decode kernel against the PyTorch scored path
(issue 15 item 2), and the kernel without scores against the kernel before them.

Three parts, each interleaved (A B A B ...) in one process so machine drift hits every
arm alike:

    engine   the default model (SmolLM2-135M, gguf-hybrid, bf16), one request with a
             --context-token prompt under --budget tokens of KV and --policy (h2o): median
             decode step time with the decode rows' scores from the kernel
             (scored.KERNEL_DECODE_SCORES = True) vs the old path (False: every row of a
             scored step through layers/attention/scored.py), rounds of --steps steps.
    prompt   the same engine: prefill time of one scored --context-token prompt, its rows
             through the C kernels (scored.KERNEL_PROMPT_SCORES) vs the PyTorch path.
    kernel   one decode-attention call per layer (9 / 3 heads, head_dim 64, bf16 pages, a
             --budget and a --context-token sequence, x 30 layers): --baseline-rev's
             kernel (built from git, no score accumulator), this tree's with NULL score
             pointers, and this tree's with an accumulator.

    PYTHONPATH=src .venv/bin/python benchmarks/h2o_decode.py --json docs/benchmarks/h2o_decode.json
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from long_context_decode import _median_ms, build_baseline  # noqa: E402


def _engine(args):
    """The benchmark's engine and its random ``--context``-token prompt."""
    from llmserve.engine.arg_utils import EngineArgs
    from llmserve.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_engine_args(EngineArgs(
        dtype="bfloat16", quantization="gguf-hybrid", enable_prefix_caching=False,
        max_num_seqs=1, max_model_len=args.context + 2 * args.rounds * args.steps + 64,
        kv_eviction_policy=args.policy, kv_budget_tokens=args.budget))
    prompt = [int(t) for t in torch.randint(100, 40000, (args.context,),
                                           generator=torch.Generator().manual_seed(1))]
    return engine, prompt


def prompt_rows(args) -> list[dict]:
    """Prefill time of one scored prompt (H2O scores every prompt row): the prompt rows
    through the C kernels (scored.KERNEL_PROMPT_SCORES = True) vs the PyTorch scored path,
    interleaved over --prompt-rounds fresh requests."""
    from llmserve.layers.attention import scored
    from llmserve.sampling_params import SamplingParams

    engine, prompt = _engine(args)
    times: dict[bool, list[float]] = {True: [], False: []}
    for r in range(args.prompt_rounds):
        for arm in (True, False):
            scored.KERNEL_PROMPT_SCORES = arm
            rid = f"p{r}{arm}"
            engine.add_request(rid, {"prompt_token_ids": prompt},
                               SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
            t0 = time.perf_counter()
            while not any(q.num_computed_tokens >= q.num_prompt_tokens
                          for q in engine.scheduler.running):
                engine.step()
            times[arm].append(time.perf_counter() - t0)
            engine.abort_request([rid])
            while engine.has_unfinished_requests():
                engine.step()
    scored.KERNEL_PROMPT_SCORES = True
    row = {"model": "smollm2-135m (engine)", "policy": args.policy, "context": args.context,
           "rounds": args.prompt_rounds,
           "kernel_prompt_prefill_s": round(min(times[True]), 2),
           "pytorch_prompt_prefill_s": round(min(times[False]), 2)}
    row["speedup"] = round(row["pytorch_prompt_prefill_s"] / row["kernel_prompt_prefill_s"], 1)
    print(row, flush=True)
    return [row]


def engine_rows(args) -> list[dict]:
    from llmserve.layers.attention import scored
    from llmserve.sampling_params import SamplingParams

    engine, prompt = _engine(args)
    engine.add_request("h2o", {"prompt_token_ids": prompt},
                       SamplingParams(max_tokens=2 * args.rounds * args.steps + 8,
                                      temperature=0.0, ignore_eos=True))
    t0 = time.perf_counter()
    while not any(r.num_computed_tokens >= r.num_prompt_tokens
                  for r in engine.scheduler.running):  # prefill (scored prompt rows)
        engine.step()
    prefill_s = time.perf_counter() - t0
    for _ in range(3):
        engine.step()  # the first decodes (evictions down to the budget), untimed
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.rounds):
        for arm in (True, False):
            scored.KERNEL_DECODE_SCORES = arm
            for _ in range(args.steps):
                t = time.perf_counter()
                engine.step()
                times[arm].append(time.perf_counter() - t)
    scored.KERNEL_DECODE_SCORES = True
    kept = len(engine.scheduler.kv_cache_manager.get_block_ids("h2o"))
    engine.abort_request(["h2o"])
    while engine.has_unfinished_requests():
        engine.step()
    row = {"model": "smollm2-135m (engine)", "policy": args.policy, "context": args.context,
           "budget": args.budget, "kept_blocks": kept, "prefill_s": round(prefill_s, 2),
           "steps_per_arm": len(times[True]),
           "kernel_scores_step_ms": round(statistics.median(times[True]) * 1e3, 2),
           "pytorch_scores_step_ms": round(statistics.median(times[False]) * 1e3, 2)}
    row["speedup"] = round(row["pytorch_scores_step_ms"] / row["kernel_scores_step_ms"], 1)
    print(row, flush=True)
    return [row]


def kernel_rows(args) -> list[dict]:
    from llmserve.kernels import get_cpu_kernels

    base, live = build_baseline(args.baseline_rev), get_cpu_kernels()
    threads = torch.get_num_threads()
    H, Hkv, D, layers, bs = 9, 3, 64, 30, 16
    rows = []
    for ctx in (args.budget, args.context):
        g = torch.Generator().manual_seed(ctx)
        nb = -(-ctx // bs)
        kc = torch.randn(nb + 1, bs, Hkv, D, generator=g).to(torch.bfloat16)
        vc = torch.randn(kc.shape, generator=g).to(torch.bfloat16)
        table = torch.arange(1, nb + 1).view(1, nb)
        lens = torch.tensor([ctx])
        q = torch.randn(1, H, D, generator=g).to(torch.bfloat16)
        scores = live.block_score_arrays([torch.zeros(nb)])
        out = q.new_empty(1, H, D)

        # dtype, out, query, q_stride, caches, num_blocks, table, width, stride, seq_lens,
        # num_seqs, heads, kv heads, head_dim, block_size, scale, window, threads
        call = (1, out.data_ptr(), q.data_ptr(), H * D, kc.data_ptr(), vc.data_ptr(), nb + 1,
                table.data_ptr(), nb, nb, lens.data_ptr(), 1, H, Hkv, D, bs, D ** -0.5, 0,
                threads)
        arms = {"baseline": functools.partial(base._lib.paged_attention_decode, *call),
                "no_scores": functools.partial(live._paged_attention_decode, *call, None, None),
                "scores": functools.partial(live._paged_attention_decode, *call,
                                            *scores.ptr_args(1, "bench"))}
        base._lib.paged_attention_decode.argtypes = live._paged_attention_decode.argtypes[:-2]
        ms: dict[str, list[float]] = {}
        for _ in range(args.kernel_rounds):
            for arm, fn in arms.items():
                ms.setdefault(arm, []).append(_median_ms(fn, args.reps))
        row = {"kernel": "paged_attention_decode bf16 9/3x64 x 30 layers", "context": ctx}
        for arm in arms:
            row[f"{arm}_step_ms"] = round(min(ms[arm]) * layers, 3)
        rows.append(row)
        print(row, flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--budget", type=int, default=512)
    p.add_argument("--policy", default="h2o")
    p.add_argument("--steps", type=int, default=5, help="decode steps per arm and round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--baseline-rev", default="720c517",
                   help="git revision whose decode kernel has no score accumulator")
    p.add_argument("--prompt-rounds", type=int, default=2,
                   help="scored prompts per arm (prefill: kernel vs PyTorch scores)")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--kernel-rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    p.add_argument("--parts", default="kernel,engine,prompt",
                   help="comma-separated parts to run (kernel, engine, prompt)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    parts = {"kernel": kernel_rows, "engine": engine_rows, "prompt": prompt_rows}
    result = {"threads": torch.get_num_threads(), "baseline_rev": args.baseline_rev}
    for name in args.parts.split(","):
        if name not in parts:
            p.error(f"--parts: unknown part {name!r}; choose from {sorted(parts)}")
        result[name] = parts[name](args)
    result["load_average"] = os.getloadavg()[0]
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
