"""Rotary position embedding (RoFormer, Su et al. 2021), Hugging Face layout.

The "rotate_half" (GPT-NeoX) layout pairs dimension ``i`` with ``i + D/2``::

    x = [x1 | x2]            (each [..., head_dim / 2])
    out = [x1 * cos - x2 * sin | x2 * cos + x1 * sin]

cos/sin come from a cache ``[max_position, head_dim / 2]`` computed once in
float32 and indexed by each token's position. Scalings follow
``transformers.modeling_rope_utils``: ``"linear"`` (position interpolation)
and ``"llama3"`` (Llama 3.1 frequency smoothing).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from llmserve.kernels import get_cpu_kernels

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def _rope_param(rope_scaling: dict[str, Any], key: str, rope_type: str) -> float:
    try:
        return float(rope_scaling[key])
    except KeyError:
        raise ValueError(f"rope_scaling of type {rope_type!r} needs the field {key!r}") from None


def compute_inv_freq(head_dim: int, base: float,
                     rope_scaling: dict[str, Any] | None = None) -> torch.Tensor:
    """Inverse frequencies ``[head_dim / 2]`` (float32), scaled per ``rope_scaling``.

    Raises:
        ValueError: for a rope type other than default, "linear" or "llama3"
            (the message names it), or a missing scaling field.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (base ** exponents)
    rope_type = "default"
    if rope_scaling:
        rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / _rope_param(rope_scaling, "factor", rope_type)
    if rope_type == "llama3":
        factor = _rope_param(rope_scaling, "factor", rope_type)
        low_freq_factor = _rope_param(rope_scaling, "low_freq_factor", rope_type)
        high_freq_factor = _rope_param(rope_scaling, "high_freq_factor", rope_type)
        old_context_len = _rope_param(rope_scaling, "original_max_position_embeddings", rope_type)
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(
        f"unsupported rope_scaling type {rope_type!r}; supported: {list(SUPPORTED_ROPE_TYPES)}")


def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[num_tokens, num_heads, head_dim]`` by ``cos``/``sin``
    ``[num_tokens, 1, head_dim / 2]`` (rotate_half layout)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def apply_rotary_emb_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """:func:`apply_rotary_emb` in place on ``x`` ``[num_tokens, num_heads, head_dim]``,
    which may be a strided view (e.g. the query and key heads of a fused qkv output).

    On CPU (float32 / bfloat16) one C kernel rotates every head with the same
    rounding as the PyTorch ops (:mod:`llmserve.kernels`).
    """
    kernels = get_cpu_kernels()
    if kernels is not None and kernels.supports(x) and cos.dtype == x.dtype == sin.dtype:
        kernels.rotary_emb_(x, cos, sin)
    else:
        x.copy_(apply_rotary_emb(x, cos, sin))


class RotaryEmbedding(nn.Module):
    """cos/sin cache ``[max_position, head_dim / 2]`` for positions ``0 .. max_position - 1``.

    Positions at or beyond ``max_position`` are an indexing error; the engine
    keeps ``max_model_len <= max_position_embeddings``.
    """

    def __init__(self, head_dim: int, max_position: int, base: float = 10000.0,
                 rope_scaling: dict[str, Any] | None = None,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary embedding needs an even head_dim, got {head_dim}")
        self.head_dim = head_dim
        self.max_position = max_position
        inv_freq = compute_inv_freq(head_dim, base, rope_scaling)  # [head_dim / 2]
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        # float32 math, then cast once, as HF casts cos/sin to the activation dtype
        self.register_buffer("cos_cache", freqs.cos().to(dtype), persistent=False)
        self.register_buffer("sin_cache", freqs.sin().to(dtype), persistent=False)

    def get_cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[num_tokens, 1, head_dim / 2]`` for ``positions`` ``[num_tokens]``."""
        return self.cos_cache[positions][:, None], self.sin_cache[positions][:, None]

    def forward(self, positions: torch.Tensor, query: torch.Tensor,
                key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate query ``[T, num_heads, head_dim]`` and key ``[T, num_kv_heads, head_dim]``."""
        cos, sin = self.get_cos_sin(positions)
        return apply_rotary_emb(query, cos, sin), apply_rotary_emb(key, cos, sin)
