"""The router's state interface: what must agree across router replicas.

One interface, two implementations chosen at start-up (``llmserve router``):

- :class:`MemoryState` (no ``--redis-url``): the state is this process's
  :class:`~llmserve.router.state.WorkerPool` and its policy; one replica.
- :class:`~llmserve.router.redis_state.RedisState` (``--redis-url``): the state
  lives in Redis and is changed by atomic Lua scripts; the pool and the policy are
  this replica's cache of it, and what it falls back to while Redis is unreachable.

What is shared (DESIGN.md sections 1 and 8): worker membership (``POST /workers``,
``DELETE /workers/{id}``, ``--worker`` seeds, ``--register-with``), health and
circuit-breaker marks, per-worker in-flight load (reserve on dispatch, refund on
finish), the cache-aware view of which blocks each worker holds (assumed from
routing, and published digests), the round-robin counter and the session map.

The proxy calls, per request::

    prepare(request, workers, session)   # refresh the cache for this decision
    pool.pick(...)                       # pure: policy over the cached state
    dispatched(request, worker, session) # the request went to worker: reserve
    finished(worker, ok)                 # it ended: refund (drained + idle -> removed)

Every method keeps the pool consistent when the shared store fails: the
request is served from the local cache, never a 500 or a hang.
"""

from __future__ import annotations

from llmserve.router.policies import RouteRequest
from llmserve.router.state import WorkerPool
from llmserve.router.worker import Worker


class MemoryState:
    """The in-process state of one router replica (the pool itself)."""

    backend = "memory"

    def __init__(self, pool: WorkerPool) -> None:
        self.pool = pool
        self.on_new_worker = None  # async callback(Worker) for workers seen via sync

    @property
    def degraded(self) -> bool:
        """True while shared state is unreachable and the local cache answers."""
        return False

    def describe(self) -> dict:
        return {"backend": self.backend, "status": "ok"}

    async def start(self) -> None:
        """Start background work (nothing for memory)."""

    async def stop(self) -> None:
        """Stop background work and close connections."""

    async def add_worker(self, url: str, worker_id: str | None = None) -> Worker:
        """Raises: ValueError (bad URL; URL or id already in the pool: message has
        "already"); :class:`SharedStateUnavailable` (Redis only)."""
        return self.pool.add(url, worker_id)

    async def drain_worker(self, worker_id: str) -> Worker:
        """Raises: KeyError (no such worker); SharedStateUnavailable (Redis only)."""
        return self.pool.drain(worker_id)

    async def prepare(self, request: RouteRequest, workers: list[Worker],
                      session: str | None) -> None:
        """Refresh what the decision for ``request`` reads (loads, matched blocks,
        session, counters); memory: the pool already is the state."""

    async def dispatched(self, request: RouteRequest, worker: Worker,
                         session: str | None) -> None:
        """``worker`` got ``request``: assume its prefix cached there, stick the
        session, reserve one in-flight slot."""
        self.pool.routed(request, worker, session)
        worker.in_flight += 1
        worker.breaker.on_send()

    async def finished(self, worker: Worker, ok: bool, connect_error: bool = False) -> None:
        """The attempt on ``worker`` ended (``ok``: answered without a transport
        error or 5xx); refund its slot and settle the breaker."""
        worker.in_flight = max(0, worker.in_flight - 1)
        self.settle(worker, ok, connect_error)
        self.pool.maybe_remove(worker)

    @staticmethod
    def settle(worker: Worker, ok: bool, connect_error: bool) -> None:
        """Settle ``worker``'s circuit breaker after an attempt."""
        if ok:
            worker.breaker.record_success()
        else:
            worker.breaker.record_failure()
            if connect_error:
                worker.healthy = False  # refused: do not wait for the next health check

    async def health_result(self, worker: Worker, ok: bool) -> None:
        """A health check of ``worker`` finished (``worker.healthy`` already updated)."""

    async def digest(self, worker: Worker, hashes: list[bytes], version: int,
                     asked_at_wall: float) -> None:
        """``worker`` published ``hashes`` (its prefix cache) at ``asked_at_wall``
        (``time.time()``); the local policy already has it."""


class SharedStateUnavailable(RuntimeError):
    """A membership change needs the shared store, which is unreachable."""
