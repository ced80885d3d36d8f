"""Router state shared by router replicas through Redis (``llmserve router --redis-url``).

Several ``llmserve router`` processes behind one load balancer agree on the
workers, their health, their load and which prefixes they hold, because all of it
lives in Redis (key layout and scripts: :mod:`llmserve.router.redis_scripts`) and
every change is one atomic Lua script (``register_script``). Each replica's
:class:`~llmserve.router.state.WorkerPool` and policy are a cache:

- per request, one ``PREPARE`` script reads the shared loads, the leading blocks
  each eligible worker holds (routed there by any replica, or in its published
  digest), the session's worker and the round-robin counter; ``DISPATCH`` reserves
  a slot, records the routed blocks and the session; ``FINISH`` refunds it (and
  removes a drained worker once idle everywhere);
- a sync loop (every ``sync_interval_s``) polls the membership version, the health
  marks (``down:{id}``, with a TTL so a dead replica leaves nothing stuck) and
  refreshes this replica's heartbeat; ``JANITOR`` gives back what a replica whose
  heartbeat expired had reserved.

Redis down or unreachable: every call fails fast (``socket_timeout``), the replica
logs one warning, sets ``llmserve_router:redis_up`` to 0, counts
``llmserve_router:redis_errors_total`` and routes from its cache (``/health``
answers ``"status": "degraded"``); membership changes answer 503 until Redis is
back. The sync loop reconnects, then re-publishes its workers if Redis lost them.
Source of the pattern: Dynamo's fault-tolerant router proposal (replicas sync
through a shared store), SGLang router's worker registry; own implementation.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid

from llmserve.router import redis_scripts as lua
from llmserve.router.policies import RouteRequest
from llmserve.router.shared_state import MemoryState, SharedStateUnavailable
from llmserve.router.state import WorkerPool, normalize_url
from llmserve.router.worker import Worker

logger = logging.getLogger("llmserve.router")


def check_redis_url(url: str) -> str:
    """Raises: ValueError unless ``redis://``, ``rediss://`` or ``unix://``."""
    if not isinstance(url, str) or not url.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError(f"--redis-url must be redis://, rediss:// or unix://, got {url!r}")
    return url


