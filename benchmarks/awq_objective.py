"""AWQ's parts against RTN, by next-token KL to the float model (issue 16).

Quantizes the float model (a GGUF is dequantized by transformers first) in memory with
each variant, then measures the mean next-token KL(float || variant) and top-1
agreement on windows of the built-in evaluation text (never the calibration text):

    rtn        round to nearest, asymmetric, per group
    awq        scales (module-output objective, token-relative error) + clipping
    scales     AWQ's scales only (clip bounds left at max |w|)
    clip       AWQ's clipping only (scales left at 1)

Calibration as ``llmserve quantize``: the built-in text, ``--calib-samples`` windows of
256 tokens. This is the quality half of ``llmserve quantize advise`` without export,
engine or speed, so a variant costs one quantization pass.

    .venv/bin/python benchmarks/awq_objective.py qwen2.5-coder-0.5b-instruct --group-size 32
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time

import torch

from llmserve.compress import awq
from llmserve.compress.pipeline import QuantizeOptions, quantize_model
from llmserve.compress.quantize import calibration_ids, load_float_model
from llmserve.compress.texts import builtin_text, token_windows
from llmserve.loader import resolve_model
from llmserve.tokenizer import encode_text


def _no_scales(x, weights, *args, **kwargs):
    return torch.ones(weights[0].shape[1])


def _no_clip(x, w, bits, group_size, **kwargs):
    n, k = w.shape
    return w.float().reshape(n, k // group_size, group_size).abs().amax(-1)


VARIANTS = {"rtn": ("rtn", awq.search_scales, awq.search_clip),
            "awq": ("awq", awq.search_scales, awq.search_clip),
            "scales": ("awq", awq.search_scales, _no_clip),
            "clip": ("awq", _no_scales, awq.search_clip)}


@torch.no_grad()
def log_probs(model, windows: list[list[int]]) -> list[torch.Tensor]:
    return [torch.log_softmax(model(torch.tensor([w])).logits[0, :-1].double(), -1)
            for w in windows]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="GGUF file, dense HF directory or model name")
    ap.add_argument("--variants", default="rtn,awq")
    ap.add_argument("--group-size", type=int, default=32)
    ap.add_argument("--calib-samples", type=int, default=12)
    ap.add_argument("--eval-len", type=int, default=256)
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args()
    ref, tok, _ = load_float_model(resolve_model(args.model).path)
    calib = calibration_ids(tok, None, args.calib_samples, 256)
    ids = encode_text(tok, builtin_text("eval"), "text", add_special_tokens=False)
    windows = token_windows(ids, args.eval_len, field="the evaluation text",
                            bos_token_id=tok.bos_token_id)
    ref_lp = log_probs(ref, windows)
    count = sum(len(r) for r in ref_lp)
    rows = []
    print(f"{args.model}: w4 g{args.group_size}, {len(calib)} x 256 calibration tokens, "
          f"{count} evaluated tokens")
    print("| variant | KL mean | top-1 | seconds |\n|---|---|---|---|")
    for name in args.variants.split(","):
        method, scales, clip = VARIANTS[name]
        model = copy.deepcopy(ref)
        t0 = time.perf_counter()
        saved = awq.search_scales, awq.search_clip
        awq.search_scales, awq.search_clip = scales, clip
        try:
            quantize_model(model, QuantizeOptions(method=method, bits=4,
                                                  group_size=args.group_size),
                           calib, progress=False)
        finally:
            awq.search_scales, awq.search_clip = saved
        seconds = time.perf_counter() - t0
        lp = log_probs(model, windows)
        kl = sum(float((r.exp() * (r - c)).sum(-1).clamp(min=0).sum())
                 for r, c in zip(ref_lp, lp)) / count
        top1 = sum(int((r.argmax(-1) == c.argmax(-1)).sum()) for r, c in zip(ref_lp, lp)) / count
        rows.append(dict(variant=name, group_size=args.group_size, kl_mean=kl, top1=top1,
                         seconds=seconds))
        print(f"| {name} | {kl:.4f} | {top1:.3f} | {seconds:.0f} |", flush=True)
        del model
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"model": args.model, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
