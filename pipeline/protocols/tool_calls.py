"""OpenAI function calling: `tool_calls` on an assistant message, answered by `tool`
messages carrying the call's id."""
from __future__ import annotations

from typing import Any

import orjson

from .base import Action, Observation, named_action, observation
from .openhands import EXIT_CODE

Message = dict[str, Any]
_COMMAND_KEYS = ("command", "cmd", "code", "script")


def arguments_of(call: dict[str, Any]) -> dict[str, Any]:
    raw = (call.get("function") or {}).get("arguments")
    if isinstance(raw, dict):
        return raw
    try:
        parsed = orjson.loads(raw or "{}")
    except orjson.JSONDecodeError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


def action_of(name: str, args: dict[str, Any], call_id: str | None) -> Action:
    """A named call with JSON arguments (OpenAI or Anthropic): the files its arguments name,
    and the shell command, when one of its arguments is one."""
    command = next((v for k, v in args.items() if k in _COMMAND_KEYS and isinstance(v, str) and " " in v.strip()), "")
    return named_action(name, args, command, call_id)


def calls_of(message: Message) -> list[Action]:
    out = []
    for call in message.get("tool_calls") or []:
        if isinstance(call, dict):
            name = (call.get("function") or {}).get("name") or ""
            out.append(action_of(name, arguments_of(call), call.get("id")))
    return out


def result_of(message: Message, tool: str | None) -> Observation:
    content = message.get("content")
    text = content if isinstance(content, str) else "\n".join(
        p.get("text", "") for p in content or [] if isinstance(p, dict) and isinstance(p.get("text"), str))
    code = EXIT_CODE.search(text)
    return observation(tool, text, int(code.group(1)) if code else None, message.get("tool_call_id"))
