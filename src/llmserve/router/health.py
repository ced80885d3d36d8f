"""Active health checks and load scrapes.

Every ``interval_s`` each worker gets ``GET /health`` (200 = healthy; a server
without that route, 404, is healthy while ``GET /v1/models`` answers 200) and
``GET /metrics`` (its ``llmserve:`` load gauges, for ``least_load``) and
``GET /v1/models`` (which models it serves, for routing by ``model``) and, for
``cache_aware``, ``GET /kv_cache/digest`` (which prefix blocks it holds). A refused
connection marks a worker unhealthy at once; other failures (timeouts, non-200)
after ``unhealthy_threshold`` in a row. One success makes it healthy again and
closes its circuit breaker. A worker without ``llmserve:`` metrics (a third-party
server) keeps ``load.scraped = False`` and is balanced by router in-flight counts.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from llmserve.router.state import WorkerPool
from llmserve.router.worker import Worker, WorkerLoad

logger = logging.getLogger("llmserve.router")

LOAD_GAUGES = {"llmserve:num_requests_running": "num_requests_running",
               "llmserve:num_requests_waiting": "num_requests_waiting",
               "llmserve:kv_cache_usage_perc": "kv_cache_usage_perc"}


def parse_load(text: str) -> WorkerLoad:
    """The load gauges in a Prometheus text page (summed over label sets)."""
    load = WorkerLoad()
    for family in text_string_to_metric_families(text):
        field = LOAD_GAUGES.get(family.name)
        if field is None:
            continue
        setattr(load, field, sum(s.value for s in family.samples))
        load.scraped = True
    return load


class HealthChecker:
    def __init__(self, pool: WorkerPool, client: httpx.AsyncClient, interval_s: float = 2.0,
                 timeout_s: float = 2.0, unhealthy_threshold: int = 2,
                 block_size: int = 16, state=None) -> None:
        self.pool = pool
        self.state = state  # a shared_state.MemoryState (or RedisState); None: none
        self.block_size = block_size
        self.client = client
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.unhealthy_threshold = unhealthy_threshold
        self._fails: dict[str, int] = {}

    async def check(self, w: Worker) -> None:
        try:
            r = await self.client.get(w.url + "/health", timeout=self.timeout_s)
            ok = r.status_code == 200
            if r.status_code == 404:  # no /health (llama-cpp-python's server): ask /v1/models
                r = await self.client.get(w.url + "/v1/models", timeout=self.timeout_s)
                ok = r.status_code == 200
        except httpx.ConnectError:
            self._fails[w.id] = self.unhealthy_threshold
            ok = False
        except httpx.HTTPError:
            ok = False
        if ok:
            if not w.healthy:
                logger.warning("worker %s (%s) is healthy again", w.id, w.url)
            self._fails[w.id] = 0
            w.healthy = True
            w.breaker.record_success()
            try:
                m = await self.client.get(w.url + "/metrics", timeout=self.timeout_s)
                if m.status_code == 200:
                    w.load = parse_load(m.text)
            except (httpx.HTTPError, ValueError):
                pass
            await self.refresh_models(w)
            await self._digest(w)
        else:
            n = self._fails.get(w.id, 0) + (
                0 if self._fails.get(w.id, 0) >= self.unhealthy_threshold else 1)
            self._fails[w.id] = n
            if n >= self.unhealthy_threshold and w.healthy:
                logger.warning("worker %s (%s) is unhealthy", w.id, w.url)
                w.healthy = False
        if self.state is not None:
            await self.state.health_result(w, ok)

    async def refresh_models(self, w: Worker) -> None:
        """Refresh the worker's ``/v1/models`` cards (kept as they were on failure, so
        a worker that needs a key for it stays "serves anything")."""
        try:
            r = await self.client.get(w.url + "/v1/models", timeout=self.timeout_s)
            data = r.json().get("data") if r.status_code == 200 else None
            if isinstance(data, list):
                w.models = [m for m in data if isinstance(m, dict)
                            and isinstance(m.get("id"), str)]
        except (httpx.HTTPError, ValueError, AttributeError):
            pass

    async def _digest(self, w: Worker) -> None:
        """Feed a ``cache_aware`` policy the worker's ``/kv_cache/digest`` (what its
        prefix cache holds); 304 = unchanged; a worker without the route is skipped."""
        policy = self.pool.policy
        if not getattr(policy, "wants_digest", False):
            return
        asked_at, asked_at_wall = policy.clock(), time.time()
        params = {} if w.digest_version is None else {"if_version": w.digest_version}
        try:
            r = await self.client.get(w.url + "/kv_cache/digest", params=params,
                                      timeout=self.timeout_s)
            if r.status_code != 200:
                return
            d = r.json()
            raw = base64.b64decode(d["hashes"])
            if d["block_size"] != self.block_size or len(raw) % 32:
                logger.warning("worker %s publishes %s-token blocks, the router uses %s: "
                               "digest ignored", w.id, d["block_size"], self.block_size)
                return
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            return
        hashes = [raw[i:i + 32] for i in range(0, len(raw), 32)]
        policy.on_digest(w.id, hashes, asked_at)
        w.digest_version = d["version"]
        if self.state is not None:
            await self.state.digest(w, hashes, d["version"],
                                    asked_at_wall - getattr(policy, "digest_grace_s", 0.0))

    async def run_once(self) -> None:
        await asyncio.gather(*(self.check(w) for w in list(self.pool.workers.values())))

    async def run(self) -> None:
        while True:
            try:
                await self.run_once()
            except Exception:  # never let the loop die
                logger.exception("health check round failed")
            await asyncio.sleep(self.interval_s)
