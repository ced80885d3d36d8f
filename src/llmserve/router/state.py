"""The router's worker pool and routing decision (no I/O here).

``pick`` filters to eligible workers (healthy, not draining, breaker allowing,
not already tried for this request), applies session affinity (a session key
sticks to the worker that served it while that worker is eligible), then asks
the policy.
"""

from __future__ import annotations

from collections import OrderedDict
from urllib.parse import urlparse

from llmserve.router.metrics import RouterMetrics
from llmserve.router.policies import Decision, RouteRequest, RoutingPolicy
from llmserve.router.worker import CircuitBreaker, Worker


def normalize_url(url: str) -> str:
    """``http(s)://host:port`` without a trailing slash.

    Raises:
        ValueError: not an http(s) URL with a host.
    """
    u = urlparse(url.strip())
    if u.scheme not in ("http", "https") or not u.netloc:
        raise ValueError(f"worker: {url!r} is not an http(s)://host:port URL")
    return url.strip().rstrip("/")


class WorkerPool:
    """Workers by id, the policy and the session table (LRU, ``max_sessions``)."""

    def __init__(self, policy: RoutingPolicy, metrics: RouterMetrics | None = None,
                 failure_threshold: int = 3, cooldown_s: float = 5.0,
                 max_sessions: int = 100_000) -> None:
        self.policy = policy
        self.metrics = metrics or RouterMetrics()
        self.failure_threshold = failure_threshold
        self.cooldown_s = cooldown_s
        self.workers: dict[str, Worker] = {}
        self.sessions: OrderedDict[str, str] = OrderedDict()
        self.max_sessions = max_sessions
        self._next_id = 0

    def add(self, url: str, worker_id: str | None = None) -> Worker:
        """Add a worker (healthy until a check says otherwise).

        Raises:
            ValueError: bad URL, or the URL or id is already in the pool.
        """
        url = normalize_url(url)
        if any(w.url == url for w in self.workers.values()):
            raise ValueError(f"worker: {url} is already in the pool")
        if worker_id is None:
            while f"w{self._next_id}" in self.workers:
                self._next_id += 1
            worker_id = f"w{self._next_id}"
            self._next_id += 1
        elif not worker_id or worker_id in self.workers:
            raise ValueError(f"id: {worker_id!r} is empty or already in the pool")
        w = Worker(worker_id, url, breaker=CircuitBreaker(self.failure_threshold,
                                                          self.cooldown_s))
        self.workers[worker_id] = w
        return w

    def drain(self, worker_id: str) -> Worker:
        """Stop sending new requests to ``worker_id``; it is removed once idle.

        Raises:
            KeyError: no such worker.
        """
        w = self.workers[worker_id]
        w.draining = True
        self.maybe_remove(w)
        return w

    def maybe_remove(self, w: Worker) -> None:
        if w.draining and w.in_flight == 0 and self.workers.get(w.id) is w:
            self.forget(w.id)

    def forget(self, worker_id: str) -> None:
        """Drop ``worker_id`` from the pool, the policy, the metrics and sessions."""
        if self.workers.pop(worker_id, None) is None:
            return
        self.policy.on_remove(worker_id)
        self.metrics.forget(worker_id)
        for key in [k for k, v in self.sessions.items() if v == worker_id]:
            del self.sessions[key]

    def eligible(self, exclude: set[str] = frozenset(),
                 model: str | None = None) -> list[Worker]:
        return [w for w in self.workers.values() if w.id not in exclude and w.eligible()
                and w.serves(model)]

    def known_model(self, model: str | None) -> bool:
        """False only when every worker's model list is known and none has ``model``."""
        return model is None or any(w.serves(model) for w in self.workers.values()) \
            or not self.workers

    def pick(self, request: RouteRequest, session: str | None = None,
             exclude: set[str] = frozenset(), model: str | None = None) -> Decision | None:
        """The worker for ``request`` among those serving ``model`` (None when no
        worker is eligible)."""
        workers = self.eligible(exclude, model)
        if not workers:
            return None
        if session is not None:
            wid = self.sessions.get(session)
            if wid is not None and any(w.id == wid for w in workers):
                self.sessions.move_to_end(session)
                return Decision(self.workers[wid], "session")
        return self.policy.select(request, workers)

    def routed(self, request: RouteRequest, worker: Worker, session: str | None) -> None:
        """``worker`` accepted ``request``: update the policy and the session table."""
        self.policy.on_routed(request, worker)
        self.remember_session(session, worker.id)

    def remember_session(self, session: str | None, worker_id: str) -> None:
        """``session`` sticks to ``worker_id`` (LRU bounded by ``max_sessions``)."""
        if session is not None:
            self.sessions[session] = worker_id
            self.sessions.move_to_end(session)
            while len(self.sessions) > self.max_sessions:
                self.sessions.popitem(last=False)

    def lora_name(self, model: str | None) -> str | None:
        """``model`` when some worker serves it as a LoRA adapter (a card with a
        ``parent``), else None."""
        for w in self.workers.values():
            if any(m.get("id") == model and m.get("parent") is not None
                   for m in w.models or ()):
                return model
        return None
