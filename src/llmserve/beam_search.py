"""Beam search on top of the engine, as vLLM's ``LLM.beam_search``.

Each step asks the engine for one token of every live beam with the top
``2 * beam_width`` logprobs, expands every beam by those candidates, and
keeps the ``beam_width`` best by score. Beams share their common prefix KV
through automatic prefix caching: a step recomputes at most the last,
partial block of each beam.

Score (vLLM's ``get_beam_search_score``, Hugging Face's length penalty)::

    score = cumulative_logprob / (sequence_length ** length_penalty)

with ``sequence_length`` counting prompt and generated tokens (minus a final
EOS). Without EOS all live beams have the same length, so the search keeps
the top beams by cumulative logprob, exactly as transformers' beam search.
Source: vLLM ``vllm/beam_search.py``; Hugging Face ``generate(num_beams=...)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llmserve.sampling_params import MAX_LOGPROBS


@dataclass(frozen=True)
class BeamSearchParams:
    """``beam_width`` beams, at most ``max_tokens`` new tokens each.

    Raises:
        ValueError: naming the field (beam_width must be in [1, MAX_LOGPROBS // 2]).
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.beam_width, bool) or not isinstance(self.beam_width, int) \
                or not 1 <= self.beam_width <= MAX_LOGPROBS // 2:
            raise ValueError(f"beam_width must be an integer in [1, {MAX_LOGPROBS // 2}], "
                             f"got {self.beam_width!r}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) \
                or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.length_penalty, (int, float)):
            raise ValueError(f"length_penalty must be a number, got {self.length_penalty!r}")


@dataclass
class BeamSearchSequence:
    """One beam: all its tokens (prompt included), the generated tokens' logprobs,
    their sum, and the decoded text of the generated part."""

    tokens: list[int]
    logprobs: list[float] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finished: bool = False


@dataclass
class BeamSearchOutput:
    """The ``beam_width`` best sequences of one prompt, best first."""

    sequences: list[BeamSearchSequence]


def beam_search_score(tokens: list[int], cum_logprob: float, eos_token_ids: tuple[int, ...],
                      length_penalty: float) -> float:
    """Length-penalized score (higher is better)."""
    seq_len = len(tokens)
    if tokens and tokens[-1] in eos_token_ids:
        seq_len -= 1
    return cum_logprob / (seq_len ** length_penalty)
