"""``llmserve eval`` and ``llmserve quantize`` (offline; see :mod:`llmserve.compress`)."""

from __future__ import annotations

import argparse
import json


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "eval", help="perplexity, KL divergence and top-1 agreement against a reference",
        description="Perplexity of MODEL on a text, and (with --reference) the mean/max KL "
                    "divergence KL(reference || model) in nats and the top-1 agreement of "
                    "their next-token distributions on the same tokens.")
    p.add_argument("model", help="model name, GGUF file or Hugging Face directory")
    p.add_argument("--reference", default=None, help="reference model (same tokenizer)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--text", default=None, help="UTF-8 text file to evaluate on")
    src.add_argument("--dataset", default="all",
                     help="built-in evaluation set: all, en, zh, code (default all)")
    p.add_argument("--quick", action="store_true",
                   help="at most 4 windows of 128 tokens (for smoke tests)")
    p.add_argument("--seq-len", type=int, default=None,
                   help="tokens per window (default 512; --quick 128)")
    p.add_argument("--max-windows", type=int, default=None, help="evaluate at most N windows")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--quantization", default="auto", choices=["auto", "native", "none"],
                   help="auto: W8A8 checkpoints run natively, weight-only ones dequantized "
                        "at load (same weights, dense matmuls); native: every checkpoint's "
                        "own kernels; none: dequantize all")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    kv = p.add_argument_group(
        "KV cache quality", "with --kv-cache-dtype or --kv-eviction-policy: the text runs "
        "teacher-forced through the engine (prompt, then one decode step per token) and "
        "each KV setting is scored against the same model with full-precision, full KV "
        "(KL over the decode steps after eviction starts; llmserve.engine.kv_quality)")
    kv.add_argument("--kv-cache-dtype", default=None,
                    help="comma list of KV dtypes to score, e.g. int8,fp8_e4m3")
    kv.add_argument("--kv-key-quant", default="per-token",
                    help="comma list for int8: per-token, per-channel (KIVI's keys)")
    kv.add_argument("--kv-eviction-policy", default=None,
                    help="comma list of policies to score: streaming_llm,h2o,snapkv")
    kv.add_argument("--kv-budget-tokens", default="512",
                    help="comma list of per-sequence budgets for each policy (default 512)")
    kv.add_argument("--num-sink-tokens", type=int, default=4)
    kv.add_argument("--num-tokens", type=int, default=2048,
                    help="tokens of the text to run (default 2048)")
    kv.add_argument("--prompt-tokens", type=int, default=None,
                    help="of which the prompt (default half); above the budget, every "
                         "policy evicts at the first decode step")
    p.set_defaults(func=_run_eval)

    q = subparsers.add_parser(
        "quantize", help="quantize a model (RTN, GPTQ, AWQ, SmoothQuant W8A8)",
        description="Quantize MODEL layer by layer and write a GPTQ, AWQ or "
                    "compressed-tensors checkpoint that llmserve (and vLLM) loads. A GGUF "
                    "input is dequantized first: measure quality against it with "
                    "`llmserve eval OUTPUT --reference MODEL`.")
    q.add_argument("model", help="dense Hugging Face directory, GGUF file or model name")
    q.add_argument("--method", required=True, choices=["rtn", "gptq", "awq", "smoothquant"])
    q.add_argument("--bits", type=int, default=None,
                   help="weight bits: 4 or 8 (rtn, gptq), 4 (awq), 8 (smoothquant); "
                        "default 4, smoothquant 8")
    q.add_argument("--group-size", type=int, default=128,
                   help="input columns per scale group, -1 = one per row (default 128)")
    q.add_argument("--act-order", action="store_true", help="GPTQ: columns by decreasing "
                   "Hessian diagonal (desc_act)")
    q.add_argument("--sym", action="store_true", help="symmetric weights (no zero points)")
    q.add_argument("--alpha", type=float, default=0.5, help="SmoothQuant strength (0.5)")
    q.add_argument("--calib", default=None,
                   help="calibration text file (default: the built-in calibration text)")
    q.add_argument("--num-samples", type=int, default=16,
                   help="calibration windows (default 16)")
    q.add_argument("--seq-len", type=int, default=256, help="tokens per window (default 256)")
    q.add_argument("--output", required=True, help="output directory (gguf: a .gguf file)")
    q.add_argument("--format", default=None,
                   choices=["compressed-tensors", "gptq", "awq", "gguf"],
                   help="checkpoint format (default: gptq for rtn/gptq, awq for awq, "
                        "compressed-tensors for smoothquant); gguf: a llama.cpp file "
                        "(q4_0/q4_1/q8_0 by --bits/--sym; not for smoothquant)")
    q.add_argument("--no-progress", action="store_true", help="no progress bar")
    q.set_defaults(func=_run_quantize)

    from llmserve.compress.advise_cli import register as register_advise

    register_advise(subparsers)  # llmserve quantize advise MODEL (routed by the top CLI)


