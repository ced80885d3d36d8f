"""Page-granular KV eviction: the policy interface and the per-request state.

A sequence under a budget of ``B = kv_budget_tokens // block_size`` blocks keeps at
most ``B`` blocks once its prompt is in (plus, transiently, the blocks of the chunk
a step writes). Evicted blocks go back to the pool at once; the block table becomes
the list of the *kept* blocks, in order::

    logical blocks     0    1    2    3    4    5    6      (block_size 4, B = 4)
    StreamingLLM      [s]   x    x    x   [r]  [r]  [w]     s sink, r recent, w written
    block table       [b0,            b4,  b5,  b6]         = 4 blocks
    compacted index    0               1    2    3

Positions stay true: a kept key was rotated (RoPE) at its own position when it was
written, and new tokens are rotated at theirs; only the *slot* a position maps to
moves: ``slot(p) = table[(p - e) // bs] * bs + (p - e) % bs`` with ``e`` the evicted
tokens (whole blocks; only full, computed blocks are evicted, never the block being
written, so every evicted block lies before the last kept one). Attention runs over
the kept blocks and masks nothing else.

A policy picks which kept blocks to drop (:meth:`EvictionPolicy.select`); the
scheduler calls it before it allocates a step's slots (``scheduler/eviction.py``).
H2O and SnapKV read per-block attention scores that the attention layers accumulate
in the step itself (``layers/attention/scored.py``): the scheduler asks for them
(:meth:`EvictionPolicy.score_from`), the runner returns them, and they are added
into :attr:`EvictionState.scores`, aligned with the block table.

Sources: Xiao et al., "Efficient Streaming Language Models with Attention Sinks"
(ICLR 2024); Zhang et al., "H2O: Heavy-Hitter Oracle" (NeurIPS 2023); Li et al.,
"SnapKV" (2024); NVIDIA kvpress for the presses' scoring rules (token-granular,
prefill-only; ours is block-granular and runs inside continuous batching).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar


@dataclass
class EvictionState:
    """One request's eviction settings and bookkeeping.

    ``budget_blocks``: most kept blocks (``kv_budget_tokens // block_size``).
    ``sink_blocks``: leading blocks StreamingLLM never evicts
    (``ceil(num_sink_tokens / block_size)``). ``window_blocks``: SnapKV's observation
    window / H2O's recent window, in blocks. ``scores[i]``: accumulated attention on
    kept block ``i`` (summed over layers, query heads and scored query rows).
    ``logical``: the logical block index (position // block_size) of each kept block.
    """

    policy: EvictionPolicy
    budget_blocks: int
    sink_blocks: int
    window_blocks: int
    window_tokens: int
    block_size: int
    scores: list[float] = field(default_factory=list)
    logical: list[int] = field(default_factory=list)
    prompt_selected: bool = False  # SnapKV: the one selection over the prompt is done

    def sync(self, num_kept_blocks: int) -> None:
        """Grow ``scores`` / ``logical`` to ``num_kept_blocks`` (new blocks: score 0)."""
        while len(self.logical) < num_kept_blocks:
            self.logical.append(self.logical[-1] + 1 if self.logical else 0)
            self.scores.append(0.0)

    def reset(self) -> None:
        """Forget everything (the request's blocks were all freed: preemption)."""
        self.scores.clear()
        self.logical.clear()
        self.prompt_selected = False

    def add_scores(self, scores: list[float]) -> None:
        """Add one step's per-block scores (aligned with the block table it ran with)."""
        self.sync(len(scores))
        for i, s in enumerate(scores):
            self.scores[i] += s

    def drop(self, indices: list[int]) -> None:
        """Forget the kept blocks at ``indices`` (evicted)."""
        gone = set(indices)
        self.scores = [s for i, s in enumerate(self.scores) if i not in gone]
        self.logical = [b for i, b in enumerate(self.logical) if i not in gone]

    def kept_positions(self, num_tokens: int) -> list[int]:
        """The true positions < ``num_tokens`` held by the kept blocks (for tests)."""
        bs = self.block_size
        return [p for b in self.logical for p in range(b * bs, (b + 1) * bs) if p < num_tokens]


class EvictionPolicy(ABC):
    """Chooses which kept blocks of a sequence to evict. Stateless: per-request state
    lives in :class:`EvictionState`.

    Invariants the scheduler relies on: :meth:`select` returns at most
    ``num_to_evict`` distinct indices, each ``< num_evictable`` (a full, computed
    block that this step does not write).
    """

    name: ClassVar[str]
    needs_scores: ClassVar[bool] = False
    evict_during_prefill: ClassVar[bool] = True  # False: the prompt is computed whole first

    def check(self, state: EvictionState) -> None:
        """Raise ValueError when the budget cannot hold what the policy always keeps."""
        if state.budget_blocks < state.sink_blocks + 2:
            raise ValueError(
                f"kv_budget_tokens must hold at least {state.sink_blocks + 2} blocks of "
                f"{state.block_size} tokens for {self.name} (sinks + one old + the written "
                f"block), got {state.budget_blocks} blocks")

    def score_from(self, state: EvictionState, num_prompt_tokens: int,
                   num_computed_tokens: int, num_new_tokens: int) -> int | None:
        """The first true query position of this step whose attention is accumulated
        into the block scores, or None for no scoring (the default)."""
        return None

    @abstractmethod
    def select(self, state: EvictionState, num_evictable: int, num_to_evict: int,
               num_prompt_tokens: int) -> list[int]:
        """Indices into the block table of the blocks to evict now."""
