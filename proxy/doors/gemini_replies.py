"""What a Gemini reply says that ctxgate keeps (the prompt's size, the calls it makes), from a
whole `GenerateContentResponse` or its stream going by; and errors in Google's shape,
`{"error": {"code", "message", "status"}}`."""
from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from ..engine.wire import ReplyFacts
from ..errors import GatewayError
from .errors import http_status
from .sse import SseWatch

STATUS = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED", 404: "NOT_FOUND",
          409: "ABORTED", 413: "INVALID_ARGUMENT", 422: "FAILED_PRECONDITION", 429: "RESOURCE_EXHAUSTED",
          499: "CANCELLED", 500: "INTERNAL", 501: "UNIMPLEMENTED", 502: "UNAVAILABLE", 503: "UNAVAILABLE",
          504: "DEADLINE_EXCEEDED"}
CONTEXT_CODES = ("context_exhausted", "context_length_exceeded")
"""A conversation past what the model takes: RESOURCE_EXHAUSTED, as Google names it, with its
HTTP 400 kept (a 429 would be retried by every Gemini client, and fail the same way)."""


def error_body(error: GatewayError) -> dict[str, Any]:
    code = http_status(error)
    status = "RESOURCE_EXHAUSTED" if error.code in CONTEXT_CODES else STATUS.get(
        code, "INTERNAL" if code >= 500 else "INVALID_ARGUMENT")
    return {"error": {"code": code, "message": error.message, "status": status}}


def google_response(error: GatewayError) -> web.Response:
    return web.Response(status=http_status(error), body=orjson.dumps(error_body(error)),
                        content_type="application/json", headers=error.headers)


def upstream_error(error: dict[str, Any]) -> dict[str, Any]:
    """A chat-completions error object met mid-stream, in Google's shape."""
    code = error.get("code")
    status = "RESOURCE_EXHAUSTED" if code in CONTEXT_CODES else "UNAVAILABLE"
    return {"error": {"code": 400 if status == "RESOURCE_EXHAUSTED" else 503,
                      "message": str(error.get("message") or "upstream error"), "status": status}}


def facts_of(data: dict[str, Any]) -> ReplyFacts:
    """What ctxgate keeps of a `GenerateContentResponse` (or a chunk of its stream)."""
    usage = data.get("usageMetadata")
    tokens = usage.get("promptTokenCount") if isinstance(usage, dict) else None
    calls = []
    for candidate in data.get("candidates") or []:
        content = candidate.get("content") if isinstance(candidate, dict) else None
        for part in (content or {}).get("parts") or []:
            call = part.get("functionCall") if isinstance(part, dict) else None
            if isinstance(call, dict):
                calls.append({"id": call.get("id"), "type": "function", "function": {
                    "name": call.get("name"), "arguments": orjson.dumps(call.get("args") or {}).decode()}})
    return ReplyFacts(tokens if isinstance(tokens, int) else None, calls)


def reply_facts(body: bytes) -> ReplyFacts:
    try:
        data = orjson.loads(body or b"")
    except orjson.JSONDecodeError:
        return ReplyFacts(malformed="not JSON")
    if not isinstance(data, dict) or not isinstance(data.get("candidates"), list):
        return ReplyFacts(malformed="JSON without a `candidates` list")
    return facts_of(data)


_READ = (b'"error"', b'"usageMetadata"', b'"functionCall"', b'"finishReason"', b"\\u")
"""What an element the stream watch reads holds: a key it reads, or an escape (a key may be spelt with one)."""


class GeminiStream(SseWatch):
    """Watches a Gemini stream go by, SSE or a JSON array cut into whole elements: the chunk
    with a `finishReason` completes it, an `error` element fails it."""

    def __init__(self, keep_all: bool) -> None:
        super().__init__(keep_all)
        self._pending = b""
        """What follows the last blank line: an event or array element not yet whole."""
        self._facts = ReplyFacts()

    def facts(self) -> ReplyFacts:
        return self._facts

    def feed(self, data: bytes) -> None:
        if self._all is not None:
            self._all += data
        *events, self._pending = (self._pending + data.replace(b"\r\n", b"\n")).split(b"\n\n")
        for event in events:
            raw = event.strip()
            raw = raw[5:] if raw.startswith(b"data:") else raw.lstrip(b"[,").rstrip(b"]")
            if not any(key in raw for key in _READ):
                continue  # a text delta: nothing in it is kept
            try:
                chunk = orjson.loads(raw)
            except orjson.JSONDecodeError:
                continue
            if not isinstance(chunk, dict):
                continue
            if "error" in chunk:
                self._failed = True
                continue
            found = facts_of(chunk)
            if found.prompt_tokens is not None:
                self._facts.prompt_tokens = found.prompt_tokens
            self._facts.tool_calls += found.tool_calls
            if any(isinstance(c, dict) and c.get("finishReason") for c in chunk.get("candidates") or []):
                self._done = True
