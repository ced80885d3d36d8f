"""Per-worker state kept by the router: health, circuit breaker, load.

Circuit breaker (as SGLang's router / the classic pattern)::

    CLOSED --failure_threshold consecutive failures--> OPEN
    OPEN   --cooldown_s elapsed--> HALF_OPEN (one trial request at a time)
    HALF_OPEN --success--> CLOSED ;  --failure--> OPEN (cooldown restarts)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


class CircuitBreaker:
    """Counts consecutive failures of one worker; times are ``time.monotonic`` s.

    Raises:
        ValueError: ``failure_threshold`` < 1 or ``cooldown_s`` < 0.
    """

    CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"

    def __init__(self, failure_threshold: int = 3, cooldown_s: float = 5.0,
                 clock=time.monotonic) -> None:
        if failure_threshold < 1:
            raise ValueError(f"failure_threshold must be >= 1, got {failure_threshold}")
        if cooldown_s < 0:
            raise ValueError(f"cooldown_s must be >= 0, got {cooldown_s}")
        self.failure_threshold = failure_threshold
        self.cooldown_s = cooldown_s
        self.clock = clock
        self.failures = 0
        self.opened_at: float | None = None
        self.trial_in_flight = False

    @property
    def state(self) -> str:
        if self.opened_at is None:
            return self.CLOSED
        if self.clock() - self.opened_at >= self.cooldown_s:
            return self.HALF_OPEN
        return self.OPEN

    def allows(self) -> bool:
        """May a request be sent now (a half-open breaker lets one trial through)?"""
        s = self.state
        return s == self.CLOSED or (s == self.HALF_OPEN and not self.trial_in_flight)

    def on_send(self) -> None:
        if self.state == self.HALF_OPEN:
            self.trial_in_flight = True

    def record_success(self) -> None:
        self.failures = 0
        self.opened_at = None
        self.trial_in_flight = False

    def record_failure(self) -> None:
        self.failures += 1
        self.trial_in_flight = False
        if self.state == self.HALF_OPEN or self.failures >= self.failure_threshold:
            self.opened_at = self.clock()


@dataclass
class WorkerLoad:
    """The last scrape of a worker's Prometheus ``/metrics`` (``llmserve:`` names)."""

    num_requests_running: float = 0.0
    num_requests_waiting: float = 0.0
    kv_cache_usage_perc: float = 0.0  # 0..1
    scraped: bool = False  # False: the worker publishes none of these (third-party)


@dataclass
class Worker:
    """One worker behind the router. ``in_flight`` counts requests the router has
    sent and not yet seen finish (SGLang's router load)."""

    id: str
    url: str
    healthy: bool = True
    draining: bool = False
    in_flight: int = 0
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)
    load: WorkerLoad = field(default_factory=WorkerLoad)
    models: list[dict] | None = None  # its /v1/models cards; None: not known yet
    digest_version: int | None = None  # version of its last /kv_cache/digest

    def serves(self, model: str | None) -> bool:
        """Does it serve ``model`` (True for no model, or while its list is unknown)?"""
        return model is None or self.models is None or any(
            m.get("id") == model for m in self.models)

    def lora_int_id(self, name: str | None) -> int | None:
        """The ``lora_int_id`` this worker's card publishes for adapter ``name``."""
        for m in self.models or ():
            if m.get("id") == name and m.get("parent") is not None:
                lid = m.get("lora_int_id")
                return lid if isinstance(lid, int) and not isinstance(lid, bool) else None
        return None

    def eligible(self) -> bool:
        """Can take a new request: healthy, not draining, breaker not open."""
        return self.healthy and not self.draining and self.breaker.allows()

    def describe(self) -> dict:
        return {"id": self.id, "url": self.url, "healthy": self.healthy,
                "draining": self.draining, "in_flight": self.in_flight,
                "circuit": self.breaker.state,
                "num_requests_running": self.load.num_requests_running,
                "num_requests_waiting": self.load.num_requests_waiting,
                "kv_cache_usage_perc": self.load.kv_cache_usage_perc,
                "models": None if self.models is None else [m.get("id") for m in self.models],
                "kv_digest_version": self.digest_version}
