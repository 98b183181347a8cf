"""What can go wrong in a turn, as the engine and everything below it say it.

A `GatewayError` names its kind (a bad request, an unknown model, an unreachable upstream,
an exhausted context ...), never an HTTP status: each door turns it into its own wire
shape and status (`doors/errors.py`), so the same failure reads as OpenAI's error object on
the chat and Responses doors and as Anthropic's on the Messages door. An error the
upstream itself answered keeps the upstream's status and error object (`UPSTREAM`).
"""
from __future__ import annotations

from enum import Enum
from typing import Any


class ErrorKind(Enum):
    INVALID_REQUEST = "invalid_request"
    AUTHENTICATION = "authentication"
    PERMISSION = "permission"
    NOT_FOUND = "not_found"
    TOO_LARGE = "too_large"
    CONFLICT = "conflict"
    """The request contradicts an earlier one (an idempotency key reused with another body)."""
    INTERNAL = "internal"
    UPSTREAM_UNREACHABLE = "upstream_unreachable"
    UNAVAILABLE = "unavailable"
    """ctxgate's own backend (the state store, the WAL) cannot serve now: retry later."""
    TIMEOUT = "timeout"
    UPSTREAM = "upstream"
    """The upstream answered with an error: its status and error object pass through."""


class GatewayError(Exception):
    def __init__(self, kind: ErrorKind, message: str, *, code: str | None = None, param: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None,
                 upstream_status: int | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.code = code
        self.param = param
        self.type = type
        """The error type to show, when it is not the one the kind implies (an upstream's own)."""
        self.headers = headers or {}
        self.upstream_status = upstream_status


def context_exhausted(detail: str) -> GatewayError:
    """The loop guard's answer (docs/compaction.md, the loop guard): compaction already ran and did not help."""
    return GatewayError(ErrorKind.INVALID_REQUEST, f"CONTEXT_EXHAUSTED: {detail}", code="context_exhausted",
                        param="messages", type="invalid_request_error")


def upstream_error_object(status: int, payload: Any, fallback: str) -> dict[str, Any]:
    """The upstream's own error object when it has one, else one in OpenAI's shape."""
    kind = "api_error" if status >= 500 else "invalid_request_error"
    if isinstance(payload, dict) and isinstance(payload.get("error"), dict):
        err = payload["error"]
        return {"error": {"message": str(err.get("message") or fallback),
                          "type": err.get("type") or kind,
                          "param": err.get("param"), "code": err.get("code"),
                          **{k: v for k, v in err.items() if k not in ("message", "type", "param", "code")}}}
    return {"error": {"message": fallback, "type": kind, "param": None, "code": None}}
