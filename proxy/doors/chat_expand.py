"""The expansion tool on the Chat Completions door: offered as a function tool, its calls
read from a whole or streamed reply, answered as `tool` messages, and taken out of what
the agent receives (docs/expansion.md)."""
from __future__ import annotations

from typing import Any

import orjson

from ..engine.expansion import AskedCalls, ToolCall
from .chat_replies import SseReply
from .sse import event_data, with_data



class ChatExpansion:
    """`ExpandingWire` for chat completions."""

    def with_tool(self, payload: dict[str, Any], tool: dict[str, Any]) -> dict[str, Any]:
        return {**payload, "tools": [*(payload.get("tools") or []), {"type": "function", "function": tool}]}

    def asked(self, body: bytes, tool_name: str) -> AskedCalls | None:
        try:
            data = orjson.loads(body)
        except orjson.JSONDecodeError:
            return None
        choices = data.get("choices") if isinstance(data, dict) else None
        if not isinstance(choices, list) or not choices:
            return None
        message = (choices[0] or {}).get("message") or {}
        calls = [c for c in message.get("tool_calls") or [] if isinstance(c, dict)]
        ours = [c for c in calls if _name(c) == tool_name]
        if not ours:
            return None
        others = len(calls) - len(ours) + len(choices) - 1  # n > 1: never answered, only cleaned
        return _asked(ours, others, message.get("content"))

    def follow_up(self, payload: dict[str, Any], asked: AskedCalls,
                  results: list[tuple[ToolCall, str]]) -> dict[str, Any]:
        return {**payload, "messages": [*payload["messages"], *self.exchange(asked, results)]}

    def exchange(self, asked: AskedCalls, results: list[tuple[ToolCall, str]]) -> list[dict[str, Any]]:
        return [asked.assistant, *({"role": "tool", "tool_call_id": call.call_id, "content": text}
                                   for call, text in results)]

    def without_ours(self, body: bytes, tool_name: str) -> bytes:
        data = orjson.loads(body)
        for choice in data.get("choices") or []:
            message = choice.get("message") or {}
            kept = [c for c in message.get("tool_calls") or [] if _name(c) != tool_name]
            if kept:
                message["tool_calls"] = kept
                continue
            message.pop("tool_calls", None)
            if message.get("content") is None:
                message["content"] = ""
            if choice.get("finish_reason") == "tool_calls":
                choice["finish_reason"] = "stop"
        return orjson.dumps(data)

    def stream_expansion(self, tool_name: str) -> "ChatStreamExpansion":
        return ChatStreamExpansion(tool_name)


class ChatStreamExpansion:
    """A streamed chat completion: tool calls come as deltas by index, the name in the first."""

    def __init__(self, tool_name: str) -> None:
        self.tool_name = tool_name
        self._ours: dict[int, bool] = {}
        """Index of each call seen -> whether it is ours."""
        self._index: dict[int, int] = {}
        """The agent's calls, renumbered from 0 as the agent will see them."""

    def opening(self, event: bytes) -> bool | None:
        chunk = event_data(event)
        if chunk is None:
            return None if not event.strip() or event.startswith(b":") else False
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            calls = delta.get("tool_calls") or []
            if calls:
                return _name(calls[0]) == self.tool_name
            if delta.get("content") or choice.get("finish_reason"):
                return False
        return None

    def asked(self, events: list[bytes]) -> AskedCalls | None:
        merged, text = SseReply(), ""
        for event in events:
            merged.feed(event)
            for choice in (event_data(event) or {}).get("choices") or []:
                text += (choice.get("delta") or {}).get("content") or ""
        calls = merged.facts().tool_calls
        ours = [c for c in calls if _name(c) == self.tool_name]
        if not ours:
            return None
        return _asked(ours, len(calls) - len(ours), text or None)

    def filter(self, event: bytes) -> bytes:
        chunk = event_data(event)
        if chunk is None or b'"tool_calls"' not in event:
            return event
        changed, empty = False, True
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            calls = delta.get("tool_calls")
            if calls:
                kept = []
                for call in calls:
                    index = int(call.get("index") or 0)
                    if index not in self._ours:
                        self._ours[index] = _name(call) == self.tool_name
                        if not self._ours[index]:
                            self._index[index] = len(self._index)
                    if not self._ours[index]:
                        kept.append({**call, "index": self._index[index]})
                changed = changed or kept != calls
                if kept:
                    delta["tool_calls"] = kept
                else:
                    delta.pop("tool_calls")
            if choice.get("finish_reason") == "tool_calls" and not self._index:
                choice["finish_reason"], changed = "stop", True
            empty = empty and not any(delta.values()) and not choice.get("finish_reason")
        if not changed:
            return event
        if empty and not chunk.get("usage"):
            return b""
        return with_data(event, chunk)


def _asked(ours: list[dict[str, Any]], others: int, content: Any) -> AskedCalls:
    asked = [ToolCall(str(c.get("id")), str((c.get("function") or {}).get("arguments") or "")) for c in ours]
    calls = [{"id": call.call_id, "type": "function", "function": {"name": _name(c), "arguments": call.arguments}}
             for call, c in zip(asked, ours)]
    return AskedCalls(asked, others, {"role": "assistant", "content": content, "tool_calls": calls})


def _name(call: dict[str, Any]) -> str:
    fn = call.get("function")
    return fn.get("name") or "" if isinstance(fn, dict) else ""
