"""Inference proxying: read and check the body, RBAC by model, safety input hook,
reserve limits, forward (streamed or not) with httpx, settle, metrics, audit hook.

Token cost reserved at admission (only when a TPM or quota limit applies)::

    cost = n * sum over prompts (prompt_tokens + max_tokens)

``prompt_tokens`` from the upstream's ``POST /tokenize`` (the model's own tokenizer and
chat template); ``max_tokens`` defaults as the server does (completions 16, chat
``max_model_len - prompt_tokens``). Settled with the usage the upstream reports
(``stream_options.include_usage`` is always asked of the upstream; the usage chunk is
dropped again if the client did not ask). A stream that ends without usage (aborted by
the client, or cut by the moderator) is charged its prompt and one token per content
chunk received.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

import httpx
from fastapi import Request
from starlette.responses import Response, StreamingResponse

from llmserve.gateway.errors import GatewayError, bad_request
from llmserve.gateway.hooks import RequestContext
from llmserve.gateway.limits import LimitsUnavailable, RateLimited, Scope

logger = logging.getLogger(__name__)


async def read_body(request: Request, limit: int) -> dict:
    """The JSON object body, at most ``limit`` bytes (413 above, 400 if not JSON)."""
    cl = request.headers.get("content-length")
    if cl is not None:
        if not cl.isdigit():
            raise bad_request("invalid Content-Length header")
        if int(cl) > limit:
            raise GatewayError(413, f"request body over the {limit}-byte limit",
                               code="request_too_large")
    buf = bytearray()
    async for chunk in request.stream():
        buf += chunk
        if len(buf) > limit:
            raise GatewayError(413, f"request body over the {limit}-byte limit",
                               code="request_too_large")
    try:
        body = json.loads(buf)
    except (ValueError, UnicodeDecodeError):
        raise bad_request("the body is not valid JSON") from None
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object")
    return body


def check_fields(body: dict, chat: bool) -> None:
    """The body checked against the server's own request models
    (:mod:`llmserve.protocol.openai`: the same types, strictly), plus what the gateway
    needs to price it: a model name, ``n >= 1``, token limits >= 0, messages present."""
    from pydantic import ValidationError

    from llmserve.protocol import validation_message
    from llmserve.protocol.openai import ChatCompletionRequest, CompletionRequest

    if not isinstance(body.get("model"), str) or not body["model"]:
        raise bad_request("'model' is required and must be a string", "model")
    try:
        (ChatCompletionRequest if chat else CompletionRequest).model_validate(body)
    except ValidationError as e:
        raise bad_request(*validation_message(e.errors(include_url=False))) from None
    for f in ("n", "max_tokens", "max_completion_tokens"):
        if isinstance(body.get(f), int) and body[f] < (1 if f == "n" else 0):
            raise bad_request(f"'{f}' must be >= {1 if f == 'n' else 0}", f)
    if chat and not body["messages"]:
        raise bad_request("'messages' must be a non-empty list", "messages")


async def _tokenize(gw, base: str, rid: str, payload: dict) -> tuple[int, int]:
    r = await gw.client.post(base + "/tokenize", json=payload, timeout=30.0,
                             headers=gw.upstream_headers(rid))
    if r.status_code != 200:
        try:
            err = r.json()["error"]
            raise GatewayError(r.status_code if 400 <= r.status_code < 500 else 502,
                               err.get("message", "tokenize failed"), err.get("type",
                               "invalid_request_error"), err.get("code"), err.get("param"))
        except (ValueError, KeyError, TypeError, AttributeError):
            raise GatewayError(502, "upstream /tokenize failed", "api_error") from None
    data = r.json()
    return int(data["count"]), int(data.get("max_model_len") or 0)


async def token_cost(gw, base: str, rid: str, body: dict, chat: bool) -> int:
    """Tokens to reserve (see the module docstring)."""
    n = body.get("n") or 1
    model = body["model"]
    if chat:
        count, max_len = await _tokenize(gw, base, rid, {
            "model": model, "messages": body["messages"],
            "add_generation_prompt": body.get("add_generation_prompt", True)})
        mt = body.get("max_completion_tokens") or body.get("max_tokens")
        return n * (count + (mt if mt is not None else max(max_len - count, 0)))
    p = body["prompt"]
    mt = body.get("max_tokens", 16)
    mt = 16 if mt is None else mt
    if isinstance(p, str):
        p = [p]
    if all(type(x) is int for x in p):
        counts = [len(p)]
    elif all(isinstance(x, list) for x in p):
        counts = [len(x) for x in p]
    else:
        counts = [(await _tokenize(gw, base, rid, {"model": model, "prompt": s}))[0]
                  for s in p]
    return n * sum(c + mt for c in counts)


def make_handler(gw, endpoint: str):
    chat = endpoint.endswith("chat/completions")

    async def handler(request: Request) -> Response:
        from llmserve.gateway.app import require_role

        p = require_role(request, "admin", "member")
        return await _proxy(gw, request, p, endpoint, chat)

    handler.__name__ = "chat_completions" if chat else "completions"
    return handler


async def _proxy(gw, request: Request, p, endpoint: str, chat: bool) -> Response:
    t0 = time.monotonic()
    rid = request.state.request_id
    rec: dict[str, Any] = {"request_id": rid, "time": time.time(), "key_id": p.key_id,
                           "team": p.team, "role": p.role, "endpoint": endpoint,
                           "safety": []}
    body: Any = None
    try:  # a body refused here (413, not JSON, bad fields) is audited as rejected too
        body = await read_body(request, gw.config.max_body_bytes)
        check_fields(body, chat)
    except GatewayError as e:
        model = body.get("model") if isinstance(body, dict) else None
        rec.update(request=body, model=model if isinstance(model, str) else None,
                   stream=False)
        audit_rejected(gw, rec, {"key": p.key_id, "team": p.team or "",
                               "model": rec["model"] or ""}, e.status, "rejected", t0,
                     error=e.message)
        raise
    model = body["model"]
    labels = {"key": p.key_id, "team": p.team or "", "model": model}
    rec.update(model=model, request=body, stream=bool(body.get("stream")))
    try:
        allowed = p.allowed_models()
        if allowed is not None and model not in allowed:
            raise GatewayError(403, f"this key may not use model '{model}'",
                               "permission_error", "model_not_allowed", "model")
        if model not in {m.get("id") for m in await gw.upstream_models()}:
            raise GatewayError(404, f"the model '{model}' does not exist",
                               "invalid_request_error", "model_not_found", "model")
        ctx = RequestContext(rid, p.key_id, p.team, p.role, model, endpoint, p.team_rec)
        if gw.safety is not None:
            try:
                verdict = await gw.safety.check_input(body, ctx)
            except Exception:
                logger.exception("safety input check failed for %s", rid)
                raise GatewayError(503, "content-safety check unavailable", "api_error",
                                   "safety_unavailable") from None
            rec["safety"] += verdict.verdicts
            if verdict.action == "block":
                raise GatewayError(400, verdict.message or "blocked by content policy",
                                   "invalid_request_error", "content_filter")
            body = verdict.body if verdict.body is not None else body
        body["priority"] = p.priority()
        want_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        if body.get("stream"):
            body["stream_options"] = {**(body.get("stream_options") or {}),
                                      "include_usage": True}
        scopes = [Scope.of("key", p.key_id, p.key)] if p.key else []
        if p.team:
            scopes.append(Scope.of("team", p.team, p.team_rec))
        ups = gw.upstream_order()
        needs_tokens = any(s.tpm is not None or s.quota is not None for s in scopes)
        try:
            cost = await token_cost(gw, ups[0], rid, body, chat) if needs_tokens else 0
        except httpx.HTTPError:
            raise GatewayError(502, "upstream unreachable (tokenize)", "api_error",
                               "upstream_unavailable") from None
        try:
            res = await gw.limiter.admit(rid, scopes, cost)
        except RateLimited as e:
            gw.metrics.rejections.labels(p.key_id, p.team or "", e.kind).inc()
            raise GatewayError(429, str(e), "rate_limit_exceeded", e.kind,
                               headers={"Retry-After": str(e.retry_after)}) from None
        except LimitsUnavailable as e:
            raise GatewayError(503, str(e), "service_unavailable",
                               "limits_unavailable") from None
        rec["request"] = body
    except GatewayError as e:
        audit_rejected(gw, rec, labels, e.status, "rejected", t0, error=e.message)
        raise
    moderator = gw.safety.output_moderator(ctx) if gw.safety is not None else None
    upstream = None
    for base in ups:
        req = gw.client.build_request("POST", base + endpoint, json=body,
                                      headers=gw.upstream_headers(rid))
        try:
            upstream = await gw.client.send(req, stream=True)
            break
        except httpx.TransportError:
            continue
    if upstream is None:
        await _settle(gw, res, rec, labels, 502, "upstream_error", t0, 0, 0,
                      error="no upstream reachable")
        raise GatewayError(502, "no upstream reachable", "api_error", "upstream_unavailable")
    gw.metrics.upstream_latency.labels(model).observe(time.monotonic() - t0)
    ctype = upstream.headers.get("content-type", "application/json")
    if upstream.status_code != 200 or not ctype.startswith("text/event-stream"):
        try:
            data = await upstream.aread()
        finally:
            await upstream.aclose()
        pt = ct = 0
        texts: list[str] = []
        if upstream.status_code == 200:
            try:
                out = json.loads(data)
                usage = out.get("usage") or {}
                pt, ct = int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0))
                if moderator is not None:
                    data = _moderate_whole(out, moderator, rec)
                for c in out.get("choices") or []:  # what the client gets
                    texts.append((c.get("message") or {}).get("content") or c.get("text") or "")
            except (ValueError, TypeError, AttributeError):
                pass
        rec["response_text"] = texts
        await _settle(gw, res, rec, labels, upstream.status_code,
                      "ok" if upstream.status_code == 200 else "upstream_error", t0, pt, ct)
        return Response(data, status_code=upstream.status_code, media_type=ctype)
    return StreamingResponse(_relay(gw, upstream, res, rec, labels, t0, want_usage,
                                    moderator), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


def _moderate_whole(out: dict, moderator, rec: dict) -> bytes:
    for i, c in enumerate(out.get("choices") or []):
        holder = c.get("message") if "message" in c else c
        field = "content" if "message" in c else "text"
        a = moderator.feed(i, holder.get(field) or "")
        b = moderator.finish(i)
        rec["safety"] += a.verdicts + b.verdicts
        holder[field] = a.text + b.text
        if a.stop or b.stop:
            c["finish_reason"] = "content_filter"
    return json.dumps(out).encode()


async def _relay(gw, upstream: httpx.Response, res, rec, labels, t0, want_usage, moderator):
    """Relay SSE events; settle in a task of its own (also when the client aborts)."""
    pt = ct = chunks = 0
    texts: dict[int, list[str]] = {}
    outcome, cut, got_usage = "aborted", False, False
    try:
        async for line in upstream.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                if line:
                    yield line + "\n\n"
                continue
            try:
                ev = json.loads(line[6:])
            except ValueError:
                yield line + "\n\n"
                continue
            if ev.get("usage"):
                got_usage = True
                pt = int(ev["usage"].get("prompt_tokens", 0))
                ct = int(ev["usage"].get("completion_tokens", 0))
                if not ev.get("choices") and not want_usage:
                    continue
            for c in ev.get("choices") or []:
                i = c.get("index", 0)
                holder = c.get("delta") if "delta" in c else c
                field = "content" if "delta" in c else "text"
                piece = (holder or {}).get(field)
                if piece:
                    chunks += 1
                    if moderator is not None:
                        step = moderator.feed(i, piece)
                        rec["safety"] += step.verdicts
                        holder[field] = piece = step.text
                        if step.stop:
                            c["finish_reason"], cut = "content_filter", True
                    texts.setdefault(i, []).append(piece)
            yield "data: " + json.dumps(ev) + "\n\n"
            if cut:
                yield "data: [DONE]\n\n"
                break
        outcome = "ok"
    except BaseException as e:
        logger.info("stream %s ended early: %r", rec["request_id"], e)
        raise
    finally:
        rec["response_text"] = ["".join(texts[i]) for i in sorted(texts)]
        if not got_usage:  # aborted, or cut by the moderator: charge what was streamed
            ct = chunks
            pt = pt or max(res.cost - _max_completion(rec["request"]), 0)
        task = asyncio.get_running_loop().create_task(
            _finish_stream(gw, upstream, res, rec, labels, t0, pt, ct, outcome))
        gw.tasks.add(task)
        task.add_done_callback(gw.tasks.discard)


def _max_completion(body: dict) -> int:
    mt = body.get("max_completion_tokens") or body.get("max_tokens")
    return (mt or 0) * (body.get("n") or 1)


async def _finish_stream(gw, upstream, res, rec, labels, t0, pt, ct, outcome) -> None:
    await upstream.aclose()
    await _settle(gw, res, rec, labels, 200, outcome, t0, pt, ct)


async def _settle(gw, res, rec, labels, status, outcome, t0, pt, ct, error=None) -> None:
    await gw.limiter.settle(res, labels["model"], pt, ct)
    rec.update(prompt_tokens=pt, completion_tokens=ct)
    await _audit(gw, rec, labels, status, outcome, t0, error)


def audit_rejected(gw, rec, labels, status, outcome, t0, error=None) -> None:
    """Count and audit (in a background task) a request answered without an upstream."""
    task = asyncio.get_running_loop().create_task(
        _audit(gw, {**rec, "prompt_tokens": 0, "completion_tokens": 0}, labels, status,
               outcome, t0, error))
    gw.tasks.add(task)
    task.add_done_callback(gw.tasks.discard)


async def _audit(gw, rec, labels, status, outcome, t0, error) -> None:
    latency = time.monotonic() - t0
    gw.metrics.requests.labels(**labels, code=str(status)).inc()
    gw.metrics.duration.labels(labels["model"]).observe(latency)
    if gw.audit is None:
        return
    rec.update(status=status, outcome=outcome, error=error, latency_s=latency)
    rec.setdefault("response_text", [])
    try:
        await gw.audit.record(rec)
    except Exception:
        logger.exception("audit sink failed for %s", rec.get("request_id"))
