"""AWQ safetensors checkpoints (AutoAWQ ``version: "gemm"``).

``config.json``::

    "quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128,
                            "zero_point": true, "version": "gemm"}

Per linear module ``<m>`` (K = in_features, N = out_features, G = K / group_size;
layout of AutoAWQ ``WQLinear_GEMM.from_linear``)::

    <m>.qweight  int32 [K, N / 8]   nibble i of word j (bits [4i, 4i + 4)): q[k, 8j + AWQ_ORDER[i]]
    <m>.qzeros   int32 [G, N / 8]   same interleave:                       z[g, 8j + AWQ_ORDER[i]]
    <m>.scales   fp16  [G, N]

    AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]       (unpack: column c is nibble AWQ_REVERSE_ORDER[c])
    w[n, k] = (q[k, n] - z[k // group, n]) * s[k // group, n]

``gemv`` / ``gemv_fast`` / ``marlin`` checkpoints use other layouts and are refused.
"""

from __future__ import annotations

from typing import Any

import torch

from llmserve.layers.quantization.int_group import (
    FLOAT_DTYPES,
    CheckpointQuantizationConfig,
    GroupQuantizedTensor,
    require,
    unpack_int32,
)

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """int32 ``[R, C]`` AWQ-interleaved nibbles -> uint8 ``[R, 8 C]`` in column order."""
    fields = unpack_int32(packed, 4, dim=1)  # [R, 8C], nibble order
    rows, cols = fields.shape
    order = torch.tensor(AWQ_REVERSE_ORDER)
    return fields.view(rows, cols // 8, 8)[:, :, order].reshape(rows, cols)


class AWQConfig(CheckpointQuantizationConfig):
    """An AWQ checkpoint's ``quantization_config``.

    Raises:
        ValueError: ``bits`` other than 4, a bad ``group_size``, ``zero_point: false`` or
            a ``version`` other than ``gemm``; the message names ``source`` and the field.
    """

    name = "awq"

    def __init__(self, qc: dict[str, Any], source: str) -> None:
        super().__init__(source)
        where = f"{source}: quantization_config"
        bits = qc.get("bits", qc.get("w_bit"))
        if bits != 4:
            raise ValueError(f"{where}.bits must be 4 for AWQ, got {bits!r}")
        self.group_size = qc.get("group_size", qc.get("q_group_size", 128))
        if not isinstance(self.group_size, int) or not (self.group_size == -1
                                                        or self.group_size > 0):
            raise ValueError(f"{where}.group_size must be a positive int or -1, "
                             f"got {self.group_size!r}")
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"{where}.version {version!r} is not supported; "
                             "supported: 'gemm'")
        if not qc.get("zero_point", True):
            raise ValueError(f"{where}.zero_point false is not supported (AWQ GEMM "
                             "checkpoints store zero points)")

    def module_suffixes(self) -> tuple[str, ...]:
        return ("qweight", "qzeros", "scales")

    def read_module(self, prefix: str, tensors: dict[str, torch.Tensor]) -> GroupQuantizedTensor:
        qweight = require(tensors, prefix, "qweight", (torch.int32,), 2)
        qzeros = require(tensors, prefix, "qzeros", (torch.int32,), 2)
        scales = require(tensors, prefix, "scales", FLOAT_DTYPES, 2)
        k, n = qweight.shape[0], qweight.shape[1] * 8
        groups = scales.shape[0]
        if scales.shape[1] != n or qzeros.shape != (groups, n // 8):
            raise ValueError(f"{prefix}: qweight {tuple(qweight.shape)}, qzeros "
                             f"{tuple(qzeros.shape)} and scales {tuple(scales.shape)} do "
                             f"not form a 4-bit AWQ [{n}, {k}] weight")
        group_size = k if self.group_size == -1 else self.group_size
        return GroupQuantizedTensor(
            codes=unpack_awq(qweight).t().contiguous(),
            scales=scales.float().t().contiguous(),
            zeros=unpack_awq(qzeros).float().t().contiguous(),
            group_size=group_size, bits=4, config=self, source=f"{prefix}.qweight")
