"""The step ledger as a real agent's upstream sees it (pipeline/ledger.py): in the last request
the upstream received, every step the agent took over the run is named in a ledger line or
range of ctxgate's notes, or is still there verbatim."""
from __future__ import annotations

from typing import Any

from ctxgate.pipeline.conversation import read_conversation
from ctxgate.pipeline.fingerprint import message_fingerprint
from ctxgate.pipeline.ledger import parse
from ctxgate.pipeline.protocols.base import text_of
from ctxgate.proxy.doors.responses_model import to_messages

NOTE_MARK = "[ctxgate: "
"""Every compaction note opens its text with one of ctxgate's markers (pipeline/notes.py)."""


def chat_messages(received: Any) -> list[dict[str, Any]]:
    """A request the upstream received as chat messages (a Responses one converted)."""
    body = received.body
    if received.door == "responses":
        raw = body.get("input")
        return to_messages(body.get("instructions"), [{"role": "user", "content": raw}] if isinstance(raw, str)
                           else list(raw or []))
    return list(body["messages"])


def _step_numbers(messages: list[dict[str, Any]], dialect: str) -> tuple[list[int], list[int]]:
    """The step numbers the ledgers of ctxgate's notes name (the upstream gets the notes
    untagged: they are known by their marker), and those of the actions still there, numbered
    as ctxgate numbers them: on from the highest number the notes before each one name."""
    named: list[int] = []
    verbatim: list[int] = []
    n = 0
    read = read_conversation(messages, dialect)
    for m, info in zip(read.messages, read.infos):
        text = text_of(m)
        if NOTE_MARK in text:
            entries = parse(text)
            named += [k for e in entries for k in range(e.first, e.last + 1)]
            n = max([n, *(e.last for e in entries)])
        for _ in info.actions:
            n += 1
            verbatim.append(n)
    return named, verbatim


def assert_every_step_named(received: list[Any]) -> tuple[int, int]:
    """Every action the upstream received over the run (each once: by its call id, else by its
    message) is in the last request: named once in a ledger line or range of ctxgate's notes, or
    still there verbatim (an agent's few-shot example before the task stays verbatim ahead of
    the notes). Returns (named, verbatim)."""
    last = chat_messages(received[-1])
    dialect = read_conversation(last).dialect
    seen: set[str] = set()
    for r in received:
        read = read_conversation(chat_messages(r), dialect)
        for m, info in zip(read.messages, read.infos):
            for k, action in enumerate(info.actions):
                seen.add(action.call_id or f"{message_fingerprint(m)}:{k}")
    named, verbatim = _step_numbers(last, dialect)
    assert sorted(named + verbatim) == list(range(1, len(seen) + 1)), (named, verbatim, len(seen))
    assert named, "no step was ever cut: the check did not run"
    return len(named), len(verbatim)
