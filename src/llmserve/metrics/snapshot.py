"""Prometheus metrics as a small JSON-able snapshot, merged across processes.

A snapshot is what ``GET /metrics/json`` answers and what the dashboard's history
keeps; it is read from the same registry (or the same text page) as ``/metrics``, so
its numbers are the scrape's numbers, summed over label sets::

    {"time": 1733090000.0,                       # unix seconds when taken
     "sources": 1,                               # processes merged into it
     "counters":   {"llmserve:prompt_tokens_total": 1234.0, ...},
     "gauges":     {"llmserve:num_requests_running": 2.0, ...},
     "histograms": {"llmserve:time_to_first_token_seconds":
                        {"buckets": [[0.001, 0.0], ..., ["+Inf", 7.0]],  # cumulative
                         "count": 7.0, "sum": 0.42}}}

Counters keep their ``_total`` sample name; a histogram is keyed by its family name.
Merging (a router over its workers, a gateway over its upstreams) adds counters,
histogram buckets and most gauges; ``MEAN_GAUGES`` are averaged and ``MAX_GAUGES``
take the largest. Pure Python plus ``prometheus_client`` (serving plane: no torch).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from typing import Any

Snapshot = dict[str, Any]

MEAN_GAUGES = frozenset({"llmserve:kv_cache_usage_perc"})
MAX_GAUGES = frozenset({"llmserve:max_batch_size"})


def empty_snapshot(now: float | None = None) -> Snapshot:
    return {"time": time.time() if now is None else now, "sources": 0, "counters": {},
            "gauges": {}, "histograms": {}}


def _le_key(le: str) -> float:
    return math.inf if le == "+Inf" else float(le)


def snapshot_from_families(families: Iterable[Any], now: float | None = None) -> Snapshot:
    """A snapshot of metric families (``registry.collect()`` or the parsed text page).

    Untyped and summary families are ignored; ``_created`` samples are dropped.
    """
    snap = empty_snapshot(now)
    snap["sources"] = 1
    counters, gauges, hists = snap["counters"], snap["gauges"], snap["histograms"]
    for fam in families:
        if fam.type == "counter":
            for s in fam.samples:
                if s.name.endswith("_total"):
                    counters[s.name] = counters.get(s.name, 0.0) + float(s.value)
        elif fam.type == "gauge":
            for s in fam.samples:
                if s.name.endswith("_created"):  # the text parser's view of _created
                    continue
                gauges[s.name] = gauges.get(s.name, 0.0) + float(s.value)
        elif fam.type == "histogram":
            buckets: dict[str, float] = {}
            count = total = 0.0
            for s in fam.samples:
                if s.name.endswith("_bucket"):
                    le = s.labels["le"]
                    le = "+Inf" if _le_key(le) == math.inf else repr(float(le))
                    buckets[le] = buckets.get(le, 0.0) + float(s.value)
                elif s.name.endswith("_count"):
                    count += float(s.value)
                elif s.name.endswith("_sum"):
                    total += float(s.value)
            ordered = sorted(buckets.items(), key=lambda kv: _le_key(kv[0]))
            hists[fam.name] = {
                "buckets": [[le if le == "+Inf" else float(le), v] for le, v in ordered],
                "count": count, "sum": total}
    return snap


def snapshot_from_registry(registry: Any, now: float | None = None) -> Snapshot:
    """A snapshot of a ``prometheus_client`` ``CollectorRegistry``."""
    return snapshot_from_families(registry.collect(), now)


def snapshot_from_text(text: str, now: float | None = None) -> Snapshot:
    """A snapshot of a Prometheus text page (e.g. a worker's ``/metrics``).

    Raises:
        ValueError: the text is not in the Prometheus exposition format.
    """
    from prometheus_client.parser import text_string_to_metric_families

    return snapshot_from_families(list(text_string_to_metric_families(text)), now)


def merge_snapshots(snaps: Iterable[Snapshot], now: float | None = None) -> Snapshot:
    """One snapshot over several processes (see the module docstring for the rules).

    Histograms with different bucket bounds merge on the union of bounds, each
    source counting at the largest of its own bounds below (a lower bound of the
    true cumulative count, exact when the bounds agree, as between llmserve servers).
    """
    snaps = [s for s in snaps if s]
    out = empty_snapshot(now)
    out["sources"] = sum(int(s.get("sources", 1)) for s in snaps)
    gauge_n: dict[str, int] = {}
    for s in snaps:
        for k, v in s.get("counters", {}).items():
            out["counters"][k] = out["counters"].get(k, 0.0) + v
        for k, v in s.get("gauges", {}).items():
            g = out["gauges"]
            if k in MAX_GAUGES:
                g[k] = max(g.get(k, v), v)
            else:
                g[k] = g.get(k, 0.0) + v
            gauge_n[k] = gauge_n.get(k, 0) + 1
    for k in MEAN_GAUGES & set(out["gauges"]):
        out["gauges"][k] /= gauge_n[k]
    names = {k for s in snaps for k in s.get("histograms", {})}
    for name in names:
        parts = [s["histograms"][name] for s in snaps if name in s.get("histograms", {})]
        bounds = sorted({_le_key(str(le)) for h in parts for le, _ in h["buckets"]})
        merged = [0.0] * len(bounds)
        for h in parts:
            own = [(_le_key(str(le)), v) for le, v in h["buckets"]]
            j, last = 0, 0.0
            for i, b in enumerate(bounds):
                while j < len(own) and own[j][0] <= b:
                    last = own[j][1]
                    j += 1
                merged[i] += last
        out["histograms"][name] = {
            "buckets": [["+Inf" if b == math.inf else b, v] for b, v in zip(bounds, merged)],
            "count": sum(h["count"] for h in parts), "sum": sum(h["sum"] for h in parts)}
    return out


def histogram_delta(new: dict, old: dict | None) -> list[tuple[float, float]]:
    """Cumulative bucket counts observed between two snapshots of one histogram,
    as ``[(upper bound, cumulative count)]``. A reset (a count that went down: the
    process restarted or a worker left) counts from zero, as Prometheus' ``rate``."""
    cur = [(_le_key(str(le)), v) for le, v in new["buckets"]]
    if old is None:
        return cur
    prev = {_le_key(str(le)): v for le, v in old["buckets"]}
    if old["count"] > new["count"] or any(prev.get(b, 0.0) > v for b, v in cur):
        return cur
    return [(b, v - prev.get(b, 0.0)) for b, v in cur]


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """The ``q``-quantile of cumulative buckets, as PromQL's ``histogram_quantile``:
    linear interpolation inside the bucket that holds rank ``q * count`` (the first
    bucket's lower bound is 0); a rank in the ``+Inf`` bucket gives the largest finite
    bound. None when the buckets hold no observation.

    Raises:
        ValueError: ``q`` is not in [0, 1].
    """
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must be in [0, 1], got {q}")
    if not buckets or buckets[-1][1] <= 0:
        return None
    total = buckets[-1][1]
    rank = q * total
    lower, below = 0.0, 0.0
    for upper, cum in buckets:
        if cum >= rank and cum > below:
            if upper == math.inf:
                return lower
            return lower + (upper - lower) * (rank - below) / (cum - below)
        lower, below = (upper if upper != math.inf else lower), cum
    return lower
