"""Token-centric continuous-batching scheduler (pure Python, no tensors).

Each step it spends a token budget (``max_num_batched_tokens``) over requests:

1. running requests first (admission order, or priority order): each gets the
   tokens it still lacks (its last sampled token when decoding, or the next
   prefill chunk), up to the remaining budget. When the KV pool has no block
   for it, the last running request (the most recently admitted, or the
   lowest priority) is preempted until the block fits: by recompute (blocks
   freed) or by swap (KV copied to the host pool), and requeued.
2. then waiting requests, in queue order, while the budget, free blocks and
   ``max_num_seqs`` allow. A new request first looks up the prefix cache and
   starts at ``num_computed_tokens`` = the hit length; a long prompt is split
   into chunks (chunked prefill) and mixed with decodes in the same step. With
   the priority policy, a waiting request that does not fit preempts running
   requests of lower priority.

There is no separate prefill phase: chunking, prefix hits, resumption after
preemption and decoding all follow from ``num_computed_tokens`` vs
``num_tokens``. ``n > 1`` requests fork from a leader once its prompt KV is
computed, sharing its blocks (copy-on-write).
Source: Yu et al., "Orca" (OSDI 2022) for iteration-level scheduling;
Agrawal et al., "Sarathi-Serve" (OSDI 2024) for chunked prefill; vLLM v1's
``Scheduler`` for the token-centric formulation and priority preemption;
vLLM v0 for swap preemption.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass

from llmserve.config import SchedulerConfig
from llmserve.kv_cache import BlockPool, KVCacheManager
from llmserve.scheduler.kv_limits import KVLimiter
from llmserve.scheduler.output import (
    CachedRequestData,
    NewRequestData,
    SchedulerOutput,
)
from llmserve.scheduler.queue import RequestQueue
from llmserve.scheduler.request import Request, RequestStatus
from llmserve.scheduler.update import SchedulerUpdateMixin
from llmserve.utils import cdiv


@dataclass

class SchedulerStats:
    """Counters and gauges read by metrics and tests."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions_total: int = 0
    num_swapped_out_total: int = 0
    num_steps_total: int = 0
    max_batch_size_seen: int = 0
    last_step_num_reqs: int = 0
    last_step_num_tokens: int = 0
    num_scheduled_tokens_total: int = 0
    prefix_cache_queries_total: int = 0
    prefix_cache_hits_total: int = 0
    kv_store_hits_total: int = 0  # prompt tokens loaded from the shared KV store


def _stop_at_prompt_end(req: Request, num_computed: int, num_new: int) -> int:
    """``num_new`` cut at the end of the prompt when a recompute (after preemption)
    spans it: the prompt part runs as a prefill, the output tokens in later steps as
    decodes, the kernels they first ran with (model_runner: bit-identical greedy
    output with and without preemption in the default format, issue 20)."""
    if num_computed < req.num_prompt_tokens < num_computed + num_new:
        return req.num_prompt_tokens - num_computed
    return num_new


