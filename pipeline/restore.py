"""activeRestore, the mandatory step after every compaction (the spec's pitfall 1).

A proxy cannot call the agent's `read_file`, so it restores from the transcript it has
seen: the current files (paths from read/edit/write tool calls and SWE-agent's file
windows and open-file line, with the latest content seen for each), the active skill,
the active plan and the pending tasks (from plan and todo tools such as `update_plan`,
`TodoWrite`, `task_tracker`), and the key line of the last error a tool reported when
the compaction took it out of view. They come back as system blocks, within a restore
budget.
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any

import orjson

from .config import RestoreConfig
from .failures import latest_error_line
from .notes import RESTORE_MARKER, system_note
from .tokens import TokenCounter
from .types import Message

_PATH_KEYS = ("path", "file_path", "filepath", "filename", "file", "target_file")
_CONTENT_KEYS = ("file_text", "content", "contents", "new_content", "text")
_DONE = ("completed", "complete", "done", "cancelled", "canceled")
_WINDOW_HEADER = re.compile(r"\[File: (\S+) \(\d+ lines total\)\]")
"""SWE-agent shows a file as a window under this header (its `open`, `goto`, `edit`)."""
_OPEN_FILE = re.compile(r"\(Open file: ([^)\n]+)\)")
"""SWE-agent's status line after every observation."""


@dataclass
class CurrentFile:
    path: str
    content: str = ""


