"""``X-Request-Id`` on every answer of the OpenAI server (pure ASGI, as the gateway's).

The client's id (the gateway's, when it proxies) is echoed when it is a sane token
(1-128 of ``[A-Za-z0-9._:-]``); otherwise a fresh ``req-<hex>`` is made, so logs and
clients can always correlate. Also readable by handlers as
``request.scope["state"]["request_id"]``.
"""

from __future__ import annotations

import re
import uuid
from typing import Any

REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


class RequestIdMiddleware:
    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        rid = next((v.decode("latin-1") for k, v in scope["headers"]
                    if k.lower() == b"x-request-id"), "")
        if not REQUEST_ID_RE.match(rid):
            rid = "req-" + uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", [])
                           if k.lower() != b"x-request-id"]
                message["headers"] = [*headers, (b"x-request-id", rid.encode())]
            await send(message)

        await self.app(scope, receive, send_with_id)
