"""User-facing results of generation (vLLM's ``RequestOutput`` shape)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """Log-probability of one token (natural log), its 1-based rank in the
    model's distribution and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per generated position: token id -> Logprob (the sampled token and the top-n).
SampleLogprobs = list[dict[int, Logprob]]
# One per prompt position (vLLM): None for the first token, then token id -> Logprob
# (the prompt token and the top-n).
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    """One generated sequence.

    ``finish_reason``: ``"stop"`` (EOS, a stop token or string), ``"length"``
    (max_tokens or the context length), ``"abort"``, or None while running.
    ``stop_reason``: the stop string or stop token id that ended it, if any.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (seconds since the epoch, ``time.time()``).

    TTFT = ``first_token_time - arrival_time``; E2E = ``finished_time - arrival_time``.
    """

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def time_in_queue(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time


@dataclass
class RequestOutput:
    """State of one request after a step (or at the end, with ``finished=True``)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    itl: list[float] = field(default_factory=list)  # every gap between tokens, s (final output only)
    # SamplingParams.prompt_logprobs: one entry per prompt token (the first None); None
    # when not asked for (or not computable, as for forked n > 1 siblings). DELTA outputs
    # carry it once, in the first output.
    prompt_logprobs: PromptLogprobs | None = None

    def __repr__(self) -> str:
        texts = [o.text[:40] for o in self.outputs]
        return f"RequestOutput(request_id={self.request_id!r}, finished={self.finished}, texts={texts!r})"
