"""Turns the engine core's token outputs into :class:`RequestOutput` objects:
incremental detokenization, stop strings, logprobs and request metrics."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from llmserve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from llmserve.sampling_params import SamplingParams
from llmserve.scheduler.output import EngineCoreOutput
from llmserve.tokenizer import IncrementalDetokenizer


class RequestOutputKind(enum.Enum):
    """What each RequestOutput carries (vLLM semantics)."""

    CUMULATIVE = 0  # everything so far, every step
    DELTA = 1  # only what is new since the last output, every step
    FINAL_ONLY = 2  # one output, when the request finishes


@dataclass
class ParentRequest:
    """An ``n > 1`` request: n child sequences reported as one RequestOutput
    whose ``outputs`` are indexed 0..n-1 (vLLM's ``ParentRequest``)."""

    request_id: str
    n: int
    child_ids: list[str]
    done: dict[int, CompletionOutput] = field(default_factory=dict)
    prompt_logprobs: list | None = None  # from the sibling that computed the prompt


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    output_kind: RequestOutputKind
    metrics: RequestMetrics
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    sent_tokens: int = 0
    sent_logprobs: int = 0
    itl: list[float] = field(default_factory=list)
    num_cached_tokens: int = 0
    parent: ParentRequest | None = None
    index: int = 0
    prompt_logprobs: list | None = None  # PromptLogprobs once computed
    sent_prompt_logprobs: bool = False


class OutputProcessor:
    """Per-request detokenization and output assembly.

    Args:
        tokenizer: a Hugging Face tokenizer (used for text and logprob tokens).
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, output_kind: RequestOutputKind,
                    arrival_time: float, parent: ParentRequest | None = None,
                    index: int = 0) -> None:
        detok = IncrementalDetokenizer(
            self.tokenizer, prompt_token_ids,
            skip_special_tokens=params.skip_special_tokens,
            spaces_between_special_tokens=params.spaces_between_special_tokens,
            stop=params.stop, include_stop_str_in_output=params.include_stop_str_in_output,
            min_tokens=params.min_tokens)
        self.states[request_id] = RequestState(
            request_id, prompt, prompt_token_ids, params, detok, output_kind,
            RequestMetrics(arrival_time=arrival_time),
            logprobs=[] if params.logprobs is not None else None,
            cumulative_logprob=0.0 if params.logprobs is not None else None,
            parent=parent, index=index)

    def has_request(self, request_id: str) -> bool:
        return request_id in self.states

    def process(self, outputs: list[EngineCoreOutput],
                first_scheduled: dict[str, float]) -> tuple[list[RequestOutput], list[str]]:
        """Apply one step's outputs.

        Returns:
            (request outputs to emit, request ids that a stop string finished
            and that the engine core must now stop).
        """
        now = time.time()
        results: list[RequestOutput] = []
        stopped_by_string: list[str] = []
        for co in outputs:
            st = self.states.get(co.req_id)
            if st is None:
                continue
            m = st.metrics
            if m.first_scheduled_time is None:
                m.first_scheduled_time = first_scheduled.get(co.req_id)
            if m.first_token_time is None:
                m.first_token_time = now
            elif m.last_token_time is not None:
                st.itl.append(now - m.last_token_time)
            m.last_token_time = now
            st.num_cached_tokens = co.num_cached_tokens
            finish_reason, stop_reason = co.finish_reason, co.stop_reason
            new_ids, stop_str, cut = self._detokenize(st, co)
            if cut:  # a stop string inside a speculative run: it ends there
                finish_reason = None
            st.token_ids.extend(new_ids)
            if co.new_logprobs is not None and st.logprobs is not None:
                self._add_logprobs(st, co.new_logprobs)
            if co.extra.get("prompt_logprobs") is not None:
                st.prompt_logprobs = self._prompt_logprobs(co.extra["prompt_logprobs"])
            if stop_str is not None and finish_reason != "stop":
                if finish_reason is None:
                    stopped_by_string.append(co.req_id)
                finish_reason, stop_reason = "stop", stop_str
            out = self._make_output(st, finish_reason, stop_reason, now)
            if out is not None and st.parent is not None:
                out = self._to_parent_output(st, out)
            if out is not None:
                results.append(out)
            if finish_reason is not None:
                del self.states[co.req_id]
        return results, stopped_by_string

    @staticmethod
    def _detokenize(st: RequestState, co: EngineCoreOutput) -> tuple[list[int], str | None, bool]:
        """Feed the new tokens to the detokenizer. Returns (tokens kept, stop string, whether
        a stop string cut a multi-token (speculative) run before its last token).

        An EOS / stop token id ends the text without showing (vLLM semantics). Several
        tokens are checked one by one so a stop string ends the output where plain
        decoding would have."""
        ids = co.new_token_ids
        eos_end = co.finish_reason == "stop"
        if len(ids) == 1 or not st.detokenizer.stop:
            return ids, st.detokenizer.update(ids, stop_terminated=eos_end), False
        for j, t in enumerate(ids):
            last = j == len(ids) - 1
            stop_str = st.detokenizer.update([t], stop_terminated=last and eos_end)
            if stop_str is not None:
                return ids[:j + 1], stop_str, not last
        return ids, None, False

    def abort(self, request_id: str, finish_reason: str = "abort") -> RequestOutput | None:
        """End a request from outside; returns its final output (``finish_reason``:
        ``abort``, or ``length`` when the KV cache cannot hold it any longer)."""
        st = self.states.pop(request_id, None)
        if st is None:
            return None
        out = self._make_output(st, finish_reason, None, time.time(), force=True)
        return self._to_parent_output(st, out) if st.parent is not None else out

    @staticmethod
    def _to_parent_output(st: RequestState, out: RequestOutput) -> RequestOutput | None:
        """Report a child sequence under its parent's id, index and completion state."""
        parent = st.parent
        completion = out.outputs[0]
        completion.index = st.index
        out.request_id = parent.request_id
        if out.prompt_logprobs is not None:
            parent.prompt_logprobs = out.prompt_logprobs
        elif st.output_kind != RequestOutputKind.DELTA:
            out.prompt_logprobs = parent.prompt_logprobs
        if out.finished:
            parent.done[st.index] = completion
        all_done = len(parent.done) == parent.n
        if st.output_kind == RequestOutputKind.FINAL_ONLY:
            if not all_done:
                return None
            out.outputs = [parent.done[i] for i in range(parent.n)]
        out.finished = all_done
        return out

    def _entry(self, ids: list[int], lps: list[float], rank: int) -> dict[int, Logprob]:
        entry: dict[int, Logprob] = {}
        for j, (tid, lp) in enumerate(zip(ids, lps)):
            if tid in entry:
                continue
            entry[tid] = Logprob(lp, rank if j == 0 else j,
                                 self.tokenizer.decode([tid], skip_special_tokens=False))
        return entry

    def _add_logprobs(self, st: RequestState, new: tuple[list[int], list[float], int]) -> None:
        ids, lps, rank = new
        st.logprobs.append(self._entry(ids, lps, rank))
        st.cumulative_logprob += lps[0]

    def _prompt_logprobs(self, raw: list) -> list:
        """Runner entries of prompt tokens 1..P-1 -> PromptLogprobs (first None)."""
        return [None] + [self._entry(ids, lps, rank) for ids, lps, rank in raw]

    def _make_output(self, st: RequestState, finish_reason: str | None,
                     stop_reason: int | str | None, now: float,
                     force: bool = False) -> RequestOutput | None:
        finished = finish_reason is not None
        if finished:
            st.metrics.finished_time = now
        kind = st.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not finished and not force:
            return None
        delta = kind == RequestOutputKind.DELTA
        text = st.detokenizer.get_next_output_text(finished, delta)
        if delta:
            token_ids = st.token_ids[st.sent_tokens:]
            logprobs = st.logprobs[st.sent_logprobs:] if st.logprobs is not None else None
            st.sent_tokens = len(st.token_ids)
            st.sent_logprobs = len(st.logprobs) if st.logprobs is not None else 0
        else:
            token_ids = list(st.token_ids)
            logprobs = list(st.logprobs) if st.logprobs is not None else None
        completion = CompletionOutput(
            index=0, text=text, token_ids=token_ids, cumulative_logprob=st.cumulative_logprob,
            logprobs=logprobs, finish_reason=finish_reason, stop_reason=stop_reason)
        prompt_logprobs = st.prompt_logprobs
        if delta:
            prompt_logprobs = None if st.sent_prompt_logprobs else prompt_logprobs
            st.sent_prompt_logprobs = st.sent_prompt_logprobs or prompt_logprobs is not None
        return RequestOutput(st.request_id, st.prompt, st.prompt_token_ids, [completion],
                             finished, st.metrics, num_cached_tokens=st.num_cached_tokens,
                             itl=list(st.itl) if finished else [],  # once, not O(n^2)
                             prompt_logprobs=prompt_logprobs)
