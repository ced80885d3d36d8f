"""OpenAI-style error responses of the gateway: ``{"error": {message, type, param, code}}``."""

from __future__ import annotations

import json

from starlette.responses import Response


class GatewayError(Exception):
    """An error a client caused or must see; becomes an HTTP 4xx/5xx OpenAI error body."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code = status, message, type_, code
        self.param, self.headers = param, headers or {}

    def response(self) -> Response:
        return error_response(self.status, self.message, self.type, self.code, self.param,
                              self.headers)


def error_response(status: int, message: str, type_: str = "invalid_request_error",
                   code: str | None = None, param: str | None = None,
                   headers: dict[str, str] | None = None) -> Response:
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return Response(json.dumps(body), status_code=status, media_type="application/json",
                    headers=headers)


def bad_request(message: str, param: str | None = None) -> GatewayError:
    return GatewayError(400, message, "invalid_request_error", "invalid_value", param)
