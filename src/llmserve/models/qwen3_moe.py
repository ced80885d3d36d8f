"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): a Qwen3 decoder (QK-norm:
:class:`~llmserve.models.qwen3.Qwen3Attention`; no q/k/v bias unless ``attention_bias``)
whose sparse layers have ``num_experts`` routed experts of width
``moe_intermediate_size`` and no shared expert.

Router as Qwen2-MoE (HF ``Qwen3MoeTopKRouter``): softmax in float32, top-k,
renormalized when ``norm_topk_prob`` (the released checkpoints set it). Checkpoint
names as Qwen2-MoE without the shared expert, plus ``self_attn.{q,k}_norm``.
"""

from __future__ import annotations

from llmserve.models.llama import LlamaModel
from llmserve.models.moe_base import MoEDecoderLayer, MoEForCausalLM
from llmserve.models.qwen3 import Qwen3Attention


class Qwen3MoeDecoderLayer(MoEDecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3MoeModel(LlamaModel):
    layer_cls = Qwen3MoeDecoderLayer


class Qwen3MoeForCausalLM(MoEForCausalLM):
    """Qwen3-MoE causal LM over a paged KV cache (see :class:`MoEForCausalLM`)."""

    model_cls = Qwen3MoeModel
