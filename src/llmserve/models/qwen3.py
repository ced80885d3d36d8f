"""Qwen3 (dense): the Llama block with QK-norm.

Each query and key head is RMS-normalised over ``head_dim`` (its own learned
weight, shared by all heads) after the projection and before RoPE
(``transformers`` ``Qwen3Attention``; Qwen3 technical report, 2025)::

    qkv = x W_qkv  ->  q, k, v  ->  q = RMSNorm_q(q), k = RMSNorm_k(k)  (per head)
        ->  RoPE(q, k)  ->  paged attention  ->  o_proj

No QKV bias by default (``attention_bias`` adds it to q/k/v/o), ``head_dim`` is
explicit (128 with hidden 1024 in Qwen3-0.6B), per-layer sliding windows through
``layer_types`` / ``max_window_layers``. Everything else is :mod:`llama`'s.
"""

from __future__ import annotations

from typing import Any

import torch

from llmserve.config import ModelConfig
from llmserve.layers.attention.backend import AttentionBackend
from llmserve.layers.layernorm import RMSNorm
from llmserve.layers.rotary_embedding import apply_rotary_emb_
from llmserve.models.llama import (
    KVCache,
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
)


class Qwen3Attention(LlamaAttention):
    """:class:`LlamaAttention` with ``q_norm`` / ``k_norm`` (``qk_norm_cls``) over each head."""

    qk_norm_cls: type[torch.nn.Module] = RMSNorm

    def __init__(self, config: ModelConfig, dtype: torch.dtype,
                 backend_cls: type[AttentionBackend], layer_idx: int = 0) -> None:
        super().__init__(config, dtype, backend_cls, layer_idx)
        self.q_norm = self.qk_norm_cls(self.head_dim, config.rms_norm_eps, dtype)
        self.k_norm = self.qk_norm_cls(self.head_dim, config.rms_norm_eps, dtype)

    def forward(self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: KVCache, attn_metadata: Any) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        qkv = self.qkv_proj.forward(hidden_states)  # [T, q_size + 2 * kv_size]
        query, key, value = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        # [num_tokens * heads, head_dim] rows, normalised, back to [T, heads, head_dim]
        query = self.q_norm.forward(query.reshape(-1, self.head_dim)).view(
            num_tokens, self.num_heads, self.head_dim)
        key = self.k_norm.forward(key.reshape(-1, self.head_dim)).view(
            num_tokens, self.num_kv_heads, self.head_dim)
        value = value.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        apply_rotary_emb_(query[..., :self.rotary_dim], cos, sin)
        apply_rotary_emb_(key[..., :self.rotary_dim], cos, sin)
        out = self.attn.forward(query, key, value, kv_cache[0], kv_cache[1], attn_metadata)
        return self.o_proj.forward(out.reshape(num_tokens, self.q_size))


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3Model(LlamaModel):
    layer_cls = Qwen3DecoderLayer


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 causal LM (``Qwen3ForCausalLM``); arguments and errors as
    :class:`~llmserve.models.llama.LlamaForCausalLM`. Checkpoint names add
    ``model.layers.N.self_attn.{q,k}_norm.weight``."""

    model_cls = Qwen3Model
