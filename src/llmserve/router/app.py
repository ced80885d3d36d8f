"""The router's HTTP app: an OpenAI-compatible proxy over the worker pool.

Routes: ``POST /v1/completions`` and ``/v1/chat/completions`` (routed by the
policy among the workers that serve the body's ``model``; a tier alias is resolved
first, :mod:`llmserve.router.tiers`), ``GET /v1/models`` (every worker's models and
the tier aliases), ``POST /tokenize``/``/detokenize`` (forwarded to any
eligible worker), ``GET /health`` (200 while some worker is eligible),
``GET /metrics`` (:mod:`llmserve.router.metrics`), ``GET /dashboard`` (and its
``/metrics/json``, ``/dashboard/data``: the workers' engine metrics merged, see
:mod:`llmserve.metrics.dashboard`), ``GET/POST /workers`` and
``DELETE /workers/{id}`` (draining: no new requests; removed when idle).

Retries: an attempt that fails before the client got its first byte (refused
connection, reset, 5xx status, the worker dying before its first body chunk) is
retried on another eligible worker, up to ``max_retries`` times (reason
``failover``). After the first byte went out nothing is retried (no duplicate
output): a stream cut mid-way ends with an SSE ``error`` event, which the
``openai`` client raises as an ``APIError``. Response headers
``x-llmserve-worker`` and ``x-llmserve-route-reason`` say where it went and why.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from llmserve.metrics.dashboard import register_routes, remote_snapshot, run_async_sampler
from llmserve.metrics.history import MetricsHistory
from llmserve.router.health import HealthChecker
from llmserve.router.policies import RouteRequest
from llmserve.router.prefix import lora_name_extra_keys, prompt_block_hashes
from llmserve.router.shared_state import MemoryState, SharedStateUnavailable
from llmserve.router.state import WorkerPool
from llmserve.router.tiers import TierRoute, finish_reasons
from llmserve.router.worker import Worker

logger = logging.getLogger("llmserve.router")
FORWARD_HEADERS = ("authorization", "content-type", "accept", "x-request-id")


def error(status: int, message: str, param: str | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param,
                                   "code": status}}, status_code=status)


class Proxy:
    def __init__(self, pool: WorkerPool, client: httpx.AsyncClient, block_size: int = 16,
                 max_retries: int = 2, tiers: dict[str, TierRoute] | None = None,
                 state: MemoryState | None = None) -> None:
        self.pool = pool
        self.state = state or MemoryState(pool)
        self.client = client
        self.block_size = block_size
        self.max_retries = max_retries
        self.tiers = dict(tiers or {})

    async def tokenize(self, path: str, body: dict, headers: dict,
                       model: str | None = None) -> list[int]:
        """Prompt token ids via a worker's ``/tokenize`` ([] when that fails)."""
        if path.endswith("/completions") and "messages" not in body:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt:
                prompt = prompt[0]
            if isinstance(prompt, list):
                return [t for t in prompt if isinstance(t, int)]
            if not isinstance(prompt, str):
                return []
            payload = {"prompt": prompt}
        else:
            if not isinstance(body.get("messages"), list):
                return []
            payload = {"messages": body["messages"],
                       "add_generation_prompt": body.get("add_generation_prompt", True)}
        if body.get("model") is not None:
            payload["model"] = body["model"]
        for w in self.pool.eligible(model=model)[:2]:
            try:
                r = await self.client.post(w.url + "/tokenize", json=payload, headers=headers,
                                           timeout=10.0)
                if r.status_code == 200:
                    return list(r.json().get("tokens") or [])
            except (httpx.HTTPError, ValueError):
                continue
        return []

    async def route(self, path: str, raw: Request) -> Response:
        data = await raw.body()
        try:
            body = json.loads(data)
        except ValueError:
            return error(400, "the request body is not valid JSON")
        if not isinstance(body, dict):
            return error(400, "the request body must be a JSON object")
        headers = {k: v for k, v in raw.headers.items() if k.lower() in FORWARD_HEADERS}
        session = raw.headers.get("x-session-id") or body.get("user")
        session = session if isinstance(session, str) and session else None
        model = body.get("model") if isinstance(body.get("model"), str) else None
        if model in self.tiers:
            return await self.tiered(path, body, headers, session, self.tiers[model])
        if not self.pool.known_model(model):
            return error(404, f"the model '{model}' does not exist", "model")
        return await self.send(path, body, data, headers, session, model)

    async def send(self, path: str, body: dict, data: bytes, headers: dict,
                   session: str | None, model: str | None) -> Response:
        """Route ``body`` (serialized as ``data``) to a worker serving ``model``."""
        req = RouteRequest(block_size=self.block_size)
        if self.pool.policy.needs_tokens:
            ids = await self.tokenize(path, body, {k: v for k, v in headers.items()
                                                   if k.lower() == "authorization"}, model)
            salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
            req.num_tokens, req.token_ids, req.cache_salt = len(ids), ids, salt or None
            req.lora_name = self.pool.lora_name(model)
            # a LoRA request is hashed per worker with its adapter id (req.hashes_for);
            # block_hashes, its worker-independent key, carries the adapter's name
            req.block_hashes = prompt_block_hashes(ids, self.block_size, salt or None) \
                if req.lora_name is None else lora_name_extra_keys(
                    ids, self.block_size, salt or None, req.lora_name)
        return await self.forward(path, data, headers, req, session,
                                  stream=bool(body.get("stream")), model=model)

    async def tiered(self, path: str, body: dict, headers: dict, session: str | None,
                     tier: TierRoute) -> Response:
        """A request to a tier alias: the chosen tier's model answers, escalating to the
        next tier while a non-streamed answer ends with an ``escalate_on`` reason."""
        level, score = tier.choose(body)
        first = model = tier.levels[level].model
        while True:
            model = tier.levels[level].model
            body = {**body, "model": model}
            resp = await self.send(path, body, json.dumps(body).encode(), headers, session,
                                   model)
            if (body.get("stream") or level + 1 >= len(tier.levels)
                    or resp.status_code != 200
                    or not set(finish_reasons(resp.body)) & set(tier.escalate_on)):
                break
            level += 1
            self.pool.metrics.tier_escalations.labels(tier.alias, model,
                                                      tier.levels[level].model).inc()
        self.pool.metrics.tier_requests.labels(tier.alias, model).inc()
        resp.headers["x-llmserve-tier"] = model
        resp.headers["x-llmserve-complexity"] = f"{score:.4f}"
        if model != first:
            resp.headers["x-llmserve-escalated-from"] = first
        return resp

    async def forward(self, path: str, data: bytes, headers: dict, req: RouteRequest,
                      session: str | None, stream: bool, model: str | None = None) -> Response:
        tried: set[str] = set()
        last: Response | None = None
        m = self.pool.metrics
        for attempt in range(self.max_retries + 1):
            await self.state.prepare(req, self.pool.eligible(tried, model), session)
            decision = self.pool.pick(req, session, exclude=tried, model=model)
            if decision is None:
                break
            w = decision.worker
            reason = "failover" if attempt else decision.reason
            m.decisions.labels(reason).inc()
            if reason == "cache_hit":
                m.cache_hit_tokens.inc(decision.matched_tokens)
            tried.add(w.id)
            # assume it is cached there from now on; reserve a slot (refund: finished)
            await self.state.dispatched(req, w, session)
            m.requests.labels(w.id).inc()
            try:
                upstream = await self.client.send(
                    self.client.build_request("POST", w.url + path, content=data,
                                              headers=headers), stream=True)
            except httpx.HTTPError as e:
                await self._failed(w, e)
                continue
            if upstream.status_code >= 500:
                body = await _safe_read(upstream)
                await self._failed(w, f"status {upstream.status_code}")
                last = Response(body, upstream.status_code,
                                media_type=upstream.headers.get("content-type"))
                continue
            out_headers = {"x-llmserve-worker": w.id, "x-llmserve-route-reason": reason}
            try:
                chunks = upstream.aiter_raw()
                first = await chunks.__anext__() if stream else await upstream.aread()
            except StopAsyncIteration:
                first, chunks = b"", None
            except httpx.HTTPError as e:
                await upstream.aclose()
                await self._failed(w, e)
                continue
            media = upstream.headers.get("content-type", "application/json")
            if not stream or chunks is None:
                await upstream.aclose()
                await self.state.finished(w, upstream.status_code < 500)
                return Response(first, upstream.status_code, headers=out_headers,
                                media_type=media)
            return StreamingResponse(self._relay(w, upstream, first, chunks),
                                     upstream.status_code, headers=out_headers,
                                     media_type=media)
        m.errors.labels("no_worker" if last is None else "upstream_failed").inc()
        if last is not None:
            return last
        return error(503 if not tried else 502,
                     "no healthy worker is available" if not tried
                     else f"all {len(tried)} workers tried failed before answering")

    async def _relay(self, w: Worker, upstream: httpx.Response, first: bytes, chunks):
        ok = False
        tail = first[-64:]
        try:
            yield first
            async for chunk in chunks:
                yield chunk
                tail = (tail + chunk)[-64:]
            ok = True
        except httpx.HTTPError as e:
            if tail.rstrip().endswith(b"data: [DONE]"):  # complete; the peer closed badly
                ok = True  # (llama-cpp-python's server does, after every stream)
                return
            logger.warning("worker %s failed mid-stream: %s", w.id, e)
            self.pool.metrics.errors.labels("midstream").inc()
            err = {"error": {"message": f"worker {w.id} failed mid-stream", "type":
                             "server_error", "param": None, "code": 502}}
            yield f"\n\ndata: {json.dumps(err)}\n\n".encode()
        finally:
            await upstream.aclose()
            await self.state.finished(w, ok)

    async def _failed(self, w: Worker, why) -> None:
        logger.warning("worker %s (%s) failed before the first byte: %s", w.id, w.url, why)
        self.pool.metrics.retries.labels(w.id).inc()
        await self.state.finished(w, False, connect_error=isinstance(why, httpx.ConnectError))

    async def passthrough(self, method: str, path: str, raw: Request) -> Response:
        headers = {k: v for k, v in raw.headers.items() if k.lower() in FORWARD_HEADERS}
        data = await raw.body()
        for w in self.pool.eligible():
            try:
                r = await self.client.request(method, w.url + path, content=data,
                                              headers=headers, timeout=30.0)
            except httpx.HTTPError:
                continue
            return Response(r.content, r.status_code, media_type=r.headers.get("content-type"))
        return error(503, "no healthy worker is available")


