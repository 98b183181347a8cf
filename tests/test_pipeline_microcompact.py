"""Level 2, Microcompact: per-tool thresholds, head/tail cuts counted with the tokenizer."""
from __future__ import annotations

import re

import pytest

from ctxgate.pipeline.config import MicrocompactConfig
from ctxgate.pipeline.microcompact import SEPARATOR, MicrocompactStrategy, is_microcompacted
from ctxgate.pipeline.tokens import TokenCounter
from ctxgate.pipeline.conversation import read_conversation
from ctxgate.pipeline.turns import newest_user_index, task_index
from ctxgate.pipeline.request import CompressionRequest
from ctxgate.pipeline.types import Level

from pipeline_builders import (NO_WINDOW, CountingEncoder, assert_invariants, assistant, call, calls, counter, filler,
                               real_histories, snapshot, system, tool, user)

SEP_RE = re.compile(r"\n\.\.\. \[middle (\d+) tokens truncated\] \.\.\.\n")
WORD_TOKENS = 6
"""The most tokens one word of `filler` takes: a head or tail cut at a word boundary keeps its
room less at most one word."""


def strategy(effective_budget=None, pin_first_user=True, **cfg) -> MicrocompactStrategy:
    return MicrocompactStrategy(MicrocompactConfig(**cfg), pin_first_user, effective_budget)


async def run(messages, budget=1, **kw):
    return await strategy(**kw).compress(CompressionRequest(messages, budget, counter(), window=NO_WINDOW))


def one_tool(name: str, tokens: int, seed: int = 7) -> list[dict]:
    return [system(), user("task"), calls(call("c1", name, command="x")), tool("c1", filler(tokens, seed)),
            user("newest"), assistant("ok")]


def split_cut(text: str) -> tuple[str, int, str]:
    m = SEP_RE.search(text)
    assert m is not None, text[:200]
    return text[:m.start()], int(m.group(1)), text[m.end():]


@pytest.mark.parametrize("name,expected", [
    ("read_file", 8000), ("view", 8000), ("str_replace_editor", 8000), ("execute_bash", 2000), ("bash", 2000),
    ("fs_read_file", 8000), ("my_bash_tool", 2000), ("run_shell_command", 2000), ("Execute_Bash", 2000),
    ("search_direct_flight", 4000), ("get_user_details", 4000), ("", 4000), (None, 4000)])
def test_thresholds_by_tool_name(name, expected) -> None:
    assert strategy().threshold_for(name) == expected


def test_custom_thresholds_and_budget_scaling() -> None:
    s = strategy(thresholds={"grep": 300}, default_threshold=900)
    assert s.threshold_for("grep") == 300 and s.threshold_for("ripgrep") == 300 and s.threshold_for("bash") == 900
    # the effective budget caps every threshold at 5% of it, but never below min_threshold
    assert strategy(effective_budget=20_000).threshold_for("read_file") == 1000
    assert strategy(effective_budget=20_000).threshold_for("bash") == 1000
    assert strategy(effective_budget=200_000).threshold_for("bash") == 2000
    assert strategy(effective_budget=200_000).threshold_for("read_file") == 8000
    assert strategy(effective_budget=100).threshold_for("read_file") == 64
    assert strategy(effective_budget=10_000, budget_share=0.5).threshold_for("read_file") == 5000


async def test_head_1500_tail_500_and_the_separator() -> None:
    h = one_tool("execute_bash", 5000)
    before = snapshot(h)
    result = await run(h)
    assert h == before, "the caller's list was mutated"
    assert result.level_used is Level.MICROCOMPACT
    out = result.compressed_messages
    original, cut = h[3]["content"], out[3]["content"]
    head, n, tail = split_cut(cut)
    assert n == 5000 - 1500 - 500
    assert f"\n... [middle {n} tokens truncated] ...\n" in cut
    assert head == counter().head(original, 1500) and original.startswith(head)
    assert tail == counter().tail(original, 500) and original.endswith(tail)
    assert counter().count(head) == 1500 and counter().count(tail) == 500
    assert is_microcompacted(cut)
    assert [m for i, m in enumerate(out) if i != 3] == [m for i, m in enumerate(h) if i != 3]
    assert {k: v for k, v in out[3].items() if k != "content"} == {k: v for k, v in h[3].items() if k != "content"}
    step = result.steps[0]
    assert step.span == (3, 4) and step.messages_affected == 1
    assert result.tokens_freed == counter().count_messages(h) - counter().count_messages(out)
    assert result.tokens_freed > 2900


