"""Level 1, Snip: on hand-built and recorded histories."""
from __future__ import annotations

import pytest

from ctxgate.pipeline.config import SnipConfig
from ctxgate.pipeline.ledger import HEADING, parse
from ctxgate.pipeline.notes import SNIP_MARKER, is_compaction_note, quoted_text
from ctxgate.pipeline.refs import REF_RE
from ctxgate.pipeline.snip import SnipStrategy, preview
from ctxgate.pipeline.conversation import read_conversation, split_units
from ctxgate.pipeline.turns import first_user_index
from ctxgate.pipeline.request import CompressionRequest
from ctxgate.pipeline.types import Level

from pipeline_builders import (LAST_UNIT, agent_history, assert_invariants, counter, real_histories, snapshot, system,
                               tool_turn, user)


async def snip(messages, budget, pin_first_user=True, **cfg):
    return await SnipStrategy(SnipConfig(**cfg), pin_first_user).compress(
        CompressionRequest(messages, budget, counter(), window=LAST_UNIT))


def unit_cost(messages, unit):
    return sum(counter().count_structured(m) for m in messages[unit.start:unit.end])


def dropped_of(original, result):
    return [m for m in original if m not in result]


async def test_fewer_than_ten_messages_is_left_alone() -> None:
    h = [system(), user("task")] + tool_turn(0, size=3000) + tool_turn(1, size=3000) + [user("newest")] \
        + tool_turn(2, size=10)
    assert len(h) == 9
    assert await snip(h, 100, keep_recent=0, min_messages=10) is None
    assert await snip(h, 100, keep_recent=0, min_messages=9, min_block=1) is not None


async def test_nothing_to_free_is_left_alone() -> None:
    h = agent_history(30, 50)
    assert await snip(h, counter().count_messages(h)) is None


async def test_blocks_smaller_than_five_messages_are_not_cut() -> None:
    h = agent_history(30, 200)
    total = counter().count_messages(h)
    units = [u for u in split_units(h) if u.start >= 2]
    two = unit_cost(h, units[0]) + unit_cost(h, units[1])
    # freeing what two units hold cuts only 4 messages: N < 5, no Snip
    assert await snip(h, total - two, keep_recent=10) is None
    # one token more needs a third unit: 6 messages, Snip runs
    result = await snip(h, total - two - 1, keep_recent=10)
    assert result is not None and result.steps[0].messages_affected == 6
    assert result.steps[0].span == (2, 8)


async def test_note_previews_and_what_stays() -> None:
    h = agent_history(30, 200)
    before = snapshot(h)
    result = await snip(h, 5000, keep_recent=20)
    assert result is not None and result.level_used is Level.SNIP
    assert h == before, "the caller's list was mutated"
    out = result.compressed_messages
    assert out[:2] == h[:2], "system prompt and pinned task statement stay first"
    note = out[2]
    assert note["role"] == "user" and quoted_text(note).startswith(SNIP_MARKER)
    assert is_compaction_note(note)
    dropped = dropped_of(h, out)
    assert f"{len(dropped)} earlier messages were removed" in note["content"]
    # every dropped step is named in the ledger, by number, tool, command and outcome
    lines = quoted_text(note).split("\n")[1:]
    assert lines[0] == HEADING
    steps = [m for m in dropped if m.get("tool_calls")]
    entries = parse(quoted_text(note))
    assert sorted(n for e in entries for n in range(e.first, e.last + 1)) == list(range(1, len(steps) + 1))
    singles = [e for e in entries if e.first == e.last]
    assert singles, entries
    for e in singles:
        i = e.first - 1
        assert e.text == f"- step {e.first}: execute_bash(ls {i}) -> ok", e.text  # no refs: expansion off
    # previews are the start of the text, whitespace collapsed, at most 80 characters
    tool_msg = next(m for m in dropped if m["role"] == "tool")
    shown = preview(tool_msg, 80)
    assert " ".join(tool_msg["content"].split()).startswith(shown) and 60 <= len(shown) <= 80
    assert preview(dropped[0], 80) == "called execute_bash(ls 0)"
    assert out[-20:] == h[-20:]
    assert_invariants(h, out)
    assert result.tokens_freed == counter().count_messages(h) - counter().count_messages(out)
    assert result.tokens_after == counter().count_messages(out)


