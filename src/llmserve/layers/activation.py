"""Activation functions over fused projections."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmserve.kernels import get_cpu_kernels


class SiluAndMul(nn.Module):
    """SwiGLU gate (Shazeer 2020): ``silu(gate) * up`` from the fused ``[gate | up]``.

    Input ``[num_tokens, 2 * intermediate_size]``, output
    ``[num_tokens, intermediate_size]``.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernels = get_cpu_kernels()
        if kernels is not None and x.dim() == 2 and kernels.supports(x):
            return kernels.silu_and_mul(x)  # one fused C kernel, same rounding
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluAndMul(nn.Module):
    """GeGLU gate (Shazeer 2020): ``gelu(gate) * up`` from the fused ``[gate | up]``.

    ``approximate="tanh"`` is Hugging Face ``gelu_pytorch_tanh`` (Gemma);
    ``"none"`` the exact erf GELU (``gelu``). Input ``[num_tokens, 2 * intermediate_size]``,
    output ``[num_tokens, intermediate_size]``.
    """

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate=self.approximate) * up


_ACTIVATIONS = {
    "silu": SiluAndMul,
    "gelu_pytorch_tanh": lambda: GeluAndMul("tanh"),
    "gelu": lambda: GeluAndMul("none"),
}


def get_act_and_mul(name: str) -> nn.Module:
    """The gated activation for a Hugging Face ``hidden_act`` name.

    Raises:
        ValueError: for an unsupported name; the message lists the supported ones.
    """
    try:
        return _ACTIVATIONS[name]()
    except KeyError:
        raise ValueError(
            f"unsupported hidden_act {name!r}; supported: {sorted(_ACTIVATIONS)}") from None
