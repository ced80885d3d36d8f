"""RMSNorm (Zhang & Sennrich 2019), computed in float32 like Hugging Face Llama."""

from __future__ import annotations

import torch
from torch import nn

from llmserve.kernels import get_cpu_kernels


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dimension.

    The normalisation runs in float32 and is cast back to the input dtype
    before the weight multiply, matching ``LlamaRMSNorm``. With ``residual``
    it first adds the residual (in the input dtype) and also returns the sum,
    the fused add-norm of vLLM's decoder layers. On CPU (float32 / bfloat16) one
    C kernel does all of it (:mod:`llmserve.kernels`), rounding as these ops do.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        self.variance_epsilon = eps

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * xf.to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x, residual: ``[num_tokens, hidden_size]``. Returns the normed x, or
        ``(normed(x + residual), x + residual)`` when a residual is given."""
        kernels = get_cpu_kernels()
        if kernels is not None and x.dim() == 2 and kernels.supports(x) \
                and self.weight.dtype == x.dtype \
                and (residual is None or residual.dtype == x.dtype):
            return kernels.rms_norm(x, self.weight, self.variance_epsilon, residual)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: ``x / sqrt(mean(x^2) + eps) * (1 + weight)``, all in float32,
    cast to the input dtype at the end (``Gemma3RMSNorm``; the checkpoint stores the
    zero-centred ``weight``). Input ``[..., hidden_size]``, any leading dims.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size, dtype=dtype), requires_grad=False)
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)
