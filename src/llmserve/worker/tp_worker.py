"""Tensor-parallel execution: the driver's runner and the followers' step loop.

Rank 0 (the driver) runs the scheduler and the sampler. Each step it broadcasts
``(SchedulerOutput, the tokens it sampled last step, request ids it dropped)`` to the
other ranks (``GroupCoordinator.broadcast_object``: pickle over gloo, one length and one
byte broadcast), then every rank runs the same forward pass over its shard; the
collectives inside the layers (all-reduce, logits all-gather) keep them in step::

    driver                                  follower r
    schedule() -> sched                     loop:
    broadcast (sched, sampled, dropped) -->   recv; append sampled tokens, drop ids
    forward (all-reduce ... all-gather)  <->  forward (same collectives)
    sample on the gathered logits             (no sampling)

Any failure inside a step (a rank died, a collective broke, an exception) ends the
engine with :class:`~llmserve.distributed.multiproc.RankFailedError`: after a partial
step the ranks' collectives no longer match, so the engine never tries to go on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from llmserve.config import EngineConfig
from llmserve.distributed.multiproc import RankFailedError, WorkerProcesses
from llmserve.distributed.parallel_state import (
    ParallelGroups,
    backend_for_device,
    check_devices_for_ranks,
    init_parallel_groups,
    rank_device,
)
from llmserve.loader import ModelSource
from llmserve.scheduler.output import ModelRunnerOutput, SchedulerOutput
from llmserve.utils import format_size
from llmserve.worker.model_loading import load_model, model_weight_bytes
from llmserve.worker.model_runner import ModelRunner

if TYPE_CHECKING:
    from llmserve.distributed.ray_executor import RayWorkers

logger = logging.getLogger("llmserve.tp")

STEP_TIMEOUT_S = 7 * 24 * 3600.0  # followers wait for the next step as long as the server idles


def _strip_for_followers(sched: SchedulerOutput) -> SchedulerOutput:
    """A copy without what followers never use and may not pickle (compiled grammars)."""
    if not any(n.sampling_params.structured_outputs is not None for n in sched.scheduled_new_reqs):
        return sched
    new = []
    for n in sched.scheduled_new_reqs:
        sp = n.sampling_params
        if sp.structured_outputs is not None:
            sp = dataclasses.replace(sp, structured_outputs=None)
        new.append(dataclasses.replace(n, sampling_params=sp))
    return dataclasses.replace(sched, scheduled_new_reqs=new)


class TPExecutor:
    """The driver's handle on its worker processes and groups (built by :meth:`start`)."""

    def __init__(self, workers: WorkerProcesses | RayWorkers, groups: ParallelGroups,
                 threads_before: int) -> None:
        self.workers, self.groups = workers, groups
        self._closed = False
        self._threads_before = threads_before

    @classmethod
    def start(cls, config: EngineConfig, source: ModelSource, quantization: str) -> TPExecutor:
        """Spawn ranks 1..N-1 (they load their shards while the driver loads its own) and
        join the process groups.

        Raises:
            RankFailedError: a rank failed to start or missed the start-up timeout.
        """
        pc = config.parallel_config
        backend = backend_for_device(config.device)
        if backend == "nccl":  # one GPU per rank; the driver's is its own config.device
            if pc.distributed_executor_backend != "ray":
                check_devices_for_ranks(config.device, pc.world_size, torch.cuda.device_count())
            torch.cuda.set_device(rank_device(config.device, 0, torch.cuda.device_count()))
        threads_before = torch.get_num_threads()
        torch.set_num_threads(max(1, threads_before // pc.world_size))  # as each worker does
        payload = (config, source, quantization)
        if pc.distributed_executor_backend == "ray":  # ranks as Ray tasks, any node
            from llmserve.distributed.ray_executor import RayWorkers

            try:
                workers = RayWorkers(run_worker, payload, pc.world_size, pc.startup_timeout_s,
                                     use_gpu=str(config.device).startswith("cuda"))
            except BaseException:
                torch.set_num_threads(threads_before)
                raise
        else:
            workers = WorkerProcesses(run_worker, payload, pc.world_size, pc.startup_timeout_s)
        try:
            workers.wait_for("joined")
            groups = init_parallel_groups(pc, 0, workers.store, backend, STEP_TIMEOUT_S)
        except BaseException:
            workers.shutdown()
            torch.set_num_threads(threads_before)
            raise
        return cls(workers, groups, threads_before)

    def agree_kv_blocks(self, num_blocks: int, num_host_blocks: int) -> int:
        """Wait until every rank is ready, then the smallest block count of all ranks
        (every rank allocates that many); also sends ``num_host_blocks``."""
        self.workers.wait_for("ready")
        agreed = self.groups.world.all_reduce_min(num_blocks)
        self.groups.world.broadcast_object(num_host_blocks)
        self.workers.start_monitor()
        if agreed != num_blocks:
            logger.info("KV cache: %d blocks (the smallest of all ranks; rank 0 had %d)",
                        agreed, num_blocks)
        return agreed

    def broadcast(self, payload: Any) -> None:
        self.workers.check()
        self.groups.world.broadcast_object(payload)

    def shutdown(self) -> None:
        """Tell the followers to exit, stop them, leave the process group."""
        if self._closed:
            return
        self._closed = True
        if self.workers.failure() is None:
            with contextlib.suppress(Exception):  # a follower is gone: terminated below
                self.groups.tp.broadcast_object(None)  # stage 0 (pp: on down the pipe)
                if self.groups.pp.world_size > 1:
                    from llmserve.worker.pp_worker import TAG_STEP

                    self.groups.pp.send_object(None, 1, TAG_STEP)
        self.workers.shutdown()
        torch.set_num_threads(self._threads_before)


class DriverRunner(ModelRunner):
    """Rank 0's :class:`ModelRunner`: broadcasts each step before running its shard."""

    def __init__(self, config: EngineConfig, model, num_blocks: int, num_host_blocks: int,
                 executor: TPExecutor) -> None:
        super().__init__(config, model, num_blocks, num_host_blocks)
        self.executor = executor
        self._sampled: dict[str, list[int]] = {}
        self._dropped: list[str] = []
        self.broadcast_s = 0.0  # time spent sending steps (benchmarks/tensor_parallel.py)
        self.num_broadcasts = 0

    def drop_request(self, req_id: str) -> None:
        super().drop_request(req_id)
        self._dropped.append(req_id)

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Broadcast the step, run it; any failure -> :class:`RankFailedError`."""
        try:
            t0 = time.perf_counter()
            self.executor.broadcast((_strip_for_followers(sched), self._sampled, self._dropped))
            self.broadcast_s += time.perf_counter() - t0
            self.num_broadcasts += 1
            self._sampled, self._dropped = {}, []
            out = super().execute_model(sched)
        except RankFailedError:
            self.executor.workers.shutdown()
            raise
        except Exception as e:
            failure = self.executor.workers.failure(wait_s=2.0)
            self.executor.workers.shutdown()  # the others wait in a collective: stop them
            if failure is not None:
                raise failure from e
            raise RankFailedError(0, f"failed a step: {type(e).__name__}: {e}") from e
        self._sampled = {r: out.new_token_ids(r) for r in out.sampled_token_ids}
        return out


class FollowerRunner(ModelRunner):
    """A worker rank's runner: same forward pass, no sampling."""

    is_driver = False

    def follow(self, sampled: dict[str, list[int]], dropped: list[str]) -> None:
        """Apply what the driver did since the last step: dropped requests, the tokens
        each request emitted (sampled, and any grammar-forced ones after it)."""
        for req_id in dropped:
            self.requests.pop(req_id, None)
        for req_id, tokens in sampled.items():
            state = self.requests.get(req_id)
            if state is not None:
                state.token_ids.extend(tokens)


def kv_block_counts(config: EngineConfig, bytes_per_token: int) -> tuple[int, int]:
    """``(device blocks, host swap blocks)`` this rank can afford (the engine's rule)."""
    from llmserve.planner.ledger import num_kv_cache_blocks

    cc = config.cache_config
    blocks = cc.num_gpu_blocks_override or num_kv_cache_blocks(
        cc.kv_cache_memory, cc.block_size, bytes_per_token)
    host = 0
    if config.scheduler_config.preemption_mode == "swap":
        host = cc.num_cpu_blocks_override or num_kv_cache_blocks(
            cc.swap_space, cc.block_size, bytes_per_token)
    return blocks, host


def log_rank_memory(rank: int, runner: ModelRunner) -> dict[str, int]:
    """Log and return what this rank allocated, measured on its tensors: ``weights``
    (parameters plus packed native weights) and ``kv_cache`` (the K and V pages of every
    layer), in bytes. ``llmserve plan`` computes the same figures for the same tp
    (tests/test_tensor_parallel.py checks they agree)."""
    kv = sum(k.nbytes + v.nbytes for k, v in runner.kv_caches)
    weights = model_weight_bytes(runner.model)
    logger.info("rank %d: weights %s (%d B), KV cache %s (%d B: %d blocks x %d tokens)", rank,
                format_size(weights), weights, format_size(kv), kv, runner.num_blocks,
                runner.block_size)
    return {"weights": weights, "kv_cache": kv}


def run_worker(rank: int, store: dist.Store, payload: tuple) -> None:
    """A follower rank's life: join the groups, load the shard, allocate the agreed KV
    cache, then follow the driver's steps until it sends ``None``."""
    config, source, quantization = payload
    # the ranks share this machine's cores: one rank's matmul threads must not starve
    # the others (each all-reduce waits for the slowest rank)
    torch.set_num_threads(max(1, torch.get_num_threads() // config.parallel_config.world_size))
    logging.basicConfig(level=logging.INFO, format=f"%(levelname)s rank{rank} %(message)s")
    from llmserve.planner.ledger import kv_cache_bytes_per_token

    backend = backend_for_device(config.device)
    if backend == "nccl":  # this rank's own GPU, before NCCL or the loader touch one
        device = rank_device(config.device, rank, torch.cuda.device_count())
        torch.cuda.set_device(device)
        config = dataclasses.replace(config, device=device)
    groups = init_parallel_groups(config.parallel_config, rank, store, backend, STEP_TIMEOUT_S)
    model, _ = load_model(config, source, quantization, groups.tp, groups.pp_rank)
    store.set(f"ready/{rank}", "1")
    bytes_per_token = kv_cache_bytes_per_token(config.model_config, config.dtype,
                                               groups.tp.world_size)
    if groups.pp.world_size > 1:  # this stage's layers only
        from llmserve.models.pipeline_parallel import stage_kv_bytes_per_token

        bytes_per_token = stage_kv_bytes_per_token(bytes_per_token, config.model_config, model)
    blocks, _ = kv_block_counts(config, bytes_per_token)
    num_blocks = groups.world.all_reduce_min(blocks)
    num_host_blocks = groups.world.broadcast_object(None)
    if groups.pp.world_size > 1:
        from llmserve.worker.pp_worker import PPFollowerRunner

        runner = PPFollowerRunner(config, model, num_blocks, num_host_blocks)
        runner.setup_pipeline(groups)
    else:
        runner = FollowerRunner(config, model, num_blocks, num_host_blocks)
    log_rank_memory(rank, runner)
    pipeline = groups.pp.world_size > 1
    while True:
        try:
            msg = runner.next_step() if pipeline else groups.world.broadcast_object(None)
            if msg is None:
                if pipeline:
                    runner.finish()
                break
            sched, sampled, dropped = msg
            runner.follow(sampled, dropped)
            runner.execute_model(sched)
        except RuntimeError as e:  # a collective broke: the driver or a peer is gone
            raise RankFailedError(rank, f"stops: a peer left mid-step ({e})") from None


__all__ = ["DriverRunner", "FollowerRunner", "TPExecutor", "run_worker"]
