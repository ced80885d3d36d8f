"""The dashboard's memory: metric snapshots sampled every ``interval_s`` seconds for
the last ``keep_s`` seconds, and the time series the page plots from them.

Each point ``t`` of a rate or percentile series looks back ``rate_window_s`` seconds
(the newest sample at or before ``t - rate_window_s``), as PromQL's
``rate(x[10s])`` and ``histogram_quantile(q, rate(x_bucket[10s]))`` do; a counter
that went down (a restart, a worker that left the pool) counts from zero.

========================  =======  ====================================================
series                    unit     from
========================  =======  ====================================================
ttft_p50/p90/p99          s        llmserve:time_to_first_token_seconds
tpot_p50/p90/p99          s        llmserve:time_per_output_token_seconds
itl_p50/p90/p99           s        llmserve:inter_token_latency_seconds
e2e_p50/p90/p99           s        llmserve:e2e_request_latency_seconds
request_throughput        req/s    llmserve:request_success_total
prompt_throughput         tok/s    llmserve:prompt_tokens_total
generation_throughput     tok/s    llmserve:generation_tokens_total
num_requests_running      reqs     gauge (summed over workers)
num_requests_waiting      reqs     gauge (summed over workers)
kv_cache_usage_perc       0..1     gauge (mean over workers)
prefix_cache_hit_rate     0..1     hits / queries of llmserve:prefix_cache_*_total
spec_acceptance_rate      0..1     accepted / draft tokens of
                                   llmserve:spec_decode_num_{accepted,draft}_tokens_total
preemptions               1/s      llmserve:num_preemptions_total
========================  =======  ====================================================

A value is None (JSON null, a gap in the chart) when nothing happened in its
window (no request finished, no prefix looked up, no speculative decoding).
"""

from __future__ import annotations

import bisect
import contextlib
import threading
from collections import deque
from collections.abc import Callable

from llmserve.metrics.snapshot import Snapshot, histogram_delta, histogram_quantile

P = "llmserve:"
QUANTILES = (0.5, 0.9, 0.99)
LATENCIES = {"ttft": P + "time_to_first_token_seconds",
             "tpot": P + "time_per_output_token_seconds",
             "itl": P + "inter_token_latency_seconds",
             "e2e": P + "e2e_request_latency_seconds"}
RATES = {"request_throughput": P + "request_success_total",
         "prompt_throughput": P + "prompt_tokens_total",
         "generation_throughput": P + "generation_tokens_total",
         "preemptions": P + "num_preemptions_total"}
GAUGES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
RATIOS = {"prefix_cache_hit_rate": (P + "prefix_cache_hits_total",
                                    P + "prefix_cache_queries_total"),
          "spec_acceptance_rate": (P + "spec_decode_num_accepted_tokens_total",
                                   P + "spec_decode_num_draft_tokens_total")}
TOTALS = {"requests": P + "request_success_total", "prompt_tokens": P + "prompt_tokens_total",
          "generation_tokens": P + "generation_tokens_total",
          "preemptions": P + "num_preemptions_total",
          "prefix_cache_hits": P + "prefix_cache_hits_total",
          "prefix_cache_queries": P + "prefix_cache_queries_total",
          "spec_accepted_tokens": P + "spec_decode_num_accepted_tokens_total",
          "spec_draft_tokens": P + "spec_decode_num_draft_tokens_total"}


def _delta(new: float | None, old: float | None) -> float:
    if new is None:
        return 0.0
    if old is None or new < old:  # first sample of it, or a reset
        return new if old is not None else 0.0
    return new - old


