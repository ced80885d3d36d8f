"""The routed experts of a mixture-of-experts layer, computed expert by expert.

Expert weights are stacked (vLLM's ``FusedMoE`` layout; transformers 5's
``*Experts.gate_up_proj`` / ``down_proj``)::

    w13_weight [num_experts, 2 * intermediate_size, hidden_size]   rows: | gate (w1) | up (w3) |
    w2_weight  [num_experts, hidden_size, intermediate_size]       down (w2)

:func:`fused_experts` groups the ``num_tokens * top_k`` (token, expert) assignments
by expert (:func:`moe_align`, a stable sort, like vLLM's ``moe_align_block_size``)
and runs each *selected* expert once, on exactly the tokens routed to it::

    for expert e with n_e > 0 tokens:   x = hidden[tokens_e]                    [n_e, H]
                                        y = down_e(silu(gate_e(x)) * up_e(x))  [n_e, H]
                                        rows_e = w_e * y
    out[t] = sum of token t's top_k rows (gathered back, ascending expert id)

An expert no token picked costs nothing; the work is ``num_tokens * top_k`` expert
rows, never ``num_tokens * num_experts``. Per token the expert outputs are summed in
ascending expert order, as Hugging Face's expert loop (``MixtralExperts.forward``) does.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from llmserve.layers.activation import get_act_and_mul
from llmserve.layers.quantization.base import QuantizedTensor

# shard ids of one expert's checkpoint projections (Mixtral's names)
EXPERT_SHARDS = ("w1", "w2", "w3")


def moe_align(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, list[int]]:
    """Group (token, slot) assignments by expert.

    Args:
        topk_ids: ``[num_tokens, top_k]`` int64 expert ids in ``0 .. num_experts - 1``.
        num_experts: number of experts.

    Returns:
        ``(sorted_slots, counts)``: ``sorted_slots [num_tokens * top_k]`` are flat slot
        indices ``token * top_k + k`` ordered by expert (tokens ascending within an
        expert); ``counts[e]`` is how many of them belong to expert ``e``.
    """
    flat = topk_ids.reshape(-1)
    sorted_slots = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    return sorted_slots, counts


def fused_experts(hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  act_fn: Callable[[torch.Tensor], torch.Tensor],
                  linear: Callable[..., torch.Tensor] = F.linear) -> torch.Tensor:
    """``sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(hidden_states[t])`` for each token.

    Args:
        hidden_states: ``[num_tokens, hidden_size]``.
        w13: ``[num_experts, 2 * intermediate_size, hidden_size]`` (gate rows, then up rows).
        w2: ``[num_experts, hidden_size, intermediate_size]``.
        topk_weights: ``[num_tokens, top_k]``; the product with an expert's output is
            taken in ``result_type(output, weights)`` (float32 weights: float32), then
            cast to ``hidden_states.dtype`` before the sum, as transformers does.
        topk_ids: ``[num_tokens, top_k]`` int64, distinct experts within a row; the id
            ``w13.shape[0]`` (one past the last) marks an expert held by another rank
            (expert parallelism): its rows are zero and come last in a token's sum.
        act_fn: ``[n, 2 * intermediate_size] -> [n, intermediate_size]`` (SwiGLU).
        linear: ``(x [n, K], weight [N, K]) -> [n, N]``; ``F.linear``, or in
            ``--deterministic`` mode ``batch_invariant.chunked_linear`` (an expert's row
            count ``n`` varies with the batch, and oneDNN's kernel with it).

    Returns:
        ``[num_tokens, hidden_size]`` in ``hidden_states.dtype``.
    """
    num_tokens, top_k = topk_ids.shape
    if num_tokens == 0:
        return torch.zeros_like(hidden_states)
    sorted_slots, counts = moe_align(topk_ids, w13.shape[0])
    token_ids = sorted_slots // top_k  # [num_tokens * top_k], grouped by expert
    weights = topk_weights.reshape(-1)[sorted_slots]
    # weighted expert outputs, rows in expert-grouped (sorted slot) order
    num_local = w13.shape[0]
    alloc = hidden_states.new_zeros if len(counts) > num_local else hidden_states.new_empty
    expert_out = alloc((num_tokens * top_k, hidden_states.shape[1]))
    start = 0
    for expert, count in enumerate(counts):
        if expert >= num_local:  # another rank's experts (sorted last): rows stay zero
            break
        if count == 0:
            continue
        end = start + count
        x = hidden_states.index_select(0, token_ids[start:end])  # [count, hidden_size]
        y = linear(act_fn(linear(x, w13[expert])), w2[expert])
        expert_out[start:end] = y * weights[start:end, None]
        start = end
    # combine by gathers, not index_add_ (which runs a thread pool even for one row): each
    # token's rows, its experts in ascending id order, summed left to right as the
    # transformers loop accumulates them
    row_of_slot = torch.argsort(sorted_slots)  # inverse permutation
    slots = topk_ids.argsort(dim=1, stable=True) + torch.arange(
        num_tokens, device=topk_ids.device)[:, None] * top_k  # [num_tokens, top_k]
    rows = expert_out[row_of_slot[slots]]  # [num_tokens, top_k, hidden_size]
    out = rows[:, 0]
    for k in range(1, top_k):
        out = out + rows[:, k]
    return out.contiguous()


class FusedMoE(nn.Module):
    """``num_experts`` SwiGLU experts with stacked weights (see the module docstring).

    Args:
        num_experts: routed experts.
        hidden_size: model width.
        intermediate_size: one expert's width (HF ``moe_intermediate_size``; Mixtral's
            ``intermediate_size``).
        hidden_act: HF ``hidden_act`` (``"silu"``).
        dtype: parameter dtype.

    Raises:
        ValueError: a non-positive size or an unsupported ``hidden_act``.

    Parameters are allocated uninitialised; load them with :meth:`weight_loader`.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 hidden_act: str = "silu", dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        for name, value in (("num_experts", num_experts), ("hidden_size", hidden_size),
                            ("intermediate_size", intermediate_size)):
            if value <= 0:
                raise ValueError(f"FusedMoE: {name} must be positive, got {value}")
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.hidden_act = hidden_act
        self.w13_weight = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size, dtype=dtype),
            requires_grad=False)
        self.w2_weight = nn.Parameter(
            torch.empty(num_experts, hidden_size, intermediate_size, dtype=dtype),
            requires_grad=False)
        self.act_fn = get_act_and_mul(hidden_act)
        self.linear = F.linear  # the experts' matmul (fused_experts' ``linear``)

    def forward(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> torch.Tensor:
        """hidden ``[T, hidden_size]``, weights/ids ``[T, top_k]`` -> ``[T, hidden_size]``."""
        return fused_experts(hidden_states, self.w13_weight, self.w2_weight, topk_weights,
                             topk_ids, self.act_fn.forward, self.linear)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor | QuantizedTensor,
                      shard_id: tuple[int, str]) -> None:
        """Load one expert's projection into the stacked weight.

        Args:
            param: ``self.w13_weight`` or ``self.w2_weight``.
            loaded_weight: ``w1`` (gate) / ``w3`` (up): ``[intermediate_size, hidden_size]``;
                ``w2`` (down): ``[hidden_size, intermediate_size]`` (HF layout). A
                :class:`QuantizedTensor` is dequantized.
            shard_id: ``(expert_id, "w1" | "w2" | "w3")``.

        Raises:
            ValueError: an unknown expert or shard, a shard loaded into the wrong
                parameter, or a shape mismatch.
        """
        expert, shard = shard_id
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} out of range 0..{self.num_experts - 1}")
        if shard not in EXPERT_SHARDS:
            raise ValueError(f"unknown expert shard {shard!r}; expected one of {EXPERT_SHARDS}")
        if (shard == "w2") != (param is self.w2_weight):
            raise ValueError(f"expert shard {shard!r} does not belong in this parameter")
        size = self.intermediate_size
        dst = param.data[expert]
        if shard != "w2":
            dst = dst.narrow(0, 0 if shard == "w1" else size, size)
        if isinstance(loaded_weight, QuantizedTensor):
            loaded_weight = loaded_weight.dequantize()
        if tuple(dst.shape) != tuple(loaded_weight.shape):
            raise ValueError(f"expert {expert} {shard}: expected shape {tuple(dst.shape)}, "
                             f"got {tuple(loaded_weight.shape)}")
        with torch.no_grad():
            dst.copy_(loaded_weight)
