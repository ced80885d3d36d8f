"""``llmserve export MODEL --format gguf|onnx --output PATH``: edge formats.

* ``--format gguf --output FILE.gguf [--type auto|f32|f16|bf16|q8_0|q5_1|q5_0|q4_1|q4_0]``:
  a GGUF that llama.cpp loads (:mod:`llmserve.compress.gguf_export`).
* ``--format onnx --output DIR [--weights fp32|int8|int4]``: the decoder with its KV cache as
  explicit inputs/outputs, for ONNX Runtime (:mod:`llmserve.compress.onnx_export`).
"""

from __future__ import annotations

import argparse
import os

FORMATS = ("gguf", "onnx")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "export", help="export a model for the edge: GGUF (llama.cpp) or ONNX (ONNX Runtime)",
        description="Write MODEL (a GGUF file, a Hugging Face directory, or a GPTQ / AWQ / "
                    "compressed-tensors checkpoint from `llmserve quantize`) as a GGUF file "
                    "that llama.cpp loads, or as an ONNX decoder with KV-cache inputs and "
                    "outputs for ONNX Runtime.")
    p.add_argument("model", help="model name, GGUF file or Hugging Face directory")
    p.add_argument("--format", required=True, help="gguf or onnx")
    p.add_argument("--output", required=True,
                   help="gguf: the .gguf file to write; onnx: the directory")
    p.add_argument("--type", default="auto",
                   help="gguf weight type: auto (a GGUF: copied as is; a quantized "
                        "checkpoint: q4_0/q4_1/q8_0 by its bits; dense: f16), f32, f16, "
                        "bf16, q8_0, q5_1, q5_0, q4_1, q4_0")
    p.add_argument("--weights", default="fp32",
                   help="onnx weights: fp32, int8 (dynamic int8 MatMul) or int4 "
                        "(MatMulNBits, block 32)")
    p.set_defaults(func=_run_export)


def _run_export(args: argparse.Namespace) -> int:
    if args.format not in FORMATS:
        raise ValueError(f"--format must be one of {list(FORMATS)}, got {args.format!r}")
    if args.format == "gguf":
        from llmserve.compress.gguf_export import export_gguf

        out = export_gguf(args.model, args.output, args.type)
        print(f"wrote {out} ({os.path.getsize(out) / 2**20:.1f} MiB)")
        return 0
    from llmserve.compress.onnx_export import export_onnx

    out = export_onnx(args.model, args.output, weights=args.weights)
    print(f"wrote {out}")
    return 0
