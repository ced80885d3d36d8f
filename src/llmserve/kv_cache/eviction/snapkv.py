"""SnapKV at block granularity: when the prompt is in, the last ``window`` prompt
queries vote (their attention, summed over layers and heads, per block) and the
prompt blocks before the window with the most votes are kept with the window.

The prompt is computed whole (no eviction during prefill); the selection happens
once, at the first step after it that would exceed the budget. Later (generation)
the budget is kept like a sliding window over the blocks from the observation window
on: the oldest of them goes first, the selected prompt blocks stay (kvpress's press
works at prefill only and leaves generation uncompressed).
Scores: the observation-window rows are scored in the step that computes them, so a
window cut by a chunk boundary votes with its rows in the prompt's last chunk only.
kvpress's 1-D pooling over neighbouring tokens is left out: a block sum already pools.
Source: Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation"
(2024); kvpress ``SnapKVPress`` (window_size 64 by default).
"""

from __future__ import annotations

from llmserve.kv_cache.eviction.base import EvictionPolicy, EvictionState


class SnapKVPolicy(EvictionPolicy):
    """One prompt selection by the observation window's votes, then a window."""

    name = "snapkv"
    needs_scores = True
    evict_during_prefill = False

    def check(self, state: EvictionState) -> None:
        if state.budget_blocks < state.window_blocks + 2:
            raise ValueError(
                f"kv_budget_tokens must hold the SnapKV window ({state.window_tokens} tokens) "
                f"plus 2 blocks of {state.block_size} tokens, got {state.budget_blocks} blocks")

    def score_from(self, state: EvictionState, num_prompt_tokens: int,
                   num_computed_tokens: int, num_new_tokens: int) -> int | None:
        first = max(0, num_prompt_tokens - state.window_tokens)
        if state.prompt_selected or num_computed_tokens + num_new_tokens <= first \
                or num_computed_tokens >= num_prompt_tokens:
            return None
        return first

    def window_start(self, state: EvictionState, num_prompt_tokens: int) -> int:
        """The logical block where the observation window starts."""
        return max(0, num_prompt_tokens - state.window_tokens) // state.block_size

    def select(self, state: EvictionState, num_evictable: int, num_to_evict: int,
               num_prompt_tokens: int) -> list[int]:
        state.sync(num_evictable)
        first_window = self.window_start(state, num_prompt_tokens)
        if not state.prompt_selected:
            state.prompt_selected = True
            cands = [i for i in range(num_evictable) if state.logical[i] < first_window]
            order = sorted(cands, key=lambda i: (state.scores[i], i))
            return sorted(order[:num_to_evict])
        # generation: slide over the blocks from the window on; then the lightest prompt block
        later = [i for i in range(num_evictable) if state.logical[i] >= first_window]
        picked = later[:num_to_evict]
        if len(picked) < num_to_evict:
            rest = [i for i in range(num_evictable) if state.logical[i] < first_window]
            rest.sort(key=lambda i: (state.scores[i], i))
            picked += rest[:num_to_evict - len(picked)]
        return sorted(picked)
