"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

Every failure a client can see goes through `ApiError`, so no handler ever answers with
a traceback or a 500 of aiohttp's own.
"""
from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 413: "invalid_request_error", 429: "rate_limit_error",
          502: "upstream_error", 503: "service_unavailable", 504: "timeout_error"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.type = type or _TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self, extra_headers: dict[str, str] | None = None) -> web.Response:
        return web.Response(status=self.status, body=orjson.dumps(self.body()), content_type="application/json",
                            headers={**self.headers, **(extra_headers or {})})


def context_exhausted(detail: str) -> ApiError:
    """The loop guard's answer (spec pitfall 2): compaction already ran and did not help."""
    return ApiError(400, f"CONTEXT_EXHAUSTED: {detail}", code="context_exhausted", param="messages",
                    type="invalid_request_error")


def upstream_error_object(status: int, payload: Any, fallback: str) -> dict[str, Any]:
    """The upstream's own error object when it has one, else one in OpenAI's shape."""
    if isinstance(payload, dict) and isinstance(payload.get("error"), dict):
        err = payload["error"]
        return {"error": {"message": str(err.get("message") or fallback),
                          "type": err.get("type") or _TYPES.get(status, "api_error"),
                          "param": err.get("param"), "code": err.get("code"),
                          **{k: v for k, v in err.items() if k not in ("message", "type", "param", "code")}}}
    return ApiError(status, fallback).body()
