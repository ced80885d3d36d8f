"""Mixtral (Jiang et al. 2024, "Mixtral of Experts"): a Mistral decoder whose every MLP is
a sparse block of ``num_local_experts`` SwiGLU experts, top-2 routed.

Router (HF ``MixtralTopKRouter``): softmax in float32 over all experts, top-k, the k
weights renormalized to sum to 1 and kept in float32. Checkpoint names:
``model.layers.{i}.block_sparse_moe.gate`` (router) and
``...block_sparse_moe.experts.{e}.w1 / w3 / w2`` (gate / up / down). Sliding-window
attention (``sliding_window``) applies to every layer, as in Mistral.
"""

from __future__ import annotations

from llmserve.models.llama import LlamaModel
from llmserve.models.moe_base import MoEDecoderLayer, MoEForCausalLM


class MixtralDecoderLayer(MoEDecoderLayer):
    float32_router_weights = True
    renormalize = True


class MixtralModel(LlamaModel):
    layer_cls = MixtralDecoderLayer


class MixtralForCausalLM(MoEForCausalLM):
    """Mixtral causal LM over a paged KV cache (see :class:`MoEForCausalLM`)."""

    model_cls = MixtralModel
    checkpoint_block = "block_sparse_moe"
    expert_names = {"w1": "w1", "w2": "w2", "w3": "w3"}
