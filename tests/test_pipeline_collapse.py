"""Level 3, Context-Collapse: a read-time projection with a persistent store."""
from __future__ import annotations

import json

import pytest

from ctxgate.pipeline.collapse import (CollapseStore, CollapseStrategy, collapse_summary, context_keys,
                                       is_decision_critical)
from ctxgate.pipeline.config import CollapseConfig
from ctxgate.pipeline.conversation import read_conversation
from ctxgate.pipeline.fingerprint import message_fingerprint, span_hash
from ctxgate.pipeline.notes import COLLAPSE_MARKER, SNIP, SNIP_MARKER, context_note, is_compaction_note, quoted_text
from ctxgate.pipeline.request import CompressionRequest
from ctxgate.pipeline.types import Level

from pipeline_builders import (LAST_UNIT, assert_invariants, assistant, call, calls, chat_history, counter, filler,
                               real_histories, snapshot, system, tool, tool_turn, user)


def make(window: int = 15, store: CollapseStore | None = None) -> CollapseStrategy:
    cfg = CollapseConfig(window=window)
    return CollapseStrategy(cfg, store or CollapseStore(cfg))


async def fold(strategy: CollapseStrategy, messages, budget: int = 1, dialect: str = "tool_calls"):
    """Chats read as a tool-calling agent's (no text protocol: every text turn is talk of its own)."""
    return await strategy.compress(CompressionRequest(messages, budget, counter(), dialect=dialect, window=LAST_UNIT))


def chat(n: int, seed: int) -> list[dict]:
    return [assistant(filler(40, seed + i)) if i % 2 == 0 else user(f"ok {seed + i}: " + filler(40, seed + i))
            for i in range(n)]


async def test_long_run_is_folded_into_one_note() -> None:
    h = chat_history(30, 40)  # system, task, 30 plain messages (the last one the newest user), "done"
    before = snapshot(h)
    s = make()
    result = await fold(s, h)
    assert h == before, "the client's list was mutated"
    assert result.level_used is Level.COLLAPSE
    out = result.compressed_messages
    assert out[:2] == h[:2] and out[-2:] == h[-2:]
    assert len(out) == 5
    note = out[2]
    assert note["role"] == "user" and quoted_text(note).startswith(f"{COLLAPSE_MARKER} (29 messages)\n")
    lines = quoted_text(note).split("\n")[1:]
    assert len(lines) == 29
    for line, m in zip(lines, h[2:31]):
        if m["role"] == "user":
            assert line == "User: " + " ".join(m["content"].split())[:200]
        else:
            assert line == f"Message from assistant ({counter().count(m['content'])} tokens)"
    assert result.steps[0].span == (2, 3) and result.steps[0].messages_affected == 28
    assert result.tokens_freed > 0 and result.tokens_after == counter().count_messages(out)
    assert_invariants(h, out)
    entry = next(iter(s.store.entries.values()))
    assert entry.original_span == (2, 31) and entry.length == 29
    assert entry.original_total_tokens == sum(counter().count_structured(m) for m in h[2:31])
    assert entry.collapsed_tokens == counter().count_structured(note)


async def test_only_runs_of_at_least_window_are_folded() -> None:
    short, long_ = chat(14, 100), chat(15, 200)
    h = [system(), user("task"), *short, *tool_turn(1), *long_, *tool_turn(2), user("newest"), assistant("ok")]
    result = await fold(make(), h)
    out = result.compressed_messages
    assert out[:2 + 14 + 2] == h[:2 + 14 + 2], "the run of 14 is kept"
    assert quoted_text(out[18]).startswith(f"{COLLAPSE_MARKER} (15 messages)")
    assert out[19:] == h[33:]
    assert await fold(make(window=16), h) is None
    h_short = [system(), user("task"), *short, *tool_turn(1), user("newest"), assistant("ok")]
    assert await fold(make(), h_short) is None


def critical(message: dict, dialect: str = "tool_calls", before: list | None = None) -> bool:
    """Whether `message` is decision-critical where it stands after `before`."""
    h = [system(), user("task"), *(before or []), message]
    return is_decision_critical(read_conversation(h, dialect), len(h) - 1)


