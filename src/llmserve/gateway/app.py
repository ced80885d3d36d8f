"""The gateway's FastAPI app: authentication, RBAC, limits, proxying to upstreams.

Routes (every one but ``/health`` needs a valid key: ``Authorization: Bearer sk-...``
or the master key from ``$LLMSERVE_MASTER_KEY``)::

    GET  /health                           200 {"status": "ok"} (no key)
    GET  /metrics                          Prometheus text (admin)
    GET  /dashboard                        live metrics page (no key; its data is admin:
                                           /metrics/json, /dashboard/data, merged over
                                           the upstreams, see llmserve.metrics.dashboard)
    GET  /v1/models                        upstream models the key may use (any role)
    POST /v1/completions, /v1/chat/completions   proxied (admin, member)
    /admin/keys, /admin/keys/{id}, /admin/usage  see :mod:`llmserve.gateway.admin`

Roles: ``admin`` everything; ``member`` inference and its own usage; ``viewer`` the
models list and its own usage. Every response carries ``X-Request-Id`` (the client's,
if it is 1-128 of ``A-Za-z0-9._:-``, else a new one), also sent to the upstream.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import re
import time
import uuid
from dataclasses import dataclass

import httpx
from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response

from llmserve.gateway.config import GatewayConfig
from llmserve.gateway.errors import GatewayError, error_response
from llmserve.gateway.hooks import AuditSink, SafetyPipeline
from llmserve.gateway.keys import KeyStore, StoreUnavailable
from llmserve.gateway.limits import Limiter
from llmserve.gateway.metrics import GatewayMetrics
from llmserve.metrics.dashboard import (
    DASHBOARD_PATHS,
    register_routes,
    remote_snapshot,
    run_async_sampler,
)
from llmserve.metrics.history import MetricsHistory

REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
MAX_AUTH_HEADER = 512


@dataclass(frozen=True)
class Principal:
    """The caller: its key record (``{}`` for the master key) and its team's record."""

    key_id: str
    role: str
    team: str | None
    key: dict
    team_rec: dict

    def allowed_models(self) -> set[str] | None:
        """Intersection of the key's and the team's allowlists; None = any model."""
        sets = [set(m) for m in (self.key.get("models"), self.team_rec.get("models"))
                if m is not None]
        return set.intersection(*sets) if sets else None

    def priority(self) -> int:
        for p in (self.key.get("priority"), self.team_rec.get("priority")):
            if p is not None:
                return p
        return 0


def _unauthorized(msg: str) -> GatewayError:
    return GatewayError(401, msg, "invalid_request_error", "invalid_api_key")


class Gateway:
    """State shared by the routes: Redis, key store, limiter, upstream client, hooks."""

    def __init__(self, config: GatewayConfig, audit: AuditSink | None = None,
                 safety: SafetyPipeline | None = None) -> None:
        import redis.asyncio as aioredis

        self.config, self.audit, self.safety = config, audit, safety
        self.redis = aioredis.from_url(config.redis_url, decode_responses=True,
                                       socket_timeout=2.0, socket_connect_timeout=2.0)
        self.keys = KeyStore(self.redis, ttl_s=config.key_cache_ttl_s,
                             stale_s=300.0 if config.fail_open.get("auth") else 0.0)
        self.limiter = Limiter(self.redis, config.fail_open,
                               lease_s=config.upstream_timeout_s + 60)
        self.metrics = GatewayMetrics()
        self.client: httpx.AsyncClient | None = None
        self._next_upstream = 0
        self._models: tuple[float, list[dict]] | None = None
        self.tasks: set = set()

    def upstream_order(self) -> list[str]:
        """Upstreams, round robin: this request's first choice, then the others."""
        ups = self.config.upstreams
        i = self._next_upstream % len(ups)
        self._next_upstream += 1
        return list(ups[i:] + ups[:i])

    def upstream_headers(self, request_id: str) -> dict[str, str]:
        h = {"X-Request-Id": request_id}
        if self.config.upstream_api_key:
            h["Authorization"] = f"Bearer {self.config.upstream_api_key}"
        return h

    async def authenticate(self, headers: list[tuple[bytes, bytes]]) -> Principal:
        auth = [v for k, v in headers if k.lower() == b"authorization"]
        if not auth:
            raise _unauthorized("missing API key: send 'Authorization: Bearer sk-...'")
        if len(auth) > 1:
            raise _unauthorized("more than one Authorization header")
        raw = auth[0]
        if len(raw) > MAX_AUTH_HEADER:
            raise _unauthorized("invalid API key")
        try:
            value = raw.decode("ascii")
        except UnicodeDecodeError:
            raise _unauthorized("invalid API key") from None
        scheme, _, secret = value.strip().partition(" ")
        secret = secret.strip()
        if scheme.lower() != "bearer" or not secret:
            raise _unauthorized("expected 'Authorization: Bearer sk-...'")
        master = self.config.master_key
        if master and hmac.compare_digest(secret.encode(), master.encode()):
            return Principal("master", "admin", None, {}, {})
        try:
            rec = await self.keys.authenticate(secret)
            team = await self.keys.get_team(rec.get("team")) if rec else None
        except StoreUnavailable:
            raise GatewayError(503, "key store (Redis) unreachable; try again later",
                               "service_unavailable", "store_unavailable") from None
        if rec is None:
            raise _unauthorized("invalid, revoked or expired API key")
        return Principal(rec["id"], rec.get("role") or "member", rec.get("team"), rec,
                         team or {})

    async def upstream_models(self) -> list[dict]:
        """The first reachable upstream's ``/v1/models`` data, cached 5 s."""
        now = time.monotonic()
        if self._models and now - self._models[0] < 5.0:
            return self._models[1]
        for base in self.upstream_order():
            try:
                r = await self.client.get(base + "/v1/models", timeout=10.0,
                                          headers=self.upstream_headers("gw-models"))
                if r.status_code == 200:
                    data = r.json().get("data") or []
                    self._models = (now, data)
                    return data
            except (httpx.HTTPError, ValueError):
                continue
        raise GatewayError(502, "no upstream answered /v1/models", "api_error",
                           "upstream_unavailable")


