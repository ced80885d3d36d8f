"""H2O at block granularity: keep the heavy-hitter blocks (highest attention accumulated
over every query so far) plus a recent window; evict the lightest older block.

Scores: each step the attention layers add, per kept block, the softmax probability
mass every query row of the sequence puts on the block's keys, summed over layers and
query heads (``layers/attention/scored.py``); a block's score is the sum over all
steps since it was written. The recent window is ``max(1, budget_blocks // 2)`` blocks
(the paper's even heavy/recent split). Ties go to the oldest block.
Source: Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of
Large Language Models" (NeurIPS 2023); kvpress ``ObservedAttentionPress``.
"""

from __future__ import annotations

from llmserve.kv_cache.eviction.base import EvictionPolicy, EvictionState


class H2OPolicy(EvictionPolicy):
    """Accumulated attention per block; lowest first, outside the recent window."""

    name = "h2o"
    needs_scores = True

    def check(self, state: EvictionState) -> None:
        if state.budget_blocks < 2:
            raise ValueError(f"kv_budget_tokens must hold at least 2 blocks of "
                             f"{state.block_size} tokens for h2o, got {state.budget_blocks}")

    def score_from(self, state: EvictionState, num_prompt_tokens: int,
                   num_computed_tokens: int, num_new_tokens: int) -> int | None:
        return 0  # every query row, every step

    def select(self, state: EvictionState, num_evictable: int, num_to_evict: int,
               num_prompt_tokens: int) -> list[int]:
        recent = max(1, state.budget_blocks // 2)
        state.sync(num_evictable)
        limit = min(num_evictable, max(0, len(state.scores) - recent))
        order = sorted(range(limit), key=lambda i: (state.scores[i], i))
        return sorted(order[:num_to_evict])
