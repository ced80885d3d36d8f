"""``llmserve quantize advise MODEL``: the table of measured levels and the pick
(see :mod:`llmserve.compress.advise`).

The top-level CLI routes ``llmserve quantize advise ...`` here (the ``quantize``
command's first positional is its MODEL, so ``advise`` is its own parser).
"""

from __future__ import annotations

import argparse
import json
import sys

from llmserve.utils import format_size, parse_size


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "quantize-advise", prog="llmserve quantize advise",
        help="measure quantization levels on this machine and pick one for an SLA "
             "(also: llmserve quantize advise)",
        description="Measure each quantization level of MODEL on this machine (size on "
                    "disk and in memory, perplexity and KL against MODEL, batch-1 and "
                    "batched tokens/s through llmserve's engine), print the table and "
                    "pick the smallest (or fastest) level meeting the SLA. Results are "
                    "cached per model sha256, machine and level (~/.cache/llmserve/advise, "
                    "or $LLMSERVE_ADVISE_CACHE). Exit code 1 when no level meets the SLA.")
    p.add_argument("model", help="GGUF file, dense Hugging Face directory or model name")
    quality = p.add_mutually_exclusive_group()
    quality.add_argument("--max-kl", type=float, default=None,
                         help="mean KL(MODEL || level) in nats at most X")
    quality.add_argument("--max-ppl-increase", type=float, default=None, metavar="P",
                         help="perplexity at most P percent above MODEL's")
    p.add_argument("--min-tokens-per-s", type=float, default=None, metavar="T",
                   help="batch-1 decode tokens/s at least T")
    p.add_argument("--max-memory", default=None, metavar="M",
                   help="weights in memory at most M (bytes or e.g. 200MiB)")
    p.add_argument("--levels", default=None,
                   help="comma-separated levels: source, {rtn,gptq,awq}-w{4,8}[-gN], "
                        "smoothquant-w8a8 (default: source, rtn/gptq/awq w4 at g32/64/128, "
                        "rtn-w8, smoothquant-w8a8)")
    p.add_argument("--objective", default="size", choices=["size", "speed"],
                   help="among levels meeting the SLA: least memory (size) or most "
                        "batch-1 tokens/s (speed)")
    p.add_argument("--kv-dtypes", default=None,
                   help="also measure the chosen level with these KV cache dtypes "
                        "(comma-separated: auto, bfloat16, int8, fp8_e4m3)")
    p.add_argument("--quick", action="store_true",
                   help="small calibration, 2 windows of 128 tokens, 8-token decodes "
                        "(smoke tests; numbers are rough)")
    p.add_argument("--output", default=None,
                   help="write the chosen checkpoint here (else print the command)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=_run_advise)


def _sla(args: argparse.Namespace):
    from llmserve.compress.advise import SLA

    memory = None
    if args.max_memory is not None:
        memory = parse_size(args.max_memory, "--max-memory")
    return SLA(max_kl=args.max_kl, max_ppl_increase=args.max_ppl_increase,
               min_tokens_per_s=args.min_tokens_per_s, max_memory=memory)


def _split(value: str | None) -> list[str] | None:
    return None if value is None else [v for v in (s.strip() for s in value.split(",")) if v]


def format_table(rows: list[dict]) -> str:
    """A plain-text table of advise rows (one per level)."""
    head = ("level", "disk", "memory", "ppl", "ppl +%", "KL mean", "KL max", "top-1",
            "tok/s b1", "tok/s batch", "SLA")
    lines = [head]
    for r in rows:
        if r.get("skipped"):
            lines.append((r["level"], *["-"] * 9, "skipped: " + r["skipped"]))
            continue
        sla = "meets" if r.get("meets_sla") else "; ".join(r.get("misses", [])) or "-"
        lines.append((r["level"], format_size(r["disk_bytes"]), format_size(r["memory_bytes"]),
                      f"{r['perplexity']:.2f}", f"{r['ppl_increase']:+.2f}",
                      f"{r['kl_mean']:.4f}", f"{r['kl_max']:.3f}",
                      f"{100 * r['top1_agreement']:.1f}%", f"{r['decode_tok_s']:.1f}",
                      f"{r['batch_tok_s']:.1f}", sla + (" (cached)" if r.get("cached") else "")))
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(head) - 1)]
    out = []
    for line in lines:
        cells = [str(c).rjust(w) if i else str(c).ljust(w)
                 for i, (c, w) in enumerate(zip(line, widths))]
        out.append("  ".join([*cells, str(line[-1])]))
    return "\n".join(out)


def _run_advise(args: argparse.Namespace) -> int:
    from llmserve.compress.advise import (
        advise,
        parse_level,
        quantize_command,
    )
    from llmserve.config import normalize_kv_cache_dtype

    sla = _sla(args)
    kv = [normalize_kv_cache_dtype(d) for d in _split(args.kv_dtypes) or []]
    result = advise(args.model, _split(args.levels), sla, args.objective, args.quick,
                    args.output, log=lambda msg: print(msg, file=sys.stderr),
                    kv_dtypes=tuple(kv))
    chosen = None
    if result.chosen is not None:
        level = parse_level(result.chosen["level"])
        if level.method is None:
            chosen = f"chosen: source (serve {args.model} as it is)"
        elif result.checkpoint is not None:
            chosen = f"chosen: {level.name}; wrote {result.checkpoint}"
        else:
            chosen = (f"chosen: {level.name}; make it with: "
                      f"{quantize_command(args.model, level, result.settings)}")
    if args.json:  # stdout holds the JSON only
        print(json.dumps(result.as_dict()))
    else:
        print(format_table(result.rows))
        for r in result.kv_rows:
            print(f"KV {r['kv_cache_dtype']:>9} ({result.chosen['level']}): "
                  f"{r['kv_bytes_per_token']} B/token, {r['decode_tok_s']:.1f} tok/s batch 1, "
                  f"{r['batch_tok_s']:.1f} tok/s batched")
    if chosen is None:
        print("advise: no level meets the SLA", file=sys.stderr)
        return 1
    print(chosen, file=sys.stderr if args.json else sys.stdout)
    return 0