@pytest.mark.parametrize("name,tokens,cut", [
    ("execute_bash", 2000, False), ("execute_bash", 2005, False), ("execute_bash", 2030, True),
    ("read_file", 7000, False),
    ("read_file", 8001, True), ("fs_read_file", 9000, True), ("lookup", 4000, False), ("lookup", 4500, True)])
async def test_threshold_decides(name, tokens, cut) -> None:
    h = one_tool(name, tokens)
    result = await run(h)
    if not cut:
        assert result is None
        return
    head, n, tail = split_cut(result.compressed_messages[3]["content"])
    assert n == tokens - counter().count(head) - counter().count(tail)
    assert 1500 - WORD_TOKENS <= counter().count(head) <= 1500 and 500 - WORD_TOKENS <= counter().count(tail) <= 500


async def test_never_truncated_twice() -> None:
    h = one_tool("execute_bash", 6000)
    first = await run(h)
    again = await run(first.compressed_messages)
    assert again is None
    # even when the cut text is still over a (smaller) threshold
    assert await run(first.compressed_messages, effective_budget=2000) is None
    # a message that already carries the mark is left as it is
    marked = one_tool("execute_bash", 10)
    marked[3] = tool("c1", filler(3000) + "\n... [middle 12 tokens truncated] ...\n" + filler(3000, 9))
    assert await run(marked) is None


async def test_budget_scaled_threshold_keeps_3_to_1_split() -> None:
    h = one_tool("execute_bash", 1200)
    assert await run(h) is None
    result = await run(h, effective_budget=20_000)  # threshold 1000 < 1500 + 500
    cut = result.compressed_messages[3]["content"]
    head, n, tail = split_cut(cut)
    kept = 1000 - counter().count(SEPARATOR.format(n=1200))
    assert kept * 3 // 4 - WORD_TOKENS <= counter().count(head) <= kept * 3 // 4
    assert kept // 4 - WORD_TOKENS <= counter().count(tail) <= kept // 4
    assert n == 1200 - counter().count(head) - counter().count(tail)
    assert counter().count(cut) <= 1000, "the separator counts against a budget-scaled threshold"


async def test_one_steps_results_share_the_budget_cap() -> None:
    """Four parallel reads must not keep four times what one read may."""
    h = [system(), user("task"),
         calls(*(call(f"c{k}", "read_file", path=f"f{k}.py") for k in range(4))),
         *(tool(f"c{k}", filler(900, k)) for k in range(4)),
         user("newest"), assistant("ok")]
    alone = one_tool("read_file", 900)
    assert await run(alone, effective_budget=20_000) is None  # one result: 900 <= the cap of 1000
    out = (await run(h, effective_budget=20_000)).compressed_messages
    for m in out[3:7]:
        assert counter().count(m["content"]) <= 1000 // 4


async def test_every_result_of_a_unit_by_its_own_tool() -> None:
    h = [system(), user("task"),
         calls(call("a", "read_file", path="x.py"), call("b", "execute_bash", command="pytest"), call("c", "other")),
         tool("a", filler(5000, 1)), tool("b", filler(5000, 2)), tool("c", filler(5000, 3)),
         user("newest"), assistant("ok")]
    result = await run(h)
    out = result.compressed_messages
    assert out[3] == h[3], "read_file keeps up to 8000"
    assert split_cut(out[4]["content"])[1] == 3000 and split_cut(out[5]["content"])[1] == 3000
    assert result.steps[0].span == (4, 6) and result.steps[0].messages_affected == 2
    assert_invariants(h, out)


async def test_swe_agent_observations_in_user_messages() -> None:
    big = [filler(6000, k) for k in range(4)]
    h = [system(), user(big[0]), assistant("open file.py"), user(big[1]), assistant("edit 1:2"), user(big[2]),
         assistant("submit"), user(big[3])]
    result = await run(h)
    out = result.compressed_messages
    assert out[1] == h[1], "the task statement is not truncated"
    assert out[7] == h[7], "the newest user message is not truncated"
    for i in (3, 5):
        assert split_cut(out[i]["content"])[1] == 6000 - 2000
    unpinned = await run(h, pin_first_user=False)
    assert unpinned.compressed_messages[1] == h[1], "the task is not tool output, pinned or not"
    assert unpinned.compressed_messages[7] == h[7]


