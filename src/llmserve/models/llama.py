"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM, TinyLlama).

RMSNorm, RoPE (RoFormer; partial rotary and the scalings of
:mod:`llmserve.layers.rope_scaling`), grouped-query attention over a paged KV cache
(PagedAttention), SwiGLU MLP, optional QKV bias, tied or untied embeddings, a
model-wide sliding window through the attention metadata or per-layer windows
(``layer_types``) carried by each attention layer. Other families reuse these
blocks through ``LlamaForCausalLM.model_cls``, ``LlamaModel.layer_cls`` and
``LlamaDecoderLayer.attention_cls`` / ``mlp_cls`` (:mod:`qwen3`, :mod:`gemma3`,
:mod:`phi3`). Layout and weight fusion
follow vLLM's ``llama.py``; numerics follow Hugging Face ``modeling_llama``.

Input is flattened: all scheduled tokens of all sequences in one dimension
``[num_tokens]`` (no batch dimension, no padding)::

    input_ids [T] -> embed -> N x (norm -> attn -> +res -> norm -> mlp -> +res) -> norm
    -> hidden [T, hidden_size] -> compute_logits (selected rows) -> [N, vocab] float32
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmserve.config import ModelConfig
from llmserve.layers.activation import SiluAndMul, get_act_and_mul
from llmserve.layers.attention import get_attn_backend
from llmserve.layers.attention.backend import AttentionBackend
from llmserve.layers.layernorm import RMSNorm
from llmserve.layers.linear import Linear, MergedColumnLinear, QKVLinear, default_weight_loader
from llmserve.layers.rotary_embedding import RotaryEmbedding, apply_rotary_emb_
from llmserve.models.cpu_decode import CpuDecodeStep, decode_layer

KVCache = tuple[torch.Tensor, torch.Tensor]

# checkpoint names ignored by load_weights (recomputed buffers)
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _has_o_proj_bias(config: ModelConfig) -> bool:
    # HF Llama puts attention_bias on o_proj too; Qwen2 has bias on q/k/v only
    is_qwen2 = config.model_type == "qwen2" or config.architecture.startswith("Qwen2")
    return config.attention_bias and not is_qwen2


def attention_scale(config: ModelConfig) -> float:
    """``query_pre_attn_scalar ** -0.5`` (Gemma) or ``head_dim ** -0.5``."""
    scalar = config.query_pre_attn_scalar
    return (scalar if scalar is not None else config.head_dim) ** -0.5


