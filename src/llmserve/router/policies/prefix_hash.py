"""``prefix_hash``: consistent hashing of the first prompt blocks, with bounded load.

The key is the chained hash of the first ``prefix_blocks`` full blocks (so it
names the whole leading prefix); a prompt shorter than one block has an empty key
and goes to the least-loaded worker. The ring holds ``virtual_nodes`` points per
worker (SHA-256 of ``"{id}#{i}"``); it is rebuilt whenever the set of eligible
workers changes (membership, health), so a departed worker never keeps a range
(sglang issue 22835). Bounded load (Mirrokni, Thorup, Zadimoghaddam 2016,
"Consistent Hashing with Bounded Loads"): walking clockwise from the key, the
first worker whose in-flight count is below ``ceil(load_factor * (total + 1) / n)``
takes the request.
"""

from __future__ import annotations

import bisect
import hashlib
import math

from llmserve.router.policies.base import (
    Decision,
    RouteRequest,
    RoutingPolicy,
    least_loaded,
    register_policy,
)
from llmserve.router.worker import Worker


def _point(data: bytes) -> int:
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "big")


@register_policy
class PrefixHashPolicy(RoutingPolicy):
    """Raises: ValueError for ``prefix_blocks`` or ``virtual_nodes`` < 1, or
    ``load_factor`` < 1."""

    name = "prefix_hash"
    needs_tokens = True

    def __init__(self, prefix_blocks: int = 4, virtual_nodes: int = 160,
                 load_factor: float = 1.25) -> None:
        if prefix_blocks < 1 or virtual_nodes < 1:
            raise ValueError("prefix_blocks and virtual_nodes must be >= 1")
        if load_factor < 1.0:
            raise ValueError("load_factor must be >= 1.0")
        self.prefix_blocks = prefix_blocks
        self.virtual_nodes = virtual_nodes
        self.load_factor = load_factor
        self._members: tuple[str, ...] = ()
        self._points: list[int] = []
        self._owners: list[str] = []

    def _rebuild(self, ids: tuple[str, ...]) -> None:
        ring = sorted((_point(f"{wid}#{i}".encode()), wid)
                      for wid in ids for i in range(self.virtual_nodes))
        self._points = [p for p, _ in ring]
        self._owners = [wid for _, wid in ring]
        self._members = ids

    def ring_owner_order(self, key: bytes, ids: tuple[str, ...]) -> list[str]:
        """Distinct worker ids clockwise from ``key``'s point on the ring of ``ids``."""
        if ids != self._members:
            self._rebuild(ids)
        start = bisect.bisect_left(self._points, _point(key))
        order: list[str] = []
        for j in range(len(self._points)):
            wid = self._owners[(start + j) % len(self._points)]
            if wid not in order:
                order.append(wid)
                if len(order) == len(ids):
                    break
        return order

    def select(self, request: RouteRequest, workers: list[Worker]) -> Decision:
        if not request.block_hashes:
            return Decision(least_loaded(workers), "miss")
        key = request.block_hashes[min(self.prefix_blocks, len(request.block_hashes)) - 1]
        by_id = {w.id: w for w in workers}
        ids = tuple(sorted(by_id))
        total = sum(w.in_flight for w in workers)
        cap = math.ceil(self.load_factor * (total + 1) / len(workers))
        order = self.ring_owner_order(key, ids)
        for wid in order:
            if by_id[wid].in_flight < cap:
                reason = "hash" if wid == order[0] else "balance"
                return Decision(by_id[wid], reason)
        return Decision(least_loaded(workers), "balance")  # unreachable: some w < cap

    def on_remove(self, worker_id: str) -> None:
        self._members = ()  # force a rebuild