class RedisState(MemoryState):
    """Args: ``pool`` (this replica's cache), ``url``, ``key_prefix``,
    ``sync_interval_s`` (membership/health poll), ``session_ttl_s``,
    ``health_ttl_s`` (how long a ``down`` mark lives unless refreshed),
    ``timeout_s`` (per Redis call).

    Raises:
        ValueError: a bad URL or a non-positive interval.
    """

    backend = "redis"

    def __init__(self, pool: WorkerPool, url: str, key_prefix: str = "llmserve:router:",
                 sync_interval_s: float = 0.25, session_ttl_s: float = 3600.0,
                 health_ttl_s: float = 10.0, timeout_s: float = 0.5,
                 max_blocks_per_worker: int = 200_000) -> None:
        super().__init__(pool)
        import redis.asyncio as aioredis
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        check_redis_url(url)
        if min(sync_interval_s, health_ttl_s, timeout_s) <= 0:
            raise ValueError("redis state: intervals, TTLs and timeouts must be > 0")
        if session_ttl_s < 1:
            raise ValueError(f"--session-ttl must be >= 1 second, got {session_ttl_s}")
        self.url, self.prefix = url, key_prefix
        self.sync_interval_s, self.session_ttl_s = sync_interval_s, session_ttl_s
        self.health_ttl_ms = int(health_ttl_s * 1000)
        self.hb_ttl_ms = int(max(3.0, 12 * sync_interval_s) * 1000)
        self.max_blocks = max_blocks_per_worker
        self.replica_id = uuid.uuid4().hex[:12]
        self.redis = aioredis.from_url(url, socket_timeout=timeout_s,
                                       socket_connect_timeout=timeout_s,
                                       retry=Retry(NoBackoff(), 0), decode_responses=False)
        self._scripts = {name: self.redis.register_script(getattr(lua, name))
                         for name in ("ADD", "DRAIN", "PREPARE", "DISPATCH", "FINISH",
                                      "DIGEST", "JANITOR")}
        self._up: bool | None = None  # None: not tried yet
        self._version: bytes | None = None
        self._reserved: dict[str, int] = {}  # worker id -> slots reserved in Redis
        self._seeds: list[str] = []
        self._task: asyncio.Task | None = None
        self._last_janitor = 0.0
        self.pool.metrics.redis_up.set(0)

    # ------------------------------------------------------------------ plumbing
    @property
    def degraded(self) -> bool:
        return self._up is False

    def describe(self) -> dict:
        return {"backend": self.backend, "status": "degraded" if self.degraded else "ok",
                "replica_id": self.replica_id, "key_prefix": self.prefix}

    async def _call(self, op: str, name: str, args: list):
        """Run script ``name``; None (and degraded) when Redis fails."""
        if self._up is False and op != "sync":
            return None  # the sync loop probes; requests use the cache meanwhile
        from redis.exceptions import ResponseError
        try:
            out = await self._scripts[name](keys=[], args=[self.prefix, *args])
        except ResponseError:  # the script itself failed: a bug, not an outage
            logger.exception("redis script %s failed", name)
            self.pool.metrics.redis_errors.labels(op).inc()
            return None
        except Exception as e:  # noqa: BLE001 - ConnectionError, TimeoutError, OSError
            self._failed(op, e)
            return None
        self._ok()
        return out

    def _failed(self, op: str, e: Exception) -> None:
        self.pool.metrics.redis_errors.labels(op).inc()
        if self._up is not False:
            logger.warning("redis %s unreachable (%s: %s): routing from this replica's "
                           "cache until it is back", self.url, type(e).__name__, e)
        self._up = False
        self.pool.metrics.redis_up.set(0)

    def _ok(self) -> None:
        if self._up is False:
            logger.warning("redis %s is reachable again: shared routing state resumed",
                           self.url)
        self._up = True
        self.pool.metrics.redis_up.set(1)

    async def start(self) -> None:
        """Publish the workers the cache was seeded with (``--worker``; ids already in
        Redis win), read the shared membership, start the sync loop."""
        self._seeds = [w.url for w in self.pool.workers.values()]
        await self._publish_seeds()
        await self.sync()
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        try:  # give back this replica's reservations at once
            await self.redis.delete(self.prefix + "hb:" + self.replica_id)
            await self._scripts["JANITOR"](keys=[], args=[self.prefix])
        except Exception:  # noqa: BLE001 - best effort on the way out
            pass
        with contextlib.suppress(Exception):
            await self.redis.aclose()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.sync_interval_s)
            try:
                await self.sync()
            except Exception:  # never let the loop die
                logger.exception("redis state sync failed")

    # --------------------------------------------------------------- membership
    async def _publish_seeds(self) -> None:
        for url in self._seeds:
            out = await self._call("sync", "ADD", [url, ""])
            if out is None:
                return
        self._seeds = []  # published; a later DELETE must not bring them back
        self._version = None  # re-read membership (ids may differ from the cache's)

    async def add_worker(self, url: str, worker_id: str | None = None) -> Worker:
        url = normalize_url(url)
        if worker_id is not None and not worker_id:
            raise ValueError(f"id: {worker_id!r} is empty or already in the pool")
        out = await self._call("admin", "ADD", [url, worker_id or ""])
        if out is None:
            raise SharedStateUnavailable("shared router state (Redis) is unreachable: "
                                         "membership changes are refused until it is back")
        status, wid = out[0].decode(), out[1].decode()
        if status == "url":
            if wid not in self.pool.workers:  # so GET /workers lists it right away
                w = self._cache_worker(wid, url)
                if self.on_new_worker is not None:
                    asyncio.create_task(self.on_new_worker(w))
            raise ValueError(f"worker: {url} is already in the pool")
        if status == "id":
            raise ValueError(f"id: {wid!r} is empty or already in the pool")
        return self._cache_worker(wid, url)

    def _cache_worker(self, wid: str, url: str) -> Worker:
        w = self.pool.workers.get(wid)
        if w is not None and w.url == url:
            return w
        for other in [o for o in self.pool.workers.values() if o.url == url or o.id == wid]:
            self.pool.forget(other.id)
        return self.pool.add(url, wid)

    async def drain_worker(self, worker_id: str) -> Worker:
        if worker_id not in self.pool.workers:  # added via another replica just now?
            self._version = None
            await self.sync()
        w = self.pool.workers[worker_id]  # KeyError: no such worker
        out = await self._call("admin", "DRAIN", [worker_id])
        if out is None:
            raise SharedStateUnavailable("shared router state (Redis) is unreachable: "
                                         "membership changes are refused until it is back")
        if out == -1:
            self.pool.forget(worker_id)
            raise KeyError(worker_id)
        w.draining = True
        if out == 1:
            self.pool.forget(worker_id)
        return w

    async def sync(self) -> None:
        """Poll membership (when its version moved), health marks and heartbeat."""
        p = self.prefix
        ids = list(self.pool.workers)
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.get(p + "version")
                pipe.set(p + "hb:" + self.replica_id, b"1", px=self.hb_ttl_ms)
                pipe.sadd(p + "replicas", self.replica_id)
                for wid in ids:
                    pipe.get(p + "down:" + wid)
                res = await pipe.execute()
        except Exception as e:  # noqa: BLE001 - RedisError, OSError, timeouts
            self._failed("sync", e)
            return
        was_down = self._up is False
        self._ok()
        if self._seeds:
            await self._publish_seeds()
        version = res[0]
        if version is None and self.pool.workers and (was_down or self._version is not None):
            await self._republish()  # Redis restarted empty: give it what we know
            return
        if version != self._version:
            await self._reload_members(version)
        for wid, mark in zip(ids, res[3:], strict=True):
            w = self.pool.workers.get(wid)
            if w is None or mark is None:
                continue
            if mark == b"unhealthy" and w.healthy:
                logger.warning("worker %s (%s) marked down by another router replica",
                               wid, w.url)
                w.healthy = False
            elif mark == b"breaker" and w.breaker.state == w.breaker.CLOSED:
                w.breaker.failures = w.breaker.failure_threshold
                w.breaker.opened_at = w.breaker.clock()
        if time.monotonic() - self._last_janitor > 1.0:
            self._last_janitor = time.monotonic()
            if await self._call("sync", "JANITOR", []):
                self._version = None

    async def _reload_members(self, version: bytes | None) -> None:
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.hgetall(self.prefix + "workers")
                pipe.smembers(self.prefix + "draining")
                members, draining = await pipe.execute()
        except Exception as e:  # noqa: BLE001
            self._failed("sync", e)
            return
        remote = {k.decode(): v.decode() for k, v in members.items()}
        drained = {d.decode() for d in draining}
        for wid in [wid for wid in self.pool.workers if wid not in remote]:
            self.pool.forget(wid)
        for wid, url in remote.items():
            known = wid in self.pool.workers and self.pool.workers[wid].url == url
            w = self._cache_worker(wid, url)
            w.draining = wid in drained
            if not known and self.on_new_worker is not None:
                asyncio.create_task(self.on_new_worker(w))  # models, digest, health now
        self._version = version

    async def _republish(self) -> None:
        for w in list(self.pool.workers.values()):
            await self._call("sync", "ADD", [w.url, w.id])
            if w.draining:
                await self._call("sync", "DRAIN", [w.id])
        self._version = None

    # ------------------------------------------------------------------ routing
    async def prepare(self, request: RouteRequest, workers: list[Worker],
                      session: str | None) -> None:
        policy = self.pool.policy
        args: list = [session or "", 1 if policy.wants_sequence else 0, len(workers)]
        match = bool(getattr(policy, "wants_digest", False) and request.block_hashes)
        for w in workers:
            hashes = request.hashes_for(w) if match else []
            args += [w.id, len(hashes), *hashes]
        out = await self._call("route", "PREPARE", args)
        if out is None:
            return  # degraded: the cache decides
        if out[0]:
            self.pool.remember_session(session, out[0].decode())
        if out[1] >= 0:
            request.sequence = int(out[1])
        request.matched = {}
        for i, w in enumerate(workers):
            w.in_flight = int(out[2 + 2 * i])
            if match:
                request.matched[w.id] = int(out[3 + 2 * i])

    async def dispatched(self, request: RouteRequest, worker: Worker,
                         session: str | None) -> None:
        await super().dispatched(request, worker, session)
        hashes = request.hashes_for(worker) \
            if getattr(self.pool.policy, "wants_digest", False) else []
        load = await self._call("route", "DISPATCH", [
            self.replica_id, worker.id, int(time.time() * 1000), self.max_blocks,
            session or "", int(self.session_ttl_s), *hashes])
        if load is not None:
            self._reserved[worker.id] = self._reserved.get(worker.id, 0) + 1
            worker.in_flight = int(load)

    async def finished(self, worker: Worker, ok: bool, connect_error: bool = False) -> None:
        was_closed = worker.breaker.state == worker.breaker.CLOSED
        worker.in_flight = max(0, worker.in_flight - 1)
        self.settle(worker, ok, connect_error)
        out = None
        if self._reserved.get(worker.id, 0) > 0:
            self._reserved[worker.id] -= 1
            out = await self._call("route", "FINISH", [self.replica_id, worker.id])
        if out is not None:
            worker.in_flight = int(out[0])
            if out[1]:
                self.pool.forget(worker.id)
        elif self.degraded:
            self.pool.maybe_remove(worker)  # the cache decides while Redis is away
        if connect_error:
            await self._mark(worker, b"unhealthy", self.health_ttl_ms)
        elif was_closed and worker.breaker.state != worker.breaker.CLOSED:
            await self._mark(worker, b"breaker", max(1, int(worker.breaker.cooldown_s * 1000)))

    async def _mark(self, worker: Worker, mark: bytes | None, ttl_ms: int = 0) -> None:
        if self._up is False:
            return
        key = self.prefix + "down:" + worker.id
        try:
            if mark is None:
                await self.redis.delete(key)
            else:
                await self.redis.set(key, mark, px=ttl_ms)
        except Exception as e:  # noqa: BLE001
            self._failed("health", e)

    async def health_result(self, worker: Worker, ok: bool) -> None:
        """A passing check clears the shared mark (it is down for all until one
        passes); a failing one (re)sets it with a fresh TTL."""
        if ok:
            await self._mark(worker, None)
        elif not worker.healthy:
            await self._mark(worker, b"unhealthy", self.health_ttl_ms)

    async def digest(self, worker: Worker, hashes: list[bytes], version: int,
                     asked_at_wall: float) -> None:
        await self._call("digest", "DIGEST", [worker.id, str(version),
                                              int(asked_at_wall * 1000), *hashes])
