"""Start, watch and stop the worker ranks of one engine as Ray tasks, on one node or
several (``distributed_executor_backend="ray"``, vLLM's ``--distributed-executor-backend
ray``).

The driver (rank 0) stays in this process, as with the ``mp`` backend
(:mod:`llmserve.distributed.multiproc`); ranks ``1 .. N-1`` are Ray tasks, one per bundle
of a placement group (``{"CPU": 1}`` each, ``{"GPU": 1}`` on CUDA), and every rank runs
the same :func:`~llmserve.distributed.multiproc.join_and_run` rendezvous::

    driver                                   Ray task r (on any node)
    ray.init(RAY_ADDRESS or a local Ray)
    placement group, N-1 bundles (PACK)
    TCPStore master on <this node's IP>  <--- TCPStore client, "joined/r", gloo groups,
    wait_for("joined"), "ready" ...            load the shard, step loop

Failures are the ``mp`` backend's: a rank that raises (``"error/r"``), a task that ends
(the process was killed, its node died) or misses the start-up timeout is a
:class:`~llmserve.distributed.multiproc.RankFailedError` naming the rank, never a hang.
Placement: ``LLMSERVE_RAY_PLACEMENT_STRATEGY`` (``PACK``, the default and vLLM's;
``SPREAD``, ``STRICT_PACK``, ``STRICT_SPREAD``). Every node must see the model file at
the same path (shared storage, or a ``registry://`` source pulled on each node).
Modelled on vLLM's ``RayDistributedExecutor`` (``vllm/executor/ray_distributed_executor.py``)
and ``vllm/executor/ray_utils.py``'s placement group.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from llmserve.distributed.multiproc import (
    RankFailedError,
    RankFailures,
    join_and_run,
)

logger = logging.getLogger("llmserve.distributed")

PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


def _import_ray():
    try:
        import ray
    except ImportError as e:  # an optional dependency
        raise RuntimeError("distributed_executor_backend='ray' needs Ray: "
                           "pip install 'ray>=2.40'") from e
    return ray


def init_ray() -> bool:
    """Connect to the Ray cluster ``RAY_ADDRESS`` names, or start a local Ray, unless
    Ray is already up; True when this call started it (its caller then owns
    ``ray.shutdown()``). Call it from the main thread where one exists: ``ray.init``
    installs its SIGTERM handler only there (elsewhere it warns), and a server that
    calls it before its own signal handlers go in keeps Ray's C++ failure handler from
    printing a stack trace on every SIGTERM (``llmserve serve`` does).

    Raises:
        RuntimeError: Ray is not installed.
    """
    ray = _import_ray()
    if ray.is_initialized():
        return False
    ray.init(address=os.environ.get("RAY_ADDRESS") or None, include_dashboard=False,
             logging_level=logging.WARNING)
    return True


class RayWorkers(RankFailures):
    """Ranks ``1 .. world_size - 1`` of one engine as Ray tasks (the interface of
    :class:`~llmserve.distributed.multiproc.WorkerProcesses`).

    Args:
        target: ``target(rank, store, payload)``, a module-level function run in each
            task; it sets ``"ready/<rank>"`` once the rank can serve.
        payload: a picklable argument for ``target``.
        world_size: ranks in all, this process (rank 0) included.
        timeout_s: the start-up timeout (seconds), placement included.
        use_gpu: one GPU per rank's bundle instead of one CPU.

    Raises:
        RuntimeError: Ray is not installed.
        ValueError: an unknown ``LLMSERVE_RAY_PLACEMENT_STRATEGY``.
        RankFailedError: the placement group cannot be placed within the timeout
            (rank 1 named; the cluster's resources in the message).
    """

    def __init__(self, target: Callable[[int, dist.Store, Any], None], payload: Any,
                 world_size: int, timeout_s: float, use_gpu: bool = False) -> None:
        ray = _import_ray()
        from ray.util.placement_group import placement_group, placement_group_table
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = os.environ.get("LLMSERVE_RAY_PLACEMENT_STRATEGY", "PACK").upper()
        if strategy not in PLACEMENT_STRATEGIES:
            raise ValueError(f"LLMSERVE_RAY_PLACEMENT_STRATEGY must be one of "
                             f"{list(PLACEMENT_STRATEGIES)}, got {strategy!r}")
        self.world_size, self.timeout_s = world_size, timeout_s
        self._owns_ray = init_ray()  # RAY_ADDRESS names a cluster, else a local Ray
        self._ray = ray
        self._failure: RankFailedError | None = None
        self._closing = False
        self.refs: dict[int, Any] = {}
        bundle = {"GPU": 1} if use_gpu else {"CPU": 1}
        self.pg = placement_group([dict(bundle) for _ in range(world_size - 1)],
                                  strategy=strategy, name=f"llmserve-{os.getpid()}")
        ready, _ = ray.wait([self.pg.ready()], timeout=timeout_s)
        if not ready:
            have = ray.available_resources()
            ray.util.remove_placement_group(self.pg)
            raise RankFailedError(1, f"could not be placed: the placement group needs "
                                     f"{world_size - 1} x {bundle} ({strategy}) and the Ray "
                                     f"cluster has {have} free (start-up timeout "
                                     f"{timeout_s:g} s)")
        table = placement_group_table(self.pg)["bundles_to_node_id"]
        self.nodes = {rank: table[rank - 1] for rank in range(1, world_size)}
        self.host = ray.util.get_node_ip_address()
        self.store = dist.TCPStore(self.host, 0, world_size, is_master=True,
                                   timeout=datetime.timedelta(seconds=timeout_s),
                                   wait_for_workers=False)
        self.port = self.store.port
        task = ray.remote(max_retries=0, max_calls=1)(join_and_run)
        for rank in range(1, world_size):
            sched = PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=rank - 1)
            self.refs[rank] = task.options(
                num_cpus=0 if use_gpu else 1, num_gpus=1 if use_gpu else 0,
                scheduling_strategy=sched, name=f"llmserve-rank{rank}").remote(
                target, rank, world_size, self.host, self.port, payload, timeout_s)
        self._rank_of = {ref: r for r, ref in self.refs.items()}
        logger.info("started %d Ray worker tasks on nodes %s, rendezvous on %s:%d",
                    len(self.refs), sorted(set(self.nodes.values())), self.host, self.port)
        self._monitor = threading.Thread(target=self._watch, name="llmserve-ray-monitor",
                                         daemon=True)

    @property
    def pids(self) -> dict[int, int]:
        """World rank -> process id (on its node) of every rank that has joined."""
        return {r: int(self.store.get(f"joined/{r}")) for r in self.refs
                if self.store.check([f"joined/{r}"])}

    def _ended(self, rank: int) -> bool:
        ready, _ = self._ray.wait([self.refs[rank]], timeout=0)
        return bool(ready)

    def _cause(self, rank: int) -> str:
        """Why rank ``rank``'s task ended, in words."""
        if self.store.check([f"error/{rank}"]):
            return "raised " + self.store.get(f"error/{rank}").decode(errors="replace")
        try:
            self._ray.get(self.refs[rank], timeout=5)
            return "returned"
        except Exception as e:  # WorkerCrashedError, NodeDiedError, TaskCancelledError ...
            return f"ended: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"

    def _ranks(self) -> list[int]:
        return list(self.refs)

    def _exit_cause(self, rank: int) -> str | None:
        return self._cause(rank) if self._ended(rank) else None

    def start_monitor(self) -> None:
        """Watch the tasks from a thread: the first to end is the failure :meth:`check`
        raises from then on."""
        self._monitor.start()

    def _watch(self) -> None:
        try:
            ready, _ = self._ray.wait(list(self.refs.values()), num_returns=1, timeout=None)
        except Exception:  # Ray itself went away (shutdown): nothing left to watch
            ready = []
        if self._closing or not ready:
            return
        rank = self._rank_of[ready[0]]
        err = RankFailedError(rank, self._cause(rank))
        if self._failure is None:
            self._failure = err
        logger.error("%s; the engine stops", err)


    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop every task (force-cancel: its worker process is killed), free the
        placement group, and stop the local Ray this object started."""
        if self._closing:
            return
        self._closing = True
        ray = self._ray
        for ref in self.refs.values():
            with contextlib.suppress(Exception):  # already finished
                ray.cancel(ref, force=True)
        if self.refs:
            ray.wait(list(self.refs.values()), num_returns=len(self.refs), timeout=timeout_s)
        with contextlib.suppress(Exception):
            ray.util.remove_placement_group(self.pg)
        if self._owns_ray:
            ray.shutdown()
