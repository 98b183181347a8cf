"""What an upstream reply says that ctxgate keeps: usage and the tool calls it makes."""
from __future__ import annotations

from typing import Any

import orjson

from ..engine.wire import ReplyFacts
from .sse import SseWatch

_USAGE_TAIL = 16_384


def reply_facts(body: bytes | None) -> ReplyFacts:
    """From a non-streaming chat completion."""
    try:
        data = orjson.loads(body or b"")
    except orjson.JSONDecodeError:
        return ReplyFacts(malformed="not JSON")
    if not isinstance(data, dict) or not isinstance(data.get("choices"), list):
        return ReplyFacts(malformed="JSON without a `choices` list")
    calls: list[dict[str, Any]] = []
    for choice in data["choices"]:
        message = choice.get("message") if isinstance(choice, dict) else None
        if isinstance(message, dict) and isinstance(message.get("tool_calls"), list):
            calls += [c for c in message["tool_calls"] if isinstance(c, dict)]
    return ReplyFacts(_prompt_tokens(data), calls)


def _prompt_tokens(data: dict[str, Any]) -> int | None:
    usage = data.get("usage")
    value = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    return value if isinstance(value, int) else None


class SseReply(SseWatch):
    """Watches a streamed chat completion go by: keeps its tail for `usage` and the chunks
    that carry tool-call deltas; complete at `data: [DONE]`."""

    def __init__(self, keep_all: bool = False) -> None:
        super().__init__(keep_all)
        self._tail = b""
        self._calls = bytearray()

    def feed(self, data: bytes) -> None:
        if b"data: [DONE]" in data:
            self._done = True
        self._tail = (self._tail + data)[-_USAGE_TAIL:]
        for line in self._lines(data):
            if line.startswith(b'data: {"error"'):  # an upstream's error mid-stream, as OpenAI sends it
                self._failed = True
            if b'"tool_calls"' in line:
                self._calls += line + b"\n"

    def facts(self) -> ReplyFacts:
        return ReplyFacts(self._usage(), self._tool_calls())

    def _usage(self) -> int | None:
        for event in reversed(_events(self._tail)):
            if isinstance(event.get("usage"), dict):
                found = _prompt_tokens(event)
                if found is not None:
                    return found
        return None

    def _tool_calls(self) -> list[dict[str, Any]]:
        """Tool-call deltas merged by index: the id and name come once, the arguments in pieces."""
        merged: dict[int, dict[str, Any]] = {}
        for event in _events(bytes(self._calls)):
            for choice in event.get("choices") or []:
                delta = choice.get("delta") if isinstance(choice, dict) else None
                for part in (delta or {}).get("tool_calls") or []:
                    if not isinstance(part, dict):
                        continue
                    call = merged.setdefault(int(part.get("index") or 0),
                                             {"id": None, "type": "function",
                                              "function": {"name": "", "arguments": ""}})
                    call["id"] = part.get("id") or call["id"]
                    fn = part.get("function") or {}
                    call["function"]["name"] += fn.get("name") or ""
                    call["function"]["arguments"] += fn.get("arguments") or ""
        return [merged[i] for i in sorted(merged)]


def _events(data: bytes) -> list[dict[str, Any]]:
    out = []
    for line in data.split(b"\n"):
        if line.startswith(b"data: {"):
            try:
                event = orjson.loads(line[6:])
            except orjson.JSONDecodeError:
                continue  # a line cut by the tail window
            if isinstance(event, dict):
                out.append(event)
    return out
