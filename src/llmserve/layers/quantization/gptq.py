"""GPTQ safetensors checkpoints (AutoGPTQ / GPTQModel / optimum), v1 and v2 zero points.

``config.json``::

    "quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128,
                            "desc_act": false, "sym": true,
                            "checkpoint_format": "gptq"}        # or "gptq_v2"

Per linear module ``<m>`` (K = in_features, N = out_features, G = K / group_size;
layout of AutoGPTQ ``QuantLinear.pack`` / GPTQModel ``pack``)::

    <m>.qweight  int32 [K * bits / 32, N]   word j of column n, bits [b*i, b*i + b): q[j*32/b + i, n]
    <m>.qzeros   int32 [G, N * bits / 32]   word j of group g, bits [b*i, ...):     zs[g, j*32/b + i]
    <m>.scales   fp16  [G, N]
    <m>.g_idx    int32 [K]                  group of input column k (desc_act: not k // group)
    <m>.bias     (optional, dense)

    w[n, k] = s[g_idx[k], n] * (q[k, n] - z[g_idx[k], n])
    v1 ("gptq"):    z = (zs + 1) & (2**bits - 1)     (AutoGPTQ stores z - 1; the mask is theirs)
    v2 ("gptq_v2"): z = zs

``group_size: -1`` means one group per row (G = 1). 4-bit layers run on the int4
kernel (``int_group.py``); 2- and 8-bit layers load dense; 3-bit (words straddled)
is refused.
"""

from __future__ import annotations

from typing import Any

import torch

from llmserve.layers.quantization.int_group import (
    FLOAT_DTYPES,
    CheckpointQuantizationConfig,
    GroupQuantizedTensor,
    require,
    trivial_g_idx,
    unpack_int32,
)

GPTQ_BITS = (2, 4, 8)
GPTQ_FORMATS = ("gptq", "gptq_v2")


class GPTQConfig(CheckpointQuantizationConfig):
    """A GPTQ checkpoint's ``quantization_config``.

    Args:
        qc: the ``quantization_config`` dict.
        source: the config file path (for error messages).

    Raises:
        ValueError: unsupported ``bits``, ``group_size``, ``checkpoint_format`` or
            per-module ``dynamic`` overrides; the message names ``source`` and the field.
    """

    name = "gptq"

    def __init__(self, qc: dict[str, Any], source: str) -> None:
        super().__init__(source)
        where = f"{source}: quantization_config"
        self.bits = qc.get("bits", qc.get("w_bit"))
        if self.bits not in GPTQ_BITS:
            raise ValueError(f"{where}.bits must be one of {GPTQ_BITS} for GPTQ, "
                             f"got {self.bits!r}")
        self.group_size = qc.get("group_size", 128)
        if not isinstance(self.group_size, int) or not (self.group_size == -1
                                                        or self.group_size > 0):
            raise ValueError(f"{where}.group_size must be a positive int or -1, "
                             f"got {self.group_size!r}")
        fmt = qc.get("checkpoint_format", qc.get("format", "gptq"))
        if fmt not in GPTQ_FORMATS:
            raise ValueError(f"{where}.checkpoint_format {fmt!r} is not supported; "
                             f"supported: {list(GPTQ_FORMATS)}")
        self.v2 = fmt == "gptq_v2"
        self.desc_act = bool(qc.get("desc_act", False))
        self.sym = bool(qc.get("sym", True))
        if qc.get("dynamic"):
            raise ValueError(f"{where}.dynamic (per-module GPTQ overrides) is not supported")

    def module_suffixes(self) -> tuple[str, ...]:
        return ("qweight", "qzeros", "scales", "g_idx")

    def read_module(self, prefix: str, tensors: dict[str, torch.Tensor]) -> GroupQuantizedTensor:
        bits, per = self.bits, 32 // self.bits
        qweight = require(tensors, prefix, "qweight", (torch.int32,), 2)
        qzeros = require(tensors, prefix, "qzeros", (torch.int32,), 2)
        scales = require(tensors, prefix, "scales", FLOAT_DTYPES, 2)
        k, n = qweight.shape[0] * per, qweight.shape[1]
        groups = scales.shape[0]
        if scales.shape[1] != n or qzeros.shape != (groups, n // per) or n % per:
            raise ValueError(f"{prefix}: qweight {tuple(qweight.shape)}, qzeros "
                             f"{tuple(qzeros.shape)} and scales {tuple(scales.shape)} do "
                             f"not form a {bits}-bit GPTQ [{n}, {k}] weight")
        group_size = k if self.group_size == -1 else self.group_size
        g_idx = tensors.get("g_idx")
        if g_idx is not None:
            g_idx = require(tensors, prefix, "g_idx", (torch.int32, torch.int64), 1).long()
            if g_idx.numel() == k and trivial_g_idx(g_idx, group_size) \
                    and groups == k // group_size:
                g_idx = None
        codes = unpack_int32(qweight, bits, dim=0).t()  # [N, K]
        zeros = unpack_int32(qzeros, bits, dim=1).to(torch.int32)  # [G, N]
        if not self.v2:
            zeros = (zeros + 1) & ((1 << bits) - 1)
        return GroupQuantizedTensor(
            codes=codes.contiguous(), scales=scales.float().t().contiguous(),
            zeros=zeros.float().t().contiguous(), group_size=group_size, bits=bits,
            config=self, g_idx=g_idx, source=f"{prefix}.qweight")