async def _safe_read(r: httpx.Response) -> bytes:
    try:
        return await r.aread()
    except httpx.HTTPError:
        return b""
    finally:
        await r.aclose()


def build_app(pool: WorkerPool, block_size: int = 16, max_retries: int = 2,
              health_interval_s: float = 2.0, request_timeout_s: float = 600.0,
              tiers: dict[str, TierRoute] | None = None,
              state: MemoryState | None = None) -> FastAPI:
    """The router app over ``pool``; its health loop runs while the app is up.
    ``tiers``: alias -> :class:`~llmserve.router.tiers.TierRoute`; ``state``: where
    shared routing state lives (default :class:`MemoryState`: this process;
    :class:`~llmserve.router.redis_state.RedisState` for several replicas)."""
    state = state or MemoryState(pool)
    client = httpx.AsyncClient(timeout=httpx.Timeout(request_timeout_s, connect=5.0),
                               limits=httpx.Limits(max_connections=None,
                                                   max_keepalive_connections=256))
    proxy = Proxy(pool, client, block_size, max_retries, tiers, state)
    checker = HealthChecker(pool, client, interval_s=health_interval_s,
                            timeout_s=max(1.0, min(5.0, 2 * health_interval_s)),
                            block_size=block_size, state=state)
    state.on_new_worker = checker.check

    history = MetricsHistory(interval_s=max(1.0, health_interval_s))

    async def snapshot() -> dict:  # the dashboard's: merged over the healthy workers
        pool.metrics.render(list(pool.workers.values()))  # refresh the router's gauges
        return await remote_snapshot(client, [w.url for w in pool.workers.values()
                                              if w.healthy], pool.metrics.registry)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await state.start()
        await checker.run_once()
        task = asyncio.create_task(checker.run())
        sampler = asyncio.create_task(run_async_sampler(history, snapshot))
        try:
            yield
        finally:
            task.cancel()
            sampler.cancel()
            await state.stop()
            await client.aclose()

    app = FastAPI(title="llmserve router", lifespan=lifespan)
    app.state.pool = pool
    app.state.health_checker = checker  # a front that learns of readiness first runs it

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Response:
        return await proxy.route("/v1/completions", raw)

    @app.post("/v1/chat/completions")
    async def chat(raw: Request) -> Response:
        return await proxy.route("/v1/chat/completions", raw)

    @app.get("/v1/models")
    async def models(raw: Request) -> Response:
        cards: dict[str, dict] = {}
        for w in pool.workers.values():
            cards.update((c["id"], c) for c in w.models or [] if c["id"] not in cards)
        if not cards:  # no worker's list known (e.g. they need a key for it)
            return await proxy.passthrough("GET", "/v1/models", raw)
        for alias, t in proxy.tiers.items():
            cards[alias] = {"id": alias, "object": "model", "created": 0,
                            "owned_by": "llmserve-router",
                            "tiers": [lv.model for lv in t.levels]}
        return JSONResponse({"object": "list", "data": list(cards.values())})

    @app.post("/tokenize")
    async def tokenize(raw: Request) -> Response:
        return await proxy.passthrough("POST", "/tokenize", raw)

    @app.post("/detokenize")
    async def detokenize(raw: Request) -> Response:
        return await proxy.passthrough("POST", "/detokenize", raw)

    @app.get("/health")
    async def health() -> Response:
        """200 while some worker is eligible; ``status`` is ``degraded`` while the
        shared state (Redis) is unreachable and this replica routes from its cache."""
        if not pool.eligible():
            return error(503, "no healthy worker is available")
        shared = state.describe()
        return JSONResponse({"status": shared["status"], "state": shared,
                             "eligible_workers": len(pool.eligible())})

    @app.get("/metrics")
    async def metrics() -> Response:
        body, ctype = pool.metrics.render(list(pool.workers.values()))
        return Response(body, media_type=ctype)

    register_routes(app, history, snapshot, "router", "router")

    @app.get("/workers")
    async def list_workers() -> dict:
        return {"policy": pool.policy.name,
                "workers": [w.describe() for w in pool.workers.values()]}

    @app.post("/workers")
    async def add_worker(raw: Request) -> Response:
        try:
            body = json.loads(await raw.body())
        except ValueError:
            return error(400, "the request body is not valid JSON")
        if not isinstance(body, dict) or not isinstance(body.get("url"), str):
            return error(400, "send {\"url\": \"http://host:port\"}", "url")
        wid = body.get("id")
        if wid is not None and not isinstance(wid, str):
            return error(400, "id must be a string", "id")
        try:
            w = await state.add_worker(body["url"], wid)
        except ValueError as e:
            return error(409 if "already" in str(e) else 400, str(e), "url")
        except SharedStateUnavailable as e:
            return error(503, str(e))
        await checker.check(w)
        return JSONResponse(w.describe(), status_code=201)

    @app.delete("/workers/{worker_id}")
    async def remove_worker(worker_id: str) -> Response:
        try:
            w = await state.drain_worker(worker_id)
        except KeyError:
            return error(404, f"no worker with id {worker_id!r}", "id")
        except SharedStateUnavailable as e:
            return error(503, str(e))
        return JSONResponse({**w.describe(), "removed": worker_id not in pool.workers})

    return app