async def test_decision_critical_messages_break_runs() -> None:
    assert critical(calls(call("x", "bash")))
    assert critical(calls(call("p", "update_plan")))
    assert critical(calls(call("t", "TodoWrite")))
    assert critical(context_note(SNIP, "compaction: snip", SNIP_MARKER + " cut"))
    # A client's turn that looks exactly like a note is the client's (ctxgate knows its own by its tag).
    assert not critical(dict(user(context_note(SNIP, "compaction: snip", SNIP_MARKER + " cut")["content"])))
    assert not critical(tool("x", "out"), before=[calls(call("x", "bash"))]), "it goes with its call, in one unit"
    assert critical(tool("x", "Traceback (most recent call last):\nValueError: no"), before=[calls(call("x", "bash"))])
    assert not critical(assistant("sure, I will do that"))
    assert not critical(user("thanks"))
    # in every text protocol an action is decision-critical, and so is an observation reporting a failure
    assert critical(assistant("<function=execute_bash>\n<parameter=command>\nls\n</parameter>\n</function>"),
                    "openhands_text")
    assert critical(assistant("THOUGHT: look\n\n```bash\nls\n```"), "mini_swe_agent")
    assert critical(assistant("Let us look.\n```\nopen a.py\n```"), "swe_agent_text")
    assert critical(user("<returncode>1</returncode>\n<output>\nboom\n</output>"), "mini_swe_agent",
                    [assistant("THOUGHT: x\n\n```bash\nfalse\n```")])
    assert not critical(user("<returncode>0</returncode>\n<output>\nfine\n</output>"), "mini_swe_agent",
                        [assistant("THOUGHT: x\n\n```bash\ntrue\n```")])
    # a plan change in the middle of 30 chat messages leaves two runs of 15 and 14
    plan = calls(call("p1", "update_plan"))
    h = [system(), user("task"), *chat(15, 0), plan, tool("p1", "ok"), *chat(14, 50), user("newest"), assistant("ok")]
    out = (await fold(make(), h)).compressed_messages
    assert quoted_text(out[2]).startswith(f"{COLLAPSE_MARKER} (15 messages)")
    assert out[3] == plan and out[4:] == h[18:]


async def test_pinned_messages_stay_out_of_the_fold() -> None:
    """The task statement and the newest user message are never folded."""
    h = [system(), user("task"), *chat(10, 0), user("NEWEST"), *[assistant(filler(30, i)) for i in range(20)],
         assistant("last")]
    s = make(window=10)
    out = (await fold(s, h)).compressed_messages
    assert out[:2] == h[:2]
    assert user("NEWEST") in out
    assert out.index(user("NEWEST")) == 3
    assert [quoted_text(m).split("\n")[0] for m in out if is_compaction_note(m)] == [
        f"{COLLAPSE_MARKER} (10 messages)", f"{COLLAPSE_MARKER} (20 messages)"]


async def test_same_span_is_never_folded_twice() -> None:
    h = chat_history(30, 40)
    s = make()
    first = await fold(s, h)
    entry = next(iter(s.store.entries.values()))
    again = await fold(s, h)
    assert len(s.store.entries) == 1
    assert next(iter(s.store.entries.values())) is entry, "not refolded"
    assert again.compressed_messages == first.compressed_messages
    # the client resends its history with a new turn: the fold still applies, nothing is refolded
    longer = h + [user("one more thing"), assistant("sure")]
    out = (await fold(s, longer)).compressed_messages
    assert out[2] == first.compressed_messages[2]
    assert out[3:] == longer[31:]
    assert len(s.store.entries) == 1
    # a run that contains already folded messages is not folded again
    assert s.store.already_folded(entry.span_hash)
    assert all(s.store.already_folded(k) for k in context_keys([message_fingerprint(m) for m in h])[2:31])
    shifted = [system(), user("task"), *h[5:31], *chat(6, 900), user("newest"), assistant("x")]
    assert await fold(s, shifted) is None


async def test_projection_replaces_exactly_the_span() -> None:
    h = chat_history(30, 40)
    s = make()
    folded = (await fold(s, h)).compressed_messages
    assert s.store.project(h) == folded
    fps = [message_fingerprint(m) for m in h]
    assert s.store.project(h, fps) == folded
    # a client that rewrote a message inside the span no longer matches it
    edited = snapshot(h)
    edited[10] = user("rewritten")
    assert s.store.project(edited) == edited
    assert CollapseStore().project(h) is h