class LlamaAttention(nn.Module):
    """Fused QKV projection, RoPE (the first ``rotary_dim`` dims of each head), paged
    attention with layer ``layer_idx``'s sliding window, output projection."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype,
                 backend_cls: type[AttentionBackend], layer_idx: int = 0) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.rotary_dim = config.rotary_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.head_splits = [self.num_heads, self.num_kv_heads, self.num_kv_heads]
        self.qkv_proj = QKVLinear(config.hidden_size, self.head_dim, self.num_heads,
                                  self.num_kv_heads, bias=config.attention_bias, dtype=dtype)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=_has_o_proj_bias(config),
                             dtype=dtype)
        self.attn = backend_cls(self.num_heads, self.head_dim, self.num_kv_heads,
                                attention_scale(config), config.layer_sliding_window(layer_idx))

    def forward(self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: KVCache, attn_metadata: Any) -> torch.Tensor:
        # (submodules are called through .forward on this hot path: nn.Module.__call__
        # costs ~2 us a call, and inference registers no hooks)
        num_tokens = hidden_states.shape[0]
        qkv = self.qkv_proj.forward(hidden_states).contiguous()  # [T, q_size + 2 * kv_size]
        # [num_tokens, num_heads + 2 * num_kv_heads, head_dim]: query | key | value heads
        heads = qkv.view(num_tokens, -1, self.head_dim)
        apply_rotary_emb_(heads[:, :self.num_heads + self.num_kv_heads, :self.rotary_dim],
                          cos, sin)
        query, key, value = heads.split_with_sizes(self.head_splits, dim=1)
        # [num_tokens, num_heads, head_dim]
        out = self.attn.forward(query, key, value, kv_cache[0], kv_cache[1], attn_metadata)
        return self.o_proj.forward(out.reshape(num_tokens, self.q_size))


class LlamaMLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))`` with gate/up fused."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype,
                 intermediate_size: int | None = None) -> None:
        super().__init__()
        size = config.intermediate_size if intermediate_size is None else intermediate_size
        self.gate_up_proj = MergedColumnLinear(config.hidden_size, [size, size], dtype=dtype)
        self.act_fn = get_act_and_mul(config.hidden_act)
        self.down_proj = Linear(size, config.hidden_size, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.forward(self.act_fn.forward(self.gate_up_proj.forward(x)))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))``, then ``+ mlp(norm(.))`` (fused add-norms).

    Subclasses swap parts through ``attention_cls`` / ``mlp_cls`` (e.g. QK-norm
    attention, a mixture-of-experts MLP); the CPU decode fast path runs only exact
    Llama layers (see :attr:`LlamaModel.use_cpu_decode_path`).
    """

    attention_cls: type[nn.Module] = LlamaAttention
    mlp_cls: type[nn.Module] = LlamaMLP

    def __init__(self, config: ModelConfig, dtype: torch.dtype,
                 backend_cls: type[AttentionBackend], layer_idx: int = 0) -> None:
        super().__init__()
        self.self_attn = self.attention_cls(config, dtype, backend_cls, layer_idx)
        self.mlp = self.make_mlp(config, dtype, layer_idx)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def make_mlp(self, config: ModelConfig, dtype: torch.dtype, layer_idx: int) -> nn.Module:
        """Layer ``layer_idx``'s MLP: ``mlp_cls(config, dtype)`` (MoE models choose per layer)."""
        return self.mlp_cls(config, dtype)

    def forward(self, hidden_states: torch.Tensor, residual: torch.Tensor | None,
                cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache,
                attn_metadata: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm.forward(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm.forward(hidden_states, residual)
        hidden_states = self.self_attn.forward(hidden_states, cos, sin, kv_cache, attn_metadata)
        hidden_states, residual = self.post_attention_layernorm.forward(hidden_states, residual)
        return self.mlp.forward(hidden_states), residual


class LlamaModel(nn.Module):
    """Embedding, ``num_hidden_layers`` x ``layer_cls``, final norm; one RoPE table."""

    layer_cls: type[nn.Module] = LlamaDecoderLayer
    # worker/layer_split.py LayerHooks (weight offload, layer split); None = off
    layer_hooks: Any = None
    supports_layer_split = True

    def __init__(self, config: ModelConfig, dtype: torch.dtype,
                 backend_cls: type[AttentionBackend]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
        self.embed_tokens.weight.requires_grad_(False)
        self.rotary_emb = RotaryEmbedding(config.rotary_dim, config.rope_max_position,
                                          config.rope_theta, config.rope_scaling, dtype,
                                          config.max_position_embeddings)
        self.layers = nn.ModuleList(self.layer_cls(config, dtype, backend_cls, i)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        # models/cpu_decode.py knows exactly these modules; other layers run their own code
        self.use_cpu_decode_path = all(
            type(layer) is LlamaDecoderLayer and type(layer.self_attn) is LlamaAttention
            and type(layer.mlp) is LlamaMLP and type(layer.mlp.act_fn) is SiluAndMul
            for layer in self.layers)

    # pipeline parallelism (models/pipeline_parallel.py): this stage runs layers
    # [start_layer, end_layer); a stage that is not the last returns (hidden, residual)
    start_layer: int = 0
    end_layer: int | None = None
    is_last_stage: bool = True

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], attn_metadata: Any,
                intermediate_tensors: tuple[torch.Tensor, torch.Tensor] | None = None):
        if self.layer_hooks is not None:  # layer split: inputs on the embedding's device
            input_ids, positions = self.layer_hooks.inputs(input_ids, positions)
        if intermediate_tensors is None:
            hidden_states = self.embed_tokens(input_ids)  # [num_tokens, hidden_size]
            residual = None
        else:  # a later pipeline stage: the previous stage's (hidden_states, residual)
            hidden_states, residual = intermediate_tensors
        cos, sin = self.rotary_emb.get_cos_sin(positions)  # [num_tokens, 1, head_dim / 2]
        nd = getattr(attn_metadata, "num_decodes", 0)
        if nd and self.use_cpu_decode_path and getattr(attn_metadata, "num_prefills", 0) \
                and hasattr(attn_metadata, "split_decodes"):
            # a mixed step runs its decode rows and its prompt rows as two passes, so a
            # decode takes the decode path's kernels whatever shares its step (batch
            # invariance, issue 20; sequences never see each other in attention)
            decode_md, prefill_md = attn_metadata.split_decodes()
            step = CpuDecodeStep.build(hidden_states[:nd], cos[:nd], sin[:nd], kv_caches,
                                       decode_md)
            if step is not None:
                hd, rd = self._decode_layers(step, hidden_states[:nd], kv_caches,
                                             None if residual is None else residual[:nd])
                hp, rp = self._layers(hidden_states[nd:], cos[nd:], sin[nd:], kv_caches,
                                      prefill_md, None if residual is None else residual[nd:])
                return self._stage_output(torch.cat([hd, hp]), torch.cat([rd, rp]))
        # pure decode steps on CPU: the layers as raw kernel calls (models/cpu_decode.py)
        step = (CpuDecodeStep.build(hidden_states, cos, sin, kv_caches, attn_metadata)
                if self.use_cpu_decode_path else None)
        if step is not None:
            hidden_states, residual = self._decode_layers(step, hidden_states, kv_caches,
                                                          residual)
        else:
            hidden_states, residual = self._layers(hidden_states, cos, sin, kv_caches,
                                                   attn_metadata, residual)
        return self._stage_output(hidden_states, residual)

    def _stage_output(self, hidden_states: torch.Tensor, residual: torch.Tensor):
        if not self.is_last_stage:
            return hidden_states, residual
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states

    def _stage_layers(self):
        return self.layers if self.end_layer is None else \
            self.layers[self.start_layer:self.end_layer]

    def _decode_layers(self, step: CpuDecodeStep, hidden_states: torch.Tensor,
                       kv_caches: list[KVCache], residual: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        hooks = self.layer_hooks
        for j, (layer, kv_cache) in enumerate(zip(self._stage_layers(), kv_caches, strict=True)):
            if hooks is not None:
                hooks.before_decode_layer(self.start_layer + j)
            hidden_states, residual = decode_layer(layer, step, hidden_states, residual, kv_cache)
        return hidden_states, residual

    def _layers(self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_caches: list[KVCache], attn_metadata: Any,
                residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        hooks = self.layer_hooks
        for j, (layer, kv_cache) in enumerate(zip(self._stage_layers(), kv_caches, strict=True)):
            if hooks is not None:  # offloaded weights in, hidden state to this layer's device
                hidden_states, residual, cos, sin, attn_metadata = hooks.before_layer(
                    self.start_layer + j, hidden_states, residual, cos, sin, attn_metadata)
            hidden_states, residual = layer.forward(hidden_states, residual, cos, sin, kv_cache,
                                                    attn_metadata)
        return hidden_states, residual


class LlamaForCausalLM(nn.Module):
    """Llama-family causal LM over a paged KV cache.

    Args:
        config: architecture hyper-parameters (Hugging Face names).
        dtype: parameter and activation dtype (float32, bfloat16, float16).
        attn_backend: registered attention backend name ("cpu", "reference").

    Raises:
        ValueError: unknown backend, unsupported ``hidden_act`` or rope type.

    Parameters are allocated uninitialised: call :meth:`load_weights`.
    """

    model_cls: type[nn.Module] = LlamaModel
    # fused parameter -> the checkpoint projections it stacks, in shard order
    packed_modules_mapping: dict[str, list[tuple[str, int | str]]] = {
        "qkv_proj": [("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")],
        "gate_up_proj": [("gate_proj", 0), ("up_proj", 1)],
    }

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32,
                 attn_backend: str = "cpu") -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.attn_backend_cls = get_attn_backend(attn_backend)
        self.num_layers = config.num_hidden_layers
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        # the runner copies this into CommonAttentionMetadata.sliding_window; with
        # per-layer windows each attention layer carries its own and the step has none
        self.sliding_window = config.sliding_window if config.layer_types is None else None
        self.model = self.model_cls(config, dtype, self.attn_backend_cls)
        self.tie_word_embeddings = config.tie_word_embeddings
        self.lm_head = (None if config.tie_word_embeddings else
                        Linear(config.hidden_size, config.vocab_size, dtype=dtype))

    def get_kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int]:
        """Shape of one layer's key (or value) cache:
        ``(num_blocks, block_size, num_kv_heads, head_dim)``."""
        return self.attn_backend_cls.get_kv_cache_shape(num_blocks, block_size,
                                                        self.num_kv_heads, self.head_dim)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], attn_metadata: Any,
                intermediate_tensors: tuple[torch.Tensor, torch.Tensor] | None = None):
        """One step over the flattened batch.

        Args:
            input_ids: ``[num_tokens]`` int64.
            positions: ``[num_tokens]`` int64, each token's position in its sequence.
            kv_caches: per layer ``(key_cache, value_cache)``, each
                ``[num_blocks, block_size, num_kv_heads, head_dim]``; written in place.
            attn_metadata: ``self.attn_backend_cls.build_metadata(common)``.

        Returns:
            Final hidden states ``[num_tokens, hidden_size]`` (after the last norm); on
            a pipeline stage that is not the last, ``(hidden_states, residual)`` to send
            on (``intermediate_tensors``: what the previous stage sent, both
            ``[num_tokens, hidden_size]``).

        Raises:
            ValueError: when ``len(kv_caches) != num_hidden_layers``.
        """
        if len(kv_caches) != self.num_layers:
            raise ValueError(f"expected {self.num_layers} KV caches, got {len(kv_caches)}")
        if intermediate_tensors is not None:
            return self.model(input_ids, positions, kv_caches, attn_metadata,
                              intermediate_tensors)
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[N, hidden_size]`` -> float32 logits ``[N, vocab_size]`` (matmul in model dtype),
        soft-capped ``cap * tanh(logits / cap)`` when ``final_logit_softcapping`` is set."""
        if self.lm_head is not None:  # through its linear method (native GGUF weights)
            logits = self.lm_head(hidden_states).float()
        else:
            logits = F.linear(hidden_states, self.model.embed_tokens.weight).float()
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def _checkpoint_name_map(self) -> dict[str, tuple[str, int | str | None]]:
        """Hugging Face weight name -> (our parameter name, shard id)."""
        mapping: dict[str, tuple[str, int | str | None]] = {}
        for pname, _ in self.named_parameters():
            fused = next((f for f in self.packed_modules_mapping if f".{f}." in pname), None)
            if fused is None:
                mapping[pname] = (pname, None)
                continue
            for orig, shard_id in self.packed_modules_mapping[fused]:
                mapping[pname.replace(f".{fused}.", f".{orig}.")] = (pname, shard_id)
        return mapping

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load Hugging Face-named tensors, fusing q/k/v and gate/up, cast to ``dtype``.

        ``*.rotary_emb.inv_freq`` is ignored, as is ``lm_head.weight`` when
        embeddings are tied.

        Raises:
            ValueError: for an unexpected name, a shape mismatch, or (after
                the iterable is exhausted) a missing weight; the message names it.
        """
        name_map = self._checkpoint_name_map()
        params = dict(self.named_parameters())
        missing = set(name_map)
        for name, tensor in weights:
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            if name not in name_map:
                raise ValueError(f"unexpected weight {name!r} for {type(self).__name__}")
            pname, shard_id = name_map[name]
            module = self.get_submodule(pname.rsplit(".", 1)[0])
            try:
                if hasattr(module, "weight_loader"):  # Linear, FusedMoE
                    module.weight_loader(params[pname], tensor, shard_id)
                else:
                    default_weight_loader(params[pname], tensor)
            except ValueError as e:
                raise ValueError(f"weight {name!r}: {e}") from None
            missing.discard(name)
        if missing:
            listed = sorted(missing)
            more = f" (and {len(listed) - 5} more)" if len(listed) > 5 else ""
            raise ValueError(f"missing weights after loading: {listed[:5]}{more}")
