"""What :class:`~llmserve.engine.async_llm.AsyncLLM` hands its callers: the output
stream of one request, the request description for ``add_requests``, and the errors
(re-exported by ``llmserve.engine.async_llm``)."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import TYPE_CHECKING

from llmserve.outputs import RequestOutput
from llmserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from llmserve.engine.async_llm import AsyncLLM
    from llmserve.engine.llm_engine import PromptType


class EngineStepError(RuntimeError):
    """An engine step raised; the requests in flight were aborted."""


class EngineShutdownError(RuntimeError):
    """The engine was shut down (or is shutting down); no new requests."""


class EngineDeadError(EngineShutdownError):
    """The engine stopped for good (a tensor-parallel rank died); the server answers 503."""


class EngineOverloadedError(RuntimeError):
    """Admitting the requests would exceed ``max_num_admitted``; nothing was queued."""

    def __init__(self, num_admitted: int, num_requested: int, limit: int) -> None:
        super().__init__(f"{num_admitted} requests are admitted (running or waiting); "
                         f"{num_requested} more would exceed the limit of {limit}")
        self.num_admitted, self.num_requested, self.limit = num_admitted, num_requested, limit


@dataclasses.dataclass
class NewRequest:
    """One request for :meth:`AsyncLLM.add_requests` (fields as in :meth:`AsyncLLM.add_request`)."""

    request_id: str
    prompt: PromptType
    sampling_params: SamplingParams
    priority: int = 0
    arrival_time: float | None = None
    fork_from: str | None = None


def merge_delta(into: RequestOutput, new: RequestOutput) -> RequestOutput:
    """Fold DELTA output ``new`` into ``into`` (same request): texts, token ids and
    logprobs are concatenated; finish state, metrics and ITLs come from ``new``."""
    a, b = into.outputs[0], new.outputs[0]
    a.text += b.text
    a.token_ids = list(a.token_ids) + list(b.token_ids)
    if b.logprobs is not None:
        a.logprobs = (list(a.logprobs) if a.logprobs is not None else []) + list(b.logprobs)
    a.cumulative_logprob = b.cumulative_logprob
    a.finish_reason, a.stop_reason = b.finish_reason, b.stop_reason
    into.finished, into.metrics, into.itl = new.finished, new.metrics, new.itl
    into.num_cached_tokens = max(into.num_cached_tokens, new.num_cached_tokens)
    if new.prompt_logprobs is not None:
        into.prompt_logprobs = new.prompt_logprobs
    return into


class RequestStream:
    """The outputs of one request, in order; an async iterator of DELTA
    :class:`RequestOutput` that stops after the final one (``finished=True``).

    Raises (from ``__anext__``):
        EngineStepError / EngineShutdownError: the engine failed or stopped the request.
    """

    def __init__(self, request_id: str, owner: AsyncLLM, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.loop = loop
        self._owner = owner
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False

    def _put(self, item: RequestOutput | BaseException) -> None:  # on self.loop
        self._queue.put_nowait(item)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished and self._queue.empty():
            raise StopAsyncIteration
        item = await self._queue.get()
        while isinstance(item, RequestOutput) and not item.finished and not self._queue.empty():
            nxt = self._queue.get_nowait()
            if isinstance(nxt, BaseException):
                item = nxt
                break
            item = merge_delta(item, nxt)
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def abort(self) -> None:
        """Abort the request in the engine (frees its KV blocks); no-op once finished."""
        if not self.finished:
            self.finished = True
            self._owner._submit_abort([self.request_id])
