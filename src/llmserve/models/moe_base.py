"""What the mixture-of-experts decoders share (Mixtral, Qwen2-MoE, Qwen3-MoE).

They are Llama-family decoders (:mod:`llmserve.models.llama`: RMSNorm, RoPE, GQA over
the paged KV cache, the same residual wiring) whose MLP is, in the sparse layers, a
:class:`~llmserve.layers.moe.SparseMoeBlock`::

    layer i:  norm -> attention -> +res -> norm -> (SparseMoeBlock if sparse(i) else LlamaMLP) -> +res

Checkpoint names (Hugging Face, as ``save_pretrained`` writes them) -> ours::

    {block}.gate.weight                          -> mlp.gate.weight            (router)
    {block}.experts.{e}.{w1|gate_proj}.weight    -> mlp.experts.w13_weight[e, :I]
    {block}.experts.{e}.{w3|up_proj}.weight      -> mlp.experts.w13_weight[e, I:]
    {block}.experts.{e}.{w2|down_proj}.weight    -> mlp.experts.w2_weight[e]
    {block}.shared_expert.{gate,up,down}_proj    -> mlp.shared_expert.{gate_up,down}_proj
    {block}.shared_expert_gate.weight            -> mlp.shared_expert_gate.weight

with ``{block}`` = ``model.layers.{i}.block_sparse_moe`` (Mixtral) or ``model.layers.{i}.mlp``.
These models never take the CPU decode fast path (``LlamaModel.use_cpu_decode_path``).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from llmserve.config import ModelConfig
from llmserve.layers.moe import SparseMoeBlock
from llmserve.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel


class MoEDecoderLayer(LlamaDecoderLayer):
    """A Llama decoder layer whose MLP is a :class:`SparseMoeBlock` in the sparse layers
    (:meth:`ModelConfig.is_moe_layer`) and a :class:`LlamaMLP` in the others.

    Subclasses set ``attention_cls`` (e.g. QK-norm) and the router's conventions.
    """

    # Mixtral keeps the router's combine weights in float32 and always renormalizes
    float32_router_weights: ClassVar[bool] = False
    renormalize: ClassVar[bool | None] = None  # None: the config's norm_topk_prob

    def make_mlp(self, config: ModelConfig, dtype: torch.dtype, layer_idx: int) -> nn.Module:
        if not config.is_moe_layer(layer_idx):
            return LlamaMLP(config, dtype)
        shared = (LlamaMLP(config, dtype, config.shared_expert_intermediate_size)
                  if config.shared_expert_intermediate_size else None)
        renormalize = config.norm_topk_prob if self.renormalize is None else self.renormalize
        return SparseMoeBlock(config.hidden_size, config.num_experts, config.num_experts_per_tok,
                              config.moe_intermediate_size, config.hidden_act, renormalize,
                              self.float32_router_weights, shared, dtype)


class MoEModel(LlamaModel):
    layer_cls = MoEDecoderLayer


class MoEForCausalLM(LlamaForCausalLM):
    """Base of the MoE causal LMs: arguments as :class:`LlamaForCausalLM`; maps the
    experts' checkpoint names (see the module docstring).

    Raises:
        ValueError: a config without experts, or as :class:`LlamaForCausalLM`.
    """

    model_cls = MoEModel
    # checkpoint module name of the sparse block ("block_sparse_moe" for Mixtral)
    checkpoint_block: ClassVar[str] = "mlp"
    # our expert shard -> the checkpoint's projection name
    expert_names: ClassVar[dict[str, str]] = {"w1": "gate_proj", "w2": "down_proj",
                                              "w3": "up_proj"}

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32,
                 attn_backend: str = "cpu") -> None:
        if config.num_experts <= 0:
            raise ValueError(f"{type(self).__name__} needs num_experts > 0 in the model config")
        super().__init__(config, dtype, attn_backend)

    def _checkpoint_name_map(self) -> dict[str, tuple[str, int | str | None]]:
        """Checkpoint name -> (our parameter, shard id); see the module docstring."""
        # our "model.layers.{i}.mlp." -> the checkpoint's "model.layers.{i}.{block}."
        blocks = {f"{name}.": f"{name.rsplit('.', 1)[0]}.{self.checkpoint_block}."
                  for name, module in self.named_modules() if isinstance(module, SparseMoeBlock)}
        mapping: dict[str, tuple[str, int | str | None]] = {}
        for ckpt, (pname, shard) in super()._checkpoint_name_map().items():
            ours = next((p for p in blocks if ckpt.startswith(p)), None)
            if ours is not None:
                ckpt = blocks[ours] + ckpt[len(ours):]
            if ours is None or not pname.startswith(f"{ours}experts."):
                mapping[ckpt] = (pname, shard)
                continue
            # a stacked expert weight: one checkpoint tensor per expert and projection
            experts = self.get_submodule(f"{ours}experts")
            shards = ("w2",) if pname.endswith(".w2_weight") else ("w1", "w3")
            for e in range(experts.num_experts):
                for s in shards:
                    name = f"{blocks[ours]}experts.{e}.{self.expert_names[s]}.weight"
                    mapping[name] = (pname, (e, s))
        return mapping
