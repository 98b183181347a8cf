"""What an upstream call fails with, as every layer above it sees it: the error reply
(`UpstreamError`), the prompt refused as too long (`ContextTooLong`, which the loop guard
acts on), and the upstream headers a client is owed with either. It imports nothing else
of the upstream package, so the forwarders, the retry policy and the engine all use it."""
from __future__ import annotations

from typing import Any

from ..errors import ErrorKind, GatewayError, upstream_error_object

BAD_REPLY = "upstream_bad_reply"
"""The code of an upstream success whose body is not the API's reply (a 502)."""
_CONTEXT_MARKERS = ("context_length_exceeded", "maximum context length", "context window", "prompt is too long",
                    "too many tokens", "reduce the length", "input is too long",
                    "exceeds the maximum number of tokens")  # Gemini's "The input token count (N) exceeds ..."


# What a client needs of the upstream's own headers: when to retry, its rate-limit state, the
# request id to quote to the provider. Passed on with replies and errors on every door.
_PASSED_HEADERS = ("retry-after", "retry-after-ms", "x-request-id", "request-id")
_PASSED_PREFIXES = ("x-ratelimit-", "anthropic-ratelimit-")


def passed_headers(headers: Any) -> dict[str, str]:
    """The upstream headers a client needs (`headers`: any mapping, possibly None)."""
    if not headers:
        return {}
    return {k: v for k, v in headers.items()
            if isinstance(k, str) and (k.lower() in _PASSED_HEADERS or k.lower().startswith(_PASSED_PREFIXES))}


class UpstreamError(Exception):
    def __init__(self, status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> None:
        super().__init__(body["error"]["message"])
        self.status = status
        self.body = body
        self.headers = headers or {}

    def to_api_error(self) -> GatewayError:
        e = self.body["error"]
        return GatewayError(ErrorKind.UPSTREAM, e["message"], code=e.get("code"), param=e.get("param"),
                            type=e.get("type"), upstream_status=self.status, headers=dict(self.headers))


class ContextTooLong(UpstreamError):
    """The provider refused the prompt as too long: the loop guard decides what happens."""


def _is_context_error(status: int, body: dict[str, Any]) -> bool:
    if status not in (400, 413, 422):
        return False
    err = body.get("error") or {}
    text = f"{err.get('code') or ''} {err.get('type') or ''} {err.get('message') or ''}".lower()
    return any(m in text for m in _CONTEXT_MARKERS)


def raise_for_error(status: int, payload: Any, fallback: str, headers: dict[str, str] | None = None) -> None:
    body = upstream_error_object(status, payload, fallback)
    raise (ContextTooLong if _is_context_error(status, body) else UpstreamError)(status, body, headers)
