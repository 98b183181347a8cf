"""OpenAI function calling: `tool_calls` on an assistant message, answered by `tool`
messages carrying the call's id."""
from __future__ import annotations

from typing import Any

import orjson

from .base import Action, Observation, id_of, named_action, observation, text_of
from ..failures import exit_status_of

Message = dict[str, Any]
_COMMAND_KEYS = ("command", "cmd", "code", "script")


def arguments_of(call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function")
    raw = function.get("arguments") if isinstance(function, dict) else None
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
    calls = message.get("tool_calls")
    for call in calls if isinstance(calls, list) else []:
        if isinstance(call, dict):
            function = call.get("function")
            name = function.get("name") if isinstance(function, dict) else None
            out.append(action_of(name if isinstance(name, str) else "", arguments_of(call), id_of(call.get("id"))))
    return out


def result_of(message: Message, tool: str | None) -> Observation:
    text = text_of(message)
    return observation(tool, text, exit_status_of(text), id_of(message.get("tool_call_id")))
