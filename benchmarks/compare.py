"""llmserve vs transformers vs llama.cpp on one GGUF model, side by side in one run.

Workloads (same token ids for every engine, greedy, EOS ignored; issue 5):

    W1  batch-1 decode: a 32-token prompt, 256 new tokens -> decode tokens/s
    W2  prefill of one 512-token prompt                   -> prompt tokens / TTFT
    W3  64 prompts of 64..512 tokens, 128 new tokens each -> output tokens/s (wall time)

Engines: llmserve in each weight format (dequantized float32, bfloat16, native
GGUF 4-bit ``gguf-native``, ``gguf-hybrid``), transformers (float32 and
bfloat16 for W1/W2; W3 in bfloat16 with its best batching: continuous batching
and padded ``generate``, the faster reported) and llama.cpp via
``llama-cpp-python`` (skipped with a message when not installed).

Measurements are interleaved: each repetition runs one workload on every engine
(rotating the order) before the next, and each repetition uses fresh prompts, so
drift on a shared machine hits all engines alike and no prefix cache helps.
Reported: the median over repetitions, and ratios. Writes a JSON result, a PNG
plot and the table in ``docs/benchmarks.md`` (between the ``compare`` markers).

    .venv/bin/python benchmarks/compare.py            # full size (~10-15 min on 2 cores)
    .venv/bin/python benchmarks/compare.py --quick    # small sizes, a smoke run (~2 min)
    .venv/bin/python benchmarks/compare.py --model qwen2.5-coder-1.5b-instruct-q4_k_m

``--model`` (a GGUF path or a fetched model's name) runs another model: by default
llmserve-hybrid, transformers fp32 and llama.cpp, with the REAL sizes (W1 48 new
tokens, 2 repetitions; W3 12 prompts of 64..256 tokens, 24 new tokens each: llama.cpp
runs W3 one prompt at a time, and the full W3 would take it ~20 min on a 1.5B model), and its
table goes between its own markers (``compare-<name>``) in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time

import torch

from llmserve.benchmarks.peers import (
    LlamaCppContestant,
    LLMServeContestant,
    TransformersContestant,
)
from llmserve.benchmarks.roofline import memory_bandwidth, peak_matmul, roofline_tokens_per_s
from llmserve.loader import load_model_config, resolve_model
from llmserve.loader.gguf_loader import gguf_tensor_types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FULL = dict(w1_prompt=32, w1_new=256, w2_prompt=512, w3_n=64, w3_lo=64, w3_hi=512, w3_new=128,
            reps_small=3, reps_w3=1)
REAL = dict(w1_prompt=32, w1_new=48, w2_prompt=512, w3_n=12, w3_lo=64, w3_hi=256, w3_new=24,
            reps_small=2, reps_w3=1)
QUICK = dict(w1_prompt=32, w1_new=48, w2_prompt=128, w3_n=8, w3_lo=32, w3_hi=128, w3_new=16,
             reps_small=2, reps_w3=1)
LLMSERVE_FORMATS = {"llmserve-fp32": ("float32", "none"), "llmserve-bf16": ("bfloat16", "none"),
                    "llmserve-native": ("bfloat16", "gguf-native"),
                    "llmserve-hybrid": ("bfloat16", "gguf-hybrid"),
                    "llmserve-hybrid-int8": ("bfloat16", "gguf-hybrid-int8")}
METRICS = {"w1": "decode_tok_s", "w2": "prefill_tok_s", "w3": "output_tok_s"}
LABELS = {"w1": "W1 decode tok/s", "w2": "W2 prefill tok/s", "w3": "W3 output tok/s"}
# transformers keeps a K-quant GGUF's weights packed and computes in float32 (bfloat16
# casts every matmul's input and output: slower), so float32 is its best dtype here
REAL_DEFAULTS = {"llmserve": ["llmserve-hybrid", "llmserve-hybrid-int8"], "transformers": ["float32"],
                 "w3_skip": []}
SMOLLM2_DEFAULTS = {"llmserve": list(LLMSERVE_FORMATS), "transformers": ["float32", "bfloat16"],
                    "w3_skip": ["transformers-fp32"]}


def markers(slug: str) -> tuple[str, str]:
    tag = "compare" if not slug else f"compare-{slug}"
    return f"<!-- {tag}:begin -->", f"<!-- {tag}:end -->"


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def prompts_for(rep: int, size: dict, vocab: int = 49152) -> dict:
    """Token ids drawn from ``[1000, vocab - 1000)`` (no special tokens), seeded by ``rep``."""
    rng = random.Random(1000 + rep)

    def ids(n):
        return [rng.randint(1000, vocab - 1000) for _ in range(n)]

    return {"w1": ids(size["w1_prompt"]), "w2": ids(size["w2_prompt"]),
            "w3": [ids(rng.randint(size["w3_lo"], size["w3_hi"])) for _ in range(size["w3_n"])]}


def build_contestants(args, gguf_path: str) -> list:
    out = []
    for name in args.llmserve:
        dtype, quant = LLMSERVE_FORMATS[name]
        mem = "2GiB" if dtype == "float32" else "1GiB"
        print(f"loading {name} ...", file=sys.stderr)
        out.append(LLMServeContestant(name, dtype, quant, mem, max_num_seqs=64,
                                      model=args.model))
    for dtype in args.transformers:
        print(f"loading transformers {dtype} ...", file=sys.stderr)
        out.append(TransformersContestant(gguf_path, dtype, args.hf_batch, args.hf_w3_mode))
    if not args.no_llama_cpp:
        try:
            out.append(LlamaCppContestant(gguf_path, torch.get_num_threads()))
        except ImportError:
            print("llama.cpp: llama-cpp-python is not installed (pip install -e '.[peers]'); "
                  "skipping it", file=sys.stderr)
    return out


def run(contestants: list, size: dict, args, vocab: int) -> dict:
    results = {c.name: {"w1": [], "w2": [], "w3": []} for c in contestants}
    short = prompts_for(99, size, vocab)["w1"]
    for c in contestants:  # warm-up: first calls pay for allocation and kernel selection
        c.w1(short, 8)
        c.w2(short)
    reps = max(size["reps_small"], size["reps_w3"])
    for rep in range(reps):
        p = prompts_for(rep, size, vocab)
        order = contestants[rep % len(contestants):] + contestants[:rep % len(contestants)]
        for wl in ("w1", "w2", "w3"):
            if rep >= (size["reps_w3"] if wl == "w3" else size["reps_small"]):
                continue
            if wl == "w3" and args.skip_w3:
                continue
            for c in order if wl != "w3" else [x for x in order if x.name not in args.w3_skip]:
                t0 = time.perf_counter()
                r = (c.w1(p["w1"], size["w1_new"]) if wl == "w1" else c.w2(p["w2"]) if wl == "w2"
                     else c.w3(p["w3"], size["w3_new"]))
                results[c.name][wl].append(r)
                print(f"rep {rep} {wl} {c.name:<22} {r.get(METRICS[wl], 0):9.1f} "
                      f"({time.perf_counter() - t0:.1f} s)", file=sys.stderr)
    return results


def summarize(results: dict) -> dict:
    return {name: {wl: statistics.median(r[METRICS[wl]] for r in runs) if runs else None
                   for wl, runs in per.items()} for name, per in results.items()}


def best_of(summary: dict, prefix: str, wl: str) -> tuple[str | None, float | None]:
    cands = [(n, s[wl]) for n, s in summary.items() if n.startswith(prefix) and s[wl]]
    return max(cands, key=lambda x: x[1]) if cands else (None, None)


def markdown(summary: dict, meta: dict) -> str:
    lines = ["| engine | " + " | ".join(LABELS[w] for w in METRICS) + " | W1 x llama.cpp | "
             "W2 x llama.cpp | W3 x llama.cpp | W3 x transformers best |",
             "|---" * 8 + "|"]
    lcpp = summary.get("llama.cpp", {})
    _, hf_w3 = best_of(summary, "transformers", "w3")

    def ratio(a, b):
        return f"{a / b:.2f}x" if a and b else "-"

    for name, s in summary.items():
        cells = [f"{s[w]:.1f}" if s[w] else "-" for w in METRICS]
        cells += [ratio(s[w], lcpp.get(w)) for w in METRICS] + [ratio(s["w3"], hf_w3)]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    roof = meta["roofline"]
    lines += ["", f"Machine: {meta['machine']['cpu']}, {meta['machine']['threads']} threads, "
              f"torch {meta['machine']['torch']}; read bandwidth "
              f"{roof['bandwidth']['read_GBps']:.1f} GB/s (copy {roof['bandwidth']['copy_GBps']:.1f}"
              f" GB/s); matmul peak {roof['matmul']['float32_GFLOPs']:.0f} GFLOP/s fp32, "
              f"{roof['matmul']['bfloat16_GFLOPs']:.0f} GFLOP/s bf16.", "",
              "| engine | weight bytes / token | W1 roofline tok/s | W1 measured | % of roofline |",
              "|---|---|---|---|---|"]
    for name, r in roof["decode"].items():
        w1 = summary.get(name, {}).get("w1")
        pct = f"{100 * w1 / r['tok_s']:.0f}%" if w1 else "-"
        lines.append(f"| {name} | {r['bytes'] / 2**20:.1f} MiB | {r['tok_s']:.0f} | "
                     f"{w1 or 0:.1f} | {pct} |")
    sz = meta["size"]
    lines += ["", f"Model: {meta['model']} (GGUF types {', '.join(meta['gguf_types'])}); W1 "
              f"{sz['w1_prompt']}-token prompt, {sz['w1_new']} new tokens; W2 {sz['w2_prompt']} "
              f"tokens; W3 {sz['w3_n']} prompts of {sz['w3_lo']}..{sz['w3_hi']} tokens, "
              f"{sz['w3_new']} new tokens each.",
              "", f"Command: `{meta['command']}` ({meta['date']}, {meta['wall_s']:.0f} s)."]
    return "\n".join(lines)


def plot(summary: dict, roof: dict, path: str, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'); no plot", file=sys.stderr)
        return
    names = list(summary)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, wl in zip(axes, METRICS):
        vals = [summary[n][wl] or 0 for n in names]
        bars = ax.bar(range(len(names)), vals, color=["C0" if n.startswith("llmserve") else
                                                      "C1" if n.startswith("trans") else "C2"
                                                      for n in names])
        ax.bar_label(bars, fmt="%.0f", fontsize=7)
        if wl == "w1":
            for i, n in enumerate(names):
                if n in roof["decode"]:
                    ax.plot([i - 0.4, i + 0.4], [roof["decode"][n]["tok_s"]] * 2, "k--", lw=1)
        ax.set_xticks(range(len(names)), names, rotation=35, ha="right", fontsize=8)
        ax.set_title(LABELS[wl] + (" (dashes: roofline)" if wl == "w1" else ""))
    fig.suptitle(f"{title}, CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def update_doc(doc: str, table: str, slug: str = "") -> None:
    begin, end = markers(slug)
    text = f"{begin}\n{end}\n"
    if os.path.exists(doc):
        with open(doc, encoding="utf-8") as f:
            text = f.read()
    if begin not in text or end not in text:
        text += f"\n{begin}\n{end}\n"
    head, rest = text.split(begin, 1)
    tail = rest.split(end, 1)[1]
    with open(doc, "w", encoding="utf-8") as f:
        f.write(f"{head}{begin}\n{table}\n{end}{tail}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    ap.add_argument("--model", default=None,
                    help="a GGUF path or fetched model name (default: the embedded SmolLM2); "
                         "another model runs the REAL sizes and its own doc section")
    ap.add_argument("--llmserve", nargs="*", default=None, choices=list(LLMSERVE_FORMATS),
                    help="default: all formats (SmolLM2), llmserve-hybrid (--model)")
    ap.add_argument("--transformers", nargs="*", default=None,
                    help="dtypes; default: float32 bfloat16 (SmolLM2), bfloat16 (--model)")
    ap.add_argument("--hf-batch", type=int, default=16, help="transformers padded batch for W3")
    ap.add_argument("--hf-w3-mode", default="both", choices=["both", "continuous", "padded"])
    ap.add_argument("--w3-skip", nargs="*", default=None,
                    help="engines left out of W3 (default: transformers fp32, the slower dtype, "
                         "for SmolLM2; none for --model)")
    ap.add_argument("--skip-w3", action="store_true")
    ap.add_argument("--reps", type=int, default=None, help="repetitions of W1/W2 (override)")
    ap.add_argument("--no-llama-cpp", action="store_true")
    ap.add_argument("--threads", type=int, default=None, help="torch/llama.cpp threads")
    ap.add_argument("--out-dir", default=os.path.join(ROOT, "docs", "benchmarks"))
    ap.add_argument("--doc", default=os.path.join(ROOT, "docs", "benchmarks.md"),
                    help="markdown file whose compare section is replaced ('' = none)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    source = resolve_model(args.model)
    real = args.model is not None and source.name != resolve_model(None).name
    for key, default in REAL_DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, default if real else SMOLLM2_DEFAULTS[key])
    size = QUICK if args.quick else REAL if real else FULL
    if args.reps:
        size = {**size, "reps_small": args.reps}
    slug = source.name if real else ""
    gguf_path = source.path
    model_config = load_model_config(source)
    roof = {"bandwidth": memory_bandwidth(), "matmul": peak_matmul()}
    contestants = build_contestants(args, gguf_path)
    results = run(contestants, size, args, model_config.vocab_size)
    summary = summarize(results)
    roof["decode"] = {}
    for c in contestants:
        nbytes = c.info().get("weight_bytes_per_token") or 2 * c.info().get("params", 0) * (
            2 if "fp32" in c.name else 1)
        roof["decode"][c.name] = {"bytes": nbytes, "tok_s": roofline_tokens_per_s(
            roof["bandwidth"]["read_GBps"], nbytes)}
    meta = {"machine": {"cpu": cpu_name(),
                        "threads": torch.get_num_threads(), "torch": torch.__version__,
                        "python": platform.python_version()},
            "roofline": roof, "size": size, "date": time.strftime("%Y-%m-%d %H:%M"),
            "model": source.name, "gguf_types": sorted(set(gguf_tensor_types(gguf_path).values())),
            "command": " ".join(["python", "benchmarks/compare.py", *sys.argv[1:]]),
            "wall_s": time.perf_counter() - t_start}
    table = markdown(summary, meta)
    print(table)
    os.makedirs(args.out_dir, exist_ok=True)
    stem = ("compare_quick" if args.quick else "compare") + (f"_{slug}" if slug else "")
    with open(os.path.join(args.out_dir, f"{stem}.json"), "w") as f:
        json.dump({**meta, "summary": summary, "results": results,
                   "engines": {c.name: c.info() for c in contestants}}, f, indent=2)
    plot(summary, roof, os.path.join(args.out_dir, f"{stem}.png"),
         f"{source.name} ({'/'.join(meta['gguf_types'])})" if real
         else "SmolLM2-135M-Instruct Q4_1")
    if args.doc and not args.quick:
        update_doc(args.doc, table, slug)
    return 0


if __name__ == "__main__":
    sys.exit(main())
