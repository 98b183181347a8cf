"""What a compaction point keeps verbatim while anything else can still give room (issue 36).

The *protected tail*: the newest `PROTECTED_TAIL.messages` messages, widened to the newest
complete step. The cost model's narrowest window is this tail, not the newest step alone:
older observations, the earlier notes and the restored state give room before any of it
does, and when the tail alone does not fit, its observations are cut oldest first, the
newest last (`pipeline/over_budget.py`). A continuing agent reads its newest steps before
anything else: a step it took two turns ago and no longer sees verbatim is one it repeats.

The *file under edit*: text the agent's edit format must match (aider's files-in-chat
message, the newest view of a file an edit targets) is pinned like the task statement while
it fits (`kept_for_edits`), so read-only dumps and older observations give room before it;
the last of the fallbacks lets it go.
"""
from __future__ import annotations

import re
from typing import TYPE_CHECKING

from .protocols.base import text_of
from .types import RecentWindow

if TYPE_CHECKING:
    from .conversation import Conversation
    from .tokens import TokenCounter

PROTECTED_TAIL = RecentWindow(messages=6, steps=1)

EDIT_SHARE = 0.25
"""The text an edit must match is kept verbatim while it takes at most this share of the budget."""
_EDITORS = {"str_replace_editor", "str_replace_based_edit_tool"}
"""Editor tools that view and edit by a `command` argument."""
_EDITOR_EDITS = {"str_replace", "insert", "undo_edit"}
_EDITS = {"edit", "multiedit", "edit_file", "str_replace", "replace", "apply_patch", "search_replace"}
_VIEWS = {"view", "open", "read_file", "read", "cat", "goto", "scroll_up", "scroll_down"}
_FILES_IN_CHAT = re.compile(r"\A\s*I (?:have )?\*?added these files to the chat\*?")
"""aider's message with the current text of the files it lets the model edit: its SEARCH
blocks must match that text byte for byte."""


def _same(a: str, b: str) -> bool:
    a, b = a.lstrip("./"), b.lstrip("./")
    return a == b or a.endswith("/" + b) or b.endswith("/" + a)


def edit_targets(conversation: "Conversation") -> list[int]:
    """The messages holding text the agent's edit format must match: aider's newest
    files-in-chat message, and the newest view (an editor's `view`, `open`, `cat`, a read
    tool) of a file an edit targets. Oldest first."""
    found: list[int] = []
    aider = next((i for i in range(len(conversation.messages) - 1, -1, -1)
                  if conversation.messages[i].get("role") == "user"
                  and _FILES_IN_CHAT.match(text_of(conversation.messages[i]))), None)
    if aider is not None:
        found.append(aider)
    where = {id(o): i for i, info in enumerate(conversation.infos) for o in info.observations}
    views: dict[str, int] = {}
    edited: list[str] = []
    for _, action, answer in conversation.steps():
        tool, command = action.tool.lower(), str(action.arguments.get("command", "")).lower()
        path = action.paths[0] if action.paths else ""
        if tool in _EDITORS and command == "view" or tool in _VIEWS or action.program in _VIEWS:
            if path and answer is not None and id(answer) in where:
                views = {p: i for p, i in views.items() if not _same(p, path)} | {path: where[id(answer)]}
        elif tool in _EDITORS and command in _EDITOR_EDITS or tool in _EDITS:
            # SWE-agent's `edit` names no path: it edits the file open, the one viewed last.
            target = path or next(reversed(views), "")
            if target:
                edited = [p for p in edited if not _same(p, target)] + [target]
    viewed = [i for p, i in views.items() if any(_same(p, e) for e in edited)]
    if viewed:
        found.append(max(viewed))
    return sorted(found)


def kept_for_edits(conversation: "Conversation", counter: "TokenCounter", budget: int) -> frozenset[str]:
    """The fingerprints of `edit_targets`, each with its unit, that every level keeps verbatim
    (`CompressionRequest.keep`): the newest first, while together they take at most
    `EDIT_SHARE` of `budget`."""
    kept: list[str] = []
    room = EDIT_SHARE * budget
    counts = conversation.counts(counter)
    for i in reversed(edit_targets(conversation)):
        # The whole unit: a view's result stays with the call it answers (a provider refuses either alone).
        unit = next((range(u.start, u.end) for u in conversation.units if u.start <= i < u.end), range(i, i + 1))
        cost = sum(counts[k] for k in unit)
        if cost <= room:
            kept += [conversation.fingerprints[k] for k in unit]
            room -= cost
    return frozenset(kept)
