"""Model loading: resolve a model reference, read its config, stream its weights.

::

    source = resolve_model("smollm2-135m-instruct")   # ModelSource(kind, path, name)
    config = load_model_config(source)                 # ModelConfig (HF field names)
    for name, tensor in iter_weights(source, config):  # HF names, HF shapes
        ...

GGUF weights come out dequantized to float32; safetensors weights keep their stored
dtype. The model casts to the engine dtype.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from llmserve.config import ModelConfig
from llmserve.layers.quantization.base import QuantizationConfig, QuantizedTensor
from llmserve.loader.gguf_loader import iter_gguf_weights, read_gguf_config
from llmserve.loader.safetensors_loader import (
    iter_safetensors_weights,
    read_checkpoint_quantization,
    read_hf_config,
)
from llmserve.loader.source import DEFAULT_MODEL_NAME, ModelSource, resolve_model

__all__ = ["DEFAULT_MODEL_NAME", "ModelSource", "resolve_model", "load_model_config",
           "iter_weights", "checkpoint_quantization"]


def _check_kind(source: ModelSource) -> None:
    if source.kind not in ("gguf", "hf"):
        raise ValueError(f"ModelSource.kind must be 'gguf' or 'hf', got {source.kind!r}")


def load_model_config(source: ModelSource) -> ModelConfig:
    """Read the model's :class:`ModelConfig` from a GGUF header or ``config.json``.

    Raises:
        ValueError: unsupported architecture, unreadable file, or unknown ``source.kind``.
    """
    _check_kind(source)
    if source.kind == "gguf":
        return read_gguf_config(source.path)[0]
    return read_hf_config(source.path)


def checkpoint_quantization(source: ModelSource) -> QuantizationConfig | None:
    """A safetensors checkpoint's own quantization (GPTQ, AWQ, compressed-tensors) or None
    (GGUF files, dense checkpoints); pass it to ``resolve_quantization(checkpoint=...)``.

    Raises:
        ValueError: an unknown ``quant_method`` or unsupported field, naming config.json.
    """
    _check_kind(source)
    return None if source.kind == "gguf" else read_checkpoint_quantization(source.path)


def iter_weights(source: ModelSource, config: ModelConfig,
                 quantization: QuantizationConfig | None = None,
                 ) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """Yield ``(hf_name, tensor)`` pairs for every weight of the model.

    See :func:`~llmserve.loader.gguf_loader.iter_gguf_weights` (float32, Q/K un-permuted)
    and :func:`~llmserve.loader.safetensors_loader.iter_safetensors_weights` (as stored).
    ``quantization``: GGUF tensors of the types it runs natively come out as
    :class:`QuantizedTensor` raw blocks; for a quantized safetensors checkpoint, its
    :func:`checkpoint_quantization` config keeps modules quantized (anything else:
    dequantized to float32).

    Raises:
        ValueError: unsupported tensor type, missing shard, or unknown ``source.kind``.
    """
    _check_kind(source)
    if source.kind == "gguf":
        return iter_gguf_weights(source.path, config, quantization)
    return iter_safetensors_weights(source.path, quantization)
