"""Micro-batches in flight under pipeline parallelism (vLLM v1's batch queue:
``EngineCore.step_with_batch_queue``, one scheduler step in flight per stage, the
"virtual engines" of vLLM v0).

With ``pp`` stages and one batch at a time, each stage idles while the others run
(the bubble: ``(pp - 1) / pp`` of the time). Keeping up to ``max_in_flight``
micro-batches in the pipe lets stage 0 start batch ``k + 1`` while stage 1 runs
batch ``k``::

    time ->        1      2      3      4
    stage 0:     [ b0 ] [ b1 ] [ b2 ] [ b3 ]
    stage 1:            [ b0 ] [ b1 ] [ b2 ] ...

A micro-batch holds different requests from every other batch in flight: the
scheduler is told which requests are in the pipe (``Scheduler.schedule(in_flight)``)
and neither schedules nor preempts them, since their next token is not known yet and
their KV blocks are being written. Outputs come back in submission order.
"""

from __future__ import annotations

import logging
from collections import deque

logger = logging.getLogger("llmserve")


class BatchQueue:
    """The engine's micro-batches in flight, oldest first.

    ``max_in_flight``: how many at most (default: the number of stages; 1 runs the
    pipeline synchronously). ``queue``: ``(SchedulerOutput, first-scheduled times)``
    per batch; ``in_flight``: the request ids in them.
    """

    def __init__(self, max_in_flight: int) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        self.max_in_flight = max_in_flight
        self.queue: deque = deque()
        self.in_flight: set[str] = set()
        self.max_depth = 0  # the most micro-batches that were in flight at once


def step_with_batch_queue(engine) -> list:
    """One engine iteration: schedule and submit a micro-batch if there is room and
    work; collect the oldest one when the queue is full or nothing new could start.

    Returns the ``RequestOutput``s of the collected batch (and of requests the
    scheduler ended on its own). A rank failure raises ``RankFailedError``.
    """
    bq, runner, scheduler = engine.batch_queue, engine.runner, engine.scheduler
    outputs: list = []
    submitted = False
    sched_out = None
    if len(bq.queue) < bq.max_in_flight:
        sched_out = scheduler.schedule(bq.in_flight)
        outputs += engine._drain_finished_without_output()
        if sched_out.total_num_scheduled_tokens > 0:
            first = engine._first_scheduled(sched_out)
            runner.submit(sched_out)
            bq.queue.append((sched_out, first))
            bq.in_flight.update(sched_out.num_scheduled_tokens)
            bq.max_depth = max(bq.max_depth, len(bq.queue))
            submitted = True
            engine._stalled_steps = 0
        elif sched_out.kv_cache_ops or sched_out.finished_req_ids:
            runner.submit(sched_out)  # swaps must still move KV; finished ids drop state
    if bq.queue and (not submitted or len(bq.queue) >= bq.max_in_flight):
        done, first = bq.queue.popleft()
        runner_out = runner.collect()
        bq.in_flight.difference_update(done.num_scheduled_tokens)
        return outputs + engine._process_step(done, runner_out, first)
    if not bq.queue and sched_out is not None and not submitted and scheduler.waiting \
            and not scheduler.running and not sched_out.kv_cache_ops:
        engine._stalled_steps += 1
        if engine._stalled_steps >= 3:  # nothing runs and the head cannot be admitted
            head = scheduler.waiting.peek().request_id
            logger.error("request %s can never be scheduled; aborting it", head)
            return outputs + engine.abort_request([head])
    return outputs
