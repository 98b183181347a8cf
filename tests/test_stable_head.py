"""A compaction record matched by its stable part (pipeline/stable_head.py): an agent that
rebuilds the messages after its history every turn (aider: the reminder appended to the newest
user message, moved to the next one the turn after) is not compacted afresh every turn, and a
client that changed what a point compacted never gets that point's notes back."""
from __future__ import annotations

import asyncio
from dataclasses import asdict
from functools import lru_cache
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from ctxgate.pipeline.config import PipelineConfig
from ctxgate.pipeline.notes import TAG, with_notice
from ctxgate.pipeline.stable_head import best_match, match, with_stable_head
from ctxgate.pipeline.views import forwarded_view
from ctxgate.proxy.engine.compaction import Compactor, fingerprints_of
from ctxgate.proxy.engine.state import CompactionRecord, SessionState
from ctxgate.proxy.engine.turn_budget import Turn
from pipeline_builders import Message, assistant, counter, filler, system, user

BUDGET = 6000
REMINDER = "\n\n# Reminder: answer with SEARCH/REPLACE blocks only.\n" + filler(120, 999)
FILES = "I am not sharing any files that you can edit yet."
CALC_V1 = "def total(*args):\n    return 0\n"
CALC_V2 = "def total(*args):\n    return sum(args)\n"


def files_message(text: str) -> str:
    return f"I have *added these files to the chat* so you can go ahead and edit them.\n\ncalc.py\n```\n{text}```\n"


async def _never(_: list[Message]) -> str:
    raise AssertionError("no summary should be needed")


def _turn(messages: list[Message]) -> Turn:
    return Turn(messages=messages, fingerprints=fingerprints_of(messages), tools=None, counter=counter(),
                config=PipelineConfig(), max_input_tokens=BUDGET, summarize=_never)


def _request(steps: int, reminder: bool = True, size: int = 300, files: str | None = None) -> list[Message]:
    """What an aider-like agent sends after `steps` steps: its instructions, its files message,
    the task, a ```bash step per turn with its output, and the reminder on the newest user turn."""
    out = [system("Act as an expert software developer."), user(FILES if files is None else files_message(files)),
           assistant("Ok."),
           user("TASK: run the steps one at a time.")]
    for k in range(1, steps + 1):
        out += [assistant(f"Running step {k}.\n\n```bash\necho STEP-{k}-OK\n```"),
                user(f"Output from echo STEP-{k}-OK\nSTEP-{k}-OK\n" + filler(size, k)), assistant("Ok"),
                user("continue")]
    if reminder:
        out[-1] = {**out[-1], "content": out[-1]["content"] + REMINDER}
    return out


async def _forward(compactor: Compactor, state: SessionState, messages: list[Message]) -> tuple[list[Message], bool]:
    """The request forwarded for `messages`, and whether the turn was a compaction point."""
    before = [(r.prefix_len, r.prefix_hash) for r in state.records]
    plan = await compactor.prepare(state, _turn(messages))
    state.has_attempted_reactive_compact = False  # the upstream answered
    return plan.messages, [(r.prefix_len, r.prefix_hash) for r in state.records] != before


async def test_a_reminder_that_moves_every_turn_does_not_make_every_turn_a_compaction_point() -> None:
    """Past the trigger, a point compacts the old steps; the turns after it start with what it
    forwarded, but for the one message the client changed itself, until the next point."""
    compactor, state = Compactor(), SessionState("t", "s")
    forwarded: list[tuple[list[Message], bool]] = []
    for steps in range(1, 40):
        forwarded.append(await _forward(compactor, state, _request(steps)))
    points = [i for i, (_, point) in enumerate(forwarded) if point]
    assert 2 <= len(points) <= len(forwarded) // 4, points  # compacted, and not every turn afresh
    for (before, _), (after, point) in zip(forwarded, forwarded[1:]):
        if not point:  # the client changed its last message (the reminder went to the next one)
            assert after[:len(before) - 1] == before[:-1]
            assert after[len(before) - 1]["content"] + REMINDER == before[-1]["content"]


async def test_the_stable_match_is_counted_as_the_view_it_forwards() -> None:
    compactor, state = Compactor(), SessionState("t", "s")
    steps = 1
    while not (await _forward(compactor, state, _request(steps)))[1]:
        steps += 1
    record = state.records[-1]
    assert 0 < record.stable_len < record.prefix_len and record.tail_tokens > 0
    nxt = _turn(_request(steps + 1))
    found = best_match(state.records, nxt)
    assert found is not None and not found.whole and found.covered == record.stable_len
    view, tokens = forwarded_view(state, nxt)
    assert view == found.head + nxt.messages[record.stable_len:]
    assert tokens == counter().count_messages(with_notice(view)) + nxt.outside_tokens()


async def test_a_client_that_rewrote_what_a_point_compacted_gets_none_of_its_notes() -> None:
    """aider summarising its own history, or any client editing an old observation: the record's
    head stands for messages the client no longer sends, so it is not applied."""
    compactor, state = Compactor(), SessionState("t", "s")
    steps = 1
    while not (await _forward(compactor, state, _request(steps)))[1]:
        steps += 1
    record = state.records[-1]
    rewritten = _request(steps + 1)
    rewritten[5] = {**rewritten[5], "content": rewritten[5]["content"].replace("STEP-1-OK\n", "STEP-1-FAILED\n")}
    assert best_match(state.records, _turn(rewritten)) is None
    # the same history with its old steps replaced by the client's own summary: under the
    # trigger, it is forwarded exactly as sent, with no note of ctxgate's
    summarised = rewritten[:4] + [user("Summary of steps 1 to 9: all printed their marker."), assistant("Ok.")] \
        + rewritten[-8:]
    sent, point = await _forward(compactor, state, summarised)
    assert sent == summarised and not point
    assert state.records[-1] is record


