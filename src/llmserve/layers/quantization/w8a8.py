"""int8 weights with int8 activations (W8A8): ``torch._int_mm`` on per-token int8 inputs.

The scheme of compressed-tensors ``int-quantized`` checkpoints (and of vLLM's
``CompressedTensorsW8A8Int8``)::

    weight   q_w int8 [N, K], s_w float32 [N]              w = q_w * s_w   (symmetric)
    dynamic  s_x[m] = max_k |x[m, k]| / 127   (per token)  q_x = clamp(round(x / s_x), -128, 127)
    static   s_x = input_scale (one float)
    y[m, n] = float(sum_k q_x[m, k] q_w[n, k]) * s_x[m] * s_w[n]   (+ bias), in the model dtype

The int32 sum is exact; its conversion to float32 rounds once when it exceeds
2**24. ``round`` is half-to-even (``torch.round``), the ``s_x`` divisor 127 as
vLLM's ``scaled_int8_quant``. Versus the dense model on the dequantized weights
the activation rounding adds a relative error of about ``1 / 254`` per input
element (the step ``s_x`` over the largest value); the tests bound the logit error.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from llmserve.layers.quantization.base import (
    LinearMethodBase,
    QuantizationConfig,
    QuantizedTensor,
)
from llmserve.layers.quantization.int_group import CheckpointLinearMethod

INT8_MAX = 127.0


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` -> int8 ``q [M, K]`` and float32 ``s [M, 1]`` with ``x ~ q * s``.

    ``s = max|x| / 127`` per row (a row of zeros gets ``s = 1``); ``q = round(x / s)``.
    """
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True) / INT8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(x / scale).clamp_(-128, 127).to(torch.int8)
    return q, scale


def quantize_static(x: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor static scale: ``q = clamp(round(x / scale), -128, 127)``."""
    s = torch.tensor([[scale]], dtype=torch.float32)
    return torch.round(x.float() / s).clamp_(-128, 127).to(torch.int8), s


@dataclass
class Int8QuantizedTensor(QuantizedTensor):
    """A W8A8 weight ``[N, K]``: int8 ``codes``, float32 per-row ``scales [N]``, and the
    activation rule (``input_scale`` None = dynamic per token)."""

    codes: torch.Tensor
    scales: torch.Tensor
    config: QuantizationConfig
    input_scale: float | None = None
    source: str = ""

    def __post_init__(self) -> None:
        self.shape = tuple(self.codes.shape)
        if self.codes.dtype != torch.int8 or self.codes.dim() != 2 or \
                self.scales.shape != (self.shape[0],):
            raise ValueError(f"{self.source}: int8 weight {tuple(self.codes.shape)} with "
                             f"scales {tuple(self.scales.shape)} is not a W8A8 weight")

    def dequantize(self) -> torch.Tensor:
        return self.codes.float() * self.scales[:, None]


class Int8Weight:
    """A packed W8A8 weight: ``codes_t`` int8 ``[K, N]`` (a transposed view), ``scales``
    float32 ``[N]``, run by :meth:`matmul` (see the module doc)."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, input_scale: float | None,
                 dtype: torch.dtype) -> None:
        self.codes_t = codes.t()
        self.scales = scales
        self.input_scale = input_scale
        self.activation_dtype = dtype
        self.out_features, self.in_features = codes.shape

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x [M, K]`` (model dtype) -> ``[M, N]`` in the same dtype."""
        if self.input_scale is None:
            q, s = quantize_per_token(x)
        else:
            q, s = quantize_static(x, self.input_scale)
        acc = torch._int_mm(q, self.codes_t)  # [M, N] int32, exact
        return (acc.float() * s * self.scales).to(x.dtype)


class W8A8LinearMethod(CheckpointLinearMethod):
    """Fused :class:`Int8QuantizedTensor` shards -> one :class:`Int8Weight`.

    Shards with different static ``input_scale`` share the largest (as vLLM does for
    a fused q/k/v); dynamic and static shards never mix (the layer then stays dense).
    """

    def pack(self, shards: list[QuantizedTensor], dtype: torch.dtype) -> Int8Weight | None:
        if not all(isinstance(t, Int8QuantizedTensor) for t in shards) or \
                len({t.input_scale is None for t in shards}) != 1:
            return None
        codes = torch.cat([t.codes for t in shards]).contiguous()
        scales = torch.cat([t.scales for t in shards]).float().contiguous()
        static = [t.input_scale for t in shards if t.input_scale is not None]
        return Int8Weight(codes, scales, max(static) if static else None, dtype)


class W8A8Config(QuantizationConfig):
    """The config an :class:`Int8QuantizedTensor` names: its layers run :class:`W8A8LinearMethod`
    (``process_model`` is the checkpoint config's, which owns this one)."""

    name = "w8a8-int8"

    def get_linear_method(self, layer: nn.Module) -> LinearMethodBase:
        return W8A8LinearMethod(self, layer)