class GatewayMiddleware:
    """Pure ASGI: request id in and out, and authentication of every path but /health
    (so unknown paths and wrong methods also need a key)."""

    def __init__(self, app, gw: Gateway) -> None:
        self.app, self.gw = app, gw

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        rid = next((v.decode("latin-1") for k, v in scope["headers"]
                    if k.lower() == b"x-request-id"), "")
        if not REQUEST_ID_RE.match(rid):
            rid = "gw-" + uuid.uuid4().hex
        state = scope.setdefault("state", {})
        state["request_id"] = rid

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (b"x-request-id", rid.encode())]
            await send(message)

        if scope["path"] != "/health" and scope["path"] not in DASHBOARD_PATHS:
            try:
                state["principal"] = await self.gw.authenticate(scope["headers"])
            except GatewayError as e:
                if scope["path"].startswith("/v1/") and scope.get("method") == "POST":
                    self._audit_unauthenticated(rid, scope["path"], e)
                return await e.response()(scope, receive, send_with_id)
        await self.app(scope, receive, send_with_id)


    def _audit_unauthenticated(self, rid: str, path: str, e: GatewayError) -> None:
        """An inference call refused at authentication gets its audit record (no key
        id, no body: the body of an unauthenticated caller is never read)."""
        from llmserve.gateway.proxy import audit_rejected

        rec = {"request_id": rid, "time": time.time(), "key_id": None, "team": None,
               "role": None, "model": None, "endpoint": path, "request": None,
               "stream": False, "safety": []}
        audit_rejected(self.gw, rec, {"key": "", "team": "", "model": ""}, e.status,
                     "unauthenticated", time.monotonic(), error=e.message)


def require_role(request: Request, *roles: str) -> Principal:
    p: Principal = request.state.principal
    if p.role not in roles:
        raise GatewayError(403, f"role '{p.role}' may not call {request.url.path}",
                           "permission_error", "insufficient_role")
    return p


def build_app(config: GatewayConfig, audit: AuditSink | None = None,
              safety: SafetyPipeline | None = None) -> FastAPI:
    """The gateway app; ``audit`` and ``safety`` are the optional hooks of
    :mod:`llmserve.gateway.hooks`."""
    from fastapi.exceptions import RequestValidationError
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
    from starlette.exceptions import HTTPException as StarletteHTTPException

    from llmserve.gateway import admin, proxy

    gw = Gateway(config, audit, safety)
    history = MetricsHistory(interval_s=2.0)

    async def snapshot() -> dict:  # the dashboard's: merged over the upstreams
        return await remote_snapshot(gw.client, list(config.upstreams), gw.metrics.registry,
                                     gw.upstream_headers("gw-metrics"))

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        gw.client = httpx.AsyncClient(timeout=httpx.Timeout(config.upstream_timeout_s,
                                                            connect=5.0))
        try:
            await gw.keys.seed(config.keys, config.teams)
        except Exception as e:  # Redis down at start: serve anyway, fail closed
            import logging

            logging.getLogger(__name__).warning("could not seed keys into Redis: %s", e)
        sampler = asyncio.create_task(run_async_sampler(history, snapshot))
        yield
        sampler.cancel()
        await gw.client.aclose()
        await gw.redis.aclose()

    app = FastAPI(title="llmserve gateway", lifespan=lifespan, docs_url=None,
                  redoc_url=None, openapi_url=None)
    app.state.gateway = gw
    app.add_middleware(GatewayMiddleware, gw=gw)

    @app.exception_handler(GatewayError)
    async def _gw_error(_: Request, exc: GatewayError) -> Response:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> Response:
        return error_response(400, f"invalid request: {exc.errors()[:1]}")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return error_response(exc.status_code, str(exc.detail), code=code)

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> Response:
        import logging

        from redis.exceptions import RedisError

        if isinstance(exc, RedisError):  # e.g. Redis went down during an admin call
            return error_response(503, "Redis unreachable; try again later",
                                  "service_unavailable", "store_unavailable")

        logging.getLogger(__name__).exception("internal error")
        return error_response(500, f"internal error: {type(exc).__name__}", "api_error")

    @app.get("/health")
    async def health() -> Response:
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        require_role(request, "admin")
        return Response(generate_latest(gw.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    register_routes(app, history, snapshot, "gateway", "gateway",
                    guard=lambda request: require_role(request, "admin"))

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        p: Principal = request.state.principal
        allowed = p.allowed_models()
        data = [m for m in await gw.upstream_models() if allowed is None or m.get("id")
                in allowed]
        return JSONResponse({"object": "list", "data": data})

    for path in ("/v1/completions", "/v1/chat/completions"):
        app.add_api_route(path, proxy.make_handler(gw, path), methods=["POST"])
    admin.register(app, gw)
    return app
