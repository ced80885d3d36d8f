"""The routes of ``llmserve serve`` that the data-parallel front does not route per
request (the router's ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``,
``/tokenize``, ``/detokenize`` are routed by load and prefix):

==========================================  ==========================================
route                                       on the front
==========================================  ==========================================
``/v1/load_lora_adapter``                   sent to every replica in turn, so each one
``/v1/unload_lora_adapter``                 serves the same adapters; a load that one
                                            replica refuses is undone on the others
``/v1/files*``, ``/v1/batches*``            pinned to replica 0 (its ``--batch-dir``;
                                            the other replicas get none): one batch
                                            store, so ids and resume-after-restart hold
``/version``, ``/tokenizer_info``           replica 0 (every replica serves one model)
==========================================  ==========================================

vLLM's data-parallel API server broadcasts adapter loads to its engine cores the same
way; OpenAI's Batch API semantics (one store per server) are kept by pinning.
"""


import json
from typing import Any

BATCH_FLAG = "--batch-dir"
LORA_ROUTES = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")


def strip_batch_dir(argv: list[str]) -> list[str]:
    """``argv`` without ``--batch-dir DIR`` / ``--batch-dir=DIR`` (replicas 1..N-1)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == BATCH_FLAG:
            skip = True
        elif not a.startswith(BATCH_FLAG + "="):
            out.append(a)
    return out


def install_replica_routes(app: Any, replicas: list[Any], pool: Any) -> None:
    """Add the routes of the table above to the front's FastAPI ``app``; ``replicas``:
    objects with ``url`` and ``id`` (``dp0`` ...), replica 0 first; ``pool``: the
    front's :class:`~llmserve.router.state.WorkerPool`, whose model cards are refreshed
    after a load or unload (so the next request routes to the adapter at once)."""
    import httpx
    from fastapi import Request
    from fastapi.responses import Response

    from llmserve.router.health import HealthChecker

    client = httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=10.0))
    cards = HealthChecker(pool, client, timeout_s=10.0)

    async def refresh() -> None:
        for w in list(pool.workers.values()):
            await cards.refresh_models(w)

    def relay(r: httpx.Response) -> Response:
        return Response(r.content, status_code=r.status_code,
                        media_type=r.headers.get("content-type"))

    async def pinned(request: Request, rest: str = "") -> Response:
        headers = {k: v for k, v in request.headers.items()
                   if k.lower() in ("content-type", "accept")}
        r = await client.request(request.method, replicas[0].url + request.url.path,
                                 params=request.query_params, headers=headers,
                                 content=await request.body())
        return relay(r)

    json_headers = {"content-type": "application/json"}

    async def load(request: Request) -> Response:
        body = await request.body()  # as sent: each replica validates it
        done = []
        for rp in replicas:
            r = await client.post(rp.url + LORA_ROUTES[0], content=body, headers=json_headers)
            if r.status_code != 200:
                name = _lora_name(body)
                for ok in done:  # undo: every replica serves the same adapters
                    await client.post(ok.url + LORA_ROUTES[1], json={"lora_name": name})
                await refresh()
                return _annotated(r, rp.id, relay)
            done.append(rp)
        await refresh()
        return relay(r)

    async def unload(request: Request) -> Response:
        body = await request.body()
        answers = [await client.post(rp.url + LORA_ROUTES[1], content=body,
                                     headers=json_headers) for rp in replicas]
        good = [r for r in answers if r.status_code == 200]
        await refresh()
        return relay(good[0] if good else answers[0])

    app.add_api_route(LORA_ROUTES[0], load, methods=["POST"], include_in_schema=False)
    app.add_api_route(LORA_ROUTES[1], unload, methods=["POST"], include_in_schema=False)
    for path in ("/v1/files", "/v1/batches"):
        app.add_api_route(path, pinned, methods=["GET", "POST"], include_in_schema=False)
        app.add_api_route(path + "/{rest:path}", pinned, methods=["GET", "POST", "DELETE"],
                          include_in_schema=False)
    for path in ("/version", "/tokenizer_info"):
        app.add_api_route(path, pinned, methods=["GET"], include_in_schema=False)


def _lora_name(body: bytes) -> str | None:
    try:
        return json.loads(body).get("lora_name")
    except (ValueError, AttributeError):
        return None


def _annotated(r, replica_id: str, relay):
    """A replica's OpenAI-style error with the replica named in its message."""
    try:
        body = r.json()
        body["error"]["message"] = f"data-parallel replica {replica_id}: " \
                                   f"{body['error']['message']}"
    except (ValueError, KeyError, TypeError):
        return relay(r)
    from fastapi.responses import JSONResponse

    return JSONResponse(body, status_code=r.status_code)