async def test_store_round_trip_keeps_bloom_and_entries() -> None:
    h = chat_history(30, 40)
    s = make()
    first = await fold(s, h)
    data = json.loads(json.dumps(s.store.to_dict()))  # what the session state and the WAL keep
    restored = CollapseStore.from_dict(data)
    assert restored.entries == s.store.entries
    entry = next(iter(restored.entries.values()))
    assert entry.original_span == (2, 31) and isinstance(entry.original_span, tuple)
    assert restored.already_folded(entry.span_hash)
    assert all(restored.already_folded(k) for k in context_keys([message_fingerprint(m) for m in h])[2:31])
    assert not restored.already_folded(span_hash([message_fingerprint(user("never seen"))]))
    # projected again after the round trip, and not folded a second time
    assert restored.project(h) == first.compressed_messages
    s2 = make(store=restored)
    again = await fold(s2, h)
    assert again.compressed_messages == first.compressed_messages
    assert list(restored.entries) == list(s.store.entries)
    assert restored.to_dict()["bloom_b64"] == s.store.to_dict()["bloom_b64"]
    # a store that lost its bloom filter would fold a span it has no entry for: the bloom stops it
    no_entries = CollapseStore.from_dict({**data, "entries": []})
    assert await fold(make(store=no_entries), h) is None


async def test_round_trip_then_new_runs_still_fold() -> None:
    h = chat_history(30, 40)
    s = make()
    await fold(s, h)
    restored = CollapseStore.from_dict(s.store.to_dict())
    longer = h + [*tool_turn(5), *chat(16, 500), user("newest"), assistant("fin")]
    out = (await fold(make(store=restored), longer)).compressed_messages
    notes = [m for m in out if m["role"] == "user" and quoted_text(m).startswith(COLLAPSE_MARKER)]
    assert len(notes) == 2 and len(restored.entries) == 2
    assert_invariants(longer, out)


def test_summary_template() -> None:
    msgs = [user("  please\n\nfix   it " + "x" * 300), calls(call("a", "read_file"), call("b", "bash")),
            tool("a", "12345"), assistant("hello there"), {"role": "system", "content": "note"}]
    lines = collapse_summary(msgs, counter(), 200).split("\n")
    assert lines[0] == "User: " + ("please fix it " + "x" * 300)[:200]
    assert lines[1] == "Called tools: read_file bash"
    assert lines[2] == f"Tool result ({counter().count('12345')} tokens)"
    assert lines[3] == f"Message from assistant ({counter().count('hello there')} tokens)"
    assert lines[4] == f"Message from system ({counter().count('note')} tokens)"


@pytest.mark.parametrize("window", [5, 15])
async def test_real_histories(window: int) -> None:
    folded_any = 0
    for name, h in real_histories():
        before = snapshot(h)
        s = make(window=window)
        result = await fold(s, h, dialect=None)
        assert h == before, name
        if result is None:
            continue
        folded_any += 1
        out = result.compressed_messages
        assert_invariants(h, out)
        gone = [i for i, m in enumerate(h) if m not in out]
        conversation = read_conversation(h)
        assert gone and not any(is_decision_critical(conversation, i) for i in gone), name
        assert s.store.project(h) == out
        again = await fold(make(window=window, store=CollapseStore.from_dict(s.store.to_dict())), h)
        assert again.compressed_messages == out, name
    assert folded_any > 0


async def test_a_repeated_message_does_not_block_a_new_fold() -> None:
    """OpenHands repeats 'Please continue working on the task ...': a run that merely repeats
    a message folded before is still folded."""
    nudge = user("Please continue working on the task.")
    a = [system(), user("task"), *chat(8, 0), nudge, *chat(8, 100), *tool_turn(1)]
    s = make()
    assert await fold(s, a) is not None
    b = a + [*chat(8, 500), nudge, *chat(8, 600), *tool_turn(2), user("newest"), assistant("x")]
    await fold(s, b)
    assert len(s.store.entries) == 2


async def test_errors_stay_visible() -> None:
    """SWE-agent style: observations come in user messages; one that reports a failure is
    decision-critical, with the command it answers, and never folded; talk around it is."""
    run = assistant("Let us run it.\n```\npython a.py\n```")
    old_error = user("Traceback (most recent call last):\n  File 'a.py'\nKeyError: 'x'")
    new_error = user("Traceback (most recent call last):\n  File 'b.py'\nValueError: bad input")
    h = [system(), user("task"), *chat(16, 0), run, old_error, *chat(16, 100), run, new_error, *chat(16, 200),
         user("newest"), assistant("x")]
    out = (await fold(make(), h, dialect="swe_agent_text")).compressed_messages
    assert new_error in out and old_error in out
    assert out.index(old_error) == out.index(run) + 1
    assert sum(quoted_text(m).startswith(COLLAPSE_MARKER) for m in out if is_compaction_note(m)) == 3
    assert_invariants(h, out)
