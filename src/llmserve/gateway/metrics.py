"""Prometheus metrics of one gateway process (its own registry, served at /metrics).

- ``llmserve_gateway:requests_total{key,team,model,code}``: finished requests by HTTP code
- ``llmserve_gateway:rate_limit_rejections_total{key,team,limit}``: 429s by limit kind
- ``llmserve_gateway:upstream_latency_seconds{model}``: request sent -> upstream's
  response headers (for a stream: time to its first byte)
- ``llmserve_gateway:request_duration_seconds{model}``: arrival -> response ended
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("llmserve_gateway:requests", "Requests by key, team, model "
                                "and HTTP status code", ["key", "team", "model", "code"],
                                registry=self.registry)
        self.rejections = Counter("llmserve_gateway:rate_limit_rejections",
                                  "Requests refused by a rate limit or quota",
                                  ["key", "team", "limit"], registry=self.registry)
        self.upstream_latency = Histogram("llmserve_gateway:upstream_latency_seconds",
                                          "Upstream time to response headers", ["model"],
                                          buckets=BUCKETS, registry=self.registry)
        self.duration = Histogram("llmserve_gateway:request_duration_seconds",
                                  "Gateway request duration, arrival to end", ["model"],
                                  buckets=BUCKETS, registry=self.registry)
