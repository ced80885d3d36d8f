"""Engine vs transformers on the default model, side by side in one run.

W1: greedy decode at batch 1 (32-token prompt, 256 new tokens, EOS ignored):
    decode tokens/s = (new tokens - 1) / (E2E - TTFT).
W3: 64 prompts with inputs of 64..512 tokens (uniform, seeded), 128 new tokens
    each, EOS ignored: output tokens/s over the whole batch.
Both for float32 and bfloat16 (dense weights), next to transformers ``generate`` on the same
GGUF (dequantized), which batches W3 with left padding in chunks of
``--hf-batch`` prompts. Absolute numbers drift on a shared machine; read the
ratios. Usage::

    .venv/bin/python benchmarks/engine_vs_transformers.py [--dtypes float32 bfloat16]
        [--num-prompts 64] [--output-json docs/benchmarks/engine_core.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import time

import torch

from llmserve import LLM, SamplingParams


def make_prompts(tokenizer, n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    vocab = [t for t in range(1000, 40000)]
    return [[rng.choice(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def bench_llmserve(dtype: str, w1_prompt: list[int], w3_prompts: list[list[int]]) -> dict:
    llm = LLM(dtype=dtype, quantization="none", kv_cache_memory="2GiB", max_num_seqs=64)
    p1 = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)
    llm.generate({"prompt_token_ids": w1_prompt}, SamplingParams(max_tokens=8), use_tqdm=False)
    out = llm.generate({"prompt_token_ids": w1_prompt}, p1, use_tqdm=False)[0]
    m = out.metrics
    decode_tps = (len(out.outputs[0].token_ids) - 1) / (m.finished_time - m.first_token_time)
    p3 = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in w3_prompts], p3, use_tqdm=False)
    dt = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    n_in = sum(len(p) for p in w3_prompts)
    return {"w1_decode_tok_s": decode_tps, "w1_ttft_s": m.time_to_first_token,
            "w3_output_tok_s": n_out / dt, "w3_total_tok_s": (n_out + n_in) / dt,
            "w3_seconds": dt, "max_batch": llm.engine.scheduler.stats.max_batch_size_seen}


def bench_transformers(gguf_path: str, dtype: str, w1_prompt: list[int],
                       w3_prompts: list[list[int]], hf_batch: int) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path),
        dtype=getattr(torch, dtype))
    model.eval()
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        ids = torch.tensor([w1_prompt])
        model.generate(ids, max_new_tokens=8, min_new_tokens=8, **kw)
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
        ttft = time.perf_counter() - t0
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=256, min_new_tokens=256, **kw)
        e2e = time.perf_counter() - t0
        decode_tps = 255 / max(e2e - ttft, 1e-9)
        t0 = time.perf_counter()
        n_out = 0
        order = sorted(range(len(w3_prompts)), key=lambda i: len(w3_prompts[i]))
        for s in range(0, len(order), hf_batch):
            chunk = [w3_prompts[i] for i in order[s:s + hf_batch]]
            width = max(len(p) for p in chunk)
            input_ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
            out = model.generate(input_ids, attention_mask=mask, max_new_tokens=128,
                                 min_new_tokens=128, **kw)
            n_out += (out.shape[1] - width) * len(chunk)
        dt = time.perf_counter() - t0
    n_in = sum(len(p) for p in w3_prompts)
    return {"w1_decode_tok_s": decode_tps, "w1_ttft_s": ttft, "w3_output_tok_s": n_out / dt,
            "w3_total_tok_s": (n_out + n_in) / dt, "w3_seconds": dt}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()

    from llmserve.loader import resolve_model

    gguf_path = resolve_model(None).path
    rng = random.Random(0)
    w1_prompt = [rng.randint(1000, 40000) for _ in range(32)]
    w3_prompts = make_prompts(None, args.num_prompts, 64, 512, seed=1)
    results = {"machine": {"cpu": platform.processor() or platform.machine(),
                           "threads": torch.get_num_threads(), "torch": torch.__version__},
               "runs": []}
    for dtype in args.dtypes:
        ours = bench_llmserve(dtype, w1_prompt, w3_prompts)
        row = {"dtype": dtype, "llmserve": ours}
        if not args.skip_transformers:
            row["transformers"] = bench_transformers(gguf_path, dtype, w1_prompt, w3_prompts,
                                                     args.hf_batch)
        results["runs"].append(row)
    print(f"{'dtype':<9} {'engine':<13} {'W1 decode tok/s':>16} {'W3 out tok/s':>13} "
          f"{'W3 total tok/s':>15}")
    for row in results["runs"]:
        for name in ("llmserve", "transformers"):
            if name in row:
                r = row[name]
                print(f"{row['dtype']:<9} {name:<13} {r['w1_decode_tok_s']:>16.1f} "
                      f"{r['w3_output_tok_s']:>13.1f} {r['w3_total_tok_s']:>15.1f}")
        if "transformers" in row:
            a, b = row["llmserve"], row["transformers"]
            print(f"{row['dtype']:<9} {'ratio':<13} {a['w1_decode_tok_s'] / b['w1_decode_tok_s']:>15.2f}x"
                  f" {a['w3_output_tok_s'] / b['w3_output_tok_s']:>12.2f}x")
    if args.output_json:
        os.makedirs(os.path.dirname(args.output_json) or ".", exist_ok=True)
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
