"""Write a :class:`~llmserve.compress.pipeline.QuantizedModel` as a standard checkpoint.

=====================  ============================================  =======================
``--format``           tensors per linear ``<m>`` (weight ``[N, K]``)  methods / bits
=====================  ============================================  =======================
``gptq``               ``qweight`` int32 ``[K b/32, N]``, ``qzeros``   rtn, gptq, awq; 4, 8
                       int32 ``[G, N b/32]`` (stores z - 1, v1),
                       ``scales`` fp16 ``[G, N]``, ``g_idx`` ``[K]``
``awq``                ``qweight`` int32 ``[K, N/8]``, ``qzeros``      rtn, gptq, awq; 4
                       ``[G, N/8]`` (nibble order 0 2 4 6 1 3 5 7),   (no act-order)
                       ``scales`` fp16 ``[G, N]``  (AutoAWQ GEMM)
``compressed-tensors``  weight-only: ``pack-quantized`` (``weight_packed``  all
                       int32 ``[N, K b/32]``, ``weight_scale [N, G]``,
                       ``weight_zero_point`` ``[N b/32, G]`` if asymmetric,
                       ``weight_shape``, ``weight_g_idx``); W8A8:
                       ``int-quantized`` (``weight`` int8, ``weight_scale [N, 1]``)
=====================  ============================================  =======================

The layouts are those the readers in ``llmserve/layers/quantization/`` document (the
AutoGPTQ, AutoAWQ and compressed-tensors packers); ``lm_head`` and embeddings stay
dense, in bfloat16 (the dtype the engine serves them in; float32 would double a
4-bit checkpoint's size on a large-vocabulary model), 1-D tensors (norms, biases) in
float32. ``config.json`` gets the format's ``quantization_config``; tokenizer files are
copied, so ``llmserve generate --model DIR`` (and vLLM, for compressed-tensors) loads it.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from safetensors.torch import save_file

from llmserve.compress.pipeline import QuantizedModel
from llmserve.compress.quantizer import QuantizedLinear

FORMATS = ("compressed-tensors", "gptq", "awq")
DEFAULT_FORMAT = {"rtn": "gptq", "gptq": "gptq", "awq": "awq", "smoothquant": "compressed-tensors"}
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def check_format(fmt: str, method: str, bits: int, act_order: bool) -> None:
    """Raises ValueError for a format the method / bits / act-order cannot be written in."""
    if fmt not in FORMATS:
        raise ValueError(f"--format must be one of {list(FORMATS)}, got {fmt!r}")
    if method == "smoothquant" and fmt != "compressed-tensors":
        raise ValueError(f"--method smoothquant (W8A8: int8 activations) cannot be written "
                         f"as --format {fmt} (weight-only); use --format compressed-tensors")
    if fmt == "awq" and bits != 4:
        raise ValueError(f"--format awq holds 4-bit weights only, got --bits {bits}")
    if fmt == "awq" and act_order:
        raise ValueError("--format awq has no g_idx for --act-order; use --format gptq or "
                         "compressed-tensors")


def pack_int32(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Unsigned ``values [R, C]`` (< 2**bits) -> int32 words packed along ``dim``: field
    ``i`` (bits ``[b i, b i + b)``) of word ``j`` holds element ``j * 32/b + i``; ``dim``
    is zero-padded to a multiple of ``32 / b``."""
    per = 32 // bits
    v = values.to(torch.int64)
    if dim == 0:
        v = v.t()
    pad = (-v.shape[1]) % per
    if pad:
        v = torch.cat([v, v.new_zeros(v.shape[0], pad)], dim=1)
    v = v.reshape(v.shape[0], -1, per)
    shifts = torch.arange(per, dtype=torch.int64) * bits
    words = (v << shifts).sum(-1)  # < 2**32, fields do not overlap
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return words.t().contiguous() if dim == 0 else words.contiguous()


def gptq_tensors(q: QuantizedLinear) -> dict[str, torch.Tensor]:
    mask = (1 << q.bits) - 1
    return {"qweight": pack_int32(q.codes.t(), q.bits, dim=0),
            "qzeros": pack_int32(((q.zeros - 1) & mask).t(), q.bits, dim=1),
            "scales": q.scales.t().contiguous().half(),
            "g_idx": q.group_index().to(torch.int32)}


