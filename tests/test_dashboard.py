"""``GET /dashboard`` on a real server, a router over it and a gateway over that,
checked in headless Chromium (Debian's ``chromium``) and against ``/metrics``.

One server (the default model, float32, an API key with open metrics) serves the
module; the router lists it twice (as 127.0.0.1 and as localhost), so its merged
engine counters must be exactly twice the server's: an oracle independent of the
merge code. Waits are bounded polls; nothing asserts on timing.
"""

from __future__ import annotations

import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")

from tests.browser import chart_points, dump_dom, screenshot  # noqa: E402
from tests.gateway_procs import MASTER_KEY, start_gateway, start_redis  # noqa: E402
from tests.test_router import start_router  # noqa: E402
from tests.test_server import start_server, stop_server  # noqa: E402

pytestmark = pytest.mark.model

KEY = "sk-dashboard-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
SHARED = ("You are a helpful assistant. Answer in one short sentence and be precise. "
          "Question number: ")
DATA_CHARTS = ("ttft", "tpot", "itl", "tokens", "requests", "queue", "kv", "prefix")
DOCS = os.path.join(os.path.dirname(__file__), "..", "docs")


@pytest.fixture(scope="module")
def server():
    s = start_server("--api-key", KEY, "--allow-unauthenticated-metrics")
    try:
        prompts = [SHARED + str(i % 3) for i in range(8)]  # repeats: prefix-cache hits

        def one(p: str) -> None:
            r = httpx.post(s.url + "/v1/completions", headers=AUTH, timeout=300,
                           json={"prompt": p, "max_tokens": 12, "temperature": 0})
            assert r.status_code == 200, r.text

        with ThreadPoolExecutor(4) as pool:
            list(pool.map(one, prompts))
        yield s
    finally:
        stop_server(s)


def wait_data(url: str, ok, headers=None, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        r = httpx.get(url + "/dashboard/data?window=600", headers=headers, timeout=30)
        assert r.status_code == 200, r.text
        body = r.json()
        if ok(body):
            return body
        assert time.monotonic() < deadline, f"dashboard data never ready: {body['totals']}"
        time.sleep(0.2)


def has_latency(body: dict) -> bool:
    return (body["totals"]["requests"] or 0) >= 8 and any(
        v is not None for v in body["series"]["ttft_p50"])


def scrape(url: str) -> dict:
    """``/metrics`` summed over label sets per sample name, by a plain line parser."""
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.split("{", 1)[0].split(" ", 1)[0], float(line.rsplit(" ", 1)[1])
            if "_bucket" in name:
                le = line.split('le="', 1)[1].split('"', 1)[0]
                name = f"{name}|{float(le) if le != '+Inf' else '+Inf'}"
            out[name] = out.get(name, 0.0) + value
    return out


def flatten(snap: dict) -> dict:
    out = {**snap["counters"], **snap["gauges"]}
    for name, h in snap["histograms"].items():
        out[name + "_count"], out[name + "_sum"] = h["count"], h["sum"]
        for le, v in h["buckets"]:
            out[f"{name}_bucket|{le}"] = v
    return out


def test_json_agrees_with_metrics_and_auth_rules(server):
    wait_data(server.url, has_latency)
    # idle now: two scrapes that agree bracket the JSON snapshot
    before = scrape(server.url)
    snap = httpx.get(server.url + "/metrics/json", timeout=30).json()
    after = scrape(server.url)
    assert before == after
    flat = flatten(snap)
    assert flat, snap
    for name, value in flat.items():
        assert name in before, name
        assert value == pytest.approx(before[name], rel=1e-9), name
    assert snap["counters"]["llmserve:request_success_total"] >= 8
    assert snap["counters"]["llmserve:prefix_cache_hits_total"] > 0
    # the page is open; the JSON follows /metrics (open here); the API needs the key
    page = httpx.get(server.url + "/dashboard", timeout=30)
    assert page.status_code == 200 and "<svg" not in page.text and "CHARTS" in page.text
    assert httpx.get(server.url + "/v1/models", timeout=30).status_code == 401
    bad = httpx.get(server.url + "/dashboard/data?window=-1", timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "window"


def test_server_dashboard_in_chromium(server, tmp_path):
    body = wait_data(server.url, has_latency)
    assert all(v is None for v in body["series"]["spec_acceptance_rate"])  # no spec decode
    dom = dump_dom(server.url + "/dashboard")
    points = chart_points(dom)
    assert set(DATA_CHARTS) <= set(points), points
    for chart in DATA_CHARTS:
        assert points[chart] > 0, (chart, points)
    assert points["spec"] == 0 and "no data in this window" in dom
    assert 'data-card="requests"' in dom
    shot = tmp_path / "dashboard.png"
    screenshot(server.url + "/dashboard", str(shot))
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if os.environ.get("LLMSERVE_UPDATE_DOCS"):
        shutil.copy(shot, os.path.join(DOCS, "dashboard.png"))


def send(url: str, n: int, headers: dict) -> None:
    for i in range(n):
        r = httpx.post(url + "/v1/completions", headers=headers, timeout=300,
                       json={"model": "smollm2-135m-instruct", "prompt": SHARED + str(i),
                             "max_tokens": 6, "temperature": 0})
        assert r.status_code == 200, r.text


def test_router_and_gateway_aggregate_workers(server, monkeypatch):
    wait_data(server.url, has_latency)
    alias = server.url.replace("127.0.0.1", "localhost")
    router = start_router([server.url, alias])
    redis = start_redis()
    gateway = None
    try:
        # the router's history starts with it: traffic after its first sample shows
        wait_data(router.url, lambda b: b["sources"] == 2)
        send(router.url, 3, AUTH)
        wait_data(router.url, lambda b: b["sources"] == 2 and has_latency(b))
        engine = httpx.get(server.url + "/metrics/json", timeout=30).json()["counters"]
        merged = httpx.get(router.url + "/metrics/json", timeout=30).json()
        assert merged["kind"] == "router" and merged["sources"] == 2
        for name, value in engine.items():
            assert merged["counters"][name] == pytest.approx(2 * value), name
        assert merged["gauges"]["llmserve_router:worker_healthy"] == 2
        assert merged["counters"]["llmserve_router:requests_total"] == 3

        monkeypatch.setenv("LLMSERVE_UPSTREAM_API_KEY", KEY)  # the gateway's to the server
        gateway = start_gateway(router.url, redis.url)
        page = httpx.get(gateway.url + "/dashboard", timeout=30)
        assert page.status_code == 200 and "CHARTS" in page.text
        assert httpx.get(gateway.url + "/dashboard/data", timeout=30).status_code == 401
        admin = {"Authorization": f"Bearer {MASTER_KEY}"}
        wait_data(gateway.url, lambda b: b["sources"] == 2, admin)
        send(gateway.url, 2, admin)
        wait_data(gateway.url, lambda b: b["sources"] == 2 and has_latency(b), admin)
        engine = httpx.get(server.url + "/metrics/json", timeout=30).json()["counters"]
        gw = httpx.get(gateway.url + "/metrics/json", headers=admin, timeout=30).json()
        for name, value in engine.items():
            assert gw["counters"][name] == pytest.approx(2 * value), name
        assert gw["counters"]["llmserve_gateway:requests_total"] == 2
        points = chart_points(dump_dom(f"{gateway.url}/dashboard#key={MASTER_KEY}"))
        for chart in DATA_CHARTS:
            assert points[chart] > 0, (chart, points)
        assert "needs an API key" in dump_dom(gateway.url + "/dashboard")
    finally:
        if gateway is not None:
            gateway.stop()
        redis.stop()
        router.stop()
