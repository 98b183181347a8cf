"""The step ledger as a real agent's upstream sees it (pipeline/ledger.py): in the last request
the upstream received, every step the agent took over the run is named in a ledger line or
range of ctxgate's notes, or is still there verbatim; and in any request forwarded, each line
names the client's own steps at its numbers (`ledger_faults`, which bench/ledger_faults.py
counts over the recorded runs)."""
from __future__ import annotations

from typing import Any

from ctxgate.pipeline.conversation import read_conversation
from ctxgate.pipeline.fingerprint import message_fingerprint
from ctxgate.pipeline.ledger import note_entries, parse, step_numbers
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


def ledger_faults(client: list[dict[str, Any]], sent: list[dict[str, Any]]) -> tuple[list[str], bool, bool]:
    """What is wrong with the step ledger of `sent` (forwarded for the agent's `client` messages),
    checked against the client's own steps (numbered 1, 2, … in the order it took them): each
    number named once and in order, a range naming as many calls as numbers, a line naming the
    tools the client's steps at those numbers called, no step both named and still verbatim.
    Also: whether `sent` names no step though some are neither named nor verbatim (a point with
    no room for a note), and whether a step kept verbatim sits after a note naming later steps
    (a step kept in place inside a cut). A message the client sent twice, byte for byte, is not
    read as either step (which one a copy is, is not known)."""
    read = read_conversation(client)
    tools: dict[int, str] = {}
    numbers: dict[str, tuple[int, ...]] = {}
    fps = read.fingerprints
    for i, found in enumerate(step_numbers(read)):
        for n, action in zip(found, read.infos[i].actions):
            tools[n] = "".join(action.tool.split()) or "?"
        if fps.count(fps[i]) == 1:
            numbers[fps[i]] = found
    faults: list[str] = []
    named: list[int] = []
    verbatim: set[int] = set()
    kept_inside = False
    for m in sent:
        kept = numbers.get(message_fingerprint(m), ())
        verbatim.update(kept)
        kept_inside |= bool(kept and named and min(kept) < max(named))
        for e in note_entries(m):
            named += range(e.first, e.last + 1)
            if sum(k for _, k in e.tools) != e.last - e.first + 1:
                faults.append(f"{e.last - e.first + 1} numbers, other calls: {e.text}")
            calls_ = [tools.get(n) for n in range(e.first, e.last + 1)]
            if sorted(t for t, k in e.tools for _ in range(k)) != sorted(map(str, calls_)):
                faults.append(f"the client's steps {e.first}–{e.last} called {calls_}: {e.text}")
    if named != sorted(set(named)):
        faults.append(f"named twice or out of order: {named}")
    if set(named) & verbatim:
        faults.append(f"named and verbatim: {sorted(set(named) & verbatim)}")
    unnamed = set(tools) - set(named) - verbatim
    return faults, bool(unnamed and not named), kept_inside
