"""W8A8 prompt rows: int8 weights (requantized once at load) x dynamic int8 activations.

``gguf-hybrid-int8`` (opt-in; ``gguf-hybrid`` keeps its dense bfloat16 copy) runs the
prompt rows of a step (the module path, ``Linear.forward``) through this GEMM instead
of a dense bfloat16 copy of each weight (1 byte a weight instead of 2)::

    weight  w' [N, K] float32 (the GGUF values, dequantized once at load, rotated)
            s_w[n] = max_k |w'[n, k]| / 127         per output channel
            q_w[n, k] = round(w'[n, k] / s_w[n])    int8, kept as [N, K] (1 byte a weight)
    input   x [M, K] (bfloat16 / float32), at every call
            x' = x H / sqrt(B)  per block of B = 256 features (block-diagonal Sylvester
                 Hadamard H; the weight is stored rotated the same way, w' = w H / sqrt(B),
                 so x'.w' = x.w); computed exactly on a 16-bit grid (see _rotate)
            s_x[m] = max_k |x'[m, k]| / 127         per row (per token)
            q_x[m, k] = round(x'[m, k] / s_x[m])    int8
    output  y[m, n] = (sum_k q_x[m, k] q_w[n, k]) * s_x[m] * s_w[n] (+ bias[n])
                      int32 sum (torch._int_mm: exact, |sum| <= K * 127^2 < 2^31 for
                      K < 133,000), scaled in float32, rounded to the input's dtype

The rotation spreads an activation outlier over its block, so one per-token scale
no longer flattens the other channels (QuaRot, Ashkboos et al. 2024; llama.cpp gets
the same effect from one scale per 256 values, Q8_K). Measured on
Qwen2.5-Coder-1.5B Q4_K_M, 96 tokens, every decoder linear layer W8A8, the rest
float32, against the dequantized float32 model: without rotation max |logit diff|
24.7, mean 0.195, perplexity +2.5%; with it 0.54 / 0.038 / +0.01%. In the engine
(``gguf-hybrid-int8``: bfloat16 activations elsewhere, 100 tokens): logits within
tests/test_quant_gguf_models.py's bounds (max < 1.5, mean < 0.1) but perplexity 11.900 vs
11.809 (+0.77%), outside its 0.5% bound, which is why it is not the default.

Why: on a CPU without AMX, oneDNN's bf16 GEMM is slower than its fp32 one (no native
bf16 FMA), while ``torch._int_mm`` runs on VNNI (``vpdpbusd``) at ~4x the fp32 rate
(measured at 2 threads, 512 x 1536 @ 1536 x 8960: bf16 151 GFLOP/s, fp32 258, int8
992 GOP/s). llama.cpp computes its prompt rows the same way (its activations as Q8_K
or Q8_0 blocks times the weight codes).

Batch invariance (issue 20): a row's scale is its own, the integer sum is exact and
the epilogue is elementwise, so a row's result is the same bits for any M and any
other rows of the call.

Scheme: per-token x per-channel W8A8 (SmoothQuant's granularity, Xiao et al. 2023)
with QuaRot's Hadamard rotation instead of smoothing; quality on the real model is
checked in tests/test_quant_gguf_models.py.
"""

from __future__ import annotations

import torch

MAX_K = 133_000  # K * 127 * 127 stays below 2^31 (int32 accumulation)
MAX_BLOCK = 256  # the Hadamard block (the largest power of two <= 256 dividing K)


def hadamard_block(k: int) -> int:
    """The rotation's block size for ``k`` input features (1 = no rotation)."""
    b = 1
    while b < MAX_BLOCK and k % (2 * b) == 0:
        b *= 2
    return b


