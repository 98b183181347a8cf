"""Anthropic content blocks: `tool_use` blocks in an assistant message, answered by
`tool_result` blocks (with the block's `tool_use_id`) in the next user message."""
from __future__ import annotations

from typing import Any, Callable

from ..failures import exit_status_of
from .base import Action, Observation, id_of, observation, text_of
from .tool_calls import action_of

Message = dict[str, Any]


def _blocks(message: Message, kind: str) -> list[dict[str, Any]]:
    content = message.get("content")
    if not isinstance(content, list):
        return []
    return [b for b in content if isinstance(b, dict) and b.get("type") == kind]


def uses_of(message: Message) -> list[Action]:
    return [action_of(b["name"] if isinstance(b.get("name"), str) else "",
                      b["input"] if isinstance(b.get("input"), dict) else {}, id_of(b.get("id")))
            for b in _blocks(message, "tool_use")]


def results_of(message: Message, tools: dict[str, str]) -> list[Observation]:
    """The tool results a user message carries; `tools` names the tool of each call id."""
    return [observation(tools.get(id_of(b.get("tool_use_id")) or ""), text_of(b), exit_status_of(text_of(b)),
                        call_id=id_of(b.get("tool_use_id")), is_error=bool(b.get("is_error")))
            for b in _blocks(message, "tool_result")]


def has_results(message: Message) -> bool:
    return bool(_blocks(message, "tool_result"))


def map_result_texts(message: Message, cut: Callable[[str], str | None]) -> Message:
    """The message with each string result passed through `cut(text)` (None: keep);
    the same object when nothing changed, so untouched messages stay byte-identical."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    changed = False
    out = []
    for block in content:
        if isinstance(block, dict) and block.get("type") == "tool_result" and isinstance(block.get("content"), str):
            new = cut(block["content"])
            if new is not None:
                block, changed = {**block, "content": new}, True
        out.append(block)
    return {**message, "content": out} if changed else message
