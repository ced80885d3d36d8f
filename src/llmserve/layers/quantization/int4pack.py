"""GGUF Q4_0 / Q4_1 / Q4_K / Q8_0 blocks -> PyTorch's weight-only int4 CPU matmul.

The kernel (``aten/src/ATen/native/cpu/int4mm_kernel.cpp``, torch 2.13)::

    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes int32 [N, K], 1)
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x [M, K], packed, group, sz [K/group, N, 2])
    y[m, n] = sum_k x[m, k] * ((codes[n, k] - 8) * sz[k // group, n, 0] + sz[k // group, n, 1])

``codes`` in 0..15, ``group`` in {32, 64, 128, 256}, N a multiple of 16, ``sz``
in the activation dtype. The dequantized weight is formed in float32 by one FMA
per element, the products accumulate in float32, the output is rounded to the
activation dtype. Only the bfloat16 kernel is vectorized (AVX2/AVX-512); the
float32 and float16 kernels are scalar (10-50x slower), so native GGUF runs
bfloat16 activations and the float32 kernel serves as the exactness oracle.

GGUF -> kernel parameters (group = 32, one GGUF block per group; ``d``, ``m``
the block's fp16 scale and minimum, exact in float32)::

    Q4_0: codes = q,               s = d,   z = 0           (q - 8) * d
    Q4_1: codes = q,               s = d,   z = m + 8 d     (q - 8) * d + m + 8 d = d q + m
    Q4_K: each 32-weight group as Q4_1 with d = d sc_j, m = -dmin m_j (exact products)
    Q8_0: u = q + 128 = 16 h + l   -> the input dimension doubled, x' = [x, x]:
          part A: codes = h, s = 16 d, z = 0       16 d (h - 8)
          part B: codes = l, s = d,    z = 8 d     d (l - 8) + 8 d = d l
          A + B = d (16 h + l - 128) = d q

``m + 8 d`` (Q4_1: two fp16 values; Q4_K: two 17-bit products) is checked to be exact in float32 when packing.
With float32 ``sz`` every dequantized weight equals the GGUF formula bit for
bit. With bfloat16 ``sz`` (the fast path) the block scale is rounded to 8
significant bits: the weight becomes ``bf16(d) (q - 8) + bf16(z)`` (Q8_0:
``bf16(d) q``), a relative error of at most 2**-8 on ``d`` and on ``z`` - the
same order as rounding the dequantized weight itself to bfloat16 (the
``--dtype bfloat16`` dense path).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from llmserve.layers.quantization.gguf_blocks import QK, UnpackedBlocks

N_ALIGN = 16  # the kernel's packing needs N % 16 == 0
try:  # the overload itself: skips the packet's overload resolution (~1 us a call)
    _INT4_MM = torch.ops.aten._weight_int4pack_mm_for_cpu.default
except AttributeError:  # torch < 2.6: resolve_quantization refuses native formats
    _INT4_MM = None


@dataclass
class Int4PackedWeight:
    """One weight ready for ``_weight_int4pack_mm_for_cpu``.

    ``packed`` uint8 ``[N_pad, K' / 2]``; ``scales_and_zeros`` ``[K' / 32, N_pad, 2]``;
    ``wide``: K' = 2 K (Q8_0 rows present: the input is duplicated); ``out_features``
    = N (rows past it are padding).
    """

    packed: torch.Tensor
    scales_and_zeros: torch.Tensor
    wide: bool
    in_features: int
    out_features: int

    def nbytes(self) -> int:
        return (self.packed.numel() * self.packed.element_size()
                + self.scales_and_zeros.numel() * self.scales_and_zeros.element_size())

    @property
    def activation_dtype(self) -> torch.dtype:
        return self.scales_and_zeros.dtype

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x [M, K]`` (the ``scales_and_zeros`` dtype) -> ``x W^T`` ``[M, N]``."""
        if self.wide:
            x = torch.cat([x, x], dim=-1)
        elif not x.is_contiguous():
            x = x.contiguous()
        y = _INT4_MM(x, self.packed, QK, self.scales_and_zeros)
        return y if self.out_features % N_ALIGN == 0 else y[:, :self.out_features]


def _kernel_params(u: UnpackedBlocks, wide: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """int32 codes ``[rows, K']`` and float32 ``s``, ``z`` ``[rows, K' / 32]`` for one shard.

    Raises:
        ValueError: a Q4_1 ``m + 8 d`` that float32 cannot hold exactly.
    """
    rows, cols = u.codes.shape
    if u.qtype == "Q8_0":
        shifted = u.codes.astype(np.int32) + 128  # 0..255
        codes = np.concatenate([shifted >> 4, shifted & 15], axis=1)
        s = np.concatenate([u.d * np.float32(16), u.d], axis=1)
        z = np.concatenate([np.zeros_like(u.d), u.d * np.float32(8)], axis=1)
        return codes, s, z
    codes = u.codes.astype(np.int32)
    s = u.d
    if u.qtype in ("Q4_1", "Q4_K"):
        z = u.m + np.float32(8) * u.d
        exact = z.astype(np.float64) == u.m.astype(np.float64) + 8 * u.d.astype(np.float64)
        if not exact.all():
            raise ValueError(f"{u.qtype} block with m + 8 d not exact in float32")
    else:
        z = np.zeros_like(u.d)
    if wide:  # part B contributes nothing: code 8, s = z = 0
        codes = np.concatenate([codes, np.full_like(codes, 8)], axis=1)
        s = np.concatenate([s, np.zeros_like(s)], axis=1)
        z = np.concatenate([z, np.zeros_like(z)], axis=1)
    return codes, s, z


def pack_gguf_shards(shards: list[UnpackedBlocks], dtype: torch.dtype) -> Int4PackedWeight:
    """Pack the row shards of one (fused) weight, top to bottom, for the int4 kernel.

    Args:
        shards: unpacked GGUF blocks, each ``[rows_i, K]``, all with the same K.
        dtype: activation dtype (``torch.bfloat16`` fast; ``torch.float32`` exact).

    Raises:
        ValueError: mismatched K, K not a multiple of 32, or an inexact Q4_1 zero point.
    """
    in_features = shards[0].codes.shape[1]
    if in_features % QK or any(u.codes.shape[1] != in_features for u in shards):
        raise ValueError(f"int4 packing needs one input size, a multiple of {QK}")
    wide = any(u.qtype == "Q8_0" for u in shards)
    parts = [_kernel_params(u, wide) for u in shards]
    codes = np.concatenate([p[0] for p in parts])
    s = np.concatenate([p[1] for p in parts])
    z = np.concatenate([p[2] for p in parts])
    n = codes.shape[0]
    pad = -n % N_ALIGN
    if pad:
        codes = np.concatenate([codes, np.full((pad, codes.shape[1]), 8, np.int32)])
        s = np.concatenate([s, np.zeros((pad, s.shape[1]), np.float32)])
        z = np.concatenate([z, np.zeros((pad, z.shape[1]), np.float32)])
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.from_numpy(codes), 1)
    sz = torch.from_numpy(np.stack([s, z], axis=-1)).transpose(0, 1).contiguous().to(dtype)
    return Int4PackedWeight(packed, sz, wide, in_features, n)
