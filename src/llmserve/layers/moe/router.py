"""Top-k softmax routing of a mixture-of-experts layer (Shazeer et al. 2017, "Outrageously
Large Neural Networks"; Mixtral, Jiang et al. 2024; Qwen-MoE).

::

    router_logits [T, E] --softmax (float32)--> probs [T, E] --top-k--> weights, ids [T, K]
                                         (norm_topk_prob: weights /= weights.sum(-1))

Numerics follow Hugging Face ``MixtralTopKRouter`` / ``Qwen2MoeTopKRouter`` /
``Qwen3MoeTopKRouter`` (transformers 5): the softmax runs in float32; Mixtral always
renormalizes and keeps the weights in float32, Qwen renormalizes when
``norm_topk_prob`` and casts the weights back to the logits' dtype.
"""

from __future__ import annotations

import torch


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                   weights_dtype: torch.dtype | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick each token's ``top_k`` experts and their combine weights.

    Args:
        router_logits: ``[num_tokens, num_experts]``, any float dtype.
        top_k: experts per token, ``1 <= top_k <= num_experts``.
        renormalize: divide the selected probabilities by their sum
            (Mixtral; Qwen's ``norm_topk_prob``).
        weights_dtype: dtype of the returned weights; None = ``router_logits.dtype``.

    Returns:
        ``(topk_weights [num_tokens, top_k], topk_ids [num_tokens, top_k] int64)``,
        experts in descending probability (``torch.topk`` order).

    Raises:
        ValueError: ``top_k`` outside ``1 .. num_experts``.
    """
    num_experts = router_logits.shape[-1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in 1..{num_experts} (num_experts), got {top_k}")
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights.to(weights_dtype or router_logits.dtype), topk_ids
