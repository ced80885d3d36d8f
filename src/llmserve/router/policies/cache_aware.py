"""``cache_aware``: longest cached prefix, unless load is out of balance.

Per request, with ``loads`` the router's in-flight counts of the eligible workers::

    imbalanced = max(loads) - min(loads) > balance_abs_threshold
                 and max(loads) > min(loads) * balance_rel_threshold
    imbalanced                          -> least-loaded worker        (reason "balance")
    best match / prompt blocks >= cache_threshold -> best-match worker (reason "cache_hit")
    otherwise                           -> least-loaded worker        (reason "miss")

A miss goes to the least-loaded worker, never to the one with the smallest tree
(SGLang PR 14305: sending every miss to the smallest tree melts it).

The router's view of a worker's cache: the block hashes the worker *published*
(its ``GET /kv_cache/digest``, polled with the health checks: exactly what it
holds, evictions included), plus the chained block hashes (:mod:`llmserve.router.prefix`,
the engine's own hash) of every prompt routed there *since* that digest was asked
for, which the router assumes cached until the next digest says (an LRU bounded by
``max_blocks_per_worker``). A worker that publishes no digest (not ours) is seen by
what was routed to it only. Because hashes are chained, block i matching means the
whole prefix up to i matches. With ``--redis-url`` this view is shared by the
router replicas (:mod:`llmserve.router.redis_state`; ``request.matched``) and this
object is the replica's cache of it. Source: SGLang router ``cache_aware`` (approximate radix
tree per worker; ``balance_abs_threshold``, ``balance_rel_threshold``,
``cache_threshold``).
"""

from __future__ import annotations

import time
from collections import OrderedDict

from llmserve.router.policies.base import (
    Decision,
    RouteRequest,
    RoutingPolicy,
    least_loaded,
    register_policy,
)
from llmserve.router.worker import Worker


@register_policy
class CacheAwarePolicy(RoutingPolicy):
    """Args: ``balance_abs_threshold`` (requests, default 32), ``balance_rel_threshold``
    (ratio, default 1.1), ``cache_threshold`` (fraction of prompt blocks, default 0.3),
    ``max_blocks_per_worker`` (LRU bound of the per-worker view), ``digest_grace_s``
    (seconds, default 30: a digest replaces only assumptions routed at least this long
    before it was asked for, since a prompt routed just before may still be prefilling
    and not yet in the worker's cache).

    Raises:
        ValueError: a negative threshold, a ratio < 1, or a bound < 1.
    """

    name = "cache_aware"
    needs_tokens = True
    wants_digest = True  # the health checker feeds it workers' /kv_cache/digest

    def __init__(self, balance_abs_threshold: int = 32, balance_rel_threshold: float = 1.1,
                 cache_threshold: float = 0.3, max_blocks_per_worker: int = 200_000,
                 digest_grace_s: float = 30.0) -> None:
        if balance_abs_threshold < 0:
            raise ValueError("balance_abs_threshold must be >= 0")
        if balance_rel_threshold < 1.0:
            raise ValueError("balance_rel_threshold must be >= 1.0")
        if not 0.0 <= cache_threshold <= 1.0:
            raise ValueError("cache_threshold must be in [0, 1]")
        if max_blocks_per_worker < 1:
            raise ValueError("max_blocks_per_worker must be >= 1")
        if not digest_grace_s >= 0:
            raise ValueError("digest_grace_s must be >= 0")
        self.digest_grace_s = float(digest_grace_s)
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.cache_threshold = cache_threshold
        self.max_blocks_per_worker = max_blocks_per_worker
        self.clock = time.monotonic
        # assumed: hash -> when it was routed there (oldest first); published: the digest
        self._blocks: dict[str, OrderedDict[bytes, float]] = {}
        self._published: dict[str, frozenset[bytes]] = {}

    def matched_blocks(self, worker_id: str, block_hashes: list[bytes]) -> int:
        """Leading blocks of ``block_hashes`` the router believes ``worker_id`` holds."""
        held = self._blocks.get(worker_id) or {}
        published = self._published.get(worker_id, frozenset())
        n = 0
        for h in block_hashes:
            if h not in held and h not in published:
                break
            n += 1
        return n

    def on_digest(self, worker_id: str, hashes: list[bytes], asked_at: float) -> None:
        """The worker holds exactly ``hashes`` as of ``asked_at`` (``self.clock`` time the
        digest was requested): it replaces every assumption made ``digest_grace_s`` or
        more before then (later ones may still be prefilling there)."""
        self._published[worker_id] = frozenset(hashes)
        held = self._blocks.get(worker_id)
        cutoff = asked_at - self.digest_grace_s
        while held and next(iter(held.values())) < cutoff:
            held.popitem(last=False)

    def is_imbalanced(self, workers: list[Worker]) -> bool:
        loads = [w.in_flight for w in workers]
        hi, lo = max(loads), min(loads)
        return hi - lo > self.balance_abs_threshold and hi > lo * self.balance_rel_threshold

    def select(self, request: RouteRequest, workers: list[Worker]) -> Decision:
        if len(workers) > 1 and self.is_imbalanced(workers):
            return Decision(least_loaded(workers), "balance")
        total = len(request.block_hashes)
        if total:
            best, best_n = None, 0
            shared = request.matched or {}
            for w in sorted(workers, key=lambda w: (w.in_flight, w.id)):
                n = shared[w.id] if w.id in shared else \
                    self.matched_blocks(w.id, request.hashes_for(w))
                if n > best_n:
                    best, best_n = w, n
            if best is not None and best_n / total >= self.cache_threshold:
                return Decision(best, "cache_hit", best_n * request.block_size)
        return Decision(least_loaded(workers), "miss")

    def on_routed(self, request: RouteRequest, worker: Worker) -> None:
        held = self._blocks.setdefault(worker.id, OrderedDict())
        now = self.clock()
        for h in request.hashes_for(worker):
            held[h] = now
            held.move_to_end(h)
        while len(held) > self.max_blocks_per_worker:
            held.popitem(last=False)

    def on_remove(self, worker_id: str) -> None:
        self._blocks.pop(worker_id, None)
        self._published.pop(worker_id, None)