def _fmt(v) -> str:
    return f"{v:.6g}" if isinstance(v, float) else str(v)


def _split(value: str | None) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()] if value else []


def _run_kv_eval(args: argparse.Namespace, text: str | None) -> int:
    import sys

    from llmserve.compress.texts import builtin_text
    from llmserve.engine.kv_quality import KVVariant, evaluate_kv

    if args.reference is not None:
        raise ValueError("--reference does not apply to --kv-cache-dtype / "
                         "--kv-eviction-policy (the reference is the full-KV run)")
    try:
        budgets = [int(b) for b in _split(args.kv_budget_tokens)]
    except ValueError:
        raise ValueError(f"--kv-budget-tokens: integers, got {args.kv_budget_tokens!r}") from None
    key_quants = _split(args.kv_key_quant) or ["per-token"]
    variants = [KVVariant(kv_cache_dtype=kv, kv_key_quant=kq)
                for kv in _split(args.kv_cache_dtype) for kq in key_quants
                if kq == "per-token" or kv == "int8"]
    variants += [KVVariant(policy=pol, budget_tokens=b, num_sink_tokens=args.num_sink_tokens)
                 for pol in _split(args.kv_eviction_policy) for b in budgets]
    quant = "auto" if args.quantization == "native" else "none"
    body = text if text is not None else builtin_text("eval", args.dataset)

    def show(r) -> None:  # progress on stderr under --json
        print(f"{r.variant:>20}  ppl {r.perplexity:.4f} (full {r.reference_perplexity:.4f})"
              f"  KL mean {r.kl_mean:.5f} max {r.kl_max:.3f}  top-1 "
              f"{r.top1_agreement:.3f}  {r.num_tokens} tokens  ({r.seconds} s)",
              file=sys.stderr if args.json else sys.stdout, flush=True)

    results = evaluate_kv(args.model, body, variants, num_tokens=args.num_tokens,
                          prompt_len=args.prompt_tokens, dtype=args.dtype,
                          quantization=quant, progress=show)
    if args.json:
        print(json.dumps([r.as_dict() for r in results]))
    return 0


def _run_eval(args: argparse.Namespace) -> int:
    from llmserve.compress.evaluate import evaluate
    from llmserve.compress.texts import read_text_file

    if args.kv_cache_dtype or args.kv_eviction_policy:
        return _run_kv_eval(args, read_text_file(args.text) if args.text else None)
    text = read_text_file(args.text) if args.text else None
    result = evaluate(args.model, args.reference, text=text, dataset=args.dataset,
                      quick=args.quick, seq_len=args.seq_len, max_windows=args.max_windows,
                      dtype=args.dtype, quantization=args.quantization)
    d = result.as_dict()
    if args.json:
        print(json.dumps(d))
    else:
        for k, v in d.items():
            if v is not None:
                print(f"{k:>22}: {_fmt(v)}")
    return 0


def _run_quantize(args: argparse.Namespace) -> int:
    import sys

    from llmserve.compress.pipeline import QuantizeOptions
    from llmserve.compress.quantize import quantize_checkpoint
    from llmserve.loader import resolve_model

    if resolve_model(args.model).kind == "gguf":
        print(f"note: {args.model} is a GGUF file; it is dequantized to float32 first, so "
              "quality is relative to that dequantized source (measure it with "
              f"`llmserve eval {args.output} --reference {args.model}`)", file=sys.stderr)
    bits = args.bits if args.bits is not None else (8 if args.method == "smoothquant" else 4)
    opts = QuantizeOptions(method=args.method, bits=bits, group_size=args.group_size,
                           act_order=args.act_order, symmetric=args.sym, alpha=args.alpha)
    out = quantize_checkpoint(args.model, opts, args.output, fmt=args.format,
                              calib=args.calib, num_samples=args.num_samples,
                              seq_len=args.seq_len, progress=not args.no_progress)
    print(f"wrote {out}")
    return 0
