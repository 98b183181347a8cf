"""activeRestore, the mandatory step after every compaction (docs/compaction.md, activeRestore).

A proxy cannot call the agent's `read_file`, so it restores from the transcript it has
seen, read through the conversation model (so in any dialect): the current files (every
path an action named, and SWE-agent's file windows and open-file line; with the latest
content seen for files a read or write tool or command showed), the active skill, the
active plan and the pending tasks (from plan and todo tools such as `update_plan`,
`TodoWrite`, `task_tracker`), and the key line of the last error an observation reported
when the compaction took it out of view. They come back as quoted data (user-role blocks
that name their source: a file's text, an error line, a plan are what a tool or the agent
wrote, never instructions), within a restore budget.
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any

import orjson

from .config import RestoreConfig
from .conversation import read_conversation
from .ledger import covering_note
from .protocols.base import readable_text
from .notes import (RESTORE, RESTORE_FILE, TAG, context_note, is_compaction_note, is_ctxgate_message,
                    is_quoted, is_restore_block, kind_of, notice_message)
from .tokens import TokenCounter
from .types import Message

_CONTENT_KEYS = ("file_text", "content", "contents", "new_content", "text")
_DONE = ("completed", "complete", "done", "cancelled", "canceled")
_WINDOW_HEADER = re.compile(r"\[File: (\S+) \(\d+ lines total\)\]")
"""SWE-agent shows a file as a window under this header (its `open`, `goto`, `edit`)."""
_OPEN_FILE = re.compile(r"\(Open file: ([^)\n]+)\)")
"""SWE-agent's status line after every observation."""
STATE_SOURCE = "restored state"
"""The source of the block about the state: what ctxgate read from the agent's calls and their outputs."""
_FILE_NAMES = "Current files: "
ERROR_SECTION = "Last error reported (may be fixed):\n"
_FILE_CONTENT = "Latest content seen of "


@dataclass
class CurrentFile:
    path: str
    content: str = ""
    tool: str = ""
    """The tool (or command) whose output showed the content: the block's source."""


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


def _matches(name: str, names: list[str]) -> bool:
    return name in names or name.lower() in (n.lower() for n in names)


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


def extract_working_state(messages: list[Message], config: RestoreConfig, dialect: str | None = None) -> WorkingState:
    """Walk the conversation once, oldest to newest; later actions override earlier ones."""
    conversation = read_conversation(messages, dialect, [*config.plan_tools, *config.task_tools])
    answers = {(i, id(action)): answer for i, action, answer in conversation.steps()}
    files: dict[str, str] = {}
    tools: dict[str, str] = {}
    state = WorkingState()
    for i, message in enumerate(messages):
        if message.get("role") in ("user", "tool") and not is_ctxgate_message(message):
            _observed_files(readable_text(message), files, tools)
        for action in conversation.infos[i].actions:
            answer = answers.get((i, id(action)))
            result = answer.output if answer is not None else ""
            for path in action.paths:  # every file an action names is one the agent works on
                _touch(files, path)
            if action.paths and (_matches(action.tool, config.read_tools)
                                 or _matches(action.program, config.read_tools)):
                path = _touch(files, action.paths[0])
                written = next((action.arguments[k] for k in _CONTENT_KEYS
                                if isinstance(action.arguments.get(k), str)), None)
                files.pop(path, None)  # re-insert: newest last
                # A folder's listing is not a file's content: the folder stays among the paths
                # worked on, with nothing to restore (the agent lists it again if it needs to).
                files[path] = (written if written is not None else "" if _is_listing(path, result)
                               else result)
                tools[path] = action.tool or action.program
            if _matches(action.tool, config.plan_tools):
                state.active_plan = _plan_of(action.arguments)
            if _matches(action.tool, config.task_tools):
                tasks = _tasks_of(action.arguments)
                if tasks is not None:
                    state.pending_tasks = tasks
            if _matches(action.tool, config.skill_tools):
                state.active_skill = result or orjson.dumps(action.arguments).decode()
    state.current_files = [CurrentFile(p, c, tools.get(p, "")) for p, c in reversed(list(files.items()))
                           ][:config.max_file_names]
    failure = conversation.latest_failure()
    state.last_error = failure[1].error_line if failure else ""
    return state


