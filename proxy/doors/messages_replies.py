"""What an Anthropic Messages reply says that ctxgate keeps: the prompt's size and the
tool calls it makes, from a whole `message` or from its SSE events going by."""
from __future__ import annotations

from typing import Any

import orjson

from ..engine.wire import ReplyFacts
from ..errors import GatewayError
from .errors import http_status
from .sse import SseWatch

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 504: "timeout_error",
                529: "overloaded_error"}
ANTHROPIC_ERROR_TYPES = frozenset({*_ERROR_TYPES.values(), "api_error", "billing_error", "timeout_error"})


def error_body(error: GatewayError) -> dict[str, Any]:
    """`{"type": "error", "error": {"type", "message"}}`: the upstream's own Anthropic type when
    it gave one, else the type Anthropic uses for the status."""
    status = http_status(error)
    kind = error.type if error.type in ANTHROPIC_ERROR_TYPES else _ERROR_TYPES.get(
        status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def error_event(error: GatewayError) -> bytes:
    return b"event: error\ndata: " + orjson.dumps(error_body(error)) + b"\n\n"


def _prompt_tokens(usage: Any) -> int | None:
    """Everything the prompt held: uncached, written to the cache, and read from it."""
    if not isinstance(usage, dict) or not isinstance(usage.get("input_tokens"), int):
        return None
    return sum(v for k in ("input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens")
               if isinstance(v := usage.get(k), int))


def _tool_call(call_id: Any, name: Any, arguments: str) -> dict[str, Any]:
    """As chat completions has it, which is what the WAL logs."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def reply_facts(body: bytes | None) -> ReplyFacts:
    """From a whole `message` object."""
    try:
        data = orjson.loads(body or b"")
    except orjson.JSONDecodeError:
        return ReplyFacts(malformed="not JSON")
    if not isinstance(data, dict) or not isinstance(data.get("content"), list):
        return ReplyFacts(malformed="JSON without a `content` list")
    calls = [_tool_call(b.get("id"), b.get("name"), orjson.dumps(b.get("input", {})).decode())
             for b in data["content"] if isinstance(b, dict) and b.get("type") == "tool_use"]
    return ReplyFacts(_prompt_tokens(data.get("usage")), calls)


class MessagesStream(SseWatch):
    """Watches Anthropic SSE go by: usage from `message_start` (and `message_delta`, which may
    restate it), tool calls from `content_block_start` and their `input_json_delta` pieces,
    `complete` once `message_stop` went by. Events may be split across network chunks."""

    def __init__(self, keep_all: bool) -> None:
        super().__init__(keep_all)
        self._usage: dict[str, Any] = {}
        self._calls: dict[int, dict[str, Any]] = {}

    def feed(self, data: bytes) -> None:
        for line in self._lines(data):
            if line.startswith(b"data:"):
                try:
                    event = orjson.loads(line[5:])
                except orjson.JSONDecodeError:
                    continue
                if isinstance(event, dict):
                    self._read(event)

    def _read(self, event: dict[str, Any]) -> None:
        kind = event.get("type")
        if kind == "message_start" and isinstance(event.get("message"), dict):
            self._take_usage(event["message"].get("usage"))
        elif kind == "message_delta":
            self._take_usage(event.get("usage"))
        elif kind == "content_block_start":
            block = event.get("content_block")
            if isinstance(block, dict) and block.get("type") == "tool_use" and isinstance(event.get("index"), int):
                self._calls[event["index"]] = {"id": block.get("id"), "name": block.get("name"), "arguments": ""}
        elif kind == "content_block_delta":
            delta = event.get("delta")
            call = self._calls.get(event.get("index"))  # type: ignore[arg-type]
            if call is not None and isinstance(delta, dict) and delta.get("type") == "input_json_delta":
                call["arguments"] += delta.get("partial_json") or ""
        elif kind == "message_stop":
            self._done = True
        elif kind == "error":  # e.g. overloaded_error mid-stream
            self._failed = True

    def _take_usage(self, usage: Any) -> None:
        if isinstance(usage, dict):
            # message_delta's usage is cumulative: a later count replaces an earlier one.
            self._usage.update({k: v for k, v in usage.items() if isinstance(v, int) and v > 0})

    def facts(self) -> ReplyFacts:
        calls = [_tool_call(c["id"], c["name"], c["arguments"] or "{}") for _, c in sorted(self._calls.items())]
        return ReplyFacts(_prompt_tokens(self._usage), calls)
