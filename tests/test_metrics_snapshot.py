"""Metric snapshots, merging and the dashboard's series, without a model: against
prometheus_client's own text exposition and numpy's quantiles as oracles."""

from __future__ import annotations

import math

import numpy as np
import pytest

pytest.importorskip("prometheus_client")
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from llmserve.metrics.history import MetricsHistory
from llmserve.metrics.prometheus import TTFT_BUCKETS
from llmserve.metrics.snapshot import (
    histogram_quantile,
    merge_snapshots,
    snapshot_from_registry,
    snapshot_from_text,
)

TTFT = "llmserve:time_to_first_token_seconds"


def registry(ttfts, requests: int, queries: int, hits: int, kv: float):
    reg = CollectorRegistry()
    h = Histogram(TTFT, "ttft", ["model_name"], buckets=TTFT_BUCKETS, registry=reg)
    for v in ttfts:
        h.labels("m").observe(v)
    c = Counter("llmserve:request_success", "done", ["model_name", "finished_reason"],
                registry=reg)
    c.labels("m", "stop").inc(requests)
    c.labels("m", "length").inc(1)
    Counter("llmserve:prefix_cache_queries", "q", registry=reg).inc(queries)
    Counter("llmserve:prefix_cache_hits", "h", registry=reg).inc(hits)
    Gauge("llmserve:kv_cache_usage_perc", "kv", registry=reg).set(kv)
    Gauge("llmserve:num_requests_running", "r", registry=reg).set(requests)
    return reg


def test_registry_and_text_snapshots_agree():
    rng = np.random.default_rng(0)
    reg = registry(rng.exponential(0.3, 200), 7, 100, 40, 0.25)
    a = snapshot_from_registry(reg, now=1.0)
    b = snapshot_from_text(generate_latest(reg).decode(), now=1.0)
    assert a == b
    assert a["counters"]["llmserve:request_success_total"] == 8  # summed over reasons
    assert a["histograms"][TTFT]["count"] == 200
    assert a["histograms"][TTFT]["buckets"][-1] == ["+Inf", 200.0]


def test_merge_equals_one_registry_with_all_observations():
    rng = np.random.default_rng(1)
    x, y = rng.exponential(0.2, 50), rng.exponential(2.0, 70)
    merged = merge_snapshots([snapshot_from_registry(registry(x, 3, 10, 4, 0.2)),
                              snapshot_from_registry(registry(y, 5, 30, 6, 0.6))])
    whole = snapshot_from_registry(registry(np.concatenate([x, y]), 9, 40, 10, 0.0))
    assert merged["sources"] == 2
    assert merged["histograms"][TTFT]["buckets"] == whole["histograms"][TTFT]["buckets"]
    assert merged["histograms"][TTFT]["sum"] == pytest.approx(whole["histograms"][TTFT]["sum"])
    for k in ("llmserve:request_success_total", "llmserve:prefix_cache_hits_total"):
        assert merged["counters"][k] == whole["counters"][k]
    assert merged["gauges"]["llmserve:kv_cache_usage_perc"] == pytest.approx(0.4)  # mean
    assert merged["gauges"]["llmserve:num_requests_running"] == 8  # sum


@pytest.mark.parametrize("q", [0.5, 0.9, 0.99])
def test_quantile_lies_in_the_bucket_of_the_true_quantile(q):
    rng = np.random.default_rng(2)
    for scale in (0.01, 0.3, 5.0):
        obs = rng.exponential(scale, 500)
        snap = snapshot_from_registry(registry(obs, 1, 1, 1, 0))
        buckets = [(math.inf if le == "+Inf" else le, v)
                   for le, v in snap["histograms"][TTFT]["buckets"]]
        est = histogram_quantile(q, buckets)
        true = float(np.quantile(obs, q, method="inverted_cdf"))
        bounds = [0.0, *TTFT_BUCKETS]
        i = next(i for i, b in enumerate(TTFT_BUCKETS) if true <= b)
        assert bounds[i] <= est <= bounds[i + 1], (scale, true, est)
    assert histogram_quantile(0.5, [(1.0, 0.0), (math.inf, 0.0)]) is None
    with pytest.raises(ValueError, match="q must be"):
        histogram_quantile(1.5, buckets)


def test_history_rates_ratios_and_resets():
    hist = MetricsHistory(interval_s=1.0, keep_s=100.0)
    states = [(0, 0, 0, []), (10, 40, 10, [0.05] * 4), (30, 100, 70, [0.5] * 6),
              (2, 20, 5, [0.05])]  # the last: a restart (counters went down)
    for t, (req, queries, hits, ttfts) in enumerate(states):
        hist.add(snapshot_from_registry(registry(ttfts, req, queries, hits, t / 10),
                                        now=100.0 + t))
    out = hist.series(window_s=100, rate_window_s=1.0)
    s = out["series"]
    assert out["t"] == [100.0, 101.0, 102.0, 103.0]
    # +1: the "length" reason counter exists from the start
    assert s["request_throughput"] == [None, 10.0, 20.0, 3.0]
    assert s["prefix_cache_hit_rate"] == [None, 0.25, 1.0, 0.25]
    assert s["kv_cache_usage_perc"] == [0.0, 0.1, 0.2, 0.3]
    assert s["ttft_p50"][0] is None and s["ttft_p50"][1] <= 0.06 and s["ttft_p50"][2] > 0.25
    assert all(v is None for v in s["spec_acceptance_rate"])
    with pytest.raises(ValueError, match="window"):
        hist.series(window_s=0)