def _is_listing(path: str, output: str) -> bool:
    """Whether reading `path` showed a folder's entries rather than a file's content: lines
    that name paths under it (an editor's view of a folder lists `path/child`, one a line)."""
    under = path.rstrip("/") + "/"
    return sum(1 for line in output.splitlines() if line.strip().startswith(under)) >= 2


def _touch(files: dict[str, str], path: str) -> str:
    """Move `path` to the newest end of `files`, keeping what is known of its content. A
    relative path and the absolute one it ends (`src/a.py`, `/repo/src/a.py`) are one file,
    under the longer name. Returns the name the file is kept under."""
    same = next((known for known in files if known == path or known.endswith("/" + path.lstrip("./"))
                 or path.endswith("/" + known.lstrip("./"))), None)
    name = path if same is None or len(path) > len(same) else same
    files[name] = files.pop(same, "") if same is not None else ""
    return name


def _observed_files(text: str, files: dict[str, str], tools: dict[str, str]) -> None:
    """Files an observation shows (SWE-agent: a window under `[File: path (N lines total)]`)
    or names as the open one (its status line), newest last."""
    window = _WINDOW_HEADER.search(text)
    if window:
        path = _touch(files, window.group(1))
        files[path], tools[path] = text[window.start():], "observation"
    opened = _OPEN_FILE.search(text)
    path = opened.group(1).strip() if opened else ""
    if path and path != "n/a":
        _touch(files, path)


class ActiveRestore:
    """Turns a WorkingState into quoted blocks that fit a token budget."""

    def __init__(self, config: RestoreConfig, state: WorkingState) -> None:
        self.config = config
        self.state = state

    def blocks(self, counter: TokenCounter, budget: int, visible: list[Message] | None = None,
               room: int | None = None, cuts: dict[str, str] | None = None) -> list[Message]:
        """The restore blocks, most important first, skipping what `visible` still shows.
        The state lists (tasks, plan, last error, skill, file names) take up to `budget`;
        file contents take what is left of it, but no more than what the lists leave of
        `room` (what the request has left for restore blocks): a content block the request
        has no room for only brings the next compaction closer, and the agent can read the
        file again (the recovery message says so). With expansion on (`cuts`: what this
        compaction kept by reference), the last error's line is quoted and the output it
        came from named (when that output is still in view with its middle cut, the block
        says so)."""
        s = self.state
        shown = "\n".join(readable_text(m) for m in visible or [])
        parts: list[str] = []
        """The sections about the state, most important first: one quoted block holds them (one
        pair of delimiters, not one per section: at a tight limit those tokens decide what fits)."""
        if s.pending_tasks:
            parts.append("Pending tasks:\n" + "\n".join(f"- {t}" for t in s.pending_tasks))
        if s.active_plan:
            parts.append("Active plan:\n" + s.active_plan)
        bare: tuple[int, str] | None = None
        """The error section without its reference, and where it is: what gives way before a file name."""
        if s.last_error and s.last_error not in shown:
            ref = next((ref for ref, text in (cuts or {}).items() if s.last_error in text), None)
            parts.append(error_section(s.last_error, ref, ref is not None and ref in shown))
            bare = (len(parts) - 1, error_section(s.last_error, None)) if ref is not None else None
        if s.active_skill:
            parts.append("Active skill:\n" + counter.head(s.active_skill, self.config.skill_tokens))
        names = [f.path for f in s.current_files if f.path not in shown]  # the kept messages name the others
        if names:
            parts.append(names_section(names))
        out: list[Message] = []
        used = 0
        tries = [parts[:n] for n in range(len(parts), 0, -1)]  # as many sections as fit, the least important go first
        if bare is not None:  # each with the error's reference, else without it
            at, text = bare
            tries = [form for kept in tries for form in ([kept, [*kept[:at], text, *kept[at + 1:]]]
                                                         if len(kept) > at else [kept])]
        for sections in tries:
            block = state_block(sections)
            cost = counter.count_structured(block)
            if cost <= budget:
                out.append(block)
                used = cost
                break
        out, used = _with_room_used(out, used, parts, counter, budget)
        limit = budget if room is None else min(budget, room)
        for f in s.current_files[:self.config.max_files]:
            if not f.content or f.content in shown:
                continue  # still in the kept messages: restoring it again only costs tokens
            header = f"{_FILE_CONTENT}{f.path}:\n"
            source = f"tool:{f.tool} path={f.path}" if f.tool else f"file path={f.path}"
            room = limit - used - counter.count_structured(context_note(RESTORE_FILE, source, header)) - 8
            if room < 32:
                break
            body = f.content if counter.count(f.content) <= room else counter.head(f.content, room) + "\n[...]"
            block = context_note(RESTORE_FILE, source, header + body)
            out.append(block)
            used += counter.count_structured(block)
        return out


