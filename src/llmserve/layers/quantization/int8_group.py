"""8-bit group-quantized weights (GPTQ / compressed-tensors W8A16, ``llmserve quantize
--bits 8``) on the C Q8_0 kernel.

The checkpoint formula (int_group.py) is ``w = (q - z) * s`` with unsigned codes
``q`` in ``0 .. 255``, integer zero points ``z`` and scales ``s`` per output row and
input group (group size ``G`` a multiple of 32, or one group per row). Split at 128::

    w = (q - 128) * s  +  (128 - z) * s
        '-- c: int8 --'   '-- o[n, g]: one float per row and group --'

    y[m, n] = sum_k x[m, k] c[n, k] s[n, g(k)]        q8_0_matmul: int8 codes, one
                                                       float32 scale per 32 weights
            + sum_g X[m, g] o[n, g]                   X[m, g] = sum of x over group g

The first term is the GGUF Q8_0 kernel (``kernels/cpu_gguf.q8_0_matmul``) with each
group's scale repeated per 32-weight block; the second vanishes for symmetric
checkpoints (``z = 128`` everywhere, AutoGPTQ's ``sym=True``) and is otherwise one small
``[M, G] x [G, N]`` matmul. 1.125 bytes a weight read per decode (a float32 scale
per 32) instead of the 2 of a dense bfloat16 copy. Act-order (``g_idx``): columns
sorted into contiguous groups and ``x`` permuted the same way, as for the int4 kernel. Float32 products and sums: the
result equals ``x @ dequantize().T`` up to float32 summation order.
"""

from __future__ import annotations

import torch

from llmserve.kernels import get_cpu_kernels

BLOCK = 32  # weights per scale in the Q8_0 kernel
MAX_ROWS = 16  # rows of x per q8_0_matmul call
KERNEL_DTYPES = (torch.bfloat16, torch.float32)


class Int8GroupWeight:
    """An 8-bit layer for :func:`q8_0_matmul`: ``codes`` int8 ``[N, K]`` (``q - 128``,
    columns in ``perm`` order), ``scales`` float32 ``[N, K / 32]``, ``offsets`` float32
    ``[N, num_groups]`` (``(128 - z) * s``; None when symmetric), ``perm`` int64 ``[K]``
    or None."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None,
                 group: int, perm: torch.Tensor | None, dtype: torch.dtype) -> None:
        self.codes, self.scales, self.offsets = codes, scales, offsets
        self.group, self.perm, self.activation_dtype = group, perm, dtype
        self.out_features, self.in_features = codes.shape

    def nbytes(self) -> int:
        extra = 0 if self.offsets is None else self.offsets.numel() * 4
        return self.codes.numel() + self.scales.numel() * 4 + extra

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x [M, K]`` -> ``x W^T`` ``[M, N]`` in ``x``'s dtype."""
        kernels = get_cpu_kernels()
        threads = torch.get_num_threads()
        x = x.index_select(1, self.perm) if self.perm is not None else x.contiguous()
        if x.shape[0] <= MAX_ROWS:
            y = kernels.q8_0_matmul(x, self.codes, self.scales, threads)
        else:
            y = torch.cat([kernels.q8_0_matmul(c, self.codes, self.scales, threads)
                           for c in x.split(MAX_ROWS)])
        if self.offsets is None:
            return y
        sums = x.float().view(x.shape[0], -1, self.group).sum(-1)  # [M, num_groups]
        return (y.float() + sums @ self.offsets.t()).to(x.dtype)


def pack_int8_groups(shards, perm: torch.Tensor | None, group_size: int,
                     dtype: torch.dtype) -> Int8GroupWeight | None:
    """Stack 8-bit :class:`~llmserve.layers.quantization.int_group.GroupQuantizedTensor`
    row shards (top to bottom) into one :class:`Int8GroupWeight`, or None where the
    kernel cannot run them (no C kernels, another dtype, ``K`` or the group size not a
    multiple of 32).

    Args:
        perm: the act-order column permutation shared by the shards, or None.
        group_size: the shards' contiguous group size after ``perm`` (``K``: one group).
    """
    k = shards[0].shape[1]
    if get_cpu_kernels() is None or dtype not in KERNEL_DTYPES or k % BLOCK or \
            group_size % BLOCK or k % group_size:
        return None
    codes, scales, offsets = [], [], []
    for t in shards:
        q, s, z = t.codes, t.scales, t.zeros  # [N, K] uint8, [N, G], [N, G]
        g = t.group_of_column()  # [K] group of each input column
        if perm is not None:
            q, g = q[:, perm], g[perm]
        first = g[::group_size]  # the group of each contiguous run, in column order
        s_run, z_run = s[:, first], z[:, first]  # [N, K / group_size]
        codes.append((q.to(torch.int16) - 128).to(torch.int8))
        scales.append(s_run.repeat_interleave(group_size // BLOCK, dim=1))
        offsets.append((128.0 - z_run) * s_run)
    off = torch.cat(offsets)
    return Int8GroupWeight(torch.cat(codes).contiguous(), torch.cat(scales).contiguous(),
                           None if bool((off == 0).all()) else off.contiguous(),
                           group_size, perm, dtype)
