"""Weight formats the engine runs natively, by name (``--quantization``).

=============  ==========================================================================
``none``       dequantize every tensor to ``--dtype`` at load (dense matmuls)
``gguf-native``  GGUF Q4_0 / Q4_1 / Q4_K in PyTorch's int4 CPU kernel, Q5_0 / Q5_K / Q6_K /
               Q8_0 in the C kernel ``gguf_matmul``; packed only
``gguf-hybrid``  the same for steps of <= 8 tokens, plus a dense bf16 copy for larger steps
``auto``       ``gguf-hybrid`` for a GGUF model on CPU with bfloat16 activations whose
               tensor types all run natively (or are float), else ``none``
=============  ==========================================================================

Usage (the engine does this when it loads a model)::

    quant = resolve_quantization("auto", model_kind="gguf", dtype="bfloat16", device="cpu")
    model.load_weights(iter_weights(source, model_config, quantization=quant))
    if quant is not None:
        quant.process_model(model)
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # this module stays importable without torch (CLI flags)
    import torch

    from llmserve.layers.quantization.base import QuantizationConfig

__all__ = ["QUANTIZATION_METHODS", "get_quantization_config", "resolve_quantization"]

FLOAT_GGUF_TYPES = frozenset({"F32", "F16", "BF16"})  # dense in every format

QUANTIZATION_METHODS: tuple[str, ...] = ("auto", "none", "gguf-native", "gguf-hybrid")


def get_quantization_config(name: str, dtype: torch.dtype | None = None,
                            ) -> QuantizationConfig | None:
    """The config registered as ``name`` (``none`` -> None); ``dtype`` defaults to bfloat16.

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    if name == "none":
        return None
    import torch

    from llmserve.layers.quantization.gguf_native import (
        DEFAULT_DENSE_THRESHOLD,
        GGUFNativeConfig,
    )

    dtype = torch.bfloat16 if dtype is None else dtype
    if name == "gguf-native":
        return GGUFNativeConfig(dtype, dense_threshold=None)
    if name == "gguf-hybrid":
        return GGUFNativeConfig(dtype, dense_threshold=DEFAULT_DENSE_THRESHOLD)
    raise ValueError(f"quantization must be one of {list(QUANTIZATION_METHODS)}, got {name!r}")


def _has_int4_kernel() -> bool:
    import torch

    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


def _uncovered(gguf_types: Collection[str] | None) -> set[str]:
    """The tensor types of a GGUF file that no native kernel here runs."""
    if gguf_types is None:
        return set()
    import torch

    from llmserve.layers.quantization.gguf_cpu import native_weight_types

    return set(gguf_types) - FLOAT_GGUF_TYPES - native_weight_types(torch.bfloat16)


def resolve_quantization(name: str, *, model_kind: str, dtype: str, device: str,
                         gguf_types: Collection[str] | None = None,
                         ) -> QuantizationConfig | None:
    """Resolve ``--quantization`` against the model format, dtype and device.

    Args:
        name: one of :data:`QUANTIZATION_METHODS`.
        model_kind: ``"gguf"`` or ``"hf"`` (``ModelSource.kind``).
        dtype: the resolved engine dtype (``"bfloat16"``, ``"float32"``, ...).
        device: the resolved device (``"cpu"``, ``"cuda:0"``, ...).
        gguf_types: the GGUF file's tensor types (ggml names); ``auto`` picks the native
            path only when each is float or runs natively (else the layers would mix).

    Returns:
        A config, or None for dense weights.

    Raises:
        ValueError: an unknown name, or a native format the model, dtype or device
            cannot run (the message says what would work).
    """
    if name not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be one of {list(QUANTIZATION_METHODS)}, "
                         f"got {name!r}")
    runnable = model_kind == "gguf" and device == "cpu" and dtype == "bfloat16" \
        and name in ("auto", "gguf-native", "gguf-hybrid") and _has_int4_kernel()
    if name == "auto":
        return get_quantization_config("gguf-hybrid") if runnable and \
            not _uncovered(gguf_types) else None
    if name == "none" or runnable:
        return get_quantization_config(name)
    why = ("needs torch >= 2.6 (torch.ops.aten._weight_int4pack_mm_for_cpu)"
           if not _has_int4_kernel() else
           "needs a GGUF model" if model_kind != "gguf" else
           "runs on the CPU only (the int4 kernel is torch's CPU kernel)" if device != "cpu" else
           "needs --dtype bfloat16 (the int4 kernel is vectorized for bfloat16 only)")
    raise ValueError(f"--quantization {name} {why}; use --quantization none (dense weights)")
