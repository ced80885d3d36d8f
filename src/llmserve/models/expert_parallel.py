"""Expert parallelism: the routed experts of a MoE model sharded over the ep group.

With ``--enable-expert-parallel`` and ``tensor_parallel_size = n`` the ep group is the
tp group (vLLM: ``EP size = TP size x DP size``; here data-parallel replicas are
separate engines, so EP size = TP size). Attention, embeddings, the LM head and the
dense MLP layers are split as tensor parallelism splits them
(:mod:`llmserve.models.tensor_parallel`); in each sparse block::

    router (gate)          replicated: every rank computes the same top-k ids/weights
    routed experts         rank r holds experts [r * E/n, (r + 1) * E/n), whole (not split)
    shared expert (+gate)  replicated
    dispatch               none: after the tp all-reduce every rank already holds every
                           token's hidden state (vLLM's naive dispatch at dp = 1)
    combine                all-reduce of the per-rank partial sums (a reduce-scatter
                           followed by the all-gather the next layer would need)

Numerics: a token's expert rows are summed in ascending expert id on one rank and the
ranks' partial sums added once, so with top-2 routing the float sum is bit-identical to
the single-process :func:`~llmserve.layers.moe.fused_experts` (``e_a + e_b``, in either
grouping); with top-k > 2 the grouping differs (``(e1 + e2) + e3`` vs ``e1 + (e2 + e3)``)
by float rounding only. Reference: vLLM ``FusedMoE`` with ``expert_map``
(``vllm/model_executor/layers/fused_moe/layer.py``, ``determine_expert_map``).
"""

from __future__ import annotations

import torch

from llmserve.distributed.parallel_state import GroupCoordinator
from llmserve.layers.moe import FusedMoE, SparseMoeBlock, fused_experts
from llmserve.layers.quantization.base import QuantizedTensor


def local_expert_range(num_experts: int, ep: GroupCoordinator) -> tuple[int, int]:
    """``(first expert, number of experts)`` this rank holds: contiguous, equal shares.

    Raises:
        ValueError: the ep size does not divide ``num_experts``.
    """
    n = ep.world_size
    if num_experts % n:
        raise ValueError(f"expert parallelism over {n} ranks needs num_experts divisible by "
                         f"{n}, got {num_experts}")
    per_rank = num_experts // n
    return ep.rank_in_group * per_rank, per_rank


class ExpertParallelFusedMoE(FusedMoE):
    """This rank's share of a :class:`FusedMoE`: stacked weights of experts
    ``[expert_start, expert_start + num_local_experts)``; ``num_experts`` stays the
    global count (checkpoint names cover every expert; other ranks' are skipped).

    ``forward``: hidden ``[T, H]``, global ``topk_ids``/``topk_weights`` ``[T, K]`` ->
    ``[T, H]``, the sum over all ranks (one all-reduce over ``ep``).
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 hidden_act: str, dtype: torch.dtype, ep: GroupCoordinator) -> None:
        start, count = local_expert_range(num_experts, ep)
        super().__init__(count, hidden_size, intermediate_size, hidden_act, dtype)
        self.num_local_experts = count
        self.num_experts = num_experts
        self.expert_start = start
        self.ep_group = ep

    def forward(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> torch.Tensor:
        local_ids = topk_ids - self.expert_start
        remote = (local_ids < 0) | (local_ids >= self.num_local_experts)
        # another rank's expert -> the id one past the last local one (rows of zeros)
        local_ids = local_ids.masked_fill(remote, self.num_local_experts)
        partial = fused_experts(hidden_states, self.w13_weight, self.w2_weight, topk_weights,
                                local_ids, self.act_fn.forward, self.linear)
        return self.ep_group.all_reduce(partial)

    def weight_loader(self, param, loaded_weight: torch.Tensor | QuantizedTensor,
                      shard_id: tuple[int, str]) -> None:
        """As :meth:`FusedMoE.weight_loader` with a global expert id; another rank's
        expert is skipped."""
        expert, shard = shard_id
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} out of range 0..{self.num_experts - 1}")
        local = expert - self.expert_start
        if not 0 <= local < self.num_local_experts:
            return
        saved, self.num_experts = self.num_experts, self.num_local_experts
        try:
            super().weight_loader(param, loaded_weight, (local, shard))
        finally:
            self.num_experts = saved


def shard_experts(model: torch.nn.Module, ep: GroupCoordinator) -> list[str]:
    """Replace every :class:`SparseMoeBlock`'s experts by this rank's
    :class:`ExpertParallelFusedMoE` (in place, before loading) and return the module
    names tensor parallelism must leave whole: each block's router ``gate``,
    ``shared_expert`` and ``shared_expert_gate``.

    Raises:
        ValueError: the ep size does not divide the number of experts.
    """
    replicated = []
    for name, block in list(model.named_modules()):
        if not isinstance(block, SparseMoeBlock):
            continue
        old = block.experts
        block.experts = ExpertParallelFusedMoE(
            old.num_experts, old.hidden_size, old.intermediate_size, old.hidden_act,
            old.w13_weight.dtype, ep)
        replicated += [f"{name}.gate", f"{name}.shared_expert", f"{name}.shared_expert_gate"]
    return replicated

