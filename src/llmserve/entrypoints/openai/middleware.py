"""Pure ASGI middleware of the OpenAI server that must act before a request body is
read or parsed: the request body size limit (413).

A body larger than the limit is refused from its ``Content-Length`` without keeping
it; a body without one (``Transfer-Encoding: chunked``) is counted while it arrives
and refused as soon as it passes the limit. The rest of the upload (up to
``DRAIN_LIMIT_BYTES``) is read and dropped first, so the client can read the 413.
Either way the application never sees
the request, so nothing is parsed, validated or tokenized. The refusal is an
OpenAI-style error body (``{"error": {"message", "type", "param", "code"}}``).
Starlette's ``BaseHTTPMiddleware`` is not used: it cannot stop a body mid-stream.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from starlette.responses import JSONResponse

DEFAULT_MAX_REQUEST_BODY_BYTES = 16 * 1024 * 1024  # 16 MiB


def _payload_too_large(limit: int, size: int | None) -> JSONResponse:
    told = f"is {size} bytes, over" if size is not None else "is larger than"
    body = {"error": {
        "message": f"the request body {told} the limit of {limit} bytes "
                   f"(--max-request-body-bytes)",
        "type": "invalid_request_error", "param": None, "code": 413}}
    # the client may still be sending: tell it this connection is done
    return JSONResponse(body, 413, headers={"Connection": "close"})


# Before a 413 the rest of the body (up to this many bytes) is read and dropped, never
# parsed or kept: closing a connection with unread upload data makes the kernel reset it,
# and the client loses the 413 ("lingering close", as nginx does); a bigger body is cut.
DRAIN_LIMIT_BYTES = 64 * 2**20


async def _drain(receive: Callable, limit: int) -> None:
    drained = 0
    while drained <= limit:
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            return
        drained += len(message.get("body", b""))


class RequestBodyLimitMiddleware:
    """Refuse request bodies longer than ``max_bytes`` with 413 before the app runs.

    Args:
        app: the ASGI application.
        max_bytes: the largest body accepted, in bytes (>= 1).

    The whole body is read here (the JSON routes read all of it anyway) and then
    replayed to the application; later ``receive()`` calls (disconnect detection)
    go to the server as before.
    """

    def __init__(self, app: Any, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_request_body_bytes must be >= 1, got {max_bytes}")
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        length = headers.get(b"content-length")
        if length is None and b"transfer-encoding" not in headers:
            await self.app(scope, receive, send)  # no body
            return
        if length is not None:
            try:
                size = int(length)
            except ValueError:
                size = None
            if size is not None and size > self.max_bytes:
                await _drain(receive, DRAIN_LIMIT_BYTES)
                await _payload_too_large(self.max_bytes, size)(scope, receive, send)
                return
        messages: list[dict] = []
        received = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # http.disconnect: the client left
                messages.append(message)
                break
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                if message.get("more_body", False):
                    await _drain(receive, DRAIN_LIMIT_BYTES)
                await _payload_too_large(self.max_bytes, None)(scope, receive, send)
                return
            messages.append(message)
            if not message.get("more_body", False):
                break

        async def replay() -> dict:
            if messages:
                return messages.pop(0)
            return await receive()

        await self.app(scope, replay, send)
