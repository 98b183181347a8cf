"""Anthropic's context editing, applied by ctxgate where the route cannot (docs/native-context.md):
`clear_tool_uses_20250919` and `clear_thinking_20251015` over a Messages request's own
`messages`, pure functions of the message list. What each edit did is reported as Anthropic
reports it in `context_management.applied_edits`; an edit that did not trigger is not.

The client keeps its whole history and sends it every turn; the edits are made again on
each request from it, so the same request always forwards the same cleared prefix.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable

import orjson

CLEAR_TOOL_USES, CLEAR_THINKING, COMPACT = "clear_tool_uses_20250919", "clear_thinking_20251015", "compact_20260112"
KNOWN = (CLEAR_TOOL_USES, CLEAR_THINKING, COMPACT)
CLEARED = "[tool result cleared to save context]"
"""What a cleared tool result says instead, so the model knows something was there."""
DEFAULT_TRIGGER_TOKENS = 100_000
DEFAULT_KEEP_TOOL_USES = 3
DEFAULT_KEEP_THINKING_TURNS = 1
COMPACT_DEFAULT_TRIGGER, COMPACT_MIN_TRIGGER = 150_000, 50_000
_THINKING = ("thinking", "redacted_thinking")
Count = Callable[[str], int]


class EditError(ValueError):
    """A context-management edit that cannot be applied as given; `param` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Applied:
    type: str
    cleared: int
    """Tool uses, or thinking turns, cleared."""
    cleared_input_tokens: int

    def to_dict(self) -> dict[str, Any]:
        what = "cleared_tool_uses" if self.type == CLEAR_TOOL_USES else "cleared_thinking_turns"
        return {"type": self.type, what: self.cleared, "cleared_input_tokens": self.cleared_input_tokens}


def _amount(value: Any, kinds: tuple[str, ...], where: str, least: int = 1) -> tuple[str, int]:
    if not isinstance(value, dict) or value.get("type") not in kinds:
        raise EditError(f"{where}: must be an object with `type` one of {', '.join(kinds)} and an integer `value`",
                        where)
    number = value.get("value")
    if isinstance(number, bool) or not isinstance(number, int) or number < least:
        raise EditError(f"{where}.value: must be an integer of at least {least}, got {number!r}", f"{where}.value")
    return str(value["type"]), number


def checked_edits(config: Any, where: str = "context_management") -> list[dict[str, Any]]:
    """The edits of a `context_management` object, each checked; an EditError names the field."""
    if not isinstance(config, dict):
        raise EditError(f"{where}: must be an object with an `edits` list", where)
    edits = config.get("edits", [])
    if not isinstance(edits, list):
        raise EditError(f"{where}.edits: must be a list", f"{where}.edits")
    for i, edit in enumerate(edits):
        at = f"{where}.edits.{i}"
        if not isinstance(edit, dict) or edit.get("type") not in KNOWN:
            kind = edit.get("type") if isinstance(edit, dict) else edit
            raise EditError(f"{at}.type: unknown edit type {kind!r} (supported: {', '.join(KNOWN)})", f"{at}.type")
        if edit["type"] == CLEAR_THINKING and i != 0:
            raise EditError(f"{at}.type: {CLEAR_THINKING} must be the first edit", f"{at}.type")
        _check(edit, at)
    return edits


def _check(edit: dict[str, Any], at: str) -> None:
    kind = edit["type"]
    if kind == CLEAR_TOOL_USES:
        trigger = _amount(edit["trigger"], ("input_tokens", "tool_uses"), f"{at}.trigger") if "trigger" in edit \
            else ("input_tokens", DEFAULT_TRIGGER_TOKENS)
        if "keep" in edit:
            _, keep = _amount(edit["keep"], ("tool_uses",), f"{at}.keep", least=0)
            if trigger[0] == "tool_uses" and keep >= trigger[1]:
                raise EditError(f"{at}.keep: keeping {keep} tool uses of the {trigger[1]} that trigger the edit "
                                "leaves nothing to clear", f"{at}.keep")
        if edit.get("clear_at_least") is not None:
            _amount(edit["clear_at_least"], ("input_tokens",), f"{at}.clear_at_least")
        excluded = edit.get("exclude_tools")
        if excluded is not None and not (isinstance(excluded, list) and all(isinstance(n, str) for n in excluded)):
            raise EditError(f"{at}.exclude_tools: must be a list of tool names", f"{at}.exclude_tools")
        inputs = edit.get("clear_tool_inputs")
        if inputs is not None and not isinstance(inputs, bool) and not (
                isinstance(inputs, list) and all(isinstance(n, str) for n in inputs)):
            raise EditError(f"{at}.clear_tool_inputs: must be true, false or a list of tool names",
                            f"{at}.clear_tool_inputs")
    elif kind == CLEAR_THINKING:
        thinking = edit.get("keep")
        if thinking is not None and thinking != "all" and not (isinstance(thinking, dict)
                                                               and thinking.get("type") == "all"):
            _amount(thinking, ("thinking_turns",), f"{at}.keep", least=1)
    else:
        if edit.get("trigger") is not None:
            _amount(edit["trigger"], ("input_tokens",), f"{at}.trigger", least=COMPACT_MIN_TRIGGER)
        if edit.get("instructions") is not None and not isinstance(edit["instructions"], str):
            raise EditError(f"{at}.instructions: must be a string", f"{at}.instructions")


