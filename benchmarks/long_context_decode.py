"""Long-context decode (issue 15 item 4): split-K decode attention against the kernel it
replaced, which gave each sequence one thread.

Two arms in one process, interleaved (A B A B ...) so machine drift hits both alike:

    one-thread   the decode-attention kernel of --baseline-rev (git), built from that
                 revision's sources with the same compiler flags: each sequence on one
                 thread, so one long sequence leaves the other cores idle.
    split-K      this tree's kernel: 512-position spans on every thread, combined by
                 log-sum-exp (flash-decoding).

    kernel   one attention call per layer shape, one sequence of 2K / 8K / 32K tokens
             (default model: 9 query heads, 3 KV heads, head_dim 64; Qwen2.5-1.5B: 12,
             2, 128), bf16 and int8 KV pages, times the model's layers = the attention
             part of one decode step; plus the KV bytes read / the measured bandwidth
             (the roofline) and a 64 x 512 batch (W3-like: must not get slower).
    engine   decode step time of the default model (gguf-hybrid, bf16) with one 2K / 8K
             sequence in the cache (2K / 8000: the model holds 8192 positions; median of pure
             decode steps): the arms swap the
             engine's attention functions, nothing else.

    .venv/bin/python benchmarks/long_context_decode.py           # ~3 min on 2 idle cores
    .venv/bin/python benchmarks/long_context_decode.py --quick

Writes docs/benchmarks/long_context_decode.json.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import os
import statistics
import subprocess
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNEL_DIR = "src/llmserve/kernels"
# (name, query heads, KV heads, head_dim, layers)
SHAPES = [("smollm2-135m", 9, 3, 64, 30), ("qwen2.5-1.5b", 12, 2, 128, 28)]


def build_baseline(rev: str):
    """The kernels of git revision ``rev``, compiled with this tree's flags."""
    from llmserve import kernels
    from llmserve.kernels.cpu import CpuKernels

    folder = tempfile.mkdtemp(prefix="llmserve-baseline-")
    names = subprocess.run(["git", "-C", ROOT, "ls-tree", "--name-only", f"{rev}:{KERNEL_DIR}"],
                           check=True, capture_output=True, text=True).stdout.split()
    for name in names:
        if name.endswith(".c"):
            src = subprocess.run(["git", "-C", ROOT, "show", f"{rev}:{KERNEL_DIR}/{name}"],
                                 check=True, capture_output=True).stdout
            with open(os.path.join(folder, name), "wb") as f:
                f.write(src)
    lib = os.path.join(folder, "libbaseline.so")
    flags = kernels._BASE_FLAGS + kernels._OPENMP_FLAGS + kernels._NATIVE_FLAGS
    subprocess.run(["cc", os.path.join(folder, "cpu_kernels.c"), "-o", lib, *flags], check=True)
    return CpuKernels(ctypes.CDLL(lib))


def _attend(kern, kv: str, q, kc, vc, table, lens, threads: int):
    """One decode-attention call of either arm on bf16 or int8 pages."""
    scale = q.shape[-1] ** -0.5
    if kv == "bf16":
        return kern.paged_attention_decode(q, kc, vc, table, lens, scale, None, threads)
    return kern.paged_attention_decode_quant("int8", q, kc, vc, table, lens, scale, None,
                                             threads)


