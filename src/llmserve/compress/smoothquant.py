"""SmoothQuant W8A8: migrate activation outliers into the weights, then int8 both.

Source: Xiao et al., "SmoothQuant: Accurate and Efficient Post-Training Quantization
for Large Language Models" (ICML 2023), section 4; llm-compressor's
``SmoothQuantModifier`` mappings (read, not copied).

For linears ``W_i [N_i, K]`` reading ``X [M, K]`` produced by an RMSNorm (or a linear),
with strength ``alpha``::

    s[k] = max_m |X[m, k]|^alpha / max_{i, n} |W_i[n, k]|^(1 - alpha)
    X' = X / s   (folded into the producer)        W_i' = W_i diag(s)

Then weights are int8 per output channel (``w = q * s_w``, ``s_w = max|w| / 127``) and
activations int8 per token at run time (``layers/quantization/w8a8.py``), the
compressed-tensors ``int-quantized`` W8A8 scheme vLLM runs.
"""

from __future__ import annotations

import torch

INT8_MAX = 127.0


def smoothing_scales(act_max: torch.Tensor, weights: list[torch.Tensor],
                     alpha: float = 0.5) -> torch.Tensor:
    """``s [K]`` from per-channel ``act_max [K]`` (max |X| over calibration tokens).

    Raises:
        ValueError: ``alpha`` outside ``[0, 1]``.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"--alpha must be in [0, 1], got {alpha}")
    w_max = torch.cat([w.float().abs() for w in weights]).amax(0).clamp(min=1e-5)
    s = act_max.float().clamp(min=1e-5).pow(alpha) / w_max.pow(1 - alpha)
    return s.clamp(min=1e-5)


def quantize_int8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [N, K]`` -> int8 codes ``[N, K]`` and float32 scales ``[N]`` (symmetric)."""
    scale = (w.float().abs().amax(1) / INT8_MAX).clamp(min=1e-8)
    q = torch.round(w.float() / scale[:, None]).clamp(-128, 127).to(torch.int8)
    return q, scale


def w8a8_matmul(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Reference W8A8 product ``x [M, K] -> [M, N]`` with dynamic per-token int8 ``x``
    (float arithmetic on the integer values; the engine uses ``torch._int_mm``)."""
    x = x.float()
    sx = (x.abs().amax(-1, keepdim=True) / INT8_MAX).clamp(min=1e-8)
    qx = torch.round(x / sx).clamp(-128, 127)
    return (qx @ codes.float().t()) * sx * scale
