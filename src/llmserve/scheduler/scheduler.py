"""Token-centric continuous-batching scheduler (pure Python, no tensors).

Each step it spends a token budget (``max_num_batched_tokens``) over requests:

1. running requests first, in admission order: each gets the tokens it still
   lacks (its last sampled token when decoding, or the next prefill chunk),
   up to the remaining budget. When the KV pool has no block for it, the most
   recently admitted running request is preempted by recompute (its blocks
   freed, back to the head of the waiting queue) until the block fits.
2. then waiting requests, first come first served, while the budget, free
   blocks and ``max_num_seqs`` allow; a long prompt is split into chunks
   (chunked prefill) and mixed with decodes in the same step.

There is no separate prefill phase: chunking, resumption after preemption
and decoding all follow from ``num_computed_tokens`` vs ``num_tokens``.
Source: Yu et al., "Orca" (OSDI 2022) for iteration-level scheduling;
Agrawal et al., "Sarathi-Serve" (OSDI 2024) for chunked prefill; vLLM v1's
``Scheduler`` for the token-centric formulation.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from llmserve.config import SchedulerConfig
from llmserve.kv_cache import KVCacheManager
from llmserve.scheduler.output import (
    CachedRequestData,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from llmserve.scheduler.request import Request, RequestStatus


@dataclass
class SchedulerStats:
    """Counters and gauges read by metrics and tests."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions_total: int = 0
    num_steps_total: int = 0
    max_batch_size_seen: int = 0
    last_step_num_reqs: int = 0
    last_step_num_tokens: int = 0


