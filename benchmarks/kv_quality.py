"""KV cache quality on a long text (issue 15 item 5): perplexity, mean / max KL and top-1
agreement of int8 / fp8 KV pages and of each eviction policy at each budget against the
full-precision (float32 KV), full-KV run of the same model and weights.

The text is docs/*.md concatenated (sorted by name; its sha256 goes into the JSON),
BOS first, cut to ``--num-tokens``; the first ``--prompt-tokens`` are the prompt (one
full-attention prefill chunk), the rest run teacher-forced, one decode step per token,
through the engine (``llmserve.engine.kv_quality``; the same as ``llmserve eval MODEL
--text FILE --kv-cache-dtype ... --kv-eviction-policy ... --kv-budget-tokens ...``).
With the prompt above every budget, each policy evicts at the first decode step, so every
scored token is predicted from the evicted cache. Weights: the default model's GGUF
dequantized to float32 (``--quantization none``), float32 activations.

    PYTHONPATH=src nice -n 10 .venv/bin/python benchmarks/kv_quality.py \
        --num-tokens 4096 --prompt-tokens 2048 --budgets 512,1024

Writes docs/benchmarks/kv_quality.json.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def docs_text() -> str:
    """docs/*.md, sorted by name, joined by blank lines."""
    parts = []
    for path in sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))):
        with open(path, encoding="utf-8") as f:
            parts.append(f.read())
    return "\n\n".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    ap.add_argument("--num-tokens", type=int, default=4096)
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--kv-dtypes", default="int8,fp8_e4m3")
    ap.add_argument("--policies", default="streaming_llm,h2o,snapkv")
    ap.add_argument("--budgets", default="512,1024")
    ap.add_argument("--num-sink-tokens", type=int, default=4)
    ap.add_argument("--json", default=os.path.join(ROOT, "docs", "benchmarks",
                                                   "kv_quality.json"))
    args = ap.parse_args()

    from llmserve.engine.kv_quality import KVVariant, evaluate_kv

    variants = [KVVariant(kv_cache_dtype=kv) for kv in args.kv_dtypes.split(",") if kv]
    variants += [KVVariant(policy=p, budget_tokens=int(b), num_sink_tokens=args.num_sink_tokens)
                 for b in args.budgets.split(",") for p in args.policies.split(",") if p]
    text = docs_text()
    t0 = time.perf_counter()

    out = {"model": args.model or "SmolLM2-135M-Instruct.Q4_1.gguf (dequantized)",
           "dtype": "float32", "reference": "float32 KV, no eviction",
           "text": "docs/*.md", "text_sha256": hashlib.sha256(text.encode()).hexdigest(),
           "num_tokens": args.num_tokens, "prompt_tokens": args.prompt_tokens,
           "num_sink_tokens": args.num_sink_tokens, "results": []}

    def show(r) -> None:  # the JSON is rewritten after every variant
        out["results"].append(r.as_dict())
        out["seconds"] = round(time.perf_counter() - t0, 1)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
        print(f"{r.variant:>20}  ppl {r.perplexity:.4f} (full {r.reference_perplexity:.4f})  "
              f"KL mean {r.kl_mean:.5f} max {r.kl_max:.3f}  top-1 {r.top1_agreement:.3f}  "
              f"kept <= {r.max_kept_blocks} blocks  ({r.seconds} s)", flush=True)

    evaluate_kv(args.model, text, variants, num_tokens=args.num_tokens,
                prompt_len=args.prompt_tokens, dtype="float32", quantization="none",
                progress=show)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
