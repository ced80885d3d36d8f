"""``llmserve export --format onnx``: the decoder with its KV cache as ONNX inputs/outputs.

::

    export_onnx("model.gguf", "out_dir", weights="int8")
    out_dir/model.onnx        (+ model.onnx.data when over 2 GiB: external weights)
    out_dir/config.json       the Hugging Face config (architecture, hparams)
    out_dir/tokenizer.json ...  the tokenizer (Hugging Face files)

The graph is :class:`~llmserve.compress.onnx_reference.ReferenceDecoder` (float32, names
as optimum / onnxruntime-genai use them: ``input_ids``, ``attention_mask``,
``position_ids``, ``past_key_values.N.key/value`` in, ``logits``, ``present.N.key/value``
out), traced by ``torch.onnx.export`` (TorchScript exporter, opset 21) with dynamic
batch / sequence / past axes. A first step passes past tensors of length 0.

``weights``: ``fp32``; ``int8`` (onnxruntime ``quantize_dynamic``: int8 weights per
tensor, dynamic uint8 activations, ``MatMulInteger``); ``int4`` (onnxruntime
``MatMulNBitsQuantizer``: 4-bit blocks of 32 along K, ``com.microsoft.MatMulNBits``, and
the embedding table as ``GatherBlockQuantized``; weight-only, activations stay float32).
"""

from __future__ import annotations

import os
import tempfile
import warnings

import torch

from llmserve.compress.onnx_reference import ReferenceDecoder, io_names

WEIGHTS = ("fp32", "int8", "int4")
OPSET = 21
MODEL_FILE = "model.onnx"


def load_reference(model: str) -> tuple[ReferenceDecoder, object, object]:
    """``(ReferenceDecoder in float32, ModelConfig, ModelSource)`` of ``model``: weights
    dequantized to float32 by llmserve's loader (GGUF, dense or quantized checkpoints).

    Raises:
        ValueError: an unknown model or an unsupported architecture.
    """
    from llmserve.loader import iter_weights, load_model_config, resolve_model

    source = resolve_model(model)
    config = load_model_config(source)
    weights = {name: t.float() for name, t in iter_weights(source, config)}
    return ReferenceDecoder(config, weights).eval(), config, source


def example_inputs(config, past_len: int = 2, seq_len: int = 3) -> tuple[torch.Tensor, ...]:
    """Inputs for tracing: batch 1, ``seq_len`` new tokens after ``past_len`` cached."""
    head_dim = config.head_dim or config.hidden_size // config.num_attention_heads
    ids = torch.zeros(1, seq_len, dtype=torch.long)
    mask = torch.ones(1, past_len + seq_len, dtype=torch.long)
    pos = torch.arange(past_len, past_len + seq_len, dtype=torch.long)[None]
    past = [torch.zeros(1, config.num_key_value_heads, past_len, head_dim)
            for _ in range(2 * config.num_hidden_layers)]
    return (ids, mask, pos, *past)


def _dynamic_axes(inputs: list[str], outputs: list[str]) -> dict[str, dict[int, str]]:
    axes: dict[str, dict[int, str]] = {
        "input_ids": {0: "batch_size", 1: "sequence_length"},
        "attention_mask": {0: "batch_size", 1: "total_sequence_length"},
        "position_ids": {0: "batch_size", 1: "sequence_length"},
        "logits": {0: "batch_size", 1: "sequence_length"}}
    for n in inputs[3:]:
        axes[n] = {0: "batch_size", 2: "past_sequence_length"}
    for n in outputs[1:]:
        axes[n] = {0: "batch_size", 2: "total_sequence_length"}
    return axes


def _quantize(src: str, dst: str, weights: str) -> None:
    import onnx

    if weights == "int8":
        from onnxruntime.quantization import QuantType, quantize_dynamic

        quantize_dynamic(src, dst, weight_type=QuantType.QInt8, op_types_to_quantize=["MatMul"])
        return
    import logging

    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    # it logs one INFO line per graph node
    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)
    q = MatMulNBitsQuantizer(onnx.load(src), block_size=32, is_symmetric=True,
                             op_types_to_quantize=("MatMul", "Gather"),
                             quant_axes=(("MatMul", 0), ("Gather", 1)))
    q.process()
    q.model.save_model_to_file(dst, use_external_data_format=False)


def export_onnx(model: str, output: str, weights: str = "fp32") -> str:
    """Export ``model`` to ``output/model.onnx`` (see the module doc); returns its path.

    Raises:
        ValueError: ``weights`` not in :data:`WEIGHTS`, ``output`` a file, an unsupported
            architecture, or onnx / onnxruntime missing (``pip install llmserve[export]``).
    """
    if weights not in WEIGHTS:
        raise ValueError(f"--weights must be one of {list(WEIGHTS)}, got {weights!r}")
    if os.path.isfile(output):
        raise ValueError(f"--output {output!r} is a file; --format onnx writes a directory")
    try:
        import onnx  # noqa: F401
        import onnxruntime  # noqa: F401
    except ImportError as e:
        raise ValueError(f"--format onnx needs onnx and onnxruntime ({e}); "
                         "pip install 'llmserve[export]'") from None
    ref, config, source = load_reference(model)
    os.makedirs(output, exist_ok=True)
    inputs, outputs = io_names(config.num_hidden_layers)
    path = os.path.join(output, MODEL_FILE)
    with tempfile.TemporaryDirectory(prefix="llmserve-onnx-") as tmp:
        traced = path if weights == "fp32" else os.path.join(tmp, MODEL_FILE)
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            torch.onnx.export(ref, example_inputs(config), traced, input_names=inputs,
                              output_names=outputs, dynamic_axes=_dynamic_axes(inputs, outputs),
                              opset_version=OPSET, do_constant_folding=True, dynamo=False)
        if weights != "fp32":
            _quantize(traced, path, weights)
    _write_side_files(source, config, output)
    return path


def _write_side_files(source, config, output: str) -> None:
    """``config.json`` (HF field names) and the tokenizer files beside the model."""
    import json
    from dataclasses import asdict

    from llmserve.tokenizer import load_tokenizer

    cfg = {k: v for k, v in asdict(config).items() if v is not None}
    cfg["architectures"] = [config.architecture]
    cfg["num_key_value_heads"] = config.num_key_value_heads
    cfg["head_dim"] = config.head_dim or config.hidden_size // config.num_attention_heads
    with open(os.path.join(output, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2, default=list)
    load_tokenizer(source).save_pretrained(output)