class MetricsHistory:
    """A ring of snapshots (thread-safe; one sampler adds, any reader reads).

    Args:
        interval_s: seconds between samples (the sampler's period, > 0).
        keep_s: how much history to keep, seconds (>= interval_s).

    Raises:
        ValueError: ``interval_s`` <= 0 or ``keep_s`` < ``interval_s``.
    """

    def __init__(self, interval_s: float = 1.0, keep_s: float = 600.0) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        if keep_s < interval_s:
            raise ValueError(f"keep_s must be >= interval_s, got {keep_s} < {interval_s}")
        self.interval_s, self.keep_s = interval_s, keep_s
        self._ring: deque[Snapshot] = deque(maxlen=int(keep_s / interval_s) + 1)
        self._lock = threading.Lock()

    def add(self, snap: Snapshot) -> None:
        with self._lock:
            if self._ring and snap["time"] <= self._ring[-1]["time"]:
                return  # clocks only move forward here
            self._ring.append(snap)

    def snapshots(self) -> list[Snapshot]:
        with self._lock:
            return list(self._ring)

    def series(self, window_s: float = 300.0, rate_window_s: float = 10.0) -> dict:
        """The plotted series over the last ``window_s`` seconds (see the module table).

        Returns:
            ``{"interval_s", "window_s", "rate_window_s", "sources", "t": [unix s],
            "series": {name: [value or None, ...]}, "totals": {name: value}}``; every
            series has one value per ``t``.

        Raises:
            ValueError: ``window_s`` or ``rate_window_s`` is not > 0.
        """
        if not window_s > 0 or not rate_window_s > 0:
            raise ValueError(f"window and rate_window must be > 0, got {window_s}, "
                             f"{rate_window_s}")
        snaps = self.snapshots()
        out: dict = {"interval_s": self.interval_s, "window_s": window_s,
                     "rate_window_s": rate_window_s, "t": [], "series": {}, "totals": {},
                     "sources": snaps[-1].get("sources", 0) if snaps else 0}
        names = ([f"{k}_p{round(q * 100)}" for k in LATENCIES for q in QUANTILES]
                 + list(RATES) + list(GAUGES) + list(RATIOS))
        series: dict[str, list] = {n: [] for n in names}
        out["series"] = series
        if not snaps:
            return out
        times = [s["time"] for s in snaps]
        start = times[-1] - window_s
        for i, snap in enumerate(snaps):
            if snap["time"] < start:
                continue
            j = bisect.bisect_right(times, snap["time"] - rate_window_s) - 1
            old = snaps[j] if 0 <= j < i else (snaps[0] if i else None)
            out["t"].append(snap["time"])
            self._point(snap, old, series)
        last = snaps[-1]["counters"]
        out["totals"] = {k: last.get(v) for k, v in TOTALS.items()}
        return out

    @staticmethod
    def _point(snap: Snapshot, old: Snapshot | None, series: dict[str, list]) -> None:
        dt = snap["time"] - old["time"] if old is not None else 0.0
        c, oc = snap["counters"], (old["counters"] if old is not None else {})
        for key, name in LATENCIES.items():
            h = snap["histograms"].get(name)
            if h is None or old is None:
                buckets = None
            else:
                buckets = histogram_delta(h, old["histograms"].get(name))
            for q in QUANTILES:
                v = histogram_quantile(q, buckets) if buckets else None
                series[f"{key}_p{round(q * 100)}"].append(v)
        for key, name in RATES.items():
            d = _delta(c.get(name), oc.get(name))
            series[key].append(d / dt if dt > 0 and name in c else None)
        for key in GAUGES:
            series[key].append(snap["gauges"].get(P + key))
        for key, (num, den) in RATIOS.items():
            dd = _delta(c.get(den), oc.get(den))
            series[key].append(_delta(c.get(num), oc.get(num)) / dd if dd > 0 else None)


class ThreadSampler:
    """Adds ``source()`` to ``history`` every ``history.interval_s`` seconds on a daemon
    thread (the engine server, whose registry is read without I/O). A failing
    ``source`` skips that sample."""

    def __init__(self, history: MetricsHistory, source: Callable[[], Snapshot]) -> None:
        self.history, self.source = history, source
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="llmserve-metrics-history",
                                        daemon=True)

    def start(self) -> ThreadSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while True:
            with contextlib.suppress(Exception):  # a failed read must not kill the loop
                self.history.add(self.source())
            if self._stop.wait(self.history.interval_s):
                return