def test_a_message_kept_beside_the_notes_may_be_rebuilt_in_place_but_not_moved_and_not_the_task() -> None:
    """The instructions and the files message kept verbatim in the head: the client's new version
    of one, at the same place, takes the old one's place in the head (pipeline/rebuilt.py). The
    task statement changed, a kept message moved, or anything the notes stand for changed beside
    it: not the history the head stands for."""
    messages = _request(12)
    head = messages[:4] + [{"role": "user", "content": "note", "ctxgate": "snip"}]
    record = _record(messages, head + messages[-6:])
    assert record.stable_len == len(messages) - 6
    assert [k[0] for k in record.rebuildable] == [0, 1, 2]  # not the task (3)
    later = _request(13)
    assert match(record, _turn(later)) is not None
    for i in (0, 1):
        changed = [dict(m) for m in later]
        changed[i]["content"] += " (rebuilt)"
        found = match(record, _turn(changed))
        assert found is not None and found.head == [*changed[:4], head[4]], i
        assert found.added == counter().count_structured(changed[i]) - counter().count_structured(later[i])
    task = [dict(m) for m in later]
    task[3]["content"] += " (edited)"
    assert match(record, _turn(task)) is None
    moved = later[:1] + later[3:-1] + later[1:3] + later[-1:]
    assert match(record, _turn(moved)) is None
    beside = [dict(m) for m in later]
    beside[1]["content"] += " (rebuilt)"
    beside[6]["content"] += " (changed)"
    assert match(record, _turn(beside)) is None


async def test_a_rebuilt_files_message_is_forwarded_as_sent_and_counted() -> None:
    """aider's files-in-chat message (kept for edits) rebuilt in place with the file's new text
    after a point: the next turn is no point, forwards the new text, and is counted as sent."""
    compactor, state = Compactor(), SessionState("t", "s")
    steps = 1
    while not (await _forward(compactor, state, _request(steps, files=CALC_V1)))[1]:
        steps += 1
    nxt = _request(steps + 1, files=CALC_V2)
    sent, point = await _forward(compactor, state, nxt)
    assert not point and any(TAG in m for m in sent), "the point's notes, in front of the rebuilt message"
    assert any(m.get("content") == files_message(CALC_V2) for m in sent)
    assert not any(m.get("content") == files_message(CALC_V1) for m in sent)
    turn = _turn(nxt)
    view, tokens = forwarded_view(state, turn)
    assert view == sent and tokens == counter().count_messages(with_notice(view)) + turn.outside_tokens()


def test_a_record_that_changed_the_last_message_or_compacted_nothing_matches_whole_only() -> None:
    messages = _request(12)
    cut = _record(messages, messages[:4] + [{**messages[-1], "content": "cut"}])
    assert cut.stable_len == 0
    nothing = _record(messages, list(messages))
    assert nothing.stable_len == 0
    assert match(nothing, _turn(messages)) is not None
    assert match(nothing, _turn(_request(13))) is None


def test_a_record_stored_before_the_stable_part_existed_still_matches_whole() -> None:
    messages = _request(12)
    record = _record(messages, messages[:4] + [{"role": "user", "content": "note", "ctxgate": "snip"}]
                     + messages[-6:])
    stored = {k: v for k, v in asdict(record).items() if k not in ("stable_len", "stable_hash", "tail_tokens")}
    old = CompactionRecord.from_dict(stored)
    assert old.stable_len == 0
    assert match(old, _turn(messages + [assistant("x"), user("y")])) is not None
    assert match(old, _turn(_request(13))) is None


def _record(messages: list[Message], out: list[Message]) -> CompactionRecord:
    turn = _turn(messages)
    made: Any = CompactionRecord(prefix_len=len(messages), prefix_hash=turn.prefix_hashes[-1], messages=out,
                                 levels=["snip"], tokens_before=0, tokens_after=0, created_at=0.0,
                                 counted_by=counter().name)
    return with_stable_head(made, turn)


@lru_cache(maxsize=1)
def _compacted() -> tuple[SessionState, int]:
    """A session after its first compaction point, and the steps the point's request had."""
    async def run() -> tuple[SessionState, int]:
        compactor, state = Compactor(), SessionState("t", "s")
        steps = 1
        while not (await _forward(compactor, state, _request(steps)))[1]:
            steps += 1
        return state, steps
    return asyncio.run(run())


@settings(max_examples=200, deadline=None)
@given(where=st.floats(0, 1, exclude_max=True), how=st.sampled_from(["edit", "drop", "insert"]))
def test_a_change_in_the_stable_part_matches_nothing_but_a_kept_message_rebuilt_in_place(where: float,
                                                                                           how: str) -> None:
    """Within the stable part, no match, but for a message the head kept verbatim edited in place
    (the head then holds the client's version); after it, the head and the client's messages
    from there on, as sent."""
    state, steps = _compacted()
    record = state.records[-1]
    messages = _request(steps + 1)
    i = int(where * len(messages))
    if how == "edit":
        messages[i] = {**messages[i], "content": str(messages[i]["content"]) + " (changed)"}
    elif how == "drop":
        del messages[i]
    else:
        messages.insert(i, user("an inserted turn"))
    found = best_match(state.records, _turn(messages))
    rebuilt = {k[0]: k[1] for k in record.rebuildable}
    if i < record.stable_len and how == "edit" and i in rebuilt:  # kept in the head: the client's version there
        assert found is not None and found.head[rebuilt[i]] == messages[i]
    elif i < record.stable_len:
        assert found is None
    else:
        assert found is not None and found.covered == record.stable_len
        assert found.head == record.messages[:len(record.messages) - (record.prefix_len - record.stable_len)]
