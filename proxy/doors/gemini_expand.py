"""The expansion tool on the Gemini door: offered as a `functionDeclaration`, its
`functionCall` parts read from a whole or streamed reply, answered as `functionResponse`
parts in a user turn, and taken out of what the agent receives (docs/expansion.md)."""
from __future__ import annotations

from typing import Any

import orjson

from ..engine.expansion import AskedCalls, ToolCall

Part = dict[str, Any]


class GeminiExpansion:
    """`ExpandingWire` for Gemini's generateContent."""

    def with_tool(self, payload: dict[str, Any], tool: dict[str, Any]) -> dict[str, Any]:
        declared = {"name": tool["name"], "description": tool["description"],
                    "parametersJsonSchema": tool["parameters"]}
        return {**payload, "tools": [*(payload.get("tools") or []), {"functionDeclarations": [declared]}]}

    def asked(self, body: bytes, tool_name: str) -> AskedCalls | None:
        return _asked(_parts(_loads(body)), tool_name)

    def follow_up(self, payload: dict[str, Any], asked: AskedCalls,
                  results: list[tuple[ToolCall, str]]) -> dict[str, Any]:
        name = asked.assistant["parts"][0]["functionCall"]["name"]
        answers = [{"functionResponse": {"name": name, "id": call.call_id, "response": {"output": text}}}
                   for call, text in results]
        return {**payload, "contents": [*payload["contents"], asked.assistant, {"role": "user", "parts": answers}]}

    def exchange(self, asked: AskedCalls, results: list[tuple[ToolCall, str]]) -> list[dict[str, Any]]:
        name = asked.assistant["parts"][0]["functionCall"]["name"]
        calls = [{"id": call.call_id, "type": "function", "function": {"name": name, "arguments": call.arguments}}
                 for call, _ in results]
        return [{"role": "assistant", "content": None, "tool_calls": calls},
                *({"role": "tool", "tool_call_id": call.call_id, "name": name, "content": text}
                  for call, text in results)]

    def without_ours(self, body: bytes, tool_name: str) -> bytes:
        return _rewritten(body, tool_name)

    def stream_expansion(self, tool_name: str) -> "GeminiStreamExpansion":
        return GeminiStreamExpansion(tool_name)


class GeminiStreamExpansion:
    """Gemini chunks (SSE events or JSON array elements): text comes in chunks of its own, the
    calls in the chunk that finishes the candidate."""

    def __init__(self, tool_name: str) -> None:
        self.tool_name = tool_name

    def opening(self, event: bytes) -> bool | None:
        chunk = _loads(_json_of(event)[1])
        parts = _parts(chunk)
        if any(_ours(p, self.tool_name) for p in parts):
            return True
        if any(p.get("text") or "functionCall" in p for p in parts) or _finished(chunk):
            return False
        return None

    def asked(self, events: list[bytes]) -> AskedCalls | None:
        return _asked([p for e in events for p in _parts(_loads(_json_of(e)[1]))], self.tool_name)

    def filter(self, event: bytes) -> bytes:
        before, data, after = _json_of(event)
        if not data or not any(_ours(p, self.tool_name) for p in _parts(_loads(data))):
            return event
        return before + _rewritten(data, self.tool_name) + after


def _json_of(event: bytes) -> tuple[bytes, bytes, bytes]:
    """An event as its framing before the JSON object (`data: `, or the array's `[` / `,`), the
    object, and what follows it."""
    start, end = event.find(b"{"), event.rfind(b"}")
    if start < 0 or end < start:
        return event, b"", b""
    return event[:start], event[start:end + 1], event[end + 1:]


def _loads(data: bytes) -> dict[str, Any]:
    try:
        found = orjson.loads(data or b"{}")
    except orjson.JSONDecodeError:
        return {}
    return found if isinstance(found, dict) else {}


def _candidate(chunk: dict[str, Any]) -> dict[str, Any]:
    candidates = chunk.get("candidates")
    first = candidates[0] if isinstance(candidates, list) and candidates else None
    return first if isinstance(first, dict) else {}


def _parts(chunk: dict[str, Any]) -> list[Part]:
    parts = (_candidate(chunk).get("content") or {}).get("parts")
    return [p for p in parts if isinstance(p, dict)] if isinstance(parts, list) else []


def _finished(chunk: dict[str, Any]) -> bool:
    return bool(_candidate(chunk).get("finishReason"))


def _ours(part: Part, tool_name: str) -> bool:
    call = part.get("functionCall")
    return isinstance(call, dict) and call.get("name") == tool_name


def _asked(parts: list[Part], tool_name: str) -> AskedCalls | None:
    ours = [p for p in parts if _ours(p, tool_name)]
    if not ours:
        return None
    others = sum(1 for p in parts if "functionCall" in p) - len(ours)
    calls = [ToolCall(str(p["functionCall"].get("id") or tool_name), orjson.dumps(p["functionCall"].get("args") or {})
                      .decode()) for p in ours]
    return AskedCalls(calls, others, {"role": "model", "parts": ours})


def _rewritten(body: bytes, tool_name: str) -> bytes:
    """A reply or chunk with the tool's calls taken out of its first candidate."""
    data = _loads(body)
    candidate = _candidate(data)
    content = candidate.get("content")
    if not isinstance(content, dict):
        return body
    kept = [p for p in _parts(data) if not _ours(p, tool_name)]
    content["parts"] = kept or [{"text": ""}]
    return orjson.dumps(data)
