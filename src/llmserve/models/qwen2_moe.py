"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): a Qwen2 decoder (q/k/v bias, no o_proj bias)
whose sparse layers have ``num_experts`` routed experts of width
``moe_intermediate_size`` plus one shared expert of width
``shared_expert_intermediate_size``, gated per token by
``sigmoid(shared_expert_gate(x))``.

Router (HF ``Qwen2MoeTopKRouter``): softmax in float32, top-k, renormalized only when
``norm_topk_prob``, weights cast to the activation dtype. Layer ``i`` is sparse unless
``i in mlp_only_layers`` or ``(i + 1) % decoder_sparse_step != 0``; dense layers are a
SwiGLU MLP of ``intermediate_size``. With ``use_sliding_window`` the window covers the
layers ``layer_types`` names (derived as ``Qwen2MoeConfig`` does when absent).
Checkpoint names: ``model.layers.{i}.mlp.gate``, ``mlp.experts.{e}.{gate,up,down}_proj``,
``mlp.shared_expert.{gate,up,down}_proj``, ``mlp.shared_expert_gate``.
"""

from __future__ import annotations

from llmserve.models.moe_base import MoEForCausalLM


class Qwen2MoeForCausalLM(MoEForCausalLM):
    """Qwen2-MoE causal LM over a paged KV cache (see :class:`MoEForCausalLM`)."""
