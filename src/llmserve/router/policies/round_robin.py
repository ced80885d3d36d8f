"""``round_robin``: each request to the next eligible worker in id order (the
counter is shared by router replicas when ``request.sequence`` comes from Redis)."""

from __future__ import annotations

from llmserve.router.policies.base import Decision, RouteRequest, RoutingPolicy, register_policy
from llmserve.router.worker import Worker


@register_policy
class RoundRobinPolicy(RoutingPolicy):
    name = "round_robin"
    wants_sequence = True  # across router replicas: a counter in Redis

    def __init__(self) -> None:
        self._next = 0

    def select(self, request: RouteRequest, workers: list[Worker]) -> Decision:
        ordered = sorted(workers, key=lambda w: w.id)
        n = self._next if request.sequence is None else request.sequence
        worker = ordered[n % len(ordered)]
        self._next += 1
        return Decision(worker, "round_robin")
