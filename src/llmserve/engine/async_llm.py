"""AsyncLLM: the engine for asyncio servers.

One background thread owns the :class:`LLMEngine` (which is not thread-safe) and is
the only code that touches it::

    asyncio tasks (any loop)            engine thread
    ------------------------            -------------
    add_request / abort  --commands-->  drain commands (add, abort) between steps
                                        step() while there is work; sleep on a
                                        condition variable when idle (no polling)
    RequestStream.queue  <--outputs---  one loop.call_soon_threadsafe per step and
                                        event loop, carrying that step's outputs

Outputs are DELTA (each carries only the new text, tokens and logprobs); a stream
merges deltas that piled up while its consumer was busy. A consumer that stops
iterating (client disconnect -> generator closed or cancelled) aborts its request,
which frees its KV blocks at once.

Admission: every request id is *admitted* from the moment :meth:`AsyncLLM.add_requests`
accepts it (synchronously, under one lock, before any ``await``) until it leaves the
engine: its final output is published, the engine rejected it, it was aborted, or a
failed step or shutdown ended it. ``num_admitted`` is that one count, so a caller that
passes ``max_num_admitted`` gets an exact bound on running + waiting + not-yet-queued
requests, whatever the concurrency. Validation errors (bad prompt, prompt too long)
come back from :meth:`AsyncLLM.add_request` as ``ValueError`` with the engine's
message, before any output. An exception inside a step is logged, fails the
requests in flight with :class:`EngineStepError`, and the loop goes on.

Modelled on vLLM's ``AsyncLLM`` (``vllm/v1/engine/async_llm.py``), with a thread
instead of a separate engine-core process.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from llmserve.distributed.multiproc import RankFailedError
from llmserve.engine.arg_utils import EngineArgs
from llmserve.engine.llm_engine import LLMEngine, PromptType
from llmserve.engine.output_processor import RequestOutputKind
from llmserve.engine.request_stream import (
    EngineDeadError,
    EngineOverloadedError,
    EngineShutdownError,
    EngineStepError,
    NewRequest,
    RequestStream,
    merge_delta,
)
from llmserve.metrics.stats import EngineStatsSnapshot, IterationStats, StatLogger
from llmserve.outputs import RequestOutput
from llmserve.sampling_params import SamplingParams

__all__ = ["AsyncLLM", "EngineDeadError", "EngineOverloadedError", "EngineShutdownError", "EngineStepError",
           "NewRequest", "RequestStream", "merge_delta"]

logger = logging.getLogger("llmserve.async_llm")

IDLE_STEP_BACKOFF_S = 0.005  # pause when requests exist but a step could schedule none


class AsyncLLM:
    """Asyncio front of an :class:`LLMEngine` stepped by one background thread.

    Args:
        engine: a built engine; this object owns it from now on.
        stat_loggers: called on the engine thread with :class:`IterationStats` after
            every iteration (e.g. the Prometheus exporter).
    """

    def __init__(self, engine: LLMEngine, stat_loggers: Sequence[StatLogger] = ()) -> None:
        self.engine = engine
        self.stat_loggers = list(stat_loggers)
        self._cv = threading.Condition()
        self._commands: list[tuple[str, Any]] = []  # guarded by _cv
        self._stopping = False  # guarded by _cv
        self.fatal_error: BaseException | None = None  # why the engine died, if it did
        self.on_fatal_error: Any = None  # called (engine thread) with that error
        self._streams: dict[str, RequestStream] = {}  # guarded by _streams_lock
        self._admitted: set[str] = set()  # ids accepted and not yet ended; _streams_lock
        self._streams_lock = threading.Lock()
        self._stats = EngineStatsSnapshot()
        self._max_num_seqs = engine.config.scheduler_config.max_num_seqs
        self._num_pending_adds = 0  # guarded by _cv
        self._thread = threading.Thread(target=self._run, name="llmserve-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(cls, args: EngineArgs,
                         stat_loggers: Sequence[StatLogger] = ()) -> AsyncLLM:
        """Load the model (blocking, seconds) and start the engine thread.

        Raises:
            ValueError: for a bad option or a model that cannot be loaded.
        """
        return cls(LLMEngine.from_engine_args(args), stat_loggers)

    # ------------------------------------------------------------------ properties
    tokenizer = property(lambda self: self.engine.tokenizer)
    max_model_len = property(lambda self: self.engine.max_model_len)
    is_running = property(lambda self: self._thread.is_alive() and not self._stopping)
    max_num_seqs = property(lambda self: self._max_num_seqs)

    @property
    def num_admitted(self) -> int:
        """Requests accepted by :meth:`add_requests` that have not left the engine yet
        (queued for the engine thread, waiting or running)."""
        with self._streams_lock:
            return len(self._admitted)

    def get_stats(self) -> EngineStatsSnapshot:
        """The latest snapshot; ``num_waiting_reqs`` includes the adds not yet taken by the
        engine thread that will not fit in the running batch (``max_num_seqs``): a request
        that arrives while a slot is free is not waiting, however fast the thread is."""
        s = self._stats
        pending = self._num_pending_adds
        if not pending:
            return s
        free = max(0, self._max_num_seqs - s.num_running_reqs - s.num_waiting_reqs)
        return dataclasses.replace(s, num_waiting_reqs=s.num_waiting_reqs
                                   + max(0, pending - free))

    # ------------------------------------------------------------------ requests
    async def add_request(self, request_id: str, prompt: PromptType,
                          sampling_params: SamplingParams, priority: int = 0,
                          arrival_time: float | None = None,
                          fork_from: str | None = None) -> RequestStream:
        """Queue a request in the engine; returns its output stream once accepted.

        Args:
            prompt: a string or ``{"prompt_token_ids": [...], "prompt": text}``.
            arrival_time: ``time.time()`` when the request arrived (default: now); TTFT
                and queue time are measured from it.
            fork_from: a request with the same prompt to share the prompt KV with
                (``n > 1``; see :meth:`LLMEngine.add_request`).

        Raises:
            ValueError: the engine's validation message (empty prompt, prompt longer
                than ``max_model_len`` or the KV cache, bad token ids, duplicate id).
            EngineShutdownError: after :meth:`shutdown`.
        """
        streams = await self.add_requests([NewRequest(request_id, prompt, sampling_params,
                                                      priority, arrival_time, fork_from)])
        return streams[0]

    async def add_requests(self, requests: Sequence[NewRequest],
                           max_num_admitted: int | None = None) -> list[RequestStream]:
        """Admit several requests at once (all or none) and queue them; returns their
        streams, in order, once the engine accepted every one.

        The admission check and the registration happen before the first ``await``,
        under one lock: with ``max_num_admitted`` the requests are admitted only if
        ``num_admitted + len(requests) <= max_num_admitted``.

        Raises:
            EngineOverloadedError: the limit would be exceeded (nothing was queued).
            ValueError: a duplicate id, or the engine's validation message for one of
                them (the others are then aborted).
            EngineShutdownError: after :meth:`shutdown`.
        """
        loop = asyncio.get_running_loop()
        ids = [r.request_id for r in requests]
        if len(set(ids)) != len(ids):
            raise ValueError("request ids must be unique")
        with self._streams_lock:
            in_use = [rid for rid in ids if rid in self._admitted or rid in self._streams]
            if in_use:
                raise ValueError(f"request_id {in_use[0]!r} is already in use")
            if max_num_admitted is not None \
                    and len(self._admitted) + len(ids) > max_num_admitted:
                raise EngineOverloadedError(len(self._admitted), len(ids), max_num_admitted)
            streams = [RequestStream(rid, self, loop) for rid in ids]
            self._streams.update(zip(ids, streams))
            self._admitted.update(ids)
        futures: list[asyncio.Future[None]] = [loop.create_future() for _ in requests]
        now = time.time()
        with self._cv:
            if self._stopping:
                self._release(ids, unregister=True)
                raise EngineShutdownError("the engine is shutting down")
            for r, fut in zip(requests, futures):
                arrival = now if r.arrival_time is None else r.arrival_time
                self._commands.append(("add", (r.request_id, r.prompt, r.sampling_params,
                                               r.priority, arrival, fut, r.fork_from)))
            self._num_pending_adds += len(requests)
            self._cv.notify()
        try:
            results = await asyncio.gather(*futures, return_exceptions=True)
        except asyncio.CancelledError:
            for stream in streams:
                stream.abort()
            raise
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            for stream in streams:
                stream.abort()  # no-op for the rejected ones: the engine never had them
            raise errors[0]
        return streams

    async def generate(self, prompt: PromptType, sampling_params: SamplingParams,
                       request_id: str, priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Add a request and yield its DELTA outputs until it finishes.

        The ``ValueError`` of a rejected request is raised by the first ``__anext__``,
        before any output. Closing or cancelling the generator aborts the request.
        """
        stream = await self.add_request(request_id, prompt, sampling_params, priority)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    async def abort(self, request_id: str | Sequence[str]) -> None:
        """Abort requests (unknown or finished ids are ignored); their streams end
        with a ``finish_reason="abort"`` output."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        self._submit_abort(ids, keep_streams=True)

    def abort_all(self) -> int:
        """Abort every request in flight (thread-safe, non-blocking); each stream ends
        with a ``finish_reason="abort"`` output. Returns how many were aborted."""
        with self._streams_lock:
            ids = list(self._streams)
        if ids:
            self._submit_abort(ids, keep_streams=True)
        return len(ids)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort every request (streams end with ``abort`` outputs), stop the thread.

        Args:
            timeout: seconds to wait for the engine thread to finish its current step.
        """
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)
        with contextlib.suppress(Exception):  # tensor-parallel worker processes
            self.engine.shutdown()
        store = getattr(self.engine, "kv_store", None)
        if store is not None:  # finish the queued KV store writes
            store.close()

    # ------------------------------------------------------------------ internals
    def _submit_abort(self, request_ids: list[str], keep_streams: bool = False) -> None:
        """Queue an abort; ``keep_streams`` delivers the final ``abort`` outputs to the
        streams, else the streams are dropped at once (their consumer is gone)."""
        if not keep_streams:
            for rid in request_ids:
                self._unregister(rid)
        with self._cv:
            self._commands.append(("abort", request_ids))
            self._cv.notify()

    def _unregister(self, request_id: str) -> RequestStream | None:
        with self._streams_lock:
            return self._streams.pop(request_id, None)

    def _release(self, request_ids: Sequence[str], unregister: bool = False) -> None:
        """These requests left the engine (or never entered it): no longer admitted."""
        with self._streams_lock:
            self._admitted.difference_update(request_ids)
            if unregister:
                for rid in request_ids:
                    self._streams.pop(rid, None)

    def _run(self) -> None:
        """The engine thread: wait for work, apply commands, step, publish."""
        engine = self.engine
        idle_step = False
        while True:
            with self._cv:
                while not self._commands and not self._stopping \
                        and not engine.has_unfinished_requests():
                    self._cv.wait()
                if idle_step and not self._commands and not self._stopping:
                    self._cv.wait(IDLE_STEP_BACKOFF_S)  # work exists but none could run
                commands, self._commands = self._commands, []
                stopping = self._stopping
            outputs: list[RequestOutput] = []
            try:
                idle_step = self._iteration(commands, stopping, outputs)
            except RankFailedError as e:  # a tensor-parallel rank is gone: stop for good
                self._die(e, outputs)
                return
            except Exception as e:  # never let one bad step or command kill the loop
                logger.exception("engine iteration failed; aborting the requests in flight")
                self._abort_all(outputs, EngineStepError(f"engine step failed: {e!r}"),
                                as_error=True)
                self._publish(outputs, False)
                idle_step = False
            if stopping:
                return

    def _die(self, error: RankFailedError, outputs: list[RequestOutput]) -> None:
        """Fail every request with :class:`EngineDeadError` (503), stop accepting work,
        stop the other ranks, then call ``on_fatal_error`` (the server exits non-zero)."""
        logger.error("the engine died: %s", error)
        self.fatal_error = error
        with self._cv:
            self._stopping = True
            commands, self._commands = self._commands, []
        for kind, payload in commands:  # adds queued meanwhile: refused (503), never lost
            if kind == "add":
                self._apply_add(payload, True)
        self._abort_all(outputs, EngineDeadError(f"the engine died: {error}"), as_error=True)
        self._publish(outputs, False)
        with contextlib.suppress(Exception):
            self.engine.shutdown()
        if self.on_fatal_error is not None:
            self.on_fatal_error(error)

    def _iteration(self, commands: list[tuple[str, Any]], stopping: bool,
                   outputs: list[RequestOutput]) -> bool:
        """Apply commands, run one step; returns True when there was work but the
        step scheduled nothing."""
        engine = self.engine
        for kind, payload in commands:
            if kind == "add":
                self._apply_add(payload, stopping)
            else:
                outputs.extend(engine.abort_request(payload))
        if stopping:
            self._abort_all(outputs, EngineShutdownError("the engine was shut down"),
                            as_error=False)
            self._publish(outputs, False)
            return False
        steps_before = engine.scheduler.stats.num_steps_total
        had_work = engine.has_unfinished_requests()
        if had_work:
            outputs.extend(engine.step())
        ran = engine.scheduler.stats.num_steps_total != steps_before
        self._publish(outputs, ran)
        return had_work and not ran and not outputs

    def _apply_add(self, payload: tuple, stopping: bool) -> None:
        request_id, prompt, params, priority, arrival, accepted, fork_from = payload
        error: BaseException | None = None
        if stopping:
            error = EngineShutdownError("the engine is shutting down")
        else:
            try:
                self.engine.add_request(request_id, prompt, params, RequestOutputKind.DELTA,
                                        arrival_time=arrival, priority=priority,
                                        fork_from=fork_from)
            except Exception as e:  # ValueError: validation; anything else: a bug
                error = e
        with self._cv:
            self._num_pending_adds -= 1
        if error is not None:
            self._release([request_id], unregister=True)
        try:
            accepted.get_loop().call_soon_threadsafe(_resolve, accepted, error)
        except RuntimeError:  # the consumer's event loop is closed
            if error is None:
                self.engine.abort_request(request_id)
                self._release([request_id], unregister=True)

    def _abort_all(self, outputs: list[RequestOutput], error: BaseException,
                   as_error: bool) -> None:
        """Abort every request in flight. Each open stream then gets ``error`` when
        ``as_error`` (or when the engine had no output for it), else its final
        ``abort`` output (appended to ``outputs`` and delivered by :meth:`_publish`)."""
        with self._streams_lock:
            ids = list(dict.fromkeys(list(self.engine.scheduler.requests) + list(self._streams)))
        aborted: list[RequestOutput] = []
        try:
            aborted = self.engine.abort_request(ids)
        except Exception:
            logger.exception("aborting the requests in flight failed")
        outputs.extend(aborted)
        with self._streams_lock:
            self._admitted.difference_update(ids)
            self._admitted.difference_update(o.request_id for o in aborted if o.finished)
            has_output = {o.request_id for o in aborted} if not as_error else set()
            failed = [s for rid, s in self._streams.items() if rid not in has_output]
            for s in failed:
                del self._streams[s.request_id]
        self._deliver([(s, error) for s in failed])

    def _publish(self, outputs: list[RequestOutput], ran_step: bool) -> None:
        """Send outputs to their streams, refresh the stats, call the stat loggers."""
        items = []
        with self._streams_lock:
            for out in outputs:
                if out.finished:  # it left the engine: no longer admitted
                    self._admitted.discard(out.request_id)
                stream = self._streams.get(out.request_id)
                if stream is None:
                    continue
                if out.finished:
                    del self._streams[out.request_id]
                items.append((stream, out))
        self._deliver(items)
        sched = self.engine.scheduler
        st = sched.stats
        self._stats = EngineStatsSnapshot(
            num_running_reqs=len(sched.running), num_waiting_reqs=len(sched.waiting),
            kv_cache_usage=sched.kv_cache_manager.usage,
            num_preemptions_total=st.num_preemptions_total, num_steps_total=st.num_steps_total,
            max_batch_size_seen=st.max_batch_size_seen,
            prefix_cache_queries_total=st.prefix_cache_queries_total,
            prefix_cache_hits_total=st.prefix_cache_hits_total,
            kv_store_hits_total=st.kv_store_hits_total,
            spec_decoding=(self.engine.spec_decoding_stats.as_dict()
                           if self.engine.spec_decoding_stats is not None else None))
        if not self.stat_loggers:
            return
        it = IterationStats(self._stats, outputs,
                            st.last_step_num_reqs if ran_step else 0,
                            st.last_step_num_tokens if ran_step else 0)
        for stat_logger in self.stat_loggers:
            try:
                stat_logger.record(it)
            except Exception:
                logger.exception("stat logger %r failed", stat_logger)

    @staticmethod
    def _deliver(items: list[tuple[RequestStream, RequestOutput | BaseException]]) -> None:
        """One ``call_soon_threadsafe`` per event loop for the whole batch."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for stream, item in items:
            by_loop.setdefault(stream.loop, []).append((stream, item))
        for loop, batch in by_loop.items():
            with contextlib.suppress(RuntimeError):  # loop closed: nobody listens any more
                loop.call_soon_threadsafe(_put_all, batch)


def _put_all(batch: list[tuple[RequestStream, RequestOutput | BaseException]]) -> None:
    for stream, item in batch:
        stream._put(item)


def _resolve(fut: asyncio.Future, error: BaseException | None) -> None:
    if fut.done():
        return
    if error is None:
        fut.set_result(None)
    else:
        fut.set_exception(error)
