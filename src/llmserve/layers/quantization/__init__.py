"""Weight formats the engine runs natively, by name (``--quantization``).

=============  ==========================================================================
``none``       dequantize every tensor to ``--dtype`` at load (dense matmuls)
``gguf-native``  GGUF Q4_0 / Q4_1 / Q4_K in PyTorch's int4 CPU kernel, Q5_0 / Q5_K / Q6_K /
               Q8_0 in the C kernel ``gguf_matmul``; packed only
``gguf-hybrid``  the same for decode rows, plus a dense bf16 copy for prompt rows
``gguf-hybrid-int8``  the same for decode rows; prompt rows W8A8 (Hadamard-rotated
               per-token int8 activations x int8 weights, ``int8_prefill.py``), the LM
               head dense; opt-in (perplexity +0.77% on Qwen2.5-Coder-1.5B Q4_K_M)
``auto``       ``gguf-hybrid`` for a GGUF model on CPU with bfloat16 activations whose
               tensor types all run natively or are float (``gguf-native`` with
               ``--deterministic``: one kernel for all rows); a quantized safetensors
               checkpoint's own method on CPU; else ``none``
``gptq``       GPTQ checkpoints (4-bit on the int4 kernel), ``gptq.py``
``awq``        AWQ GEMM checkpoints (int4 kernel), ``awq.py``
``compressed-tensors``  ``pack-quantized`` W4A16 (int4 kernel), ``int-quantized`` W8A8
               (dynamic per-token int8 activations), ``compressed_tensors.py``
=============  ==========================================================================

A safetensors checkpoint names its method in ``config.json``'s
``quantization_config.quant_method`` (:func:`checkpoint_quantization_config`);
``--quantization none`` dequantizes it at load.

Usage (the engine does this when it loads a model)::

    quant = resolve_quantization("auto", model_kind="gguf", dtype="bfloat16", device="cpu")
    model.load_weights(iter_weights(source, model_config, quantization=quant))
    if quant is not None:
        quant.process_model(model)
        quant.fix_layouts(model)  # unless the layers will move (offload)
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # this module stays importable without torch (CLI flags)
    import torch

    from llmserve.layers.quantization.base import QuantizationConfig
    from llmserve.layers.quantization.int_group import CheckpointQuantizationConfig

__all__ = ["CHECKPOINT_METHODS", "QUANTIZATION_METHODS", "checkpoint_quantization_config",
           "get_quantization_config", "resolve_quantization"]

# quantization_config.quant_method -> module.class (safetensors checkpoints)
CHECKPOINT_METHODS: dict[str, str] = {
    "gptq": "gptq.GPTQConfig",
    "awq": "awq.AWQConfig",
    "compressed-tensors": "compressed_tensors.CompressedTensorsConfig",
}
QUANTIZATION_METHODS: tuple[str, ...] = ("auto", "none", "gguf-native", "gguf-hybrid",
                                         "gguf-hybrid-int8", *CHECKPOINT_METHODS)
FLOAT_GGUF_TYPES = frozenset({"F32", "F16", "BF16"})  # dense in every format


def checkpoint_quantization_config(qc: object, source: str) -> CheckpointQuantizationConfig:
    """The :class:`~llmserve.layers.quantization.int_group.CheckpointQuantizationConfig`
    for a ``quantization_config`` dict read from ``source`` (a config.json path).

    Raises:
        ValueError: not an object, an unknown ``quant_method`` (the message names
            ``source`` and lists the known ones), or a field the method rejects.
    """
    if not isinstance(qc, dict):
        raise ValueError(f"{source}: quantization_config must be an object")
    method = qc.get("quant_method")
    if method not in CHECKPOINT_METHODS:
        raise ValueError(f"{source}: quantization_config.quant_method {method!r} is not "
                         f"supported; supported: {sorted(CHECKPOINT_METHODS)}")
    import importlib

    module, cls = CHECKPOINT_METHODS[method].split(".")
    mod = importlib.import_module(f"llmserve.layers.quantization.{module}")
    return getattr(mod, cls)(qc, source)

def get_quantization_config(name: str, dtype: torch.dtype | None = None,
                            ) -> QuantizationConfig | None:
    """The config registered as ``name`` (``none`` -> None); ``dtype`` defaults to bfloat16.

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    if name == "none":
        return None
    import torch

    from llmserve.layers.quantization.gguf_native import GGUFNativeConfig

    dtype = torch.bfloat16 if dtype is None else dtype
    if name in CHECKPOINT_METHODS:
        raise ValueError(f"quantization {name!r} comes from a checkpoint's config.json; "
                         "use checkpoint_quantization_config")
    if name == "gguf-native":
        return GGUFNativeConfig(dtype, dense_prefill=False)
    if name == "gguf-hybrid":
        return GGUFNativeConfig(dtype, dense_prefill=True)
    if name == "gguf-hybrid-int8":
        return GGUFNativeConfig(dtype, dense_prefill=True, prefill_weights="int8")
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
                         checkpoint: QuantizationConfig | None = None,
                         gguf_types: Collection[str] | None = None,
                         deterministic: bool = False) -> QuantizationConfig | None:
    """Resolve ``--quantization`` against the model format, dtype and device.

    Args:
        name: one of :data:`QUANTIZATION_METHODS`.
        model_kind: ``"gguf"`` or ``"hf"`` (``ModelSource.kind``).
        dtype: the resolved engine dtype (``"bfloat16"``, ``"float32"``, ...).
        device: the resolved device (``"cpu"``, ``"cuda:0"``, ...).
        checkpoint: a safetensors checkpoint's own config
            (``loader.read_checkpoint_quantization``), or None.
        gguf_types: the GGUF file's tensor types (ggml names); ``auto`` picks the native
            path only when each is float or runs natively (else the layers would mix).
        deterministic: batch-invariant mode; ``auto`` then picks ``gguf-native`` (every
            row runs the packed kernel, so the dense copy of ``gguf-hybrid`` is unused).

    Returns:
        A config, or None for dense weights.

    Raises:
        ValueError: an unknown name, or a native format the model, dtype or device
            cannot run (the message says what would work).
    """
    if name not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be one of {list(QUANTIZATION_METHODS)}, "
                         f"got {name!r}")
    if checkpoint is not None and name in ("auto", *CHECKPOINT_METHODS):
        if name not in ("auto", checkpoint.name):
            raise ValueError(f"--quantization {name} does not match the checkpoint's "
                             f"quant_method {checkpoint.name!r}; use --quantization auto "
                             "(or none: dequantize at load)")
        if device == "cpu" and _has_int4_kernel():
            return checkpoint
        if name == "auto":
            return None
        raise ValueError(f"--quantization {name} runs on the CPU only (torch >= 2.6 int4 "
                         "kernel); use --quantization none (dequantize at load)")
    if name in CHECKPOINT_METHODS:
        raise ValueError(f"--quantization {name} needs a safetensors checkpoint whose "
                         f"config.json has quantization_config.quant_method {name!r}")
    runnable = model_kind == "gguf" and device == "cpu" and dtype == "bfloat16" \
        and name in ("auto", "gguf-native", "gguf-hybrid", "gguf-hybrid-int8") \
        and _has_int4_kernel()
    if name == "auto":
        if not runnable or _uncovered(gguf_types):
            return None
        return get_quantization_config("gguf-native" if deterministic else "gguf-hybrid")
    if name == "none" or runnable:
        return get_quantization_config(name)
    why = ("needs torch >= 2.6 (torch.ops.aten._weight_int4pack_mm_for_cpu)"
           if not _has_int4_kernel() else
           "needs a GGUF model" if model_kind != "gguf" else
           "runs on the CPU only (the int4 kernel is torch's CPU kernel)" if device != "cpu" else
           "needs --dtype bfloat16 (the int4 kernel is vectorized for bfloat16 only)")
    raise ValueError(f"--quantization {name} {why}; use --quantization none (dense weights)")
