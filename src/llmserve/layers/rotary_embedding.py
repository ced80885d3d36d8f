"""Rotary position embedding (RoFormer, Su et al. 2021), Hugging Face layout.

The "rotate_half" (GPT-NeoX) layout pairs dimension ``i`` with ``i + D/2``::

    x = [x1 | x2]            (each [..., head_dim / 2])
    out = [x1 * cos - x2 * sin | x2 * cos + x1 * sin]

cos/sin come from a cache ``[max_position, rotary_dim / 2]`` computed once in
float32 and indexed by each token's position. With ``partial_rotary_factor < 1``
only the first ``rotary_dim`` dimensions of a head rotate (Phi-3/Phi-4-mini,
``transformers`` ``apply_rotary_pos_emb``); the rest pass through. Scalings
("linear", "llama3", "yarn", "dynamic", "longrope") are in
:mod:`llmserve.layers.rope_scaling`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from llmserve.kernels import get_cpu_kernels
from llmserve.layers.rope_scaling import (  # noqa: F401 (re-exported)
    SUPPORTED_ROPE_TYPES,
    compute_inv_freq,
    rope_cos_sin,
)


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
    """cos/sin cache ``[max_position, rotary_dim / 2]`` for positions ``0 .. max_position - 1``.

    Args:
        rotary_dim: the rotated width of a head (``head_dim`` unless partial).
        max_position: rows of the cache (the longest context served).
        base: ``rope_theta``.
        rope_scaling: Hugging Face ``rope_scaling`` dict or None.
        dtype: the activation dtype the cache is cast to (after float32 math).
        max_position_embeddings: the model's own ``max_position_embeddings``
            (default ``max_position``), for "dynamic", "yarn" and "longrope".

    Raises:
        ValueError: odd ``rotary_dim``, unsupported rope type or missing field.

    Positions at or beyond ``max_position`` are an indexing error; the engine
    keeps ``max_model_len <= ModelConfig.max_context_len``.
    """

    def __init__(self, rotary_dim: int, max_position: int, base: float = 10000.0,
                 rope_scaling: dict[str, Any] | None = None,
                 dtype: torch.dtype = torch.float32,
                 max_position_embeddings: int | None = None) -> None:
        super().__init__()
        if rotary_dim % 2 or rotary_dim <= 0:
            raise ValueError(f"rotary embedding needs a positive even rotary_dim, got {rotary_dim}")
        self.rotary_dim = rotary_dim
        self.max_position = max_position
        cos, sin = rope_cos_sin(rotary_dim, max_position, base, rope_scaling,
                                max_position_embeddings)  # [max_position, rotary_dim / 2]
        # float32 math, then cast once, as HF casts cos/sin to the activation dtype
        self.register_buffer("cos_cache", cos.to(dtype), persistent=False)
        self.register_buffer("sin_cache", sin.to(dtype), persistent=False)

    def get_cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[num_tokens, 1, rotary_dim / 2]`` for ``positions`` ``[num_tokens]``."""
        return self.cos_cache[positions][:, None], self.sin_cache[positions][:, None]

    def forward(self, positions: torch.Tensor, query: torch.Tensor,
                key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate query ``[T, num_heads, head_dim]`` and key ``[T, num_kv_heads, head_dim]``
        (the first ``rotary_dim`` dimensions of each head); returns new tensors."""
        cos, sin = self.get_cos_sin(positions)
        d = self.rotary_dim
        return tuple(torch.cat((apply_rotary_emb(x[..., :d], cos, sin), x[..., d:]), dim=-1)
                     for x in (query, key))
