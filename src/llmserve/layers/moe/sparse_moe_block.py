"""A sparse mixture-of-experts MLP block: router, routed experts, optional shared expert.

::

    x [T, H] -> gate (router linear) -> logits [T, E] -> select_experts -> weights, ids [T, K]
             -> experts (FusedMoE: only the selected experts, on their tokens)     -> routed [T, H]
             -> shared_expert(x) * sigmoid(shared_expert_gate(x))   (Qwen2-MoE)   -> shared [T, H]
    out = routed (+ shared)

Mixtral (``MixtralSparseMoeBlock``): top-2, always renormalized, float32 weights.
Qwen2-MoE (``Qwen2MoeSparseMoeBlock``): top-k, ``norm_topk_prob``, plus a shared
expert gated per token by a sigmoid. Qwen3-MoE: as Qwen2-MoE without the shared expert.
"""

from __future__ import annotations

import torch
from torch import nn

from llmserve.layers.linear import Linear
from llmserve.layers.moe.fused_moe import FusedMoE
from llmserve.layers.moe.router import select_experts


class SparseMoeBlock(nn.Module):
    """Routed experts (+ a gated shared expert) in place of a dense MLP.

    Args:
        hidden_size: model width.
        num_experts: routed experts ``E``.
        top_k: experts per token ``K`` (HF ``num_experts_per_tok``).
        intermediate_size: one routed expert's width.
        hidden_act: HF ``hidden_act``.
        renormalize: renormalize the top-k weights (Mixtral; Qwen ``norm_topk_prob``).
        float32_weights: keep the combine weights in float32 (Mixtral) instead of
            casting them to the activation dtype (Qwen).
        shared_expert: an MLP module ``[T, H] -> [T, H]`` run on every token, or None;
            with it comes ``shared_expert_gate`` (``Linear(H, 1)``, sigmoid).
        dtype: parameter dtype.

    Raises:
        ValueError: ``top_k`` outside ``1 .. num_experts``, or a bad size.
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int,
                 hidden_act: str, renormalize: bool, float32_weights: bool = False,
                 shared_expert: nn.Module | None = None,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok must be in 1..{num_experts} (num_experts), "
                             f"got {top_k}")
        self.top_k = top_k
        self.renormalize = renormalize
        self.weights_dtype = torch.float32 if float32_weights else None
        self.gate = Linear(hidden_size, num_experts, dtype=dtype)  # the router
        self.experts = FusedMoE(num_experts, hidden_size, intermediate_size, hidden_act, dtype)
        self.shared_expert = shared_expert
        self.shared_expert_gate = (Linear(hidden_size, 1, dtype=dtype)
                                   if shared_expert is not None else None)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[num_tokens, hidden_size]`` -> ``[num_tokens, hidden_size]``."""
        router_logits = self.gate.forward(hidden_states)  # [T, E]
        topk_weights, topk_ids = select_experts(router_logits, self.top_k, self.renormalize,
                                                self.weights_dtype)
        out = self.experts.forward(hidden_states, topk_weights, topk_ids)
        if self.shared_expert is not None:
            gate = torch.sigmoid(self.shared_expert_gate.forward(hidden_states))  # [T, 1]
            out = out + gate * self.shared_expert.forward(hidden_states)
        return out
