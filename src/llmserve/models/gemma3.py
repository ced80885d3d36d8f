"""Gemma 3 text decoder (``Gemma3ForCausalLM``, model type ``gemma3_text``).

Differences from the Llama block (``transformers`` ``modeling_gemma3``; Gemma 3
technical report, 2025)::

    h = embed(ids) * sqrt(hidden_size)                       (scale cast to the dtype)
    per layer:  h = h + post_attn_norm(attn(input_norm(h)))
                h = h + post_ff_norm(mlp(pre_ff_norm(h)))    (sandwich norms)
    out = norm(h)

* every norm is Gemma's ``x * (1 + w)`` RMSNorm (:class:`GemmaRMSNorm`), also the
  per-head QK-norm applied before RoPE;
* attention scale ``query_pre_attn_scalar ** -0.5``;
* layers interleave sliding-window (``"sliding_attention"``, RoPE base
  ``rope_local_base_freq``, 10k) and global layers (``"full_attention"``, base
  ``rope_theta``, 1M, with the model's ``rope_scaling``), by ``layer_types`` or
  every ``sliding_window_pattern``-th layer global;
* GeGLU MLP (``gelu_pytorch_tanh``), tied embeddings, optional final logit
  soft-capping. ``attn_logit_softcapping`` is ignored, as transformers' Gemma 3
  ignores it; ``use_bidirectional_attention`` is refused by the config parser.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from llmserve.config import ModelConfig
from llmserve.layers.attention.backend import AttentionBackend
from llmserve.layers.layernorm import GemmaRMSNorm
from llmserve.layers.rotary_embedding import RotaryEmbedding
from llmserve.models.llama import KVCache, LlamaForCausalLM, LlamaMLP
from llmserve.models.qwen3 import Qwen3Attention


class Gemma3Attention(Qwen3Attention):
    """QK-norm attention with Gemma's ``(1 + w)`` norms (scale from the config)."""

    qk_norm_cls = GemmaRMSNorm


class Gemma3DecoderLayer(nn.Module):
    """Sandwich-norm block (see the module docstring); ``is_sliding`` picks its RoPE."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype,
                 backend_cls: type[AttentionBackend], layer_idx: int = 0) -> None:
        super().__init__()
        self.is_sliding = config.layer_sliding_window(layer_idx) is not None
        self.self_attn = Gemma3Attention(config, dtype, backend_cls, layer_idx)
        self.mlp = LlamaMLP(config, dtype)
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps, dtype)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps, dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps, dtype)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps, dtype)

    def forward(self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: KVCache, attn_metadata: Any) -> torch.Tensor:
        """hidden_states ``[num_tokens, hidden_size]`` -> same shape."""
        attn = self.self_attn.forward(self.input_layernorm.forward(hidden_states), cos, sin,
                                      kv_cache, attn_metadata)
        hidden_states = hidden_states + self.post_attention_layernorm.forward(attn)
        mlp = self.mlp.forward(self.pre_feedforward_layernorm.forward(hidden_states))
        return hidden_states + self.post_feedforward_layernorm.forward(mlp)


class Gemma3Model(nn.Module):
    """Scaled embedding, interleaved local/global layers, final norm."""

    layer_hooks: Any = None  # worker/layer_split.py LayerHooks (weight offload only)

    def __init__(self, config: ModelConfig, dtype: torch.dtype,
                 backend_cls: type[AttentionBackend]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
        self.embed_tokens.weight.requires_grad_(False)
        # sqrt(hidden) rounded to the dtype, as HF casts its embed_scale buffer
        self.embed_scale = float(torch.tensor(math.sqrt(config.hidden_size), dtype=dtype))
        max_len = config.rope_max_position
        self.rotary_emb = RotaryEmbedding(config.rotary_dim, max_len, config.rope_theta,
                                          config.rope_scaling, dtype,
                                          config.max_position_embeddings)
        local_theta = config.rope_local_theta
        self.rotary_emb_local = None if local_theta is None else RotaryEmbedding(
            config.rotary_dim, max_len, local_theta, config.rope_local_scaling, dtype,
            config.max_position_embeddings)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(config, dtype, backend_cls, i)
                                    for i in range(config.num_hidden_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], attn_metadata: Any) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids) * self.embed_scale  # [T, hidden_size]
        rope_global = self.rotary_emb.get_cos_sin(positions)  # [T, 1, rotary_dim / 2] each
        rope_local = (rope_global if self.rotary_emb_local is None
                      else self.rotary_emb_local.get_cos_sin(positions))
        hooks = self.layer_hooks
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            if hooks is not None:  # offloaded weights (no layer split for Gemma 3 yet)
                hooks.before_decode_layer(i)
            cos, sin = rope_local if layer.is_sliding else rope_global
            hidden_states = layer.forward(hidden_states, cos, sin, kv_cache, attn_metadata)
        return self.norm.forward(hidden_states)


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma 3 causal LM; arguments and errors as
    :class:`~llmserve.models.llama.LlamaForCausalLM`. Checkpoint names add
    ``self_attn.{q,k}_norm``, ``pre_feedforward_layernorm`` and
    ``post_feedforward_layernorm`` per layer."""

    model_cls = Gemma3Model
