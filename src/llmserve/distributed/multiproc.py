"""Start, watch and stop the worker processes of one engine on this machine.

Rendezvous and failure handling (the hangs vLLM's and SGLang's users report are a
rank that died or never came up while the others wait in a collective)::

    driver (rank 0)                         worker r (spawned process)
    TCPStore master on 127.0.0.1:<free>
    spawn ranks 1..N-1  ------------------> TCPStore client, set "joined/r"
    wait_for("joined")                      init process group, load the shard
    init process group                      set "ready/r"   (or "error/r" = the cause)
    load rank 0's shard, wait_for("ready")  -> step loop (follows the driver)
    monitor thread: a worker exits -> RankFailedError on the next step

:meth:`WorkerProcesses.wait_for` polls the store and each process: a worker that raises
(its ``"error/r"``), exits, or misses the start-up timeout raises
:class:`RankFailedError` naming the rank and the cause, never a hang.
Modelled on vLLM's ``MultiprocExecutor`` (``vllm/v1/executor/multiproc_executor.py``).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

logger = logging.getLogger("llmserve.distributed")

POLL_S = 0.05


class RankFailedError(RuntimeError):
    """A rank of a multi-process engine failed to start or died; the engine cannot go on.

    ``rank``: the failed rank (the first one seen); ``cause``: why, in words.
    """

    def __init__(self, rank: int, cause: str) -> None:
        super().__init__(f"tensor-parallel rank {rank} {cause}")
        self.rank, self.cause = rank, cause


def describe_exit(exitcode: int | None) -> str:
    """``-9`` -> ``"was killed by SIGKILL"``; ``1`` -> ``"exited with code 1"``."""
    if exitcode is None:
        return "is still running"
    if exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


def join_and_run(target: Callable[[int, dist.Store, Any], None], rank: int,
                 world_size: int, host: str, port: int, payload: Any,
                 timeout_s: float) -> None:
    """A worker rank's life on any backend: join the driver's store at ``host:port``
    (``"joined/<rank>"`` = its pid), run ``target``; an exception's cause goes to
    ``"error/<rank>"`` (and stderr) before it is re-raised."""
    store = dist.TCPStore(host, port, world_size, is_master=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    store.set(f"joined/{rank}", str(os.getpid()))
    try:
        target(rank, store, payload)
    except BaseException as e:
        if isinstance(e, RankFailedError):  # it lost a peer: one line, not a traceback
            print(f"llmserve rank {rank}: {e}", file=sys.stderr)
        else:
            traceback.print_exc()
        with contextlib.suppress(Exception):
            store.set(f"error/{rank}", f"{type(e).__name__}: {e}")
        sys.stderr.flush()
        raise


def _worker_entry(target: Callable[[int, dist.Store, Any], None], rank: int, world_size: int,
                  port: int, payload: Any, timeout_s: float) -> None:
    """The spawned process: :func:`join_and_run` on loopback, then exit (1 on an error)."""
    try:
        join_and_run(target, rank, world_size, "127.0.0.1", port, payload, timeout_s)
    except BaseException:
        os._exit(1)
    os._exit(0)


class RankFailures:
    """The first failure seen among a launcher's ranks (its monitor or ``wait_for``
    records it): shared by :class:`WorkerProcesses` and
    :class:`~llmserve.distributed.ray_executor.RayWorkers`, which define ``shutdown``."""

    _failure: RankFailedError | None = None

    def check(self) -> None:
        """Raise the recorded failure, if any (the driver calls it around each step)."""
        if self._failure is not None:
            raise self._failure

    def failure(self, wait_s: float = 0.0) -> RankFailedError | None:
        """The recorded failure, waiting up to ``wait_s`` for the monitor to see one."""
        deadline = time.monotonic() + wait_s
        while self._failure is None and time.monotonic() < deadline:
            time.sleep(POLL_S)
        return self._failure

    def _fail(self, err: RankFailedError) -> RankFailedError:
        self._failure = err
        self.shutdown()
        return err

    def shutdown(self) -> None:
        raise NotImplementedError

    def wait_for(self, stage: str, timeout_s: float | None = None) -> None:
        """Block until every worker rank has set ``"<stage>/<rank>"`` in ``self.store``.

        Raises:
            RankFailedError: a rank reported an error, ended, or missed the timeout.
        """
        limit = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + limit
        pending = set(self._ranks())
        while pending:
            for rank in sorted(pending):
                if self.store.check([f"error/{rank}"]):
                    cause = self.store.get(f"error/{rank}").decode(errors="replace")
                    raise self._fail(RankFailedError(rank, f"failed to start: {cause}"))
                if self.store.check([f"{stage}/{rank}"]):
                    pending.discard(rank)
                elif (why := self._exit_cause(rank)) is not None:
                    raise self._fail(RankFailedError(rank, f"{why} before it was {stage}"))
            if pending and time.monotonic() > deadline:
                raise self._fail(RankFailedError(
                    min(pending), f"was not {stage} within the start-up timeout of "
                                  f"{limit:g} s (ranks not {stage}: {sorted(pending)})"))
            if pending:
                time.sleep(POLL_S)

    def _ranks(self) -> list[int]:
        raise NotImplementedError

    def _exit_cause(self, rank: int) -> str | None:
        """Why ``rank`` has ended, in words; None while it runs."""
        raise NotImplementedError


class WorkerProcesses(RankFailures):
    """Ranks ``1 .. world_size - 1`` of one engine, spawned on this machine.

    Args:
        target: ``target(rank, store, payload)``, a module-level function (it is pickled
            into each spawned process); it should set ``"ready/<rank>"`` in the store
            once the rank can serve, and returns when the engine shuts down.
        payload: a picklable argument for ``target``.
        world_size: ranks in all, this process (rank 0) included.
        timeout_s: the start-up timeout (seconds).
    """

    def __init__(self, target: Callable[[int, dist.Store, Any], None], payload: Any,
                 world_size: int, timeout_s: float) -> None:
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True,
                                   timeout=datetime.timedelta(seconds=timeout_s),
                                   wait_for_workers=False)
        self.port = self.store.port
        ctx = multiprocessing.get_context("spawn")
        self.procs: dict[int, multiprocessing.Process] = {}
        self._failure: RankFailedError | None = None
        self._closing = False
        for rank in range(1, world_size):
            p = ctx.Process(target=_worker_entry, name=f"llmserve-rank{rank}", daemon=True,
                            args=(target, rank, world_size, self.port, payload, timeout_s))
            p.start()
            self.procs[rank] = p
        logger.info("started %d worker processes (pids %s), rendezvous on 127.0.0.1:%d",
                    len(self.procs), [p.pid for p in self.procs.values()], self.port)
        self._monitor = threading.Thread(target=self._watch, name="llmserve-rank-monitor",
                                         daemon=True)

    @property
    def pids(self) -> dict[int, int]:
        """World rank -> process id of every worker."""
        return {r: p.pid for r, p in self.procs.items()}

    def _ranks(self) -> list[int]:
        return list(self.procs)

    def _exit_cause(self, rank: int) -> str | None:
        p = self.procs[rank]
        if p.is_alive():
            return None
        p.join(1)
        return describe_exit(p.exitcode)

    def start_monitor(self) -> None:
        """Watch the workers from a thread: the first exit is recorded as the failure
        every later :meth:`check` raises (and logged at once)."""
        self._monitor.start()

    def _watch(self) -> None:
        sentinels = {p.sentinel: r for r, p in self.procs.items()}
        ready = multiprocessing.connection.wait(list(sentinels))
        if self._closing:
            return
        rank = sentinels[ready[0]]
        self.procs[rank].join(1)
        err = RankFailedError(rank, f"{describe_exit(self.procs[rank].exitcode)}")
        if self._failure is None:
            self._failure = err
        logger.error("%s; the engine stops", err)


    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop every worker (terminate, then kill what is left)."""
        self._closing = True
        for p in self.procs.values():
            if p.is_alive():
                p.terminate()
        deadline = time.monotonic() + timeout_s
        for p in self.procs.values():
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(1)
