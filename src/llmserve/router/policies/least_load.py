"""``least_load``: the worker with the lowest load, from its own ``/metrics``.

Score per worker (lower is better), compared as a tuple::

    (max(running + waiting, in_flight), kv_cache_usage_perc, id)

``running``/``waiting``/``kv_cache_usage_perc`` are the last scrape of
``llmserve:num_requests_running``, ``llmserve:num_requests_waiting`` and
``llmserve:kv_cache_usage_perc``; ``in_flight`` is what the router itself has
outstanding there, which covers the gap between scrapes (and a worker that
publishes no metrics). Source: llm-d's queue and KV-utilization scorers.
"""

from __future__ import annotations

from llmserve.router.policies.base import Decision, RouteRequest, RoutingPolicy, register_policy
from llmserve.router.worker import Worker


def load_score(worker: Worker) -> tuple:
    load = worker.load
    queue = load.num_requests_running + load.num_requests_waiting
    return (max(queue, float(worker.in_flight)), load.kv_cache_usage_perc, worker.id)


@register_policy
class LeastLoadPolicy(RoutingPolicy):
    name = "least_load"

    def select(self, request: RouteRequest, workers: list[Worker]) -> Decision:
        return Decision(min(workers, key=load_score), "load")
