"""`llmserve plan`: will this model fit, with how much KV cache, on how many GPUs?

Prints the memory ledger (parameters, weights, KV cache per token, sequence
and batch) and the capacity of each device, every figure with its formula and
numbers substituted, or the same as JSON (``--json``). Pure Python: no torch.

Exit codes: 0 the plan fits, 1 it does not (or no tp x pp fits), 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from llmserve.entrypoints.arg_types import positive_int
from llmserve.planner.capacity import (
    DoesNotFitError,
    parse_memory,
    plan_capacity,
    smallest_parallelism,
)
from llmserve.planner.formats import parse_weight_format
from llmserve.planner.report import build_report, render_table
from llmserve.planner.sources import DEFAULT_PRESET, list_presets, resolve_model

EPILOG = """\
--model takes a config.json, a model directory, a GGUF file or a preset name
({presets}). Without --tp/--pp, plan picks the smallest tp x pp (tp a power of
two within a node, pp across nodes) that holds --concurrency sequences of
--max-model-len tokens. Exit codes: 0 fits, 1 does not fit, 2 bad input.
"""


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``plan`` flags to ``parser``."""
    parser.add_argument("--model", default=DEFAULT_PRESET,
                        help=f"config.json, model dir, GGUF file or preset (default {DEFAULT_PRESET})")
    parser.add_argument("--weight-dtype", default="auto",
                        help="weight format: auto, fp32, bf16, fp16, fp8, int8, int4[-g128][-sym], "
                             "awq, gptq, or a GGUF type (Q4_K, Q8_0, ...); auto = the checkpoint's "
                             "(a GGUF file's real tensor sizes)")
    parser.add_argument("--kv-cache-dtype", default="auto",
                        help="auto (the model dtype), bf16, fp16, fp32, fp8 (default auto)")
    parser.add_argument("--max-model-len", type=positive_int, default=None,
                        help="context per sequence in tokens (default the model's maximum)")
    parser.add_argument("--concurrency", type=positive_int, default=1,
                        help="sequences of --max-model-len that must fit at once (default 1)")
    parser.add_argument("--gpu-memory", default="80GiB",
                        help="memory of one device, e.g. 80GiB, 24GB (default 80GiB)")
    parser.add_argument("--gpus", type=positive_int, default=None,
                        help="devices available (default: tp x pp, or as many as needed)")
    parser.add_argument("--gpus-per-node", type=positive_int, default=8,
                        help="devices per node; tp stays within one (default 8)")
    parser.add_argument("--gpu-memory-utilization", type=_fraction, default=0.9,
                        help="fraction of device memory the engine may use (default 0.9)")
    parser.add_argument("--activation-reserve", default=None,
                        help="bytes per device kept for activations, e.g. 2GiB (default: estimate)")
    parser.add_argument("--block-size", type=positive_int, default=16,
                        help="tokens per KV cache block (default 16)")
    parser.add_argument("--tp", type=positive_int, default=None, help="tensor parallel size")
    parser.add_argument("--pp", type=positive_int, default=None, help="pipeline parallel size")
    parser.add_argument("--kv-budget-tokens", type=positive_int, default=None,
                        help="per-sequence KV budget of --kv-eviction-policy: caps each "
                             "sequence's blocks (a sliding window on every layer caps them too)")
    parser.add_argument("--no-enable-prefix-caching", action="store_true",
                        help="as the engine's flag: a mixed model (local and global layers, "
                             "Gemma 3) then keeps its local layers' KV in a window pool "
                             "and the paged pool pays for the global layers only")
    parser.add_argument("--cpu-offload-gb", type=float, default=0.0,
                        help="GiB of decoder-layer weights kept in host memory and streamed "
                             "to the device per layer (as the engine's flag; tp = pp = 1)")
    parser.add_argument("--num-device-layers", "--n-gpu-layers", dest="num_device_layers",
                        type=int, default=None, metavar="N",
                        help="the first N decoder layers (and their KV) on the device, the "
                             "rest in host memory (as the engine's flag; tp = pp = 1)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``plan`` subcommand to an argparse ``subparsers`` object."""
    parser = subparsers.add_parser(
        "plan", help="memory ledger and capacity plan for a model",
        description=__doc__.splitlines()[0],
        epilog=EPILOG.format(presets=", ".join(list_presets())),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    parser.set_defaults(func=run)
    return parser


def _plan(args: argparse.Namespace) -> tuple[dict[str, Any], bool]:
    resolved = resolve_model(args.model)
    m = resolved.model
    parse_memory(args.gpu_memory, "--gpu-memory")
    if args.activation_reserve is not None and args.activation_reserve not in ("0", 0):
        parse_memory(args.activation_reserve, "--activation-reserve")
    use_file = resolved.file_weight_bytes is not None and args.weight_dtype == "auto"
    fmt = parse_weight_format("bf16" if use_file else args.weight_dtype,
                              m.quantization or m.torch_dtype)
    common: dict[str, Any] = dict(
        gpu_memory=args.gpu_memory, gpu_memory_utilization=args.gpu_memory_utilization,
        activation_reserve=args.activation_reserve, weight_format=fmt,
        kv_cache_dtype=args.kv_cache_dtype, block_size=args.block_size,
        max_model_len=args.max_model_len, concurrency=args.concurrency,
        file_weight_bytes=resolved.file_weight_bytes if use_file else None,
        kv_budget_tokens=args.kv_budget_tokens,
        window_pool=getattr(args, "no_enable_prefix_caching", False))
    offload = getattr(args, "cpu_offload_gb", 0.0) or \
        getattr(args, "num_device_layers", None) is not None
    if offload:
        common.update(cpu_offload_gb=args.cpu_offload_gb,
                      num_device_layers=args.num_device_layers)
    if args.tp is None and args.pp is None and not offload:
        plan = smallest_parallelism(m, gpus_per_node=args.gpus_per_node, num_gpus=args.gpus,
                                    **common)
    else:
        plan = plan_capacity(m, tp=args.tp or 1, pp=args.pp or 1, num_gpus=args.gpus, **common)
    return build_report(resolved, plan, fmt, args.activation_reserve is not None), plan.fits


def run(args: argparse.Namespace) -> int:
    """Run ``llmserve plan``; returns the exit code (0 fits, 1 does not fit, 2 bad input)."""
    try:
        report, fits = _plan(args)
    except DoesNotFitError as e:
        print(f"llmserve plan: {e}", file=sys.stderr)
        return 1
    except ValueError as e:
        print(f"llmserve plan: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        sys.stdout.write(render_table(report))
    return 0 if fits else 1


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry point: ``python -m llmserve.entrypoints.plan_cmd``."""
    parser = argparse.ArgumentParser(prog="llmserve")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["plan", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