def hadamard(n: int) -> torch.Tensor:
    """Sylvester's ``n x n`` Hadamard matrix (entries +-1, ``H H^T = n I``), float32."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return h


class Int8PrefillWeight:
    """``[N, K]`` int8 codes and float32 per-output-channel scales ``[N]``.

    Args:
        codes: int8 ``[N, K]``, contiguous.
        scales: float32 ``[N]``.

    Raises:
        ValueError: wrong dtypes or shapes, or ``K`` too large for int32 sums.
    """

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, block: int = 1) -> None:
        if codes.dtype != torch.int8 or codes.dim() != 2:
            raise ValueError(f"int8 codes must be int8 [N, K], got {codes.dtype} "
                             f"{tuple(codes.shape)}")
        if scales.dtype != torch.float32 or tuple(scales.shape) != (codes.shape[0],):
            raise ValueError(f"int8 scales must be float32 [{codes.shape[0]}], got "
                             f"{scales.dtype} {tuple(scales.shape)}")
        if codes.shape[1] >= MAX_K:
            raise ValueError(f"in_features {codes.shape[1]} too large for int32 sums")
        self.codes, self.scales = codes.contiguous(), scales.contiguous()
        self.out_features, self.in_features = codes.shape
        self.block = block  # > 1: codes of the rotated weight (module doc)
        self.hadamard = hadamard(block) if block > 1 else None

    @classmethod
    def from_float(cls, weight: torch.Tensor, rotate: bool = True) -> Int8PrefillWeight:
        """Round ``weight [N, K]`` (any float dtype; computed in float32) to int8 codes
        with one scale per row (module doc); an all-zero row gets scale 0, codes 0.
        ``rotate``: of ``weight`` times the block-diagonal normalized Hadamard matrix."""
        w = weight.float()
        block = hadamard_block(w.shape[1]) if rotate else 1
        if block > 1:
            n, k = w.shape
            w = (w.reshape(n, k // block, block) @ (hadamard(block) / block ** 0.5)).reshape(n, k)
        amax = w.abs().amax(dim=1)
        scales = amax / 127
        inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
        codes = torch.round(w * inv[:, None]).clamp_(-127, 127).to(torch.int8)
        return cls(codes, scales, block)

    @classmethod
    def from_rows(cls, parts: list[torch.Tensor], rotate: bool = True) -> Int8PrefillWeight:
        """The weight of consecutive row blocks (the shards of a fused layer), each
        quantized on its own (the scales are per row, so this equals one call)."""
        done = [cls.from_float(p, rotate) for p in parts]
        if len(done) == 1:
            return done[0]
        return cls(torch.cat([d.codes for d in done]), torch.cat([d.scales for d in done]),
                   done[0].block)

    def nbytes(self) -> int:
        return self.codes.numel() + self.scales.numel() * 4

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x [M, K]`` (float) -> ``[M, N]`` in ``x.dtype`` (module doc's formula)."""
        dtype = x.dtype
        # [M, 1] row max (exact in x's dtype: one pass, no temporary)
        amax = torch.linalg.vector_norm(x, float("inf"), dim=1, keepdim=True).float()
        if self.hadamard is not None:
            x, amax = self._rotate(x, amax)
        inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
        xq = (x * inv).round_().to(torch.int8)  # (never in place: x is the caller's)
        acc = torch._int_mm(xq, self.codes.t())  # [M, N] int32
        y = torch.mul(acc, amax.div_(127))  # float32
        out = torch.empty(y.shape, dtype=dtype)  # scaled and rounded in one pass
        if bias is None:
            return torch.mul(y, self.scales, out=out)
        return torch.addcmul(bias.float(), y, self.scales, out=out)

    def _rotate(self, x: torch.Tensor, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` times the normalized block Hadamard matrix, computed exactly on a 16-bit
        grid: integers of magnitude <= 32767 * 256 < 2^24 sum exactly in float32 in any
        order, so every row gets the same bits for any M. Returns the rotated rows
        (float32 ``[M, K]``) and their row max ``[M, 1]``."""
        m, k = x.shape
        inv = torch.where(amax > 0, 32767 / amax, torch.zeros_like(amax))
        xi = (x * inv).round_()
        y = (xi.view(m * k // self.block, self.block) @ self.hadamard).view(m, k)
        y.mul_(amax / (32767 * self.block ** 0.5))
        return y, torch.linalg.vector_norm(y, float("inf"), dim=1, keepdim=True)
