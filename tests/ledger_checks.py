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


def _ledger_numbers(messages: list[dict[str, Any]]) -> set[int]:
    """The step numbers the ledgers of ctxgate's notes name (the upstream gets them untagged:
    they are known by their marker)."""
    covered: set[int] = set()
    for m in messages:
        text = text_of(m)
        if NOTE_MARK in text:
            covered |= {n for e in parse(text) for n in range(e.first, e.last + 1)}
    return covered


def assert_every_step_named(received: list[Any]) -> tuple[int, int]:
    """Every action the upstream received over the run (each once: by its call id, else by its
    message) is named in the last request's ledgers or still there: the ledgers name 1..N
    without a gap, and the N + 1st step on are the actions left verbatim. Returns (named,
    verbatim)."""
    last = chat_messages(received[-1])
    dialect = read_conversation(last).dialect
    seen: set[str] = set()
    for r in received:
        read = read_conversation(chat_messages(r), dialect)
        for m, info in zip(read.messages, read.infos):
            for k, action in enumerate(info.actions):
                seen.add(action.call_id or f"{message_fingerprint(m)}:{k}")
    verbatim = sum(len(info.actions) for info in read_conversation(last, dialect).infos)
    covered = _ledger_numbers(last)
    named = max(covered, default=0)
    assert covered == set(range(1, named + 1)), sorted(covered)
    assert named + verbatim == len(seen), (named, verbatim, len(seen))
    assert named > 0, "no step was ever cut: the check did not run"
    return named, verbatim