def _median_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def kernel_rows(arms: dict, contexts: list[int], reps: int, bandwidth: float) -> list[dict]:
    from llmserve.layers.attention.kv_quant import quantize_kv

    rows = []
    threads = torch.get_num_threads()
    cases = [(n, 1, ctx) for n in range(len(SHAPES)) for ctx in contexts] + [(0, 64, 512)]
    for shape_idx, num_seqs, ctx in cases:
        name, H, Hkv, D, layers = SHAPES[shape_idx]
        bs = 16
        per_seq = -(-ctx // bs)
        g = torch.Generator().manual_seed(ctx)
        k = torch.randn(num_seqs * per_seq + 1, bs, Hkv, D, generator=g).to(torch.bfloat16)
        v = torch.randn(k.shape, generator=g).to(torch.bfloat16)
        caches = {"bf16": (k, v), "int8": (quantize_kv(k.float(), "int8"),
                                           quantize_kv(v.float(), "int8"))}
        table = torch.arange(1, num_seqs * per_seq + 1).view(num_seqs, per_seq)
        lens = torch.full((num_seqs,), ctx, dtype=torch.int64)
        q = torch.randn(num_seqs, H, D, generator=g).to(torch.bfloat16)
        for kv, (kc, vc) in caches.items():
            row = {"model": name, "num_seqs": num_seqs, "context": ctx, "kv": kv}
            ms = {}
            for _ in range(2):  # interleaved rounds
                for arm, kern in arms.items():
                    fn = functools.partial(_attend, kern, kv, q, kc, vc, table, lens, threads)
                    ms.setdefault(arm, []).append(_median_ms(fn, reps))
            for arm in arms:
                row[f"{arm}_step_ms"] = round(min(ms[arm]) * layers, 2)
            kv_bytes = num_seqs * ctx * Hkv * 2 * (D * 2 if kv == "bf16" else D + 2) * layers
            row["roofline_ms"] = round(kv_bytes / bandwidth * 1e3, 2)
            row["speedup"] = round(row["one-thread_step_ms"] / row["split-K_step_ms"], 2)
            row["split-K_of_roofline"] = round(row["roofline_ms"] / row["split-K_step_ms"], 2)
            rows.append(row)
            print(row, flush=True)
    return rows


def engine_rows(arms: dict, contexts: list[int], steps: int) -> list[dict]:
    from llmserve.engine.arg_utils import EngineArgs
    from llmserve.engine.llm_engine import LLMEngine
    from llmserve.kernels import get_cpu_kernels
    from llmserve.sampling_params import SamplingParams

    live = get_cpu_kernels()
    fns = {arm: (k._paged_attention_decode, k._paged_attention_decode_quant)
           for arm, k in arms.items()}
    engine = LLMEngine.from_engine_args(EngineArgs(
        dtype="bfloat16", quantization="gguf-hybrid", enable_prefix_caching=False,
        max_num_seqs=1, max_model_len=max(contexts) + 4 * steps + 8))
    rows = []
    for ctx in contexts:
        prompt = [int(t) for t in torch.randint(100, 40000, (ctx,),
                                               generator=torch.Generator().manual_seed(1))]
        engine.add_request(f"ctx-{ctx}", {"prompt_token_ids": prompt},
                           SamplingParams(max_tokens=4 * steps + 4, temperature=0.0,
                                          ignore_eos=True))
        while not any(r.num_computed_tokens >= r.num_prompt_tokens
                      for r in engine.scheduler.running):  # prefill, untimed
            engine.step()
        times: dict[str, list[float]] = {arm: [] for arm in arms}
        for _ in range(2):
            for arm in arms:
                live._paged_attention_decode, live._paged_attention_decode_quant = fns[arm]
                for _ in range(steps):
                    t = time.perf_counter()
                    engine.step()
                    times[arm].append(time.perf_counter() - t)
        live._paged_attention_decode, live._paged_attention_decode_quant = fns["split-K"]
        engine.abort_request([f"ctx-{ctx}"])
        while engine.has_unfinished_requests():
            engine.step()
        row = {"model": "smollm2-135m (engine)", "context": ctx}
        for arm in arms:
            row[f"{arm}_step_ms"] = round(statistics.median(times[arm]) * 1e3, 2)
        row["speedup"] = round(row["one-thread_step_ms"] / row["split-K_step_ms"], 2)
        rows.append(row)
        print(row, flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--baseline-rev", default="5f08633",
                   help="git revision whose decode kernel is the one-thread arm")
    p.add_argument("--contexts", default="2048,8192,32768")
    p.add_argument("--engine-contexts", default="2048,8000",
                   help="the default model holds 8192 positions")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "benchmarks",
                                                 "long_context_decode.json"))
    args = p.parse_args()
    from llmserve.benchmarks.roofline import memory_bandwidth
    from llmserve.kernels import get_cpu_kernels

    torch.set_num_threads(min(2, os.cpu_count() or 1))
    if args.quick:
        args.contexts, args.engine_contexts, args.reps, args.steps = "2048", "2048", 3, 3
    arms = {"one-thread": build_baseline(args.baseline_rev), "split-K": get_cpu_kernels()}
    bandwidth = memory_bandwidth()["read_GBps"] * 1e9
    contexts = [int(c) for c in args.contexts.split(",")]
    result = {"threads": torch.get_num_threads(), "baseline_rev": args.baseline_rev,
              "read_bandwidth_gb_s": round(bandwidth / 1e9, 1),
              "kernel": kernel_rows(arms, contexts, args.reps, bandwidth),
              "engine": engine_rows(arms, [int(c) for c in args.engine_contexts.split(",")],
                                    args.steps),
              "load_average": os.getloadavg()[0]}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
