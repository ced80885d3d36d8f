"""``deploy/grafana/llmserve.json``: valid Grafana JSON whose every query names only
metrics (and labels) that the code exports, read from the real exporters' registries
through prometheus_client's own text exposition; every exported family is plotted."""

from __future__ import annotations

import json
import os
import re

import pytest

pytest.importorskip("prometheus_client")
from prometheus_client import generate_latest

from llmserve.gateway.metrics import GatewayMetrics
from llmserve.metrics.prometheus import PrometheusStatLogger
from llmserve.router.metrics import RouterMetrics

ROOT = os.path.join(os.path.dirname(__file__), "..")
PATH = os.path.join(ROOT, "deploy", "grafana", "llmserve.json")
NAME_RE = re.compile(r"\b(llmserve(?:_router|_gateway)?:[A-Za-z0-9_]+)")
SUFFIXES = {"counter": ("",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}


def registries():
    return [PrometheusStatLogger("m").registry, RouterMetrics().registry,
            GatewayMetrics().registry]


def exported() -> dict[str, str]:
    """sample name -> family name, from the exposition's ``# TYPE`` lines (a counter's
    is its ``_total`` name; the ``_created`` gauges are left out)."""
    out = {}
    for reg in registries():
        for line in generate_latest(reg).decode().splitlines():
            if line.startswith("# TYPE ") and not line.endswith("_created gauge"):
                _, _, family, kind = line.split(" ")
                for s in SUFFIXES[kind]:
                    out[family + s] = family
    return out


def labels() -> dict[str, set[str]]:
    """sample name -> the label names its metric was declared with (plus ``le``)."""
    out: dict[str, set[str]] = {}
    for reg in registries():
        for collector, sample_names in reg._collector_to_names.items():
            for n in sample_names:
                out[n] = set(getattr(collector, "_labelnames", ())) | {"le"}
    return out


@pytest.fixture(scope="module")
def board() -> dict:
    with open(PATH, encoding="utf-8") as f:
        return json.load(f)


def targets(board: dict):
    for p in board["panels"]:
        for t in p.get("targets", []):
            yield p, t


def test_every_queried_metric_is_exported_and_every_family_plotted(board):
    names = exported()
    used = set()
    for p, t in targets(board):
        found = NAME_RE.findall(t["expr"])
        assert found, (p["title"], t["expr"])
        for n in found:
            assert n in names, f"panel {p['title']!r} queries {n}, which no code exports"
            used.add(names[n])
    families = set(names.values())
    assert families - used == set(), f"exported but not on the dashboard: {families - used}"


def test_grouping_labels_exist_on_their_metrics(board):
    lbls = labels()
    for p, t in targets(board):
        family_labels = set.union(*(lbls[n] for n in NAME_RE.findall(t["expr"])))
        grouped = {x.strip() for g in re.findall(r"by\s*\(([^)]*)\)", t["expr"])
                   for x in g.split(",")}
        legend = set(re.findall(r"\{\{(\w+)\}\}", t["legendFormat"]))
        selectors = set(re.findall(r"(\w+)=~?\"", t["expr"]))
        for label in grouped | legend | selectors:
            assert label in family_labels, (p["title"], label, t["expr"])


def test_dashboard_structure(board):
    assert board["title"] == "llmserve" and board["uid"] == "llmserve"
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    cells = set()
    for p in board["panels"]:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24
        for dx in range(g["w"]):
            for dy in range(g["h"]):
                cell = (g["x"] + dx, g["y"] + dy)
                assert cell not in cells, f"panel {p['title']!r} overlaps another"
                cells.add(cell)
        if p["type"] != "row":
            refs = [t["refId"] for t in p["targets"]]
            assert len(refs) == len(set(refs)) and p["datasource"]["uid"] == "${DS_PROMETHEUS}"
    variables = {v["name"] for v in board["templating"]["list"]}
    assert {"DS_PROMETHEUS", "model_name"} <= variables
    rows = [p["title"] for p in board["panels"] if p["type"] == "row"]
    assert rows == ["Engine", "Router", "Gateway"]
