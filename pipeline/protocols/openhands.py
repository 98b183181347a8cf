"""OpenHands without function calling: `<function=NAME>` blocks in assistant text, and
observations as user turns opening `EXECUTION RESULT of [NAME]:`."""
from __future__ import annotations

import re

import orjson

from ..failures import exit_status_of
from .base import Action, Observation, named_action, observation

_FUNCTION = re.compile(r"<function=([\w.\-]+)>(.*?)(?:</function>|\Z)", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([\w.\-]+)>(.*?)(?:</parameter>|\Z)", re.DOTALL)
_RESULT = re.compile(r"EXECUTION RESULT of \[([^\]\n]+)\]:\n?")
_SHELL_HINTS = ("bash", "shell", "terminal", "cmd", "run", "exec")


def _value(raw: str) -> object:
    """A parameter's value: one leading and trailing newline are framing; JSON lists and
    objects (a todo list) are read as such."""
    text = raw[1:] if raw.startswith("\n") else raw
    text = text[:-1] if text.endswith("\n") else text
    if text[:1] in "[{":
        try:
            return orjson.loads(text)
        except orjson.JSONDecodeError:
            pass
    return text


def function_actions(text: str) -> list[Action]:
    """The `<function=NAME><parameter=KEY>VALUE</parameter></function>` blocks of a text
    (also SWE-agent's variant of the same form)."""
    out = []
    for found in _FUNCTION.finditer(text):
        name, body = found.group(1), found.group(2)
        args = {k: _value(v) for k, v in _PARAMETER.findall(body)}
        command = args.get("command") if any(h in name.lower() for h in _SHELL_HINTS) else args.get("code")
        command = command if isinstance(command, str) else ""
        out.append(named_action(name, args, command))
    return out


class OpenHandsReader:
    name = "openhands_text"

    def learn(self, instructions: str) -> "OpenHandsReader":
        return self

    def actions(self, text: str) -> list[Action]:
        return function_actions(text)

    def signals(self, text: str, role: str) -> bool:
        if role == "assistant":
            return "<function=" in text and _FUNCTION.search(text) is not None
        return text.startswith("EXECUTION RESULT of [")

    def observation(self, text: str, tool: str | None) -> Observation:
        header = _RESULT.match(text)
        output = text[header.end():] if header else text
        return observation(header.group(1) if header else tool, output, exit_status_of(output))