def awq_tensors(q: QuantizedLinear) -> dict[str, torch.Tensor]:
    def interleave(t: torch.Tensor) -> torch.Tensor:  # [R, C] -> AWQ column order
        r, c = t.shape
        return t.reshape(r, c // 8, 8)[:, :, list(AWQ_ORDER)].reshape(r, c)

    return {"qweight": pack_int32(interleave(q.codes.t()), 4, dim=1),
            "qzeros": pack_int32(interleave(q.zeros.t()), 4, dim=1),
            "scales": q.scales.t().contiguous().half()}


def ct_packed_tensors(q: QuantizedLinear) -> dict[str, torch.Tensor]:
    out = {"weight_packed": pack_int32(q.codes, q.bits, dim=1),
           "weight_scale": q.scales.half().contiguous(),
           "weight_shape": torch.tensor(list(q.shape), dtype=torch.int64)}
    if not q.symmetric:
        out["weight_zero_point"] = pack_int32(q.zeros, q.bits, dim=0)
    if q.g_idx is not None:
        out["weight_g_idx"] = q.g_idx.to(torch.int32)
    return out


def quantization_config(qm: QuantizedModel, fmt: str) -> dict[str, Any]:
    """The ``config.json`` ``quantization_config`` of ``qm`` written as ``fmt``."""
    o = qm.options
    if fmt == "gptq":
        return {"quant_method": "gptq", "bits": o.bits, "group_size": o.group_size, "desc_act": o.act_order,
                "sym": o.symmetric, "checkpoint_format": "gptq", "static_groups": False,
                "true_sequential": False, "damp_percent": o.percdamp,
                "quantizer": f"llmserve-{o.method}"}
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": o.group_size,
                "zero_point": True, "version": "gemm", "quantizer": f"llmserve-{o.method}"}
    if o.method == "smoothquant":
        scheme = {"targets": ["Linear"], "format": "int-quantized",
                  "weights": {"num_bits": 8, "type": "int", "symmetric": True,
                              "strategy": "channel", "dynamic": False},
                  "input_activations": {"num_bits": 8, "type": "int", "symmetric": True,
                                        "strategy": "token", "dynamic": True}}
        ct_fmt = "int-quantized"
    else:
        per_row = o.group_size == -1
        scheme = {"targets": ["Linear"], "format": "pack-quantized",
                  "weights": {"num_bits": o.bits, "type": "int", "symmetric": o.symmetric,
                              "strategy": "channel" if per_row else "group",
                              "group_size": None if per_row else o.group_size,
                              "actorder": "group" if o.act_order else None,
                              "dynamic": False},
                  "input_activations": None}
        ct_fmt = "pack-quantized"
    return {"quant_method": "compressed-tensors", "format": ct_fmt,
            "config_groups": {"group_0": scheme}, "ignore": ["lm_head"],
            "quantization_status": "compressed"}


def module_tensors(weight: Any, fmt: str) -> dict[str, torch.Tensor]:
    """One module's tensors in ``fmt`` (W8A8 results are ``(codes, scales)``)."""
    if isinstance(weight, tuple):
        codes, scales = weight
        return {"weight": codes.contiguous(), "weight_scale": scales[:, None].float()}
    return {"gptq": gptq_tensors, "awq": awq_tensors,
            "compressed-tensors": ct_packed_tensors}[fmt](weight)


def save_quantized(qm: QuantizedModel, output: str, fmt: str, tokenizer: Any) -> str:
    """Write ``qm`` to the directory ``output`` as ``fmt``; returns ``output``.

    Raises:
        ValueError: an unsupported method / format combination, or ``output`` is a file.
    """
    o = qm.options
    check_format(fmt, o.method, o.bits, o.act_order)
    if os.path.isfile(output):
        raise ValueError(f"--output {output!r} is a file; pass a directory")
    os.makedirs(output, exist_ok=True)
    model = qm.model
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    tensors: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        module, suffix = name.rsplit(".", 1)
        if (module in qm.weights and suffix == "weight") or (tied and name == "lm_head.weight"):
            continue  # a quantized linear's bias (Qwen2's q/k/v) stays
        dtype = torch.bfloat16 if t.dim() >= 2 else torch.float32
        tensors[name] = t.detach().to(dtype).contiguous()
    for module, weight in qm.weights.items():
        for suffix, t in module_tensors(weight, fmt).items():
            tensors[f"{module}.{suffix}"] = t
    save_file(tensors, os.path.join(output, "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config["architectures"] = [type(model).__name__]
    config["torch_dtype"] = "bfloat16"
    config.pop("dtype", None)
    config["quantization_config"] = quantization_config(qm, fmt)
    with open(os.path.join(output, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    if tokenizer is not None:
        tokenizer.save_pretrained(output)
    return output
