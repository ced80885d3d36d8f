"""The published OpenAPI schema (``/openapi.json``), made to say what the server answers.

FastAPI documents a 422 ``HTTPValidationError`` for every route with a body, while
this server answers invalid requests with 400 and OpenAI's error body (vLLM does the
same); routes return ``Response`` objects, so FastAPI cannot infer their bodies. The
routes therefore declare their responses with :func:`responses`, and
:func:`install_openapi` replaces the 422s with the 400 the server sends (and documents
401 on ``/v1/*`` when an API key is required). ``tests/test_server_schema.py`` runs
schemathesis' conformance checks against the live schema.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from llmserve.protocol.openai import ErrorResponse

ERROR_DESCRIPTIONS = {
    400: "invalid request: a field is missing, of the wrong type or out of range",
    401: "missing or wrong API key (Authorization: Bearer <key>)",
    404: "the model is not served here",
    500: "the engine failed while running the request",
    503: "the model is loading, the engine stopped, or too many requests wait",
}
_ERROR_REF = {"$ref": "#/components/schemas/ErrorResponse"}


def responses(model: type[BaseModel] | None = None, *errors: int, stream: bool = False,
              media_type: str | None = None) -> dict[int | str, dict[str, Any]]:
    """The ``responses=`` of a route: 200 with ``model`` as JSON (plus
    ``text/event-stream`` when ``stream``), or with ``media_type`` text, or with no
    body when both are None; then each of ``errors`` with OpenAI's error body."""
    out: dict[int | str, dict[str, Any]] = {}
    if model is not None:
        out[200] = {"model": model, "description": "success"}
        if stream:
            # one server-sent event (its fields, as SSE parsers and schemathesis read them)
            out[200]["content"] = {"text/event-stream": {"schema": {
                "type": "object", "required": ["data"],
                "properties": {"data": {"type": "string"}, "event": {"type": "string"},
                               "id": {"type": "string"}, "retry": {"type": "integer"}},
                "description": "server-sent events, one JSON chunk per `data:` line, "
                "ending with `data: [DONE]`"}}}
    elif media_type is not None:
        out[200] = {"description": "success",
                    "content": {media_type: {"schema": {"type": "string"}}}}
    else:
        out[200] = {"description": "success (no body)"}
    for code in errors:
        out[code] = {"model": ErrorResponse, "description": ERROR_DESCRIPTIONS[code]}
    return out


def install_openapi(app: FastAPI, api_key_required: bool = False) -> None:
    """Make ``app.openapi()`` publish 400 (OpenAI's error body) where FastAPI would say
    422, and 401 on ``/v1/*`` when ``api_key_required``."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes,
                             description=app.description)
        for path, item in schema.get("paths", {}).items():
            for op in item.values():
                resps = op.setdefault("responses", {})
                if resps.pop("422", None) is not None:
                    resps.setdefault("400", {"description": ERROR_DESCRIPTIONS[400],
                                             "content": {"application/json": {
                                                 "schema": _ERROR_REF}}})
                if api_key_required and path.startswith("/v1"):
                    resps.setdefault("401", {"description": ERROR_DESCRIPTIONS[401],
                                             "content": {"application/json": {
                                                 "schema": _ERROR_REF}}})
        components = schema.get("components", {}).get("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            components.pop(name, None)
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
