"""The autoscaler's decision logic: pure functions of the samples it has seen (no
I/O, no clock), after Knative's KPA (stable and panic windows) with the targets of
vLLM production-stack / llm-d (waiting requests 5 per replica, KV usage 0.8).

Each sample is turned into a *demand* per metric, in replicas::

    waiting:  num_requests_waiting (sum over replicas) / target_num_requests_waiting
    concurrency: (num_requests_running + num_requests_waiting) / target_concurrency
    kv:       replicas * kv_cache_usage (mean)      / target_kv_cache_usage
    ttft:     replicas * ttft_p90_s                 / target_ttft_p90_s

A decision at time ``t`` with ``current`` replicas::

    stable  = ceil(max over metrics of the mean demand in (t - stable_window_s, t])
    panic   = ceil(max over metrics of the mean demand in (t - panic_window_s,  t])
    panic >= panic_threshold * current  -> panic mode until t + stable_window_s
    desired = max(current, panic) in panic mode (never down), else stable
    desired <= ceil(current * max_scale_up_rate);  >= floor(current / max_scale_down_rate)
    desired in [min, max] (min 0 only with scale_to_zero; 0 -> 1 when requests wait)
    a change needs scale_up_cooldown_s / scale_down_cooldown_s since the last change
    (decided, or completed: the caller reports a slow scale-up with ``applied(t)``)

Source: Knative Serving autoscaler (pkg/autoscaler/scaling/autoscaler.go), KServe's
defaults (stable 60 s, panic 6 s at 200%).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from llmserve.deploy.spec import AutoscalingSpec

EPS = 1e-9


@dataclass(frozen=True)
class Sample:
    """What the replicas reported at time ``t`` (seconds, any origin).

    ``num_requests_waiting``: total over replicas; ``kv_cache_usage``: mean, 0..1;
    ``ttft_p90_s``: p90 time to first token since the previous sample (None: no
    requests finished their first token); ``replicas``: how many reported."""

    t: float
    replicas: int
    num_requests_waiting: float = 0.0
    kv_cache_usage: float = 0.0
    ttft_p90_s: float | None = None
    num_requests_running: float = 0.0


@dataclass(frozen=True)
class Decision:
    t: float
    current: int
    desired: int
    reason: str
    panic: bool
    stable_demand: float
    panic_demand: float


def demands(s: Sample, cfg: AutoscalingSpec) -> dict[str, float]:
    """Replicas each metric asks for at sample ``s`` (only the targets that are set)."""
    out: dict[str, float] = {}
    if cfg.target_num_requests_waiting:
        out["waiting"] = s.num_requests_waiting / cfg.target_num_requests_waiting
    if cfg.target_concurrency:
        out["concurrency"] = (s.num_requests_running + s.num_requests_waiting) \
            / cfg.target_concurrency
    if cfg.target_kv_cache_usage:
        out["kv"] = s.replicas * s.kv_cache_usage / cfg.target_kv_cache_usage
    if cfg.target_ttft_p90_s and s.ttft_p90_s is not None:
        out["ttft"] = s.replicas * s.ttft_p90_s / cfg.target_ttft_p90_s
    return out


def window_demand(samples, t: float, window_s: float, cfg: AutoscalingSpec) -> float | None:
    """max over metrics of the mean demand of the samples in ``(t - window_s, t]``;
    None without samples there."""
    inside = [s for s in samples if t - window_s < s.t <= t + EPS]
    if not inside:
        return None
    sums: dict[str, list[float]] = {}
    for s in inside:
        for k, v in demands(s, cfg).items():
            sums.setdefault(k, []).append(v)
    return max((sum(v) / len(v) for v in sums.values()), default=0.0)


class Autoscaler:
    """Keeps the samples of the last stable window and the panic/cooldown state.

    Raises:
        ValueError: ``min_replicas`` > ``max_replicas``, or 0 without scale_to_zero.
    """

    def __init__(self, cfg: AutoscalingSpec, min_replicas: int, max_replicas: int) -> None:
        if min_replicas > max_replicas or max_replicas < 1:
            raise ValueError(f"replicas: min {min_replicas} / max {max_replicas}")
        if min_replicas == 0 and not cfg.scale_to_zero:
            raise ValueError("replicas.min 0 needs autoscaling.scale_to_zero")
        self.cfg, self.min, self.max = cfg, min_replicas, max_replicas
        self.samples: deque[Sample] = deque()
        self.panic_until = -math.inf
        self.last_change = -math.inf

    def observe(self, sample: Sample) -> None:
        self.samples.append(sample)
        while self.samples and self.samples[0].t <= sample.t - self.cfg.stable_window_s:
            self.samples.popleft()

    def applied(self, t: float) -> None:
        """The last change finished at ``t`` (a new worker is serving, a drained one
        stopped): the cooldowns count from here."""
        self.last_change = max(self.last_change, t)

    def decide(self, t: float, current: int) -> Decision:
        """The replica count to run now (see the module docstring). A returned change
        is taken as applied at ``t`` (it starts the cooldown)."""
        c = self.cfg
        stable = window_demand(self.samples, t, c.stable_window_s, c)
        panic = window_demand(self.samples, t, c.panic_window_s, c)
        if stable is None or panic is None:
            return Decision(t, current, current, "no metrics", False, 0.0, 0.0)
        want_stable = math.ceil(stable - EPS)
        want_panic = math.ceil(panic - EPS)
        if want_panic >= c.panic_threshold * max(current, 1) and want_panic > current:
            self.panic_until = t + c.stable_window_s
        in_panic = t < self.panic_until
        if in_panic:
            desired, reason = max(current, want_panic), "panic window"
        else:
            desired, reason = want_stable, "stable window"
        up_cap = max(1, math.ceil(current * c.max_scale_up_rate - EPS))
        down_floor = math.floor(current / c.max_scale_down_rate + EPS)
        if desired > up_cap:
            desired, reason = up_cap, reason + ", scale-up rate"
        if desired < down_floor:
            desired, reason = down_floor, reason + ", scale-down rate"
        floor = self.min
        if floor == 0 and self.samples and self.samples[-1].num_requests_waiting > 0:
            floor = 1  # requests wait at zero replicas: wake one up
        clipped = min(max(desired, floor), self.max)
        if clipped != desired:
            reason += f", bounds [{floor}, {self.max}]"
        desired = clipped
        since = t - self.last_change
        if desired > current and since < c.scale_up_cooldown_s:
            return Decision(t, current, current, "scale-up cooldown", in_panic, stable, panic)
        if desired < current and since < c.scale_down_cooldown_s:
            return Decision(t, current, current, "scale-down cooldown", in_panic, stable,
                            panic)
        if desired != current:
            self.last_change = t
        return Decision(t, current, desired, reason, in_panic, stable, panic)


def simulate(trace: list[dict], cfg: AutoscalingSpec, min_replicas: int, max_replicas: int,
             start_replicas: int | None = None, startup_s: float = 0.0) -> list[Decision]:
    """Replay a load trace: rows ``{t, num_requests_waiting, kv_cache_usage,
    ttft_p90_s}`` where the totals are what *one replica's worth* of load showed
    (``kv_cache_usage`` and ``ttft_p90_s`` at one replica; they are divided by the
    replicas running, ``num_requests_waiting`` is a total). New replicas count after
    ``startup_s``. Returns one decision per row."""
    scaler = Autoscaler(cfg, min_replicas, max_replicas)
    ready = start_replicas if start_replicas is not None else max(min_replicas, 1)
    pending: list[tuple[float, int]] = []  # (ready at, replicas)
    out = []
    for row in sorted(trace, key=lambda r: r["t"]):
        t = float(row["t"])
        ready += sum(n for at, n in pending if at <= t)
        pending = [(at, n) for at, n in pending if at > t]
        n = max(ready, 1)
        ttft = row.get("ttft_p90_s")
        scaler.observe(Sample(t, ready, float(row.get("num_requests_waiting", 0.0)),
                              min(1.0, float(row.get("kv_cache_usage", 0.0)) / n),
                              None if ttft is None else float(ttft) / n))
        target_total = ready + sum(n for _, n in pending)
        d = scaler.decide(t, target_total)
        if d.desired > target_total:
            pending.append((t + startup_s, d.desired - target_total))
            if startup_s == 0:
                ready += d.desired - target_total
                pending.pop()
        elif d.desired < target_total:
            ready -= target_total - d.desired
        out.append(d)
    return out