class Scheduler:
    """Continuous batching over a :class:`KVCacheManager`.

    Args:
        scheduler_config: limits (``max_num_seqs``, ``max_num_batched_tokens``,
            ``max_model_len``, ``enable_chunked_prefill``).
        kv_cache_manager: owns the blocks.
    """

    def __init__(self, scheduler_config: SchedulerConfig, kv_cache_manager: KVCacheManager) -> None:
        self.config = scheduler_config
        self.max_model_len = scheduler_config.max_model_len
        self.kv_cache_manager = kv_cache_manager
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._seen_by_runner: set[str] = set()
        self._finished_since_last_step: set[str] = set()
        self.stats = SchedulerStats()

    # ------------------------------------------------------------------ admission
    def check_request_fits(self, num_prompt_tokens: int) -> None:
        """Refuse a prompt that can never run.

        Raises:
            ValueError: if the prompt (plus one output token) exceeds
                ``max_model_len`` or needs more blocks than the whole cache.
        """
        if num_prompt_tokens >= self.max_model_len:
            raise ValueError(
                f"prompt is too long: {num_prompt_tokens} tokens, but max_model_len is "
                f"{self.max_model_len} (prompt plus at least one output token must fit)")
        need = self.kv_cache_manager.num_blocks_needed(num_prompt_tokens + 1)
        if need > self.kv_cache_manager.num_usable_blocks:
            cap = self.kv_cache_manager.num_usable_blocks * self.kv_cache_manager.block_size
            raise ValueError(
                f"prompt is too long: {num_prompt_tokens} tokens, but the whole KV cache holds "
                f"{cap} tokens; raise kv_cache_memory or shorten the prompt")

    def add_request(self, request: Request) -> None:
        """Queue a request (call :meth:`check_request_fits` first).

        Raises:
            ValueError: on a duplicate request id.
        """
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.check_request_fits(request.num_prompt_tokens)
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort_requests(self, request_ids: list[str] | str) -> list[str]:
        """Abort requests (unknown or finished ids are ignored); frees their blocks."""
        return self.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def finish_requests(self, request_ids: list[str] | str, status: RequestStatus) -> list[str]:
        """End requests from outside (abort, or a stop string found by the detokenizer)."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        done = []
        for req_id in request_ids:
            req = self.requests.get(req_id)
            if req is None or req.is_finished():
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            req.status = status
            self._free_request(req)
            done.append(req_id)
        return done

    def _free_request(self, req: Request) -> None:
        self.kv_cache_manager.free(req.request_id)
        self.requests.pop(req.request_id, None)
        if req.request_id in self._seen_by_runner:
            self._seen_by_runner.discard(req.request_id)
            self._finished_since_last_step.add(req.request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    # ------------------------------------------------------------------ schedule
    def _preempt(self, req: Request) -> None:
        """Preemption by recompute: drop the KV, requeue at the head."""
        self.kv_cache_manager.free(req.request_id)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.stats.num_preemptions_total += 1
        self.waiting.appendleft(req)

    def schedule(self) -> SchedulerOutput:
        """Plan one step. Never blocks; returns an empty output when idle."""
        out = SchedulerOutput(finished_req_ids=self._finished_since_last_step)
        self._finished_since_last_step = set()
        budget = self.config.max_num_batched_tokens
        chunked = self.config.enable_chunked_prefill
        scheduled: list[tuple[Request, int]] = []

        # 1. running requests, oldest admission first
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if num_new <= 0:
                i += 1
                continue
            while not self.kv_cache_manager.allocate_slots(
                    req.request_id, req.num_computed_tokens + num_new):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted_req_ids.add(victim.request_id)
                if victim is req:
                    break
            else:
                scheduled.append((req, num_new))
                budget -= num_new
                i += 1
                continue
            # req itself was preempted; if nothing else runs it can never grow
            if not self.running and len(self.waiting) and self.waiting[0] is req \
                    and req.num_output_tokens > 0 and not scheduled:
                self.waiting.popleft()
                req.status = RequestStatus.FINISHED_LENGTH_CAPPED
                self._free_request(req)
            break

        # 2. waiting requests, FCFS (preempted ones are at the head); none are
        #    admitted in a step that had to preempt, to avoid thrashing
        while (self.waiting and budget > 0 and not out.preempted_req_ids
               and len(self.running) < self.config.max_num_seqs):
            req = self.waiting[0]
            num_new = req.num_tokens - req.num_computed_tokens
            if num_new > budget:
                if not chunked:
                    break
                num_new = budget
            if not self.kv_cache_manager.allocate_slots(req.request_id, num_new):
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.time()
            self.running.append(req)
            scheduled.append((req, num_new))
            budget -= num_new

        for req, num_new in scheduled:
            block_ids = self.kv_cache_manager.get_block_ids(req.request_id)
            if req.request_id not in self._seen_by_runner:
                self._seen_by_runner.add(req.request_id)
                out.scheduled_new_reqs.append(NewRequestData(
                    req.request_id, list(req.all_token_ids), req.sampling_params, block_ids,
                    req.num_computed_tokens))
            else:
                out.scheduled_cached_reqs.append(CachedRequestData(
                    req.request_id, block_ids, req.num_computed_tokens,
                    resumed_from_preemption=req.num_preemptions > 0 and req.num_computed_tokens == 0))
            out.num_scheduled_tokens[req.request_id] = num_new
        out.total_num_scheduled_tokens = sum(out.num_scheduled_tokens.values())
        self._update_stats(len(scheduled), out.total_num_scheduled_tokens)
        return out

    def _update_stats(self, num_reqs: int, num_tokens: int) -> None:
        s = self.stats
        s.num_running_reqs = len(self.running)
        s.num_waiting_reqs = len(self.waiting)
        s.kv_cache_usage = self.kv_cache_manager.usage
        if num_tokens:
            s.num_steps_total += 1
        s.last_step_num_reqs = num_reqs
        s.last_step_num_tokens = num_tokens
        s.max_batch_size_seen = max(s.max_batch_size_seen, num_reqs)

    # ------------------------------------------------------------------ update
    def update_from_output(self, sched_out: SchedulerOutput,
                           runner_out: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Advance ``num_computed_tokens``, append sampled tokens, finish requests
        that hit a token-level stop condition and free their blocks."""
        outputs: list[EngineCoreOutput] = []
        for req_id, num_new in sched_out.num_scheduled_tokens.items():
            req = self.requests.get(req_id)
            if req is None or req.status != RequestStatus.RUNNING:
                continue  # aborted or preempted meanwhile
            req.num_computed_tokens += num_new
            token = runner_out.sampled_token_ids.get(req_id)
            if token is None:
                continue  # a partial prefill chunk: nothing sampled
            req.append_output_token_ids([token])
            finished = req.check_stop(self.max_model_len)
            outputs.append(EngineCoreOutput(
                req_id, [token], finish_reason=req.get_finished_reason() if finished else None,
                stop_reason=req.stop_reason, new_logprobs=runner_out.logprobs.get(req_id)))
            if finished:
                self.running.remove(req)
                self._free_request(req)
        self.stats.num_running_reqs = len(self.running)
        self.stats.kv_cache_usage = self.kv_cache_manager.usage
        return outputs
