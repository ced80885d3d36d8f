"""Group-wise integer weight quantization: the shared rounding rule and result type.

For a weight ``w [N, K]`` (out_features x in_features), ``b`` bits, ``maxq = 2**b - 1``,
column ``k`` in group ``g_idx[k]`` (``k // group_size`` unless GPTQ act-order)::

    asymmetric: s = (max(w_g, 0) - min(w_g, 0)) / maxq      z = round(-min(w_g, 0) / s)
    symmetric:  s = 2 max|w_g| / maxq  (AutoGPTQ's rule)    z = 2**(b-1)
    q = clamp(round(w / s) + z, 0, maxq)                    w ~ (q - z) * s

per output row and group. ``s`` is rounded to float16 before ``q`` is computed (the
checkpoint formats store float16 scales), so ``dequantize`` is exactly what a loader
computes. RTN (round-to-nearest) is this rule alone; GPTQ and AWQ choose what to round.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

WEIGHT_BITS = (4, 8)


@dataclass
class QuantizedLinear:
    """One quantized linear weight ``[N, K]``.

    ``codes`` uint8 ``[N, K]`` in ``0 .. 2**bits - 1`` (original column order),
    ``scales`` float32 ``[N, G]`` (float16-representable), ``zeros`` int32 ``[N, G]``
    (unsigned, ``2**(bits-1)`` when ``symmetric``), ``g_idx`` int64 ``[K]`` or None
    (``k // group_size``), ``group_size`` (K for one group per row).
    """

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    bits: int
    group_size: int
    symmetric: bool
    g_idx: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def rows(self, start: int, end: int) -> QuantizedLinear:
        """Output rows ``start .. end - 1`` (one module of a jointly quantized group)."""
        return QuantizedLinear(self.codes[start:end].contiguous(),
                               self.scales[start:end].contiguous(),
                               self.zeros[start:end].contiguous(), self.bits, self.group_size,
                               self.symmetric, self.g_idx)

    def group_index(self) -> torch.Tensor:
        """int64 ``[K]``: the group of each input column."""
        if self.g_idx is not None:
            return self.g_idx
        return torch.arange(self.codes.shape[1]) // self.group_size

    def dequantize(self) -> torch.Tensor:
        """float32 ``[N, K]``: ``(q - z[g_idx]) * s[g_idx]``."""
        g = self.group_index()
        return (self.codes.float() - self.zeros[:, g].float()) * self.scales[:, g]


def check_bits(bits: int, allowed: tuple[int, ...] = WEIGHT_BITS, method: str = "rtn") -> None:
    """Raises ValueError unless ``bits`` is one of ``allowed`` (naming ``method``)."""
    if bits not in allowed:
        raise ValueError(f"--bits {bits} is not supported by --method {method}; "
                         f"supported: {list(allowed)}")


def resolve_group_size(group_size: int, in_features: int, name: str = "") -> int:
    """``-1`` -> ``in_features``; else ``group_size``, which must divide ``in_features``.

    Raises:
        ValueError: a group size that is neither -1 nor a positive divisor.
    """
    if group_size == -1:
        return in_features
    if group_size <= 0 or in_features % group_size:
        raise ValueError(f"--group-size {group_size} must be -1 or a positive divisor of "
                         f"{name or 'the'} in_features {in_features}")
    return group_size


def group_params(w: torch.Tensor, bits: int, symmetric: bool,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point per row of ``w [N, k]`` (one group): float32 ``[N]`` each."""
    maxq = (1 << bits) - 1
    w = w.float()
    if symmetric:
        amax = w.abs().amax(dim=1)
        scale = (2 * amax / maxq).clamp(min=1e-6).half().float()
        zero = torch.full_like(scale, float(1 << (bits - 1)))
    else:
        lo = w.amin(dim=1).clamp(max=0)
        hi = w.amax(dim=1).clamp(min=0)
        scale = ((hi - lo) / maxq).clamp(min=1e-6).half().float()
        zero = torch.round(-lo / scale).clamp(0, maxq)
    return scale, zero


def quantize_codes(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                   bits: int) -> torch.Tensor:
    """``w [N, k]`` with per-row ``scale``/``zero [N]`` (or ``[N, 1]``) -> float codes."""
    scale = scale.reshape(-1, 1)
    zero = zero.reshape(-1, 1)
    return torch.clamp(torch.round(w / scale) + zero, 0, (1 << bits) - 1)


def fake_quantize(w: torch.Tensor, bits: int, group_size: int,
                  symmetric: bool = False) -> torch.Tensor:
    """``w [N, K]`` rounded to its grid and back (float32), groups along K."""
    n, k = w.shape
    gs = resolve_group_size(group_size, k)
    wg = w.float().reshape(n * (k // gs), gs)
    scale, zero = group_params(wg, bits, symmetric)
    q = quantize_codes(wg, scale, zero, bits)
    return ((q - zero[:, None]) * scale[:, None]).reshape(n, k)


def quantize_rtn(w: torch.Tensor, bits: int, group_size: int,
                 symmetric: bool = False) -> QuantizedLinear:
    """Round-to-nearest quantization of ``w [N, K]`` (see the module doc).

    Raises:
        ValueError: unsupported bits or a group size that does not divide K.
    """
    check_bits(bits)
    n, k = w.shape
    gs = resolve_group_size(group_size, k)
    groups = k // gs
    wg = w.float().reshape(n * groups, gs)
    scale, zero = group_params(wg, bits, symmetric)
    codes = quantize_codes(wg, scale, zero, bits).reshape(n, k).to(torch.uint8)
    return QuantizedLinear(codes=codes, scales=scale.reshape(n, groups),
                           zeros=zero.reshape(n, groups).to(torch.int32), bits=bits,
                           group_size=gs, symmetric=symmetric)