@dataclass
class WorkingState:
    current_files: list[CurrentFile] = field(default_factory=list)
    """Newest first."""
    active_skill: str = ""
    active_plan: str = ""
    pending_tasks: list[str] = field(default_factory=list)
    last_error: str = ""
    """The key line of the newest observation that reported a failure."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "WorkingState":
        files = [CurrentFile(**f) for f in data.get("current_files", [])]
        return cls(current_files=files, active_skill=data.get("active_skill", ""),
                   active_plan=data.get("active_plan", ""), pending_tasks=list(data.get("pending_tasks", [])),
                   last_error=data.get("last_error", ""))

    def is_empty(self) -> bool:
        return not (self.current_files or self.active_skill or self.active_plan or self.pending_tasks
                    or self.last_error)


def _arguments(call: dict[str, Any]) -> dict[str, Any]:
    raw = (call.get("function") or {}).get("arguments")
    if isinstance(raw, dict):
        return raw
    try:
        parsed = orjson.loads(raw or "{}")
    except orjson.JSONDecodeError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


def _matches(name: str, names: list[str]) -> bool:
    return name in names or name.lower() in (n.lower() for n in names)


def _text(message: Message | None) -> str:
    content = (message or {}).get("content")
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else ""


def _tasks_of(args: dict[str, Any]) -> list[str] | None:
    items = args.get("todos") or args.get("task_list") or args.get("tasks")
    if not isinstance(items, list):
        return None
    pending = []
    for item in items:
        if isinstance(item, dict):
            status = str(item.get("status", "")).lower()
            title = item.get("content") or item.get("title") or item.get("task") or item.get("description")
            if title and status not in _DONE:
                pending.append(f"{title} [{status or 'todo'}]")
        elif isinstance(item, str):
            pending.append(item)
    return pending


def _plan_of(args: dict[str, Any]) -> str:
    plan = args.get("plan")
    if isinstance(plan, list):
        lines = []
        for step in plan:
            if isinstance(step, dict):
                lines.append(f"- [{step.get('status', '')}] {step.get('step') or step.get('content') or ''}")
            else:
                lines.append(f"- {step}")
        plan = "\n".join(lines)
    explanation = args.get("explanation")
    text = plan if isinstance(plan, str) else orjson.dumps(args).decode()
    return f"{explanation}\n{text}" if isinstance(explanation, str) and explanation else text


def extract_working_state(messages: list[Message], config: RestoreConfig) -> WorkingState:
    """Walk the transcript once, oldest to newest; later calls override earlier ones."""
    results = {m.get("tool_call_id"): m for m in messages if m.get("role") == "tool"}
    files: dict[str, str] = {}
    state = WorkingState()
    for m in messages:
        if m.get("role") in ("user", "tool"):
            _observed_files(_text(m), files)
        for call in m.get("tool_calls") or []:
            if not isinstance(call, dict):
                continue
            name = (call.get("function") or {}).get("name") or ""
            args = _arguments(call)
            result = _text(results.get(call.get("id")))
            if _matches(name, config.read_tools):
                path = next((args[k] for k in _PATH_KEYS if isinstance(args.get(k), str)), None)
                if path:
                    written = next((args[k] for k in _CONTENT_KEYS if isinstance(args.get(k), str)), None)
                    files.pop(path, None)  # re-insert: newest last
                    files[path] = written if written is not None else result
            if _matches(name, config.plan_tools):
                state.active_plan = _plan_of(args)
            if _matches(name, config.task_tools):
                tasks = _tasks_of(args)
                if tasks is not None:
                    state.pending_tasks = tasks
            if _matches(name, config.skill_tools):
                state.active_skill = result or orjson.dumps(args).decode()
    state.current_files = [CurrentFile(p, c) for p, c in reversed(list(files.items()))][:config.max_file_names]
    state.last_error = latest_error_line(messages)
    return state


def _observed_files(text: str, files: dict[str, str]) -> None:
    """Files an observation shows (SWE-agent: a window under `[File: path (N lines total)]`)
    or names as the open one (its status line), newest last."""
    window = _WINDOW_HEADER.search(text)
    if window:
        files.pop(window.group(1), None)
        files[window.group(1)] = text[window.start():]
    opened = _OPEN_FILE.search(text)
    path = opened.group(1).strip() if opened else ""
    if path and path != "n/a":
        files[path] = files.pop(path, "")


class ActiveRestore:
    """Turns a WorkingState into system blocks that fit a token budget."""

    def __init__(self, config: RestoreConfig, state: WorkingState) -> None:
        self.config = config
        self.state = state

    def blocks(self, counter: TokenCounter, budget: int, visible: list[Message] | None = None,
               room: int | None = None) -> list[Message]:
        """The restore blocks, most important first, skipping what `visible` still shows.
        The state lists (tasks, plan, last error, skill, file names) take up to `budget`;
        file contents take what is left of it, but no more than what the lists leave of
        `room` (what the request has left for restore blocks): a content block the request
        has no room for only brings the next compaction closer, and the agent can read the
        file again (the recovery message says so)."""
        s = self.state
        shown = "\n".join(_text(m) for m in visible or [])
        parts: list[str] = []
        if s.pending_tasks:
            parts.append("Pending tasks:\n" + "\n".join(f"- {t}" for t in s.pending_tasks))
        if s.active_plan:
            parts.append("Active plan:\n" + s.active_plan)
        if s.last_error and s.last_error not in shown:
            parts.append("Last error a tool reported (it may since be fixed):\n" + s.last_error)
        if s.active_skill:
            parts.append("Active skill:\n" + counter.head(s.active_skill, self.config.skill_tokens))
        if s.current_files:
            parts.append("Current files: " + ", ".join(f.path for f in s.current_files))
        out: list[Message] = []
        used = 0
        for text in parts:
            block = system_note(f"{RESTORE_MARKER} {text}")
            cost = counter.count_structured(block)
            if used + cost > budget:
                break
            out.append(block)
            used += cost
        limit = budget if room is None else min(budget, room)
        for f in s.current_files[:self.config.max_files]:
            if not f.content or f.content in shown:
                continue  # still in the kept messages: restoring it again only costs tokens
            header = f"{RESTORE_MARKER} Latest content seen of {f.path}:\n"
            room = limit - used - counter.count_structured(system_note(header)) - 8
            if room < 32:
                break
            body = f.content if counter.count(f.content) <= room else counter.head(f.content, room) + "\n[...]"
            block = system_note(header + body)
            out.append(block)
            used += counter.count_structured(block)
        return out
