"""What a protocol reader produces: the actions an assistant message takes and the
observation a message reports, whatever the wire form."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson

from ..failures import failure_line


@dataclass(frozen=True)
class Action:
    """One thing the agent did: a tool call, or a command written in its text."""
    tool: str
    """The tool's name (`str_replace_editor`, `read_file`); for SWE-agent, whose tools are
    commands, the command (`open`, `edit`); for mini-swe-agent, `bash`."""
    arguments: dict[str, Any] = field(default_factory=dict)
    command: str = ""
    """The shell command it runs, if it runs one."""
    paths: tuple[str, ...] = ()
    """Files it names, in order."""
    call_id: str | None = None
    """The id its result answers (tool calls); None in text protocols."""

    @property
    def program(self) -> str:
        """The program its shell command starts with (`cat`, `python`), else ''."""
        return program_of(self.command)


@dataclass(frozen=True)
class Observation:
    """What the environment answered to an action."""
    tool: str | None
    output: str
    exit_status: int | None = None
    error_line: str = ""
    """The line that says what failed, if the output reports a failure."""
    call_id: str | None = None

    @property
    def failed(self) -> bool:
        return bool(self.error_line)


def observation(tool: str | None, output: str, exit_status: int | None = None,
                call_id: str | None = None, is_error: bool = False) -> Observation:
    """An observation with its failure judged (`failures.failure_line`)."""
    return Observation(tool=tool, output=output, exit_status=exit_status,
                       error_line=failure_line(output, exit_status, is_error), call_id=call_id)


class TextReader(Protocol):
    """A text protocol: actions in assistant text, observations in the user turn after."""

    name: str

    def actions(self, text: str) -> list[Action]:
        """The actions an assistant message's text takes (none: it is talk)."""
        ...

    def signals(self, text: str, role: str) -> bool:
        """The text is unmistakably in this protocol (used to detect a session's dialect)."""
        ...

    def observation(self, text: str, tool: str | None) -> Observation:
        """The observation a user turn after an action reports."""
        ...

    def learn(self, instructions: str) -> "TextReader":
        """This reader as the agent's instructions configure it (the fence its system prompt
        shows for commands); itself when they change nothing."""
        ...


def program_of(command: str) -> str:
    """The first program a shell command runs, past `cd DIR &&` and variable assignments."""
    first = command.strip().split("\n", 1)[0]
    for segment in _SEGMENT.split(first):
        words = [w for w in segment.split() if "=" not in w.split("/", 1)[0]]
        if words and words[0] != "cd":
            return words[0].rsplit("/", 1)[-1]
    return ""


_SEGMENT = re.compile(r"&&|\|\||;|\|")
_EXT = (r"py|pyi|pyx|js|mjs|cjs|ts|tsx|jsx|json|yaml|yml|toml|cfg|ini|txt|md|rst|c|h|cc|cpp|hpp|go|rs|java|kt|rb|"
        r"php|sh|html|css|scss|sql|xml|csv|lock|patch|diff|ipynb|conf|env|lua|swift|scala|r|pl|ex|exs|vue|svelte")
PATH_RE = re.compile(r"(?<![\w/.\-])((?:~|\.{1,2})?/?(?:[\w.\-]+/)*[\w\-][\w.\-]*\.(?:" + _EXT + r"))(?![\w/\-])")
"""A file path: words and slashes ending in a known file extension."""


def paths_in(text: str) -> tuple[str, ...]:
    """File paths named in `text`, in order, each once."""
    return tuple(dict.fromkeys(m.group(1) for m in PATH_RE.finditer(text)
                               if "://" not in text[max(0, m.start() - 8):m.start()]))


def shell_action(command: str, tool: str) -> Action:
    """An action that runs `command`; its paths come from the command line itself (the first
    line: an `edit` or a heredoc's body below it is content, not a list of files)."""
    command = command.strip()
    first = command.split("\n", 1)[0]
    return Action(tool=tool or program_of(command), command=command, paths=paths_in(first))


PATH_KEYS = ("path", "file_path", "filepath", "filename", "file", "target_file", "file_name")
"""Argument names that hold a file's path, in any tool's schema."""


def named_action(tool: str, arguments: dict[str, Any], command: str = "", call_id: str | None = None) -> Action:
    """An action with named arguments (a tool call, an OpenHands function block): the files
    its path arguments name, then those its shell command names; failing both, any path in
    its short string arguments."""
    named = [v for k, v in arguments.items() if k in PATH_KEYS and isinstance(v, str)]
    paths = tuple(dict.fromkeys([*named, *(shell_action(command, tool).paths if command else ())]))
    if not paths:
        paths = paths_in(" ".join(v for v in arguments.values() if isinstance(v, str) and len(v) < 500))
    return Action(tool=tool, arguments=arguments, command=command, paths=paths, call_id=call_id)


def text_of(message: dict[str, Any] | None, field: str = "content") -> str:
    """A message's (or a content block's) text: a string, or the text parts of a list; ''
    for anything else. Readers run on whatever a client sent, so nothing here may raise."""
    content = (message or {}).get(field)
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return ""
    return "\n".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))


def readable_text(message: dict[str, Any]) -> str:
    """Everything a reader of the message sees, in any wire format: its text, the output of
    each Anthropic `tool_result` block, and each `tool_use` or chat tool call as
    `[called NAME(ARGUMENTS)]` (for the summariser's transcript and the file headers
    activeRestore looks for)."""
    parts = [text_of(message)]
    content = message.get("content")
    for block in content if isinstance(content, list) else []:
        if not isinstance(block, dict):
            continue
        if block.get("type") == "tool_result":
            parts.append(text_of(block))
        elif block.get("type") == "tool_use":
            parts.append(f"[called {block.get('name')}({orjson.dumps(block.get('input')).decode()})]")
    calls = message.get("tool_calls")
    for call in calls if isinstance(calls, list) else []:
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict):
            parts.append(f"[called {fn.get('name')}({fn.get('arguments', '')})]")
    return "\n".join(p for p in parts if p)


def id_of(value: Any) -> str | None:
    """A call id as a client sent it, when it is one (a string); None otherwise."""
    return value if isinstance(value, str) and value else None
