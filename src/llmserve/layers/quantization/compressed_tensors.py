"""compressed-tensors checkpoints (llm-compressor): ``pack-quantized`` and ``int-quantized``.

``config.json`` (schema: ``compressed_tensors.QuantizationConfig``)::

    "quantization_config": {
      "quant_method": "compressed-tensors", "format": "pack-quantized",
      "config_groups": {"group_0": {
          "targets": ["Linear"],                       # class name, module name or "re:<regex>"
          "weights": {"num_bits": 4, "type": "int", "symmetric": true,
                      "strategy": "group", "group_size": 128},     # or "channel"
          "input_activations": null}},                 # W8A8: {"num_bits": 8, "type": "int",
      "ignore": ["lm_head"]}                           #   "strategy": "token", "dynamic": true}

``pack-quantized`` (W4A16; layout of ``pack_to_int32`` / ``PackedQuantizationCompressor``),
for a weight ``[N, K]`` with signed values ``v`` in ``-2**(b-1) .. 2**(b-1) - 1``::

    <m>.weight_packed      int32 [N, K * b / 32]   field i of word j = v[n, 32/b j + i] + 2**(b-1)
    <m>.weight_scale       float [N, G]            (G = K / group_size; channel: G = 1)
    <m>.weight_zero_point  int32 [N * b / 32, G]   asymmetric only; packed along dim 0 (rows)
    <m>.weight_shape       int   [2] = [N, K]
    <m>.weight_g_idx       int32 [K]               optional (actorder "group")
    w = (v - zp) * s

``int-quantized`` (W8A8 or W8A16; ``IntQuantizationCompressor``)::

    <m>.weight int8 [N, K], <m>.weight_scale float [N, 1] (channel) or [1] (tensor),
    <m>.input_scale float [1] (static activations only)          w = v * s

W8A8 runs :mod:`~llmserve.layers.quantization.w8a8`; W4A16 the int4 kernel
(``int_group.py``); int8 weights without activation quantization load dense.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from llmserve.layers.quantization.base import QuantizedTensor
from llmserve.layers.quantization.int_group import (
    FLOAT_DTYPES,
    CheckpointQuantizationConfig,
    GroupQuantizedTensor,
    require,
    trivial_g_idx,
    unpack_int32,
)
from llmserve.layers.quantization.w8a8 import Int8QuantizedTensor, W8A8Config

CT_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized")
_SUFFIXES = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape",
             "weight_g_idx", "input_scale", "input_zero_point", "weight")


class CTScheme:
    """One ``config_groups`` entry: targets, weight and activation arguments, format."""

    def __init__(self, name: str, group: dict[str, Any], default_format: str,
                 where: str) -> None:
        where = f"{where}.config_groups.{name}"
        self.targets = list(group.get("targets") or [])
        w = group.get("weights")
        if not isinstance(w, dict):
            raise ValueError(f"{where}.weights must be an object")
        self.format = group.get("format") or default_format
        if self.format not in CT_FORMATS:
            raise ValueError(f"{where}: format {self.format!r} is not supported; "
                             f"supported: {list(CT_FORMATS)}")
        self.bits = w.get("num_bits", 8)
        if w.get("type", "int") != "int" or self.bits not in (4, 8):
            raise ValueError(f"{where}.weights: only int 4- or 8-bit weights are supported, "
                             f"got {w.get('type', 'int')} {self.bits}-bit")
        self.strategy = w.get("strategy") or "tensor"
        if self.strategy not in ("group", "channel", "tensor"):
            raise ValueError(f"{where}.weights.strategy {self.strategy!r} is not supported; "
                             "supported: group, channel, tensor")
        self.group_size = w.get("group_size") if self.strategy == "group" else -1
        if self.strategy == "group" and (not isinstance(self.group_size, int)
                                         or self.group_size <= 0):
            raise ValueError(f"{where}.weights.group_size must be a positive int")
        self.symmetric = bool(w.get("symmetric", True))
        if w.get("dynamic"):
            raise ValueError(f"{where}.weights.dynamic is not supported")
        a = group.get("input_activations")
        self.act_dynamic: bool | None = None  # None: weight-only
        if a:
            if a.get("type", "int") != "int" or a.get("num_bits", 8) != 8 \
                    or not a.get("symmetric", True) or self.bits != 8 \
                    or a.get("strategy", "tensor") not in ("token", "tensor"):
                raise ValueError(f"{where}.input_activations: only symmetric int8 activations "
                                 "(per token or per tensor) with int8 weights are supported")
            self.act_dynamic = bool(a.get("dynamic", False))
            if self.act_dynamic and a.get("strategy") != "token":
                raise ValueError(f"{where}.input_activations: dynamic needs strategy 'token'")
            if not self.symmetric:
                raise ValueError(f"{where}.weights: W8A8 needs symmetric weights")
        if self.format == "pack-quantized" and self.act_dynamic is not None:
            raise ValueError(f"{where}: pack-quantized with input_activations is not supported")

    def matches(self, prefix: str) -> bool:
        for t in self.targets:
            if t == "Linear" or t == prefix or (t.startswith("re:") and re.match(t[3:], prefix)):
                return True
        return False


class CompressedTensorsConfig(CheckpointQuantizationConfig):
    """A compressed-tensors checkpoint's ``quantization_config``.

    Raises:
        ValueError: an unsupported format, scheme or ``kv_cache_scheme``; the message
            names ``source`` and the field.
    """

    name = "compressed-tensors"

    def __init__(self, qc: dict[str, Any], source: str) -> None:
        super().__init__(source)
        where = f"{source}: quantization_config"
        groups = qc.get("config_groups")
        if not isinstance(groups, dict) or not groups:
            raise ValueError(f"{where}.config_groups must be a non-empty object")
        if qc.get("kv_cache_scheme"):
            raise ValueError(f"{where}.kv_cache_scheme is not supported")
        fmt = qc.get("format", "pack-quantized")
        self.schemes = [CTScheme(str(n), g, fmt, where) for n, g in groups.items()]
        self.w8a8 = W8A8Config()

    def module_suffixes(self) -> tuple[str, ...]:
        return _SUFFIXES

    def marker_suffixes(self) -> tuple[str, ...]:
        return ("weight_packed", "weight_scale")

    def scheme_for(self, prefix: str) -> CTScheme:
        """The config group whose targets match ``prefix`` (the only group if just one).

        Raises:
            ValueError: no group targets the module.
        """
        scheme = next((s for s in self.schemes if s.matches(prefix)), None)
        if scheme is None and len(self.schemes) == 1:
            scheme = self.schemes[0]
        if scheme is None:
            raise ValueError(f"{self.source}: no config_groups entry targets the quantized "
                             f"module {prefix!r}")
        return scheme

    def read_module(self, prefix: str, tensors: dict[str, torch.Tensor]) -> QuantizedTensor:
        scheme = self.scheme_for(prefix)
        if "weight_packed" in tensors:
            return self._read_packed(prefix, tensors, scheme)
        return self._read_int(prefix, tensors, scheme)

    def _read_packed(self, prefix: str, tensors: dict[str, torch.Tensor],
                     s: CTScheme) -> GroupQuantizedTensor:
        packed = require(tensors, prefix, "weight_packed", (torch.int32,), 2)
        scale = require(tensors, prefix, "weight_scale", FLOAT_DTYPES)
        shape = require(tensors, prefix, "weight_shape", (torch.int32, torch.int64), 1)
        n, k = (int(v) for v in shape.tolist()) if shape.numel() == 2 else (-1, -1)
        per, offset = 32 // s.bits, 1 << (s.bits - 1)
        if n <= 0 or packed.shape != (n, -(-k // per)) or k % per:
            raise ValueError(f"{prefix}: weight_packed {tuple(packed.shape)} does not hold "
                             f"a {s.bits}-bit weight of weight_shape {shape.tolist()}")
        if s.strategy == "tensor" and scale.numel() == 1:
            scale = scale.reshape(1, 1).expand(n, 1)
        elif scale.numel() % n == 0:
            scale = scale.reshape(n, -1)
        else:
            raise ValueError(f"{prefix}.weight_scale {tuple(scale.shape)} does not fit "
                             f"{s.strategy} quantization of a [{n}, {k}] weight")
        groups = scale.shape[1]
        group_size = s.group_size if s.strategy == "group" else k
        codes = unpack_int32(packed, s.bits, dim=1)  # unsigned: v + offset
        if s.symmetric:
            zeros = torch.full((n, groups), float(offset))
        else:
            zp = require(tensors, prefix, "weight_zero_point", (torch.int32,), 2)
            if zp.shape != (-(-n // per), groups):
                raise ValueError(f"{prefix}.weight_zero_point {tuple(zp.shape)} is not "
                                 f"[{-(-n // per)}, {groups}] (packed along rows)")
            zeros = unpack_int32(zp, s.bits, dim=0)[:n].float()
        g_idx = tensors.get("weight_g_idx")
        if g_idx is not None:
            g_idx = g_idx.long()
            if trivial_g_idx(g_idx, group_size) and groups * group_size == k:
                g_idx = None
        return GroupQuantizedTensor(codes=codes, scales=scale.float().contiguous(),
                                    zeros=zeros.contiguous(), group_size=group_size,
                                    bits=s.bits, config=self, g_idx=g_idx,
                                    source=f"{prefix}.weight_packed")

    def _read_int(self, prefix: str, tensors: dict[str, torch.Tensor],
                  s: CTScheme) -> QuantizedTensor:
        weight = require(tensors, prefix, "weight", (torch.int8,), 2)
        scale = require(tensors, prefix, "weight_scale", FLOAT_DTYPES)
        n, k = weight.shape
        if s.strategy == "group" or scale.numel() not in (1, n):
            raise ValueError(f"{prefix}.weight_scale {tuple(scale.shape)}: int-quantized "
                             f"weights need a per-channel [{n}, 1] or per-tensor scale")
        scales = scale.float().reshape(-1).expand(n).contiguous()
        if s.act_dynamic is not None:
            input_scale = None
            if not s.act_dynamic:
                t = require(tensors, prefix, "input_scale", FLOAT_DTYPES)
                if t.numel() != 1:
                    raise ValueError(f"{prefix}.input_scale must hold one value "
                                     f"(per-tensor), got shape {tuple(t.shape)}")
                input_scale = float(t.float().reshape(()))
            return Int8QuantizedTensor(codes=weight.contiguous(), scales=scales,
                                       config=self.w8a8, input_scale=input_scale,
                                       source=f"{prefix}.weight")
        zeros = torch.full((n, 1), 128.0)
        if not s.symmetric and "weight_zero_point" in tensors:
            zeros = tensors["weight_zero_point"].float().reshape(-1).expand(n)[:, None] + 128
        return GroupQuantizedTensor(  # W8A16: int8 weights, dense matmul in the model dtype
            codes=(weight.to(torch.int16) + 128).to(torch.uint8), scales=scales[:, None],
            zeros=zeros.contiguous(), group_size=k, bits=8, config=self,
            source=f"{prefix}.weight")