def _text(content: Any) -> str:
    return content if isinstance(content, str) else orjson.dumps(content).decode()


def clear_tool_uses(messages: list[dict[str, Any]], edit: dict[str, Any], input_tokens: int,
                    count: Count) -> tuple[list[dict[str, Any]], Applied | None]:
    """The oldest tool results (and, as asked, their calls' inputs) replaced by a placeholder,
    once the request is past the trigger; the newest `keep` tool uses and the excluded tools
    stay. Nothing changes when less than `clear_at_least` would be freed."""
    kind, limit = (edit["trigger"]["type"], edit["trigger"]["value"]) if "trigger" in edit \
        else ("input_tokens", DEFAULT_TRIGGER_TOKENS)
    uses = [(i, j, block) for i, m in enumerate(messages) if m.get("role") == "assistant"
            and isinstance(m.get("content"), list)
            for j, block in enumerate(m["content"]) if isinstance(block, dict) and block.get("type") == "tool_use"]
    if (input_tokens if kind == "input_tokens" else len(uses)) <= limit:
        return messages, None
    keep = edit.get("keep", {}).get("value", DEFAULT_KEEP_TOOL_USES) if isinstance(edit.get("keep"), dict) \
        else DEFAULT_KEEP_TOOL_USES
    excluded = set(edit.get("exclude_tools") or [])
    inputs = edit.get("clear_tool_inputs") or False
    candidates = {block.get("id"): (i, j, block) for i, j, block in (uses[:-keep] if keep else uses)
                  if block.get("name") not in excluded}
    out = copy.deepcopy(messages)
    cleared, freed = set(), 0
    for m in out:
        if m.get("role") != "user" or not isinstance(m.get("content"), list):
            continue
        for k, block in enumerate(m["content"]):
            if isinstance(block, dict) and block.get("type") == "tool_result" \
                    and block.get("tool_use_id") in candidates and block.get("content") != CLEARED:
                freed += max(0, count(_text(block.get("content", ""))) - count(CLEARED))
                m["content"][k] = {**{key: v for key, v in block.items() if key != "content"}, "content": CLEARED}
                cleared.add(block["tool_use_id"])
    for use_id in cleared:
        i, j, block = candidates[use_id]
        if inputs is True or (isinstance(inputs, list) and block.get("name") in inputs):
            if block.get("input"):
                freed += count(_text(block.get("input")))
                out[i]["content"][j] = {**block, "input": {}}
    least = edit.get("clear_at_least")
    if not cleared or (isinstance(least, dict) and freed < least.get("value", 0)):
        return messages, None
    return out, Applied(CLEAR_TOOL_USES, len(cleared), freed)


def clear_thinking(messages: list[dict[str, Any]], edit: dict[str, Any],
                   count: Count) -> tuple[list[dict[str, Any]], Applied | None]:
    """Thinking blocks gone from every assistant turn but the newest `keep` that have some."""
    keep = edit.get("keep")
    if keep == "all" or (isinstance(keep, dict) and keep.get("type") == "all"):
        return messages, None
    kept = keep["value"] if isinstance(keep, dict) else DEFAULT_KEEP_THINKING_TURNS
    thinking = [i for i, m in enumerate(messages) if m.get("role") == "assistant" and isinstance(m.get("content"), list)
                and any(isinstance(b, dict) and b.get("type") in _THINKING for b in m["content"])]
    older = thinking[:-kept] if kept else thinking
    if not older:
        return messages, None
    out, freed = list(messages), 0
    for i in older:
        content = messages[i]["content"]
        freed += sum(count(str(b.get("thinking") or b.get("data") or "")) for b in content
                     if isinstance(b, dict) and b.get("type") in _THINKING)
        rest = [b for b in content if not (isinstance(b, dict) and b.get("type") in _THINKING)]
        out[i] = {**messages[i], "content": rest or [{"type": "text", "text": "(thinking cleared)"}]}
    return out, Applied(CLEAR_THINKING, len(older), freed)
