"""Shard a Llama-family model over a tensor-parallel group, outside the model code.

A model file builds plain layers and never asks "am I sharded?". Sharding is two
steps, as Hugging Face's ``tp_plan`` / torch's ``parallelize_module`` do it:

1. the model is built from :func:`local_model_config` (this rank's head counts and
   MLP width), so attention, RoPE and the KV cache see local shapes;
2. :func:`parallelize_model` swaps each layer named in :data:`TP_PLAN` for its
   parallel class of the same local shape (which loads its own shard and
   all-reduces where the plan needs it), and wraps ``compute_logits`` to gather the
   vocab-parallel logits, so the sampler runs once on the full ``[N, vocab]``::

    embed_tokens  vocab      -> VocabParallelEmbedding (all-reduce)
    qkv_proj      colwise    -> QKVParallelLinear      (heads; KV replicated past kv heads)
    o_proj        rowwise    -> RowParallelLinear      (all-reduce)
    gate_up_proj  colwise    -> MergedColumnParallelLinear
    down_proj     rowwise    -> RowParallelLinear      (all-reduce)
    lm_head       vocab      -> ParallelLMHead          (logits all-gathered)

A model may set its own ``tp_plan`` (module name -> kind). Any other ``Linear`` or
embedding left unsharded is an error, so a new architecture never runs half-split.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from llmserve.config import ModelConfig
from llmserve.distributed.parallel_state import GroupCoordinator
from llmserve.layers.linear import Linear, MergedColumnLinear, QKVLinear
from llmserve.layers.parallel_linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from llmserve.layers.vocab_parallel import (
    ParallelLMHead,
    VocabParallelEmbedding,
    gather_logits,
)

TP_PLAN: dict[str, str] = {
    "embed_tokens": "vocab_embedding",
    "qkv_proj": "qkv",
    "o_proj": "rowwise",
    "gate_up_proj": "colwise",
    "down_proj": "rowwise",
    "lm_head": "lm_head",
}


def local_model_config(config: ModelConfig, tp_size: int) -> ModelConfig:
    """The shapes one rank builds: ``heads / tp`` query heads, ``max(1, kv_heads / tp)``
    KV heads, ``intermediate_size / tp``; everything else (hidden size, vocab, head_dim)
    unchanged. Validate first with ``ParallelConfig.check_model``."""
    if tp_size == 1:
        return config
    return replace(config, num_attention_heads=config.num_attention_heads // tp_size,
                   num_key_value_heads=max(1, config.num_key_value_heads // tp_size),
                   intermediate_size=config.intermediate_size // tp_size,
                   head_dim=config.head_dim)


def build_model_shard(model_cls: type[nn.Module], config: ModelConfig, dtype: torch.dtype,
                      attn_backend: str, tp: GroupCoordinator,
                      expert_parallel: bool = False) -> nn.Module:
    """This rank's model: built at local shapes, then :func:`parallelize_model`
    (``expert_parallel``: MoE experts sharded over ``tp`` as the ep group,
    :mod:`llmserve.models.expert_parallel`)."""
    model = model_cls(local_model_config(config, tp.world_size), dtype, attn_backend)
    if tp.world_size > 1:
        parallelize_model(model, config, tp, expert_parallel)
    return model


def _parallel_layer(kind: str, old: nn.Module, config: ModelConfig,
                    tp: GroupCoordinator) -> nn.Module | None:
    n = tp.world_size
    if kind == "vocab_embedding" and isinstance(old, nn.Embedding):
        return VocabParallelEmbedding(config.vocab_size, old.embedding_dim, old.weight.dtype, tp)
    if not isinstance(old, Linear):
        return None
    dtype, bias = old.weight.dtype, old.bias is not None
    if kind == "qkv" and isinstance(old, QKVLinear):
        return QKVParallelLinear(old.input_size, config.head_dim, config.num_attention_heads,
                                 config.num_key_value_heads, bias, dtype, tp)
    if kind == "colwise" and isinstance(old, MergedColumnLinear):
        return MergedColumnParallelLinear(old.input_size, [s * n for s in old.output_sizes],
                                          bias, dtype, tp)
    if kind == "rowwise" and type(old) is Linear:
        return RowParallelLinear(old.input_size * n, old.output_size, bias, dtype, tp)
    if kind == "lm_head" and type(old) is Linear and not bias:
        return ParallelLMHead(config.vocab_size, old.input_size, dtype, tp)
    return None


def parallelize_model(model: nn.Module, config: ModelConfig, tp: GroupCoordinator,
                      expert_parallel: bool = False) -> None:
    """Swap the layers of ``model`` (built from :func:`local_model_config`) for their
    tensor-parallel classes, in place, before its weights are loaded. With
    ``expert_parallel`` the MoE experts are sharded first and the routers and shared
    experts left whole (:func:`~llmserve.models.expert_parallel.shard_experts`).

    Raises:
        ValueError: a ``Linear`` or embedding the plan does not cover, or a layer of an
            unexpected type under a planned name (the message names it).
    """
    plan = getattr(model, "tp_plan", None) or TP_PLAN
    swaps = []
    whole: tuple[str, ...] = ()
    if expert_parallel:
        from llmserve.models.expert_parallel import shard_experts

        whole = tuple(shard_experts(model, tp))
    for name, module in model.named_modules():
        if any(name == w or name.startswith(w + ".") for w in whole):
            continue  # replicated on every rank (expert parallelism)
        leaf = name.rsplit(".", 1)[-1]
        if leaf in plan:
            new = _parallel_layer(plan[leaf], module, config, tp)
            if new is None:
                raise ValueError(f"tensor parallelism cannot split {name} "
                                 f"({type(module).__name__}) of {type(model).__name__}")
            swaps.append((name, new))
        elif isinstance(module, (Linear, nn.Embedding)):
            raise ValueError(f"tensor parallelism has no plan for {name} "
                             f"({type(module).__name__}) of {type(model).__name__}")
    for name, new in swaps:
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, new)
    local_logits = model.compute_logits
    vocab = config.vocab_size

    def compute_logits(hidden_states: torch.Tensor) -> torch.Tensor:
        """``[N, hidden]`` -> float32 ``[N, vocab]``: local logits, all-gathered."""
        return gather_logits(local_logits(hidden_states), vocab, tp)
    model.compute_logits = compute_logits
    model.tp_group = tp
