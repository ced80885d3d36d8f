"""The admin API (role ``admin`` or the master key, except ``/admin/usage``)::

    POST   /admin/keys           {name, team, role, models, rpm, tpm, max_parallel_requests,
                                  daily_token_quota, priority, expires_at} -> the record
                                  plus "key": "sk-..." (the secret, shown this once)
    GET    /admin/keys           {"data": [records]}   (never the hash or the secret)
    GET    /admin/keys/{id}      the record plus "window": current use of its limits
    PATCH  /admin/keys/{id}      change any of the POST fields
    DELETE /admin/keys/{id}      revoke (the record stays, for usage and audit)
    PUT    /admin/teams/{name}   {models, rpm, tpm, max_parallel_requests,
                                  daily_token_quota, priority}
    GET    /admin/teams          {"data": {name: record}}
    GET    /admin/usage?key_id=&team=   {"data": [{key_id|team, day, model, requests,
                                  prompt_tokens, completion_tokens}]}; members and
                                  viewers: their own key only

Changes are written to Redis; every replica sees them within its cache TTL (< 1 s).
"""

from __future__ import annotations

import json

from fastapi import Request
from starlette.responses import JSONResponse, Response

from llmserve.gateway.config import check_team
from llmserve.gateway.errors import GatewayError, bad_request
from llmserve.gateway.keys import KEY_ID_RE, check_key_fields, public
from llmserve.gateway.limits import Scope


async def _json(request: Request, limit: int) -> dict:
    from llmserve.gateway.proxy import read_body

    return await read_body(request, limit)


def _not_found(key_id: str) -> GatewayError:
    return GatewayError(404, f"no key with id '{key_id}'", "invalid_request_error",
                        "key_not_found", "key_id")


def _checked(where: str, fn, *args):
    try:
        return fn(where, *args)
    except ValueError as e:
        raise bad_request(str(e)) from None


def register(app, gw) -> None:
    from llmserve.gateway.app import require_role

    limit = gw.config.max_body_bytes

    @app.post("/admin/keys")
    async def create_key(request: Request) -> Response:
        require_role(request, "admin")
        fields = _checked("POST /admin/keys", check_key_fields, await _json(request, limit),
                          False)
        rec, secret = await gw.keys.create(fields)
        return JSONResponse({**public(rec), "key": secret}, status_code=201)

    @app.get("/admin/keys")
    async def list_keys(request: Request) -> Response:
        require_role(request, "admin")
        return JSONResponse({"data": [public(r) for r in await gw.keys.list_keys()]})

    @app.get("/admin/keys/{key_id}")
    async def get_key(key_id: str, request: Request) -> Response:
        require_role(request, "admin")
        rec = await gw.keys.read_key(key_id) if KEY_ID_RE.match(key_id) else None
        if rec is None:
            raise _not_found(key_id)
        window = await gw.limiter.window(Scope.of("key", key_id, rec))
        return JSONResponse({**public(rec), "window": window})

    @app.patch("/admin/keys/{key_id}")
    async def patch_key(key_id: str, request: Request) -> Response:
        require_role(request, "admin")
        changes = _checked(f"PATCH /admin/keys/{key_id}", check_key_fields,
                           await _json(request, limit), True)
        rec = await gw.keys.update(key_id, changes) if KEY_ID_RE.match(key_id) else None
        if rec is None:
            raise _not_found(key_id)
        return JSONResponse(public(rec))

    @app.delete("/admin/keys/{key_id}")
    async def revoke_key(key_id: str, request: Request) -> Response:
        require_role(request, "admin")
        rec = await gw.keys.update(key_id, {"revoked": True}) \
            if KEY_ID_RE.match(key_id) else None
        if rec is None:
            raise _not_found(key_id)
        return JSONResponse(public(rec))

    @app.put("/admin/teams/{name}")
    async def put_team(name: str, request: Request) -> Response:
        require_role(request, "admin")
        team = _checked(f"PUT /admin/teams/{name}", check_team, await _json(request, limit))
        await gw.redis.set(f"gw:team:{name}", json.dumps(team))
        await gw.redis.sadd("gw:teams", name)
        return JSONResponse({"name": name, **team})

    @app.get("/admin/teams")
    async def list_teams(request: Request) -> Response:
        require_role(request, "admin")
        names = sorted(await gw.redis.smembers("gw:teams"))
        raws = await gw.redis.mget([f"gw:team:{n}" for n in names]) if names else []
        return JSONResponse({"data": {n: json.loads(r) for n, r in zip(names, raws) if r}})

    @app.get("/admin/usage")
    async def usage(request: Request) -> Response:
        p = request.state.principal
        key_id = request.query_params.get("key_id")
        team = request.query_params.get("team")
        if p.role != "admin":
            if team is not None or (key_id is not None and key_id != p.key_id):
                raise GatewayError(403, "only admins may read other keys' or teams' usage",
                                   "permission_error", "insufficient_role")
            key_id = p.key_id
        subjects = []
        if key_id is not None:
            if not KEY_ID_RE.match(key_id):
                raise bad_request("invalid key_id", "key_id")
            subjects.append(("key_id", key_id, f"gw:usage:key:{key_id}:"))
        if team is not None:
            if not 0 < len(team) <= 128:
                raise bad_request("invalid team", "team")
            subjects.append(("team", team, f"gw:usage:team:{team}:"))
        if not subjects:
            subjects.append(("key_id", None, "gw:usage:key:"))
        rows = []
        for label, value, prefix in subjects:
            async for rkey in gw.redis.scan_iter(match=_glob(prefix) + "*", count=500):
                subject, day = rkey[len("gw:usage:key:" if label == "key_id"
                                        else "gw:usage:team:"):].rsplit(":", 1)
                by_model: dict[str, dict] = {}
                for f, v in (await gw.redis.hgetall(rkey)).items():
                    model, counter = f.rsplit("|", 1)
                    by_model.setdefault(model, {})[counter] = int(v)
                for model, counts in sorted(by_model.items()):
                    rows.append({label: value or subject, "day": day, "model": model,
                                 **counts})
        rows.sort(key=lambda r: (r["day"], r["model"]))
        return JSONResponse({"data": rows})


def _glob(s: str) -> str:
    """Escape Redis glob characters in a literal prefix."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in s)
