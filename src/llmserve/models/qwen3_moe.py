"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): a Qwen3 decoder (QK-norm, no q/k/v bias
unless ``attention_bias``) whose sparse layers have ``num_experts`` routed experts of
width ``moe_intermediate_size`` and no shared expert.

QK-norm (HF ``Qwen3MoeAttention``): an RMSNorm over ``head_dim``, weights
``self_attn.q_norm`` / ``self_attn.k_norm`` shared by all heads, on every query and key
head after the projection and before RoPE::

    qkv = qkv_proj(x) -> heads [T, H + 2 Hkv, D] -> q_norm(q heads), k_norm(k heads)
        -> RoPE(q, k) -> paged attention -> o_proj

Router as Qwen2-MoE (``norm_topk_prob``; the released checkpoints set it true).
"""

from __future__ import annotations

from typing import Any

import torch

from llmserve.config import ModelConfig
from llmserve.layers.attention.backend import AttentionBackend
from llmserve.layers.layernorm import RMSNorm
from llmserve.layers.rotary_embedding import apply_rotary_emb_
from llmserve.models.llama import KVCache, LlamaAttention
from llmserve.models.moe_base import MoEForCausalLM


class QKNormAttention(LlamaAttention):
    """:class:`LlamaAttention` with Qwen3's per-head RMSNorm on queries and keys.

    (Qwen3 dense uses the same attention; one shared class is the intent.)
    """

    def __init__(self, config: ModelConfig, dtype: torch.dtype,
                 backend_cls: type[AttentionBackend]) -> None:
        super().__init__(config, dtype, backend_cls)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype)

    def forward(self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: KVCache, attn_metadata: Any) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        qkv = self.qkv_proj.forward(hidden_states).contiguous()  # [T, q_size + 2 * kv_size]
        heads = qkv.view(num_tokens, -1, self.head_dim)  # [T, H + 2 * Hkv, D]
        h, hk = self.num_heads, self.num_kv_heads
        # RMSNorm over head_dim of each head: as [T * heads, D] rows, written back in place
        heads[:, :h] = self.q_norm.forward(heads[:, :h].reshape(-1, self.head_dim)).view(
            num_tokens, h, self.head_dim)
        heads[:, h:h + hk] = self.k_norm.forward(
            heads[:, h:h + hk].reshape(-1, self.head_dim)).view(num_tokens, hk, self.head_dim)
        apply_rotary_emb_(heads[:, :h + hk], cos, sin)
        query, key, value = heads.split_with_sizes(self.head_splits, dim=1)
        out = self.attn.forward(query, key, value, kv_cache[0], kv_cache[1], attn_metadata)
        return self.o_proj.forward(out.reshape(num_tokens, self.q_size))


class Qwen3MoeForCausalLM(MoEForCausalLM):
    """Qwen3-MoE causal LM over a paged KV cache (see :class:`MoEForCausalLM`)."""

    attn_cls = QKNormAttention