def _with_room_used(out: list[Message], used: int, parts: list[str], counter: TokenCounter,
                    budget: int) -> tuple[list[Message], int]:
    """The state block `out` holds (if any) with the sections after its own that fit beside it:
    a section too long for the room leaves it to less important ones after it (the file names
    after a failure line the room cannot hold), rather than to nothing."""
    sections = _sections(out[0]) if out else []
    grown = sections
    for part in parts[len(sections):]:
        if counter.count_structured(state_block([*grown, part])) <= budget:
            grown = [*grown, part]
    if grown == sections:
        return out, used
    block = state_block(grown)
    return [block, *out[1:]], counter.count_structured(block)


def names_section(names: list[str]) -> str:
    """The state's section naming the files the agent works on."""
    return _FILE_NAMES + ", ".join(names)


def error_section(line: str, ref: str | None, in_view: bool = False) -> str:
    """The state's section about the last failure: its line, and the output it is from by
    reference; with `in_view`, that output is still in the request with the line in its cut
    middle. The line is quoted all the same: it is the last failure only when its output
    reports one by its structure (`failures.key_error_line`), and what the agent acts on next;
    the rest of that middle stays an expansion away (a build log's error-looking line in an
    output that ended well is no failure, and stays behind its reference: check_expand)."""
    where = "cut from an output still in view" if in_view else "the output it is from"
    return ERROR_SECTION + line + ("" if ref is None else f"\n({where}: ref {ref})")


def state_block(sections: list[str]) -> Message:
    """The block about the state: its sections quoted as one, and kept in its tag, so shedding
    can give up the least important of them rather than the whole block."""
    block = context_note(RESTORE, STATE_SOURCE, "\n\n".join(sections))
    block[TAG] = {"kind": RESTORE, "sections": list(sections)}
    return block


def _sections(message: Message) -> list[str]:
    tag = message.get(TAG)
    found = tag.get("sections") if isinstance(tag, dict) else None
    return [x for x in found if isinstance(x, str)] if isinstance(found, list) else []


def _lighter_states(sections: list[str], names_only: bool) -> list[Message | None]:
    """The state block with less in it, each form lighter than the one before: the file names
    one at a time, the oldest first (they are newest first); with not `names_only`, then the
    other sections, the least important first, and at last nothing."""
    names = sections[-1][len(_FILE_NAMES):].split(", ") if sections and sections[-1].startswith(_FILE_NAMES) else []
    rest = sections[:-1] if names else sections
    forms: list[Message | None] = [state_block([*rest, _FILE_NAMES + ", ".join(names[:k])]) if k else
                                   state_block(rest) if rest else None for k in range(len(names) - 1, -1, -1)]
    if not names_only:
        forms += [state_block(rest[:k]) for k in range(len(rest) - 1, 0, -1)] + [None]
    return forms


