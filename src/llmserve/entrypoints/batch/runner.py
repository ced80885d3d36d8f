"""Runs a batch through the OpenAI handlers of the server, many requests in flight.

Each request goes through the same :class:`OpenAIServingCompletion` /
:class:`OpenAIServingChat` code as ``POST /v1/...`` (same validation, same outputs),
and up to ``max_in_flight`` of them are in the engine at once, so the engine's
continuous batching runs them together (as ``llmserve bench throughput``), not one at
a time. Finished results go to the :class:`CheckpointStore` at once; what is already
there is skipped. ``stop`` (a SIGTERM, a cancel) stops new requests; those in flight
get ``grace_s`` seconds to finish, then are aborted (and run again on resume).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from llmserve.entrypoints.batch.batch_format import BatchItem, result_line
from llmserve.entrypoints.batch.checkpoint import CheckpointStore

logger = logging.getLogger("llmserve.batch")
RETRY_503_S = 1.0  # a 503 (overloaded, loading) is retried after this many seconds
Executor = Callable[[BatchItem], Awaitable[tuple[int | None, dict | None, dict | None]]]


class _NeverDisconnects:
    """The ``raw_request`` the handlers watch for a client disconnect: a batch has no
    client to lose."""

    async def receive(self) -> dict:
        await asyncio.Event().wait()
        return {"type": "http.disconnect"}  # never reached


def handler_executor(completion: Any, chat: Any) -> Executor:
    """An executor over the server's handlers: ``(status, body, error)`` per item. A
    503 is not a result: the request is retried every :data:`RETRY_503_S` seconds."""
    from llmserve.entrypoints.openai.serving_engine import APIError, bad_request
    from llmserve.protocol import validation_message
    from llmserve.protocol.openai import ChatCompletionRequest, CompletionRequest

    async def run(item: BatchItem) -> tuple[int | None, dict | None, dict | None]:
        chat_url = item.url == "/v1/chat/completions"
        try:
            if item.body.get("stream"):
                raise bad_request("stream is not supported in a batch", "stream")
            model = ChatCompletionRequest if chat_url else CompletionRequest
            try:
                req = model.model_validate(item.body)
            except ValidationError as e:
                message, param = validation_message(e.errors())
                raise bad_request(message, param) from None
            handler = chat.create_chat_completion if chat_url else completion.create_completion
            while True:
                try:
                    resp = await handler(req, _NeverDisconnects())
                    return resp.status_code, json.loads(resp.body), None
                except APIError as e:
                    if e.status != 503:
                        raise
                    # overloaded or shutting down: a batch waits instead of failing the
                    # line (a stop or cancel ends the wait; the line runs on resume)
                    await asyncio.sleep(RETRY_503_S)
        except APIError as e:
            return e.status, e.body(), None

    return run


@dataclass
class RunResult:
    """What one run did: ``skipped`` (already in the checkpoint), ``finished`` now,
    ``submitted`` to the engine, ``unfinished`` (stopped before finishing), and
    ``stopped`` (a stop was requested)."""

    total: int
    skipped: int
    submitted: int = 0
    finished: int = 0
    unfinished: int = 0
    stopped: bool = False


async def run_batch(items: Sequence[BatchItem], execute: Executor, store: CheckpointStore,
                    max_in_flight: int, stop: asyncio.Event | None = None,
                    grace_s: float = 30.0, on_result: Callable[[bool], None] | None = None,
                    abort: asyncio.Event | None = None) -> RunResult:
    """Run every item not yet in ``store``; see the module docstring.

    Args:
        max_in_flight: most requests in the engine at once (>= 1).
        on_result: called with ``ok`` after each stored result (a progress bar).
        abort: once set (with ``stop``), requests in flight are aborted at once instead
            of getting ``grace_s`` (a cancelled batch).

    Raises:
        ValueError: ``max_in_flight`` < 1 or ``grace_s`` < 0.
    """
    if max_in_flight < 1:
        raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
    if grace_s < 0:
        raise ValueError(f"grace period must be >= 0 s, got {grace_s}")
    stop = stop or asyncio.Event()
    done = store.done()
    todo = [it for it in items if it.custom_id not in done]
    result = RunResult(total=len(items), skipped=len(items) - len(todo))
    slots = asyncio.Semaphore(max_in_flight)
    tasks: set[asyncio.Task] = set()

    async def one(item: BatchItem) -> None:
        try:
            try:
                status, body, error = await execute(item)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a bug: keep the batch going, report the line
                logger.exception("batch request %s failed", item.custom_id)
                status, body, error = None, None, {"code": "internal_error",
                                                   "message": f"{type(e).__name__}: {e}"}
            ok = status is not None and 200 <= status < 300
            if store.add(item.custom_id, item.index, ok, result_line(item, status, body,
                                                                     error)):
                result.finished += 1
                if on_result is not None:
                    on_result(ok)
        finally:
            slots.release()

    stop_wait = asyncio.ensure_future(stop.wait())
    try:
        for item in todo:
            acquire = asyncio.ensure_future(slots.acquire())
            await asyncio.wait({acquire, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
            if stop.is_set():
                if acquire.done():
                    slots.release()
                else:
                    acquire.cancel()
                break
            result.submitted += 1
            task = asyncio.create_task(one(item))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        while tasks and not stop.is_set():
            await asyncio.wait(set(tasks) | {stop_wait}, return_when=asyncio.FIRST_COMPLETED)
        if stop.is_set():
            result.stopped = True
            if tasks:
                logger.warning("stopping: %d requests in flight get %.0f s to finish",
                               len(tasks), grace_s)
                waits = set(tasks)
                abort_wait = asyncio.ensure_future((abort or asyncio.Event()).wait())
                deadline = asyncio.get_running_loop().time() + grace_s
                while tasks and not abort_wait.done():
                    left = deadline - asyncio.get_running_loop().time()
                    if left <= 0:
                        break
                    await asyncio.wait(set(tasks) | {abort_wait}, timeout=left,
                                       return_when=asyncio.FIRST_COMPLETED)
                abort_wait.cancel()
                pending = {t for t in waits if not t.done()}
                for t in pending:
                    t.cancel()
                if pending:
                    await asyncio.wait(pending)
    finally:
        stop_wait.cancel()
        for t in list(tasks):
            t.cancel()
    result.unfinished = len(todo) - result.finished
    return result