async def test_non_text_content_is_left_alone() -> None:
    h = one_tool("execute_bash", 10)
    h[3] = {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": filler(5000)}]}
    assert await run(h) is None


async def test_compact_range_only_cuts_inside_it() -> None:
    h = [system(), user("task")]
    for i in range(4):
        h += [calls(call(f"c{i}", "bash")), tool(f"c{i}", filler(3000, i))]
    h.append(user("newest"))
    out, changed = strategy().compact_range(CompressionRequest(h, 1, counter(), window=NO_WINDOW), 6, 9)
    assert changed == [7]
    assert out[:6] == h[:6] and out[8:] == h[8:]


async def test_the_recent_window_is_never_cut() -> None:
    """The newest 10 messages and the last two complete steps reach the upstream as they are."""
    h = [system(), user("task")]
    for i in range(8):
        h += [calls(call(f"c{i}", "bash")), tool(f"c{i}", filler(3000, i))]
    h.append(user("newest"))
    result = await strategy().compress(CompressionRequest(h, 1, counter()))
    out = result.compressed_messages
    assert out[-11:] == h[-11:], "the last 10, widened to the step the 10th belongs to"
    assert [i for i, (a, b) in enumerate(zip(h, out)) if a != b] == [3, 5, 7]
    long_steps = [system(), user("task")]
    for i in range(3):
        long_steps += [calls(*[call(f"c{i}{k}", "bash") for k in range(6)]),
                       *[tool(f"c{i}{k}", filler(3000, 10 * i + k)) for k in range(6)]]
    result = await strategy().compress(CompressionRequest(long_steps, 1, counter()))
    assert result.compressed_messages[-14:] == long_steps[-14:], "the last two steps, though over 10 messages"
    assert result.compressed_messages[3] != long_steps[3]


@pytest.mark.parametrize("effective_budget", [None, 20_000, 4_000])
async def test_real_histories(effective_budget) -> None:
    s = strategy(effective_budget=effective_budget)
    c = counter()
    changed_total = 0
    for name, h in real_histories():
        before = snapshot(h)
        result = await s.compress(CompressionRequest(h, 1, c, window=NO_WINDOW))
        assert h == before, name
        if result is None:
            continue
        out = result.compressed_messages
        assert_invariants(h, out)
        assert len(out) == len(h)
        protected = {newest_user_index(h), task_index(h)}
        thresholds = {i: s.threshold_for(tool_name, in_step)
                      for i, tool_name, in_step in s.candidates(read_conversation(h), 0, len(h))}
        for i, (a, b) in enumerate(zip(h, out)):
            if a == b:
                continue
            changed_total += 1
            assert a["role"] in ("tool", "user") and i not in protected, (name, i)
            threshold = thresholds[i]
            tokens = c.count(a["content"])
            assert tokens > threshold
            head, n, tail = split_cut(b["content"])
            kept = threshold - c.count(SEPARATOR.format(n=tokens))
            kept_head, kept_tail = (1500, 500) if threshold >= 2000 else (kept * 3 // 4, kept // 4)
            assert n == tokens - c.count(head) - c.count(tail), (name, i)
            assert a["content"].startswith(head) and a["content"].endswith(tail)
            assert c.count(head) <= kept_head and c.count(tail) <= kept_tail
            assert c.count_structured(b) < c.count_structured(a)
    assert changed_total > 0


async def test_resent_outputs_are_not_tokenized_again() -> None:
    """An agent resends every output each turn: a second call counts them from the cache and
    encodes only the one output it cuts, once for its head and tail together."""
    h = [system(), user("task"), calls(call("c1", "execute_bash", command="x"), call("c2", "execute_bash")),
         tool("c1", filler(5000, 1)), tool("c2", filler(1500, 2)), user("newest"), assistant("ok")]
    enc = CountingEncoder()
    c = TokenCounter("tiktoken:o200k_base(counting)", enc)
    first = await strategy().compress(CompressionRequest(h, 1, c, window=NO_WINDOW))
    enc.tokens = 0
    again = await strategy().compress(CompressionRequest(h, 1, c, window=NO_WINDOW))
    assert again.compressed_messages == first.compressed_messages
    assert enc.tokens <= 5000 + 10