def shed_own_messages(messages: list[Message], counter: TokenCounter, limit: int,
                      everything: bool = False) -> list[Message] | None:
    """`messages` without as much of ctxgate's own messages as it takes to fit `limit` tokens:
    first the restore blocks about files (the contents, the last first, then the file names in
    the state block, the oldest first); with `everything` (the last resort) then the compaction
    notes, the oldest first, then the state's other sections, the least important first (the
    last error, plan and tasks go last: a few lines the summary notes mostly repeat at greater
    length); then what was given up before the step that made room comes back if it fits beside
    it (a file list is not lost to a note that had to go anyway). None if they do not fit even
    so. A request over the budget gives up what ctxgate added before anything the client sent:
    the newest steps verbatim are worth more than a list of what came before them, and a request
    the provider refuses is worth nothing."""
    state = next((i for i, m in enumerate(messages) if _sections(m)), None)
    sections = _sections(messages[state]) if state is not None else []
    forms: dict[int, list[Message | None]] = {}
    """Per message ctxgate may lighten, its lighter forms in order (None: gone)."""
    steps: list[tuple[int, int]] = []
    """(message, index into its forms), in the order they are tried."""
    for i in range(len(messages) - 1, -1, -1):
        if kind_of(messages[i]) == RESTORE_FILE:
            forms[i] = [None]
            steps.append((i, 0))
    if state is not None:
        forms[state] = _lighter_states(sections, names_only=not everything)
        names = len(_lighter_states(sections, names_only=True))
        steps += [(state, k) for k in range(names)]
    if everything:
        notes = [i for i, m in enumerate(messages) if is_compaction_note(m)]
        cover = covering_note([messages[i] for i in notes])
        for i in notes:  # the oldest first; the first stands for them all in one line before it goes
            forms[i] = [None] if cover is None or i != notes[0] else [cover, None]
            steps.append((i, 0))
        for i in range(len(messages) - 1, -1, -1):
            if is_restore_block(messages[i]) and i not in forms:
                forms[i] = [None]
                steps.append((i, 0))
        if state is not None:
            steps += [(state, k) for k in range(names, len(forms[state]))]
        if cover is not None:
            steps.append((notes[0], 1))
    # Counted as forwarded: ctxgate's notice comes with its quoted notes, and goes with the last of them.
    notice = counter.count_structured(notice_message())
    base = counter.count_messages([m for i, m in enumerate(messages) if i not in forms])
    quoted_base = any(is_quoted(m) for i, m in enumerate(messages) if i not in forms)
    sizes: dict[tuple[int, int], int] = {}

    def shown(i: int, at: int | None) -> Message | None:
        return messages[i] if at is None else forms[i][at]

    def total(applied: dict[int, int]) -> int:
        kept = [form for i in forms if (form := shown(i, applied.get(i))) is not None]
        size = 0
        for i in forms:
            key = (i, applied.get(i, -1))
            if key not in sizes:
                m = shown(i, applied.get(i))
                sizes[key] = 0 if m is None else counter.count_structured(m)
            size += sizes[key]
        return base + size + (notice if quoted_base or any(is_quoted(m) for m in kept) else 0)

    applied: dict[int, int] = {}
    done = 0
    while total(applied) > limit and done < len(steps):
        i, at = steps[done]
        applied[i] = at
        done += 1
    if total(applied) > limit:
        return None
    # The last step is what made room: what the steps before it gave up may fit again beside it.
    for step in range(done - 2, -1, -1):
        i, at = steps[step]
        if applied.get(i) != at:
            continue  # a later step took more of it
        before = next((k for j, k in reversed(steps[:step]) if j == i), None)
        trial = {k: v for k, v in applied.items() if k != i} | ({} if before is None else {i: before})
        if total(trial) <= limit:
            applied = trial
    out = (shown(i, applied.get(i)) for i in range(len(messages)))
    return [m for m in out if m is not None]