class Scheduler(SchedulerUpdateMixin):
    """Continuous batching over a :class:`KVCacheManager`.

    Args:
        scheduler_config: limits and policies.
        kv_cache_manager: owns the device blocks.
        num_host_blocks: blocks of the host pool for swap preemption (0 = none;
            swap then falls back to recompute).
    """

    def __init__(self, scheduler_config: SchedulerConfig, kv_cache_manager: KVCacheManager,
                 num_host_blocks: int = 0, num_lookahead_tokens: int = 0,
                 max_loras: int = 0, kv_limits: KVLimiter | None = None) -> None:
        self.config = scheduler_config
        self.max_model_len = scheduler_config.max_model_len
        self.kv_cache_manager = kv_cache_manager
        self.block_size = kv_cache_manager.block_size
        self.priority_policy = scheduler_config.scheduling_policy == "priority"
        self.swap = scheduler_config.preemption_mode == "swap" and num_host_blocks > 0
        self.host_pool = BlockPool(num_host_blocks + 1) if num_host_blocks > 0 else None
        self.requests: dict[str, Request] = {}
        self.waiting = RequestQueue(scheduler_config.scheduling_policy)
        self.running: list[Request] = []
        self.pending_forks: dict[str, list[Request]] = {}
        self._seen_by_runner: set[str] = set()
        self._finished_since_last_step: set[str] = set()
        # requests the scheduler itself ended (no model output carried them): (id, reason)
        self.finished_without_output: list[tuple[str, str]] = []
        self.stats = SchedulerStats()
        # speculative decoding with a draft model: KV slots after a verified run where the
        # draft writes its next drafts' KV (vLLM's num_lookahead_tokens)
        self.num_lookahead_tokens = num_lookahead_tokens
        # multi-LoRA: at most this many distinct adapters run at once (0: no limit)
        self.max_loras = max_loras
        # sliding-window freeing and KV eviction (scheduler/kv_limits.py), or None
        self.kv_limits = kv_limits

    # ------------------------------------------------------------------ admission
    def check_request_fits(self, num_prompt_tokens: int, params=None) -> None:
        """Refuse a prompt that can never run (``params``: its SamplingParams, for the
        per-request KV eviction settings; a capped sequence needs only its cap).

        Raises:
            ValueError: if the prompt (plus one output token) exceeds
                ``max_model_len`` or needs more blocks than the whole cache, or for bad
                eviction settings.
        """
        if num_prompt_tokens >= self.max_model_len:
            raise ValueError(
                f"prompt is too long: {num_prompt_tokens} tokens, but max_model_len is "
                f"{self.max_model_len} (prompt plus at least one output token must fit)")
        need = self.kv_cache_manager.num_blocks_needed(num_prompt_tokens + 1)
        if self.kv_limits is not None:
            cap = self.kv_limits.max_blocks(self.kv_limits.make_state(params),
                                            self.config.max_num_batched_tokens)
            need = need if cap is None else min(need, cap)
        if need > self.kv_cache_manager.num_usable_blocks:
            cap = self.kv_cache_manager.num_usable_blocks * self.block_size
            raise ValueError(
                f"prompt is too long: {num_prompt_tokens} tokens, but the whole KV cache holds "
                f"{cap} tokens; raise kv_cache_memory or shorten the prompt")

    def add_request(self, request: Request) -> None:
        """Queue a request (a forked one waits for its leader's prompt).

        Raises:
            ValueError: on a duplicate request id or a prompt that can never fit.
        """
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.check_request_fits(request.num_prompt_tokens, request.sampling_params)
        request.eviction = (self.kv_limits.make_state(request.sampling_params)
                            if self.kv_limits is not None else None)
        self.requests[request.request_id] = request
        leader = self.requests.get(request.fork_from) if request.fork_from else None
        if self.kv_cache_manager.window_blocks is not None:  # no shared blocks: no forks
            leader = None
        if leader is not None and not leader.is_finished():
            self.pending_forks.setdefault(leader.request_id, []).append(request)
        else:
            request.fork_from = None
            request.status = RequestStatus.WAITING
            self.waiting.add(request)

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
            elif req.status == RequestStatus.WAITING_FOR_FORK:
                self.pending_forks[req.fork_from].remove(req)
            else:
                self.waiting.remove(req)
            req.status = status
            self._free_request(req)
            done.append(req_id)
        return done

    def _free_request(self, req: Request) -> None:
        self.kv_cache_manager.free(req.request_id)
        self._free_host_blocks(req)
        self.requests.pop(req.request_id, None)
        for child in self.pending_forks.pop(req.request_id, []):
            # the leader ended before its prompt was computed: compute our own
            child.fork_from = None
            child.status = RequestStatus.WAITING
            self.waiting.add(child)
        if req.request_id in self._seen_by_runner:
            self._seen_by_runner.discard(req.request_id)
            self._finished_since_last_step.add(req.request_id)

    def _free_host_blocks(self, req: Request) -> None:
        if req.host_block_ids and self.host_pool is not None:
            self.host_pool.free_blocks([self.host_pool.blocks[i] for i in req.host_block_ids])
        req.host_block_ids = []

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ------------------------------------------------------------------ preemption
    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        """Swap the KV out to the host pool when possible, else drop it (recompute)."""
        self.running.remove(req)
        kv = self.kv_cache_manager
        num_blocks = cdiv(req.num_computed_tokens, self.block_size)
        if (self.swap and num_blocks and self.host_pool is not None
                and not kv.num_evicted_tokens.get(req.request_id)  # evicted: recompute
                and self.host_pool.get_num_free_blocks() >= num_blocks):
            device_ids = kv.get_block_ids(req.request_id)[:num_blocks]
            host_ids = [b.block_id for b in self.host_pool.get_new_blocks(num_blocks)]
            out.kv_cache_ops.extend(("swap_out", d, h) for d, h in zip(device_ids, host_ids))
            req.host_block_ids = host_ids
            req.status = RequestStatus.SWAPPED
            self.stats.num_swapped_out_total += 1
        else:
            req.num_computed_tokens = 0
            req.status = RequestStatus.PREEMPTED
            if req.eviction is not None:  # its blocks are gone: start the bookkeeping anew
                req.eviction.reset()
        req.spec_token_ids = []
        kv.free(req.request_id)
        req.num_preemptions += 1
        self.stats.num_preemptions_total += 1
        self.waiting.prepend(req)
        out.preempted_req_ids.add(req.request_id)

    def _admit_running(self, req: Request) -> None:
        if self.priority_policy:
            keys = [r.sort_key() for r in self.running]
            self.running.insert(bisect.bisect(keys, req.sort_key()), req)
        else:
            self.running.append(req)

    # ------------------------------------------------------------------ schedule
    def schedule(self, in_flight: frozenset[str] | set[str] = frozenset()) -> SchedulerOutput:
        """Plan one step. Never blocks; returns an empty output when idle.

        ``in_flight``: requests of micro-batches still in the pipeline (pipeline
        parallelism, vLLM's batch queue): neither scheduled nor preempted this step."""
        out = SchedulerOutput(finished_req_ids=self._finished_since_last_step)
        self._finished_since_last_step = set()
        budget = self.config.max_num_batched_tokens
        kv = self.kv_cache_manager
        scheduled: dict[str, int] = {}
        admitted: set[str] = set()

        # 1. running requests
        i = 0
        preempted_running = False
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.request_id in in_flight:
                i += 1
                continue
            num_new = _stop_at_prompt_end(req, req.num_computed_tokens, min(
                req.num_tokens - req.num_computed_tokens + len(req.spec_token_ids),
                budget))  # drafted tokens are just more tokens of the decode
            if num_new <= 0:
                i += 1
                continue
            num_slots = num_new + self._lookahead(req.num_computed_tokens + num_new)
            if self.kv_limits is not None:  # free slid-out / evicted blocks first
                self.kv_limits.before_allocate(req, num_slots)
            copies = kv.allocate_slots(req.request_id, req.num_computed_tokens, num_slots)
            while copies is None:
                # most recently admitted / lowest priority, not in the pipeline
                victim = next((r for r in reversed(self.running)
                               if r.request_id not in in_flight), None)
                if victim is None:
                    break
                self._preempt(victim, out)
                preempted_running = True
                if victim is req:
                    break
                copies = kv.allocate_slots(req.request_id, req.num_computed_tokens, num_slots)
            if copies is None:
                if not self.running and not scheduled and req.num_output_tokens > 0 \
                        and req.status in (RequestStatus.PREEMPTED, RequestStatus.SWAPPED):
                    # alone and still too big for the whole cache: it can never grow
                    self.waiting.remove(req)
                    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
                    self._free_request(req)
                    self.finished_without_output.append((req.request_id, "length"))
                break
            out.kv_cache_ops.extend(("copy", s, d) for s, d in copies)
            scheduled[req.request_id] = num_new
            budget -= num_new
            i += 1

        # 2. waiting requests (none admitted in a step that had to preempt, to avoid thrashing)
        while self.waiting and budget > 0 and not preempted_running:
            req = self.waiting.peek()
            if len(self.running) >= self.config.max_num_seqs:
                if self._preempt_lower_priority(req, scheduled, admitted | in_flight, out):
                    budget = self.config.max_num_batched_tokens - sum(scheduled.values())
                    continue
                break
            if self.max_loras and self._lora_slots_full(req):
                break  # its adapter waits for a running adapter's requests to finish
            ops, num_new = self._try_admit(req, budget)
            if ops is None:
                if self._preempt_lower_priority(req, scheduled, admitted | in_flight, out):
                    budget = self.config.max_num_batched_tokens - sum(scheduled.values())
                    continue
                break
            self.waiting.pop()
            out.kv_cache_ops.extend(ops)
            req.status = RequestStatus.RUNNING
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.time()
            self._admit_running(req)
            admitted.add(req.request_id)
            scheduled[req.request_id] = num_new
            budget -= num_new

        for req in self.running:
            num_new = scheduled.get(req.request_id)
            if num_new is None:
                continue
            block_ids = kv.get_block_ids(req.request_id)
            if req.request_id not in self._seen_by_runner:
                self._seen_by_runner.add(req.request_id)
                out.scheduled_new_reqs.append(NewRequestData(
                    req.request_id, list(req.all_token_ids), req.sampling_params, block_ids,
                    req.num_computed_tokens, req.lora_request,
                    kv.num_evicted_tokens.get(req.request_id, 0),
                    kv.get_window_blocks(req.request_id)))
            else:
                out.scheduled_cached_reqs.append(CachedRequestData(
                    req.request_id, block_ids, req.num_computed_tokens,
                    resumed_from_preemption=req.request_id in admitted,
                    num_evicted_tokens=kv.num_evicted_tokens.get(req.request_id, 0),
                    window_blocks=kv.get_window_blocks(req.request_id)))
            out.num_scheduled_tokens[req.request_id] = num_new
            if req.eviction is not None:
                first = KVLimiter.score_from(req, num_new)
                if first is not None:
                    out.kv_score_from[req.request_id] = first
            num_spec = num_new - (req.num_tokens - req.num_computed_tokens)
            if num_spec > 0:
                out.scheduled_spec_decode_tokens[req.request_id] = req.spec_token_ids[:num_spec]
        out.total_num_scheduled_tokens = sum(out.num_scheduled_tokens.values())
        self._update_stats(len(out.num_scheduled_tokens), out.total_num_scheduled_tokens)
        return out

    def _lora_slots_full(self, req: Request) -> bool:
        """Admitting ``req`` would put more than ``max_loras`` adapters in the batch."""
        if req.lora_request is None:
            return False
        active = {r.lora_request.lora_int_id for r in self.running if r.lora_request}
        return req.lora_request.lora_int_id not in active and len(active) >= self.max_loras

    def _try_admit(self, req: Request, budget: int) -> tuple[list | None, int]:
        """Allocate blocks for a waiting request. Returns (kv ops, tokens) or (None, 0)."""
        kv = self.kv_cache_manager
        chunked = self.config.enable_chunked_prefill
        if req.status == RequestStatus.SWAPPED:
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            copies = kv.allocate_slots(req.request_id, 0, req.num_computed_tokens + num_new
                                       + self._lookahead(req.num_computed_tokens + num_new))
            if copies is None:
                return None, 0
            device_ids = kv.get_block_ids(req.request_id)
            ops = [("swap_in", h, d) for h, d in zip(req.host_block_ids, device_ids)]
            self._free_host_blocks(req)
            return ops, num_new
        computed_blocks = []
        num_hit = 0
        store_bodies: list = []  # the shared KV store's hits after the local ones
        # prompt logprobs need every prompt position's logits: no prefix-cache read
        if req.num_computed_tokens == 0 and req.sampling_params.prompt_logprobs is None:
            computed_blocks = kv.get_computed_blocks(req.request_id, req.all_token_ids,
                                                     req.extra_keys)
            num_hit = len(computed_blocks) * self.block_size
            store_bodies = kv.get_store_hits(req.request_id, req.all_token_ids,
                                             req.extra_keys, len(computed_blocks))
        num_store = len(store_bodies) * self.block_size
        num_computed = req.num_computed_tokens or num_hit + num_store
        num_new = _stop_at_prompt_end(req, num_computed, req.num_tokens - num_computed)
        if num_new > budget:
            if not chunked:
                return None, 0
            num_new = budget
        copies = kv.allocate_slots(req.request_id, num_computed,
                                   num_new + self._lookahead(num_computed + num_new),
                                   computed_blocks)
        if copies is None:
            return None, 0
        ops: list = []
        if req.num_computed_tokens == 0:
            kv.record_prefix_query(req.num_tokens, num_hit)
            self.stats.prefix_cache_queries_total = kv.stats.queries
            self.stats.prefix_cache_hits_total = kv.stats.hits
            # blocks found in the shared KV store: filled from bytes, counted as computed
            load_ids = kv.commit_store_hits(req.request_id, len(computed_blocks),
                                            len(store_bodies))
            ops = [("load", body, d) for body, d in zip(store_bodies, load_ids)]
            self.stats.kv_store_hits_total += num_store
            req.num_computed_tokens = num_hit + num_store
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit + num_store
        return ops + [("copy", s, d) for s, d in copies], num_new

    def _preempt_lower_priority(self, req: Request, scheduled: dict[str, int],
                                admitted: set[str], out: SchedulerOutput) -> bool:
        """Priority policy: preempt the lowest-priority running request below ``req``
        (never one admitted in this step). Returns True if one was preempted."""
        if not self.priority_policy:
            return False
        for victim in reversed(self.running):
            if victim.request_id in admitted:
                continue
            if victim.sort_key() <= req.sort_key():
                return False
            scheduled.pop(victim.request_id, None)  # un-schedule it for this step
            self._preempt(victim, out)
            return True
        return False

    def _update_stats(self, num_reqs: int, num_tokens: int) -> None:
        s = self.stats
        s.num_running_reqs = len(self.running)
        s.num_waiting_reqs = len(self.waiting)
        s.kv_cache_usage = self.kv_cache_manager.usage
        if num_tokens:
            s.num_steps_total += 1
        s.last_step_num_reqs = num_reqs
        s.last_step_num_tokens = num_tokens
        s.num_scheduled_tokens_total += num_tokens
        s.max_batch_size_seen = max(s.max_batch_size_seen, num_reqs)

    def _lookahead(self, num_tokens: int) -> int:
        """Slots a draft model writes after ``num_tokens`` (within max_model_len)."""
        return max(0, min(self.num_lookahead_tokens, self.max_model_len - num_tokens))
