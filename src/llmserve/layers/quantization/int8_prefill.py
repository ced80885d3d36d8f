"""W8A8 prompt rows: int8 weights (requantized once at load) x dynamic int8 activations.

``gguf-hybrid`` runs the prompt rows of a step (the module path, ``Linear.forward``)
through this GEMM instead of a dense bfloat16 copy of each weight::

    weight  w [N, K] float32 (the GGUF values, dequantized once at load)
            s_w[n] = max_k |w[n, k]| / 127          per output channel
            q_w[n, k] = round(w[n, k] / s_w[n])     int8, kept as [N, K] (1 byte a weight)
    input   x [M, K] (bfloat16 / float32), at every call
            s_x[m] = max_k |x[m, k]| / 127          per row (per token)
            q_x[m, k] = round(x[m, k] / s_x[m])     int8
    output  y[m, n] = (sum_k q_x[m, k] q_w[n, k]) * s_x[m] * s_w[n] (+ bias[n])
                      int32 sum (torch._int_mm: exact, |sum| <= K * 127^2 < 2^31 for
                      K < 133,000), scaled in float32, rounded to the input's dtype

Why: on a CPU without AMX, oneDNN's bf16 GEMM is slower than its fp32 one (no native
bf16 FMA), while ``torch._int_mm`` runs on VNNI (``vpdpbusd``) at ~4x the fp32 rate
(measured at 2 threads, 512 x 1536 @ 1536 x 8960: bf16 151 GFLOP/s, fp32 258, int8
992 GOP/s). llama.cpp computes its prompt rows the same way (its activations as Q8_K
or Q8_0 blocks times the weight codes).

Batch invariance (issue 20): a row's scale is its own, the integer sum is exact and
the epilogue is elementwise, so a row's result is the same bits for any M and any
other rows of the call.

Scheme: LLM.int8() / SmoothQuant's per-token x per-channel W8A8 (Dettmers et al.
2022; Xiao et al. 2023, without outlier decomposition or smoothing); quality on
Qwen2.5-Coder-1.5B Q4_K_M against the dequantized float32 model is checked in
tests/test_quant_gguf.py.
"""

from __future__ import annotations

import torch

MAX_K = 133_000  # K * 127 * 127 stays below 2^31 (int32 accumulation)


class Int8PrefillWeight:
    """``[N, K]`` int8 codes and float32 per-output-channel scales ``[N]``.

    Args:
        codes: int8 ``[N, K]``, contiguous.
        scales: float32 ``[N]``.

    Raises:
        ValueError: wrong dtypes or shapes, or ``K`` too large for int32 sums.
    """

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor) -> None:
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

    @classmethod
    def from_float(cls, weight: torch.Tensor) -> Int8PrefillWeight:
        """Round ``weight [N, K]`` (any float dtype; computed in float32) to int8 codes
        with one scale per row (module doc); an all-zero row gets scale 0, codes 0."""
        w = weight.float()
        amax = w.abs().amax(dim=1)
        scales = amax / 127
        inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
        codes = torch.round(w * inv[:, None]).clamp_(-127, 127).to(torch.int8)
        return cls(codes, scales)

    @classmethod
    def from_rows(cls, parts: list[torch.Tensor]) -> Int8PrefillWeight:
        """The weight of consecutive row blocks (the shards of a fused layer), each
        quantized on its own (the scales are per row, so this equals one call)."""
        done = [cls.from_float(p) for p in parts]
        if len(done) == 1:
            return done[0]
        return cls(torch.cat([d.codes for d in done]), torch.cat([d.scales for d in done]))

    def nbytes(self) -> int:
        return self.codes.numel() + self.scales.numel() * 4

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None,
               two_pass: bool = False) -> torch.Tensor:
        """``x [M, K]`` (float) -> ``[M, N]`` in ``x.dtype`` (module doc's formula);
        ``two_pass``: also the activations' rounding residual, as a second int8 GEMM."""
        xf = x.float()
        amax = xf.abs().amax(dim=1, keepdim=True)  # [M, 1]
        inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
        t = xf * inv  # (never in place: xf may be x)
        q = t.round()
        acc = torch._int_mm(q.to(torch.int8), self.codes.t())  # [M, N] int32
        if two_pass:  # residual t - q in [-1/2, 1/2] steps, in steps of 1/254
            res = torch._int_mm(t.sub_(q).mul_(254).round_().to(torch.int8), self.codes.t())
            y = res.float().div_(254).add_(acc).mul_(amax.div_(127))
        else:
            y = torch.mul(acc, amax.div_(127))  # float32
        if bias is None:
            y.mul_(self.scales)
        else:
            y = torch.addcmul(bias.float(), y, self.scales)
        return y.to(x.dtype)
