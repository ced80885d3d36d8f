"""``llmserve quantize``: load a float model, calibrate, quantize layer by layer, write.

::

    quantize_checkpoint("smollm2-135m-instruct", QuantizeOptions("gptq", 4, 128),
                        output="out/", fmt="gptq")

Input: a Hugging Face directory (dense) or a GGUF file, dequantized to float32 by
transformers' GGUF reader (quality is then measured against that dequantized source:
``llmserve eval out/ --reference MODEL``). Calibration: ``num_samples`` windows of
``seq_len`` tokens of ``calib`` (default: the built-in calibration text, never the
evaluation text), each starting with BOS when the tokenizer has one.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from llmserve.compress.export import DEFAULT_FORMAT, check_format, save_quantized
from llmserve.compress.pipeline import QuantizeOptions, check_options, quantize_model
from llmserve.compress.texts import builtin_text, read_text_file, token_windows


def load_float_model(model: str) -> tuple[Any, Any, str]:
    """``(transformers model in float32, llmserve tokenizer, source kind)`` of ``model``.

    Raises:
        ValueError: an unknown model, or an already quantized checkpoint.
    """
    from transformers import AutoModelForCausalLM

    from llmserve.loader import checkpoint_quantization, load_model_config, resolve_model
    from llmserve.tokenizer import load_tokenizer

    source = resolve_model(model)
    load_model_config(source)  # architecture check with llmserve's message
    if checkpoint_quantization(source) is not None:
        raise ValueError(f"{source.path!r} is already quantized; pass a dense checkpoint "
                         "or a GGUF file")
    if source.kind == "gguf":
        net = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(source.path), gguf_file=os.path.basename(source.path),
            dtype=torch.float32)
    else:
        net = AutoModelForCausalLM.from_pretrained(source.path, dtype=torch.float32)
    return net.eval(), load_tokenizer(source), source.kind


def calibration_ids(tokenizer: Any, calib: str | None, num_samples: int,
                    seq_len: int) -> torch.Tensor:
    """int64 ``[num_samples, seq_len]`` windows of ``calib`` (a file) or the built-in set.

    Raises:
        ValueError: an unreadable file or too few tokens for the windows asked for.
    """
    from llmserve.tokenizer import encode_text

    text = read_text_file(calib, "--calib") if calib else builtin_text("calib")
    ids = encode_text(tokenizer, text, "--calib", add_special_tokens=False)
    where = f"--calib {calib!r}" if calib else "the built-in calibration text"
    windows = token_windows(ids, seq_len, num_samples, field=where,
                            bos_token_id=tokenizer.bos_token_id)
    return torch.tensor(windows, dtype=torch.long)


def quantize_checkpoint(model: str, opts: QuantizeOptions, output: str,
                        fmt: str | None = None, calib: str | None = None,
                        num_samples: int = 16, seq_len: int = 256,
                        progress: bool = True) -> str:
    """Quantize ``model`` with ``opts`` and write it to ``output`` as ``fmt`` (default:
    gptq for rtn/gptq, awq for awq, compressed-tensors for smoothquant).

    Raises:
        ValueError: bad options or format, too little calibration text, a bad model.
    """
    check_options(opts)
    fmt = fmt or DEFAULT_FORMAT[opts.method]
    if fmt == "gguf":
        return _quantize_to_gguf(model, opts, output, calib, num_samples, seq_len, progress)
    check_format(fmt, opts.method, opts.bits, opts.act_order)
    net, tokenizer, _ = load_float_model(model)
    ids = None if opts.method == "rtn" else calibration_ids(tokenizer, calib, num_samples,
                                                            seq_len)
    qm = quantize_model(net, opts, ids, progress=progress)
    return save_quantized(qm, output, fmt, tokenizer)


def _quantize_to_gguf(model: str, opts: QuantizeOptions, output: str, calib: str | None,
                      num_samples: int, seq_len: int, progress: bool) -> str:
    """``--format gguf``: quantize, write a GPTQ checkpoint to a temporary directory, then
    :func:`~llmserve.compress.gguf_export.export_gguf` it (8 bits -> q8_0, 4 bits -> q4_0
    symmetric / q4_1, requantized in 32-weight blocks from the dequantized weights).

    Raises:
        ValueError: ``--method smoothquant`` (W8A8 has no GGUF form), ``output`` a directory.
    """
    import tempfile

    from llmserve.compress.gguf_export import export_gguf

    if opts.method == "smoothquant":
        raise ValueError("--method smoothquant (W8A8: int8 activations) cannot be written as "
                         "--format gguf (weight-only types); use --format compressed-tensors, "
                         "or --method rtn|gptq|awq for GGUF")
    if os.path.isdir(output):
        raise ValueError(f"--output {output!r} is a directory; --format gguf writes a file")
    with tempfile.TemporaryDirectory(prefix="llmserve-quantize-") as tmp:
        quantize_checkpoint(model, opts, tmp, fmt="gptq", calib=calib, num_samples=num_samples,
                            seq_len=seq_len, progress=progress)
        return export_gguf(tmp, output, "auto")
