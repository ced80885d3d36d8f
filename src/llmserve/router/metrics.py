"""The router's Prometheus metrics, under ``llmserve_router:``.

========================================== ======= ==========================================
llmserve_router:requests_total              counter requests sent to a worker, ``worker`` label
llmserve_router:routing_decisions_total     counter picks by ``reason``: cache_hit, balance,
                                                    miss, failover, session, hash, load,
                                                    round_robin
llmserve_router:cache_hit_tokens_total      counter prompt tokens the router expected cached
                                                    on the worker it picked (cache_hit)
llmserve_router:retries_total               counter attempts that failed before the first byte
                                                    and were retried, ``worker`` = the failed one
llmserve_router:request_errors_total        counter requests answered with an error by the
                                                    router, by ``reason``
llmserve_router:worker_healthy              gauge   1 healthy / 0 not, ``worker`` label
llmserve_router:worker_in_flight            gauge   router requests outstanding per worker
llmserve_router:tier_requests_total         counter tiered requests by ``alias`` and the
                                                    ``model`` of the tier that answered
llmserve_router:tier_escalations_total      counter retries on a larger tier, by ``alias``,
                                                    ``from_model``, ``to_model``
llmserve_router:redis_up                    gauge   1 while the shared state (``--redis-url``)
                                                    answers, 0 while degraded (or no Redis)
llmserve_router:redis_errors_total          counter failed Redis calls by ``op`` (route,
                                                    sync, admin, health, digest)
========================================== ======= ==========================================
"""

from __future__ import annotations

import contextlib

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    generate_latest,
)

PREFIX = "llmserve_router:"


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(PREFIX + "requests", "requests sent to a worker",
                                ["worker"], registry=r)
        self.decisions = Counter(PREFIX + "routing_decisions", "routing decisions by reason",
                                 ["reason"], registry=r)
        self.cache_hit_tokens = Counter(PREFIX + "cache_hit_tokens",
                                        "prompt tokens expected cached on the chosen worker",
                                        registry=r)
        self.retries = Counter(PREFIX + "retries", "attempts retried before the first byte",
                               ["worker"], registry=r)
        self.errors = Counter(PREFIX + "request_errors", "requests answered with an error",
                              ["reason"], registry=r)
        self.healthy = Gauge(PREFIX + "worker_healthy", "1 if the worker is healthy",
                             ["worker"], registry=r)
        self.in_flight = Gauge(PREFIX + "worker_in_flight", "router requests outstanding",
                               ["worker"], registry=r)
        self.tier_requests = Counter(PREFIX + "tier_requests", "tiered requests by the "
                                     "tier that answered", ["alias", "model"], registry=r)
        self.tier_escalations = Counter(PREFIX + "tier_escalations", "retries on a larger "
                                        "tier", ["alias", "from_model", "to_model"],
                                        registry=r)

        self.redis_up = Gauge(PREFIX + "redis_up", "1 while the shared router state "
                              "(Redis) answers", registry=r)
        self.redis_errors = Counter(PREFIX + "redis_errors", "failed Redis calls", ["op"],
                                    registry=r)

    def render(self, workers) -> tuple[bytes, str]:
        for w in workers:
            self.healthy.labels(w.id).set(1 if w.healthy else 0)
            self.in_flight.labels(w.id).set(w.in_flight)
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def forget(self, worker_id: str) -> None:
        for g in (self.healthy, self.in_flight):
            with contextlib.suppress(KeyError):
                g.remove(worker_id)
