"""The cost of ``--deterministic`` (batch-invariant mode): W1 and W3 of compare.py,
llmserve's default (bfloat16, ``--quantization auto`` = gguf-hybrid) vs the same with
``--deterministic`` (gguf-native weights, every token through the decode kernels).

Interleaved as compare.py (each repetition runs a workload on both engines, rotating
the order, fresh prompts each time); reports medians and the ratio.

    .venv/bin/python benchmarks/deterministic_cost.py [--quick] [--reps-w3 2]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare import FULL, QUICK, ROOT, cpu_name, run, summarize  # noqa: E402
from llmserve.benchmarks.peers import LLMServeContestant  # noqa: E402
from llmserve.loader import load_model_config, resolve_model  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps-w3", type=int, default=None, help="W3 repetitions (default: compare.py's)")
    ap.add_argument("--reps-small", type=int, default=None, help="W1/W2 repetitions")
    ap.add_argument("--w1-new", type=int, default=None, help="W1 new tokens (default 256)")
    ap.add_argument("--w3-n", type=int, default=None, help="W3 prompts (default 64)")
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "benchmarks", "deterministic.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    size = dict(QUICK if args.quick else FULL)
    for key, value in (("reps_w3", args.reps_w3), ("reps_small", args.reps_small),
                       ("w1_new", args.w1_new), ("w3_n", args.w3_n)):
        if value:
            size[key] = value
    t0 = time.perf_counter()
    engines = [LLMServeContestant("default", "bfloat16", "auto", "1GiB", max_num_seqs=64),
               LLMServeContestant("deterministic", "bfloat16", "auto", "1GiB", max_num_seqs=64,
                                  deterministic=True)]
    opts = argparse.Namespace(skip_w3=False, w3_skip=[])
    vocab = load_model_config(resolve_model(None)).vocab_size  # the default model's
    results = run(engines, size, opts, vocab)
    summary = summarize(results)
    d, b = summary["deterministic"], summary["default"]
    lines = ["| mode | W1 decode tok/s | W2 prefill tok/s | W3 output tok/s |", "|---|---|---|---|"]
    for name, s in summary.items():
        lines.append(f"| {name} | {s['w1']:.1f} | {s['w2']:.1f} | {s['w3']:.1f} |")
    lines.append(f"| deterministic / default | {d['w1'] / b['w1']:.2f}x | {d['w2'] / b['w2']:.2f}x "
                 f"| {d['w3'] / b['w3']:.2f}x |")
    meta = {"cpu": cpu_name(), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "size": size, "date": time.strftime("%Y-%m-%d %H:%M"),
            "command": " ".join(["python", "benchmarks/deterministic_cost.py", *sys.argv[1:]]),
            "wall_s": time.perf_counter() - t0}
    print("\n".join(lines))
    print(f"{meta['cpu']}, {meta['threads']} threads, {meta['wall_s']:.0f} s")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({**meta, "summary": summary, "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
