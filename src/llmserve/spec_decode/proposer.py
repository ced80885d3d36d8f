"""The proposer interface and the n-gram proposer.

A proposer drafts up to ``k`` tokens for each request that has just emitted a
token; the scheduler gives them to the target as extra tokens of the request's
next decode. Invariants every proposer keeps:

- ``propose`` returns, per request, at most its ``k`` tokens (fewer or none is fine);
- when ``needs_draft_probs`` it also records, for those drafts, the distribution
  ``q`` each was sampled from (``[k_i, V]``, the request's temperature/top-k/top-p/
  min-p applied), returned by :meth:`draft_probs`; otherwise drafts count as
  deterministic (``q`` one-hot);
- a proposer that writes KV of its own at the drafted positions asks the scheduler
  for ``num_lookahead_tokens`` extra slots after each verified run.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

from llmserve.spec_decode.config import SpeculativeConfig
from llmserve.spec_decode.ngram import ngram_propose

if TYPE_CHECKING:
    import torch

    from llmserve.scheduler.output import SchedulerOutput
    from llmserve.worker.model_runner import CachedRequestState, ModelRunner


class Proposer(ABC):
    """Drafts tokens for speculative decoding (see the module docstring)."""

    needs_draft_probs: bool = False
    num_lookahead_tokens: int = 0
    # True after a ``propose`` that also caught up on a prompt (a draft model's prefill):
    # its time is not a draft position's cost (the adaptive policy's fit skips it)
    last_propose_prefilled: bool = False

    def begin_step(self, runner: ModelRunner, sched: SchedulerOutput) -> None:
        """Called once per step after the runner updated its request states, before
        the KV ops and the forward pass (drop finished requests, reset preempted ones)."""
        return None

    def apply_kv_cache_ops(self, ops: list[tuple[str, int, int]]) -> None:
        """Mirror the target's block copies on the proposer's own KV cache, if any."""
        return None

    @abstractmethod
    def propose(self, states: list[CachedRequestState], num_drafts: list[int]
                ) -> list[list[int]]:
        """Up to ``num_drafts[i]`` tokens to follow ``states[i].token_ids``."""

    def draft_probs(self, req_id: str, num: int) -> torch.Tensor | None:
        """``[num, V]`` float32: the ``q`` of the first ``num`` drafts proposed last for
        ``req_id`` (None for deterministic proposers)."""
        return None


class NgramProposer(Proposer):
    """Prompt lookup over the request's own tokens (:func:`ngram_propose`)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose(self, states, num_drafts):
        return [ngram_propose(s.token_ids, self.min_n, self.max_n, k) if k > 0 else []
                for s, k in zip(states, num_drafts)]