async def test_cuts_fall_on_unit_boundaries() -> None:
    h = [system(), user("task")]
    for i in range(25):  # units of 1, 2, 3 and 4 messages: a call with 0-3 extra results
        n = i % 4
        ids = [f"c{i}_{k}" for k in range(n)]
        if n == 0:
            h.append({"role": "assistant", "content": "thinking " * 50})
        else:
            h.append({"role": "assistant", "content": "", "tool_calls": [
                {"id": cid, "type": "function", "function": {"name": "bash", "arguments": "{}"}} for cid in ids]})
            h += [{"role": "tool", "tool_call_id": cid, "content": "out " * 60} for cid in ids]
    h += [user("newest"), {"role": "assistant", "content": "ok"}]
    starts = {u.start for u in split_units(h)}
    total = counter().count_messages(h)
    for budget in range(total // 4, total, max(1, total // 25)):
        result = await snip(h, budget, keep_recent=5)
        if result is None:
            continue
        a, b = result.steps[0].span
        assert a in starts and (b in starts or b == len(h)), (budget, a, b)
        assert_invariants(h, result.compressed_messages)


async def test_newest_user_is_pinned_even_inside_the_cut() -> None:
    """An agent loop: the newest user message is old, deep in what Snip cuts."""
    h = [system(), {"role": "developer", "content": "Be terse."}, user("TASK"), *tool_turn(0),
         user("NEWEST: also run the linter")]
    for i in range(1, 30):
        h += tool_turn(i, size=200)
    newest = h[5]
    result = await snip(h, 4000, keep_recent=10)
    assert result is not None
    out = result.compressed_messages
    assert out[:3] == h[:3]
    assert quoted_text(out[3]).startswith(SNIP_MARKER)
    assert out[4] == newest, "the pinned newest user message follows the note"
    assert out.count(newest) == 1
    assert out[-10:] == h[-10:]
    assert_invariants(h, out)


async def test_first_user_can_go_when_not_pinned() -> None:
    h = agent_history(30, 200)
    pinned = await snip(h, 6000, keep_recent=10)
    free = await snip(h, 6000, pin_first_user=False, keep_recent=10)
    assert h[1] in pinned.compressed_messages
    assert h[1] not in free.compressed_messages
    assert quoted_text(free.compressed_messages[1]).startswith(SNIP_MARKER)


async def test_keep_recent_bounds_the_cut() -> None:
    h = agent_history(30, 200)
    for keep in (5, 20, 40):
        result = await snip(h, 100, keep_recent=keep)
        assert result is not None and not result.fits
        out = result.compressed_messages
        assert out[-keep:] == h[-keep:]
        a, b = result.steps[0].span
        assert len(h) - b >= keep
    assert await snip(h, 100, keep_recent=len(h) - 6) is None  # only 4 messages may go


async def test_tokens_are_freed_in_order_oldest_first() -> None:
    h = agent_history(40, 100)
    total = counter().count_messages(h)
    r1 = await snip(h, total - 1000, keep_recent=10)
    r2 = await snip(h, total - 3000, keep_recent=10)
    # a bigger need cuts a longer oldest block, starting at the same place
    assert r1.steps[0].span[0] == r2.steps[0].span[0] == 2
    assert r2.steps[0].span[1] > r1.steps[0].span[1]
    assert r2.tokens_freed > r1.tokens_freed


@pytest.mark.parametrize("name,h", real_histories(10), ids=[n for n, _ in real_histories(10)])
async def test_real_histories(name, h) -> None:
    before = snapshot(h)
    total = counter().count_messages(h)
    result = await snip(h, total // 2, keep_recent=6)
    assert h == before
    if result is None:
        return
    out = result.compressed_messages
    assert_invariants(h, out)
    at = next(i for i, m in enumerate(out) if is_compaction_note(m))
    assert quoted_text(out[at]).startswith(SNIP_MARKER)
    assert out[:at] == h[:at]
    fu = first_user_index(h)
    if fu == at - 1:
        assert out[fu] == h[fu]
    assert out[-6:] == h[-6:]
    assert result.steps[0].messages_affected >= 5
    assert counter().count_messages(out) < total


@pytest.mark.parametrize("over", [200, 400, 800, 1600])
async def test_the_note_counts_against_the_target(over: int) -> None:
    """Snip cuts enough to make room for its own note: with history left to cut, the result
    fits (cutting exactly what the target asks for leaves the note over it)."""
    h = agent_history(60, 30)
    budget = counter().count_messages(h) - over
    result = await snip(h, budget)
    assert result is not None and result.fits, (result.tokens_after, budget)
    assert result.tokens_after <= budget
    note = next(m for m in result.compressed_messages if is_compaction_note(m))
    n = int(note["content"].split("] ", 1)[1].split(" ", 1)[0])
    assert n == len(dropped_of(h, result.compressed_messages))


def test_a_preview_never_ends_in_a_reference_cut_short():
    """A model reads `ref ctx:HEX` in a note as something it may ask for: a preview that ends
    inside one would name a reference that does not exist."""
    ref = "ctx:9662046ef26b"
    for cut_at in range(len("OBSERVATION: see ref "), len(f"OBSERVATION: see ref {ref}")):
        message = {"role": "tool", "tool_call_id": "c1", "content": f"OBSERVATION: see ref {ref} for the rest"}
        shown = preview(message, cut_at)
        assert "ref ctx:" not in shown or ref in shown, (cut_at, shown)
        assert shown.startswith("OBSERVATION: see")
    whole = preview({"role": "tool", "content": f"see ref {ref}"}, 80)
    assert whole == f"see ref {ref}"


def test_a_note_without_previews_only_counts_what_it_cut() -> None:
    """`preview_chars: 0` (the last resort under a prompt that fills the room): the note says
    how many messages went and where they are kept, nothing more, and its count holds."""
    from ctxgate.pipeline.snip import SnipNote
    h = [user(f"message {i} " * 20) for i in range(3)]
    note = SnipNote(counter(), 6000, 0, with_ref=True)
    for i in range(3):
        note.add(read_conversation(h), range(i, i + 1))
    note.ref = "ctx:0123456789ab"
    made = note.message()
    assert quoted_text(made).startswith(SNIP_MARKER) and "3 earlier messages" in made["content"]
    assert "preview" not in quoted_text(made) and "\n" not in quoted_text(made)
    assert counter().count_messages([made]) - counter().count_messages([]) <= note.tokens


def test_a_note_without_previews_still_names_its_steps_in_one_range() -> None:
    """The last resort's note keeps the ledger as one range line: the step numbers stay covered."""
    from ctxgate.pipeline.snip import SnipNote
    h = [system(), user("task")] + [m for i in range(6) for m in tool_turn(i, size=40)]
    conversation = read_conversation(h)
    note = SnipNote(counter(), 6000, 0, with_ref=True)
    for unit in conversation.units[2:]:
        note.add(conversation, range(unit.start, unit.end))
    made = note.message()
    entries = parse(quoted_text(made))
    assert [(e.first, e.last) for e in entries] == [(1, 6)], quoted_text(made)
    assert entries[0].tools == (("execute_bash", 6),) and "ref ctx:" in entries[0].text
    assert set(note.originals) >= set(REF_RE.findall(made["content"]))
    assert counter().count_messages([made]) - counter().count_messages([]) <= note.tokens
