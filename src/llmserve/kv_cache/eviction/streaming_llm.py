"""StreamingLLM at block granularity: keep the attention-sink blocks and the most
recent blocks, evict the oldest block in between.

kvpress's ``StreamingLLMPress`` keeps the first ``n_sink`` tokens and the last
``n_kept - n_sink``; with ``num_sink_tokens`` and the budget multiples of
``block_size`` the kept positions are the same (tests/test_kv_eviction.py).
Source: Xiao et al., "Efficient Streaming Language Models with Attention Sinks"
(ICLR 2024), without re-rotating kept keys (kvpress's default too).
"""

from __future__ import annotations

from llmserve.kv_cache.eviction.base import EvictionPolicy, EvictionState


class StreamingLLMPolicy(EvictionPolicy):
    """Sinks + recent window; the oldest non-sink block goes first."""

    name = "streaming_llm"

    def select(self, state: EvictionState, num_evictable: int, num_to_evict: int,
               num_prompt_tokens: int) -> list[int]:
        first = min(state.sink_blocks, num_evictable)
        return list(range(first, min(num_evictable, first + num_to_evict)))
