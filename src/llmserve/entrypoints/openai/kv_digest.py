"""``GET /kv_cache/digest``: which prefix-cache blocks this worker holds, for routers.

The router (``llmserve router``, policy ``cache_aware``) polls it with its health
checks, so its view of each worker's cache is what the worker actually holds, not a
guess. The hashes are the engine's chained block hashes
(:mod:`llmserve.kv_cache.prefix_cache`), which the router computes the same way.

Response (JSON)::

    {"block_size": 16, "version": 812, "num_blocks": 2,
     "hashes": "<base64 of the 32-byte hashes, concatenated>"}

``?if_version=V`` answers 304 with no body while the set is unchanged (a cheap poll).
Guarded like ``/metrics`` (open with ``--allow-unauthenticated-metrics``).
"""

from __future__ import annotations

import base64

from fastapi import FastAPI
from starlette.responses import JSONResponse, Response

DIGEST_PATH = "/kv_cache/digest"


def install_kv_digest(app: FastAPI, state) -> None:
    """Add the route; ``state.require_engine()`` gives the running ``AsyncLLM``."""

    @app.get(DIGEST_PATH, include_in_schema=False)
    async def kv_cache_digest(if_version: int | None = None) -> Response:
        engine = state.require_engine()
        block_size, version, hashes = engine.engine.prefix_cache_digest()
        if if_version is not None and if_version == version:
            return Response(status_code=304)
        return JSONResponse({"block_size": block_size, "version": version,
                             "num_blocks": len(hashes),
                             "hashes": base64.b64encode(b"".join(hashes)).decode()})
