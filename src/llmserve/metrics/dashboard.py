"""``GET /dashboard``: a live page of the server's (or a router's / gateway's
aggregated) metrics, with two JSON routes beside ``/metrics``.

=====================  =====================================================================
route                  answer
=====================  =====================================================================
/dashboard             the page (``static/dashboard.html``: one file, no build step, plain
                       SVG charts); it polls ``dashboard/data`` every 2 s. Holds no data,
                       so it is open; with an API key, open it as ``/dashboard#key=KEY`` or
                       type the key into the page (kept in the tab's ``sessionStorage``)
/metrics/json          the current :mod:`~llmserve.metrics.snapshot` (same numbers as
                       ``/metrics``; a router/gateway: merged over its workers/upstreams)
/dashboard/data        :meth:`MetricsHistory.series` (``?window=`` seconds, default 300,
                       ``&rate_window=`` seconds, default 10)
=====================  =====================================================================

The JSON routes follow ``/metrics``' auth rule on each host. Pure serving plane
(FastAPI, no torch).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Awaitable, Callable
from importlib import resources
from typing import Any

from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response

from llmserve.metrics.history import MetricsHistory, ThreadSampler
from llmserve.metrics.snapshot import Snapshot, merge_snapshots, snapshot_from_registry

logger = logging.getLogger("llmserve.metrics")
DASHBOARD_PATHS = ("/dashboard",)  # open paths (the page itself carries no data)
DATA_PATHS = ("/metrics/json", "/dashboard/data")  # same auth rule as /metrics
MAX_WINDOW_S = 3600.0


def page_html(title: str) -> str:
    """The dashboard page with ``title`` in its heading."""
    text = resources.files("llmserve.metrics").joinpath("static/dashboard.html").read_text(
        encoding="utf-8")
    from html import escape

    return text.replace("{{TITLE}}", escape(title))


def _bad(message: str, param: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error",
                                   "param": param, "code": None}}, status_code=400)


def _seconds(request: Request, name: str, default: float) -> float | JSONResponse:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        v = float(raw)
    except ValueError:
        return _bad(f"{name} must be a number of seconds, got {raw!r}", name)
    if not 0 < v <= MAX_WINDOW_S:
        return _bad(f"{name} must be in (0, {MAX_WINDOW_S:g}] seconds, got {raw}", name)
    return v


SnapshotFn = Callable[[], Snapshot] | Callable[[], Awaitable[Snapshot]]


def register_routes(app: Any, history: MetricsHistory, snapshot: SnapshotFn, title: str,
                    kind: str, guard: Callable[[Request], None] | None = None) -> None:
    """Add ``/dashboard``, ``/metrics/json`` and ``/dashboard/data`` to a FastAPI app.

    Args:
        history: the sampled history the page plots.
        snapshot: the current snapshot (sync, or async for hosts that fetch it).
        title: the page heading, e.g. the model name.
        kind: ``server``, ``router`` or ``gateway`` (shown on the page).
        guard: called with the request before either JSON route answers; raises the
            host's own 401/403 error (the gateway's admin check). None: the host's
            middleware already applies ``/metrics``' rule.
    """
    html = page_html(title)

    async def dashboard() -> Response:
        return HTMLResponse(html, headers={"Cache-Control": "no-store"})

    async def metrics_json(request: Request) -> Response:
        if guard is not None:
            guard(request)
        snap = snapshot()
        if inspect.isawaitable(snap):
            snap = await snap
        return JSONResponse({"kind": kind, "title": title, **snap})

    async def data(request: Request) -> Response:
        if guard is not None:
            guard(request)
        window = _seconds(request, "window", 300.0)
        if isinstance(window, Response):
            return window
        rate_window = _seconds(request, "rate_window", 10.0)
        if isinstance(rate_window, Response):
            return rate_window
        body = history.series(window, rate_window)
        return JSONResponse({"kind": kind, "title": title, "now": time.time(), **body},
                            headers={"Cache-Control": "no-store"})

    app.add_api_route("/dashboard", dashboard, methods=["GET"], include_in_schema=False)
    app.add_api_route("/metrics/json", metrics_json, methods=["GET"], include_in_schema=False)
    app.add_api_route("/dashboard/data", data, methods=["GET"], include_in_schema=False)


def install_server_dashboard(app: Any, registry: Any, title: str,
                             interval_s: float = 1.0) -> MetricsHistory:
    """The engine server's dashboard: samples ``registry`` (its Prometheus registry)
    every ``interval_s`` seconds on a daemon thread."""
    history = MetricsHistory(interval_s=interval_s)
    ThreadSampler(history, lambda: snapshot_from_registry(registry)).start()
    register_routes(app, history, lambda: snapshot_from_registry(registry), title, "server")
    return history


async def run_async_sampler(history: MetricsHistory,
                            source: Callable[[], Awaitable[Snapshot]]) -> None:
    """Add ``await source()`` to ``history`` every ``history.interval_s`` seconds until
    cancelled (routers and gateways, whose snapshot needs HTTP)."""
    while True:
        try:
            history.add(await source())
        except asyncio.CancelledError:
            raise
        except Exception:  # never let the loop die
            logger.debug("metrics sample failed", exc_info=True)
        await asyncio.sleep(history.interval_s)


async def fetch_snapshot(client: Any, base_url: str, headers: dict[str, str] | None = None,
                         timeout_s: float = 2.0) -> Snapshot | None:
    """A remote process' snapshot: its ``/metrics/json``, else its ``/metrics`` text
    (a server that has no dashboard); None when it answers neither."""
    from llmserve.metrics.snapshot import snapshot_from_text

    try:
        r = await client.get(base_url + "/metrics/json", headers=headers, timeout=timeout_s)
        if r.status_code == 200:
            body = r.json()
            if isinstance(body, dict) and "counters" in body:
                return {k: body[k] for k in ("time", "sources", "counters", "gauges",
                                              "histograms")}
        r = await client.get(base_url + "/metrics", headers=headers, timeout=timeout_s)
        if r.status_code == 200:
            return snapshot_from_text(r.text)
    except Exception:  # unreachable, or not a metrics page
        logger.debug("no metrics from %s", base_url, exc_info=True)
    return None


async def remote_snapshot(client: Any, base_urls: list[str], own_registry: Any = None,
                          headers: dict[str, str] | None = None) -> Snapshot:
    """Merge the snapshots of ``base_urls`` (fetched concurrently) and, if given, the
    caller's own registry (its router/gateway metrics)."""
    parts = await asyncio.gather(*(fetch_snapshot(client, u, headers) for u in base_urls))
    snaps = [p for p in parts if p is not None]
    if own_registry is not None:
        own = snapshot_from_registry(own_registry)
        own["sources"] = 0  # the router/gateway itself is not an engine
        snaps.append(own)
    return merge_snapshots(snaps)
