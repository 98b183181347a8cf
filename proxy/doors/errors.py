"""A `GatewayError` at the edge: the HTTP status of its kind, and OpenAI's error shape (the
chat and Responses doors, the admin API). The Messages door renders Anthropic's shape
from the same status (`messages_replies.error_body`)."""
from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from ..errors import ErrorKind, GatewayError

HTTP_STATUS = {ErrorKind.INVALID_REQUEST: 400, ErrorKind.AUTHENTICATION: 401, ErrorKind.PERMISSION: 403,
               ErrorKind.NOT_FOUND: 404, ErrorKind.TOO_LARGE: 413, ErrorKind.CONFLICT: 422,
               ErrorKind.INTERNAL: 500, ErrorKind.UPSTREAM_UNREACHABLE: 502, ErrorKind.UNAVAILABLE: 503,
               ErrorKind.TIMEOUT: 504}
OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "invalid_request_error", 429: "rate_limit_error",
                502: "upstream_error", 503: "service_unavailable", 504: "timeout_error"}


def http_status(error: GatewayError) -> int:
    if error.kind is ErrorKind.UPSTREAM and error.upstream_status is not None:
        return error.upstream_status
    return HTTP_STATUS.get(error.kind, 502)


def openai_body(error: GatewayError) -> dict[str, Any]:
    status = http_status(error)
    kind = error.type or OPENAI_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": error.message, "type": kind, "param": error.param, "code": error.code}}


def openai_response(error: GatewayError, extra_headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=http_status(error), body=orjson.dumps(openai_body(error)),
                        content_type="application/json", headers={**error.headers, **(extra_headers or {})})
