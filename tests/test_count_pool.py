"""A large new conversation counted on worker processes (proxy/engine/count_pool.py): the counts
are exactly one thread's, through `ctxgate serve` (X-Ctx-Tokens-In, the WAL) and on the pool
alone; a worker killed is replaced and its count done in a thread meanwhile; the workers end with
the server. The workers start at the first count they would take, which a thread does."""
from __future__ import annotations

import asyncio
import os
import re
import signal
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest

from ctxgate.pipeline.history_index import HistoryIndex
from ctxgate.pipeline.tokens import REPLY_PRIMING, TokenizerRegistry
from ctxgate.proxy.engine.count_pool import POOL_CHARACTERS, CountPool, _balanced
from servers import METRICS_HEADERS, Gateway, main_config, start_gateways, wait_until
from test_count_beside_upstream import COUNTER, conversation, last_turn, logged, send
from upstream import ScriptedUpstream

SPEC = "tiktoken:o200k_base"


def large(tag: str) -> list[dict[str, Any]]:
    """A new conversation of ~130K characters, past POOL_CHARACTERS."""
    messages = conversation(tag, steps=48)
    assert sum(len(str(m.get("content") or "")) for m in messages) > POOL_CHARACTERS
    return messages


def shapes(tag: str) -> list[dict[str, Any]]:
    """Every kind of message a count reads: content parts, images, names, calls, a legacy call,
    a Responses reasoning item, Anthropic tool blocks, empty content, a door's own fields."""
    out = large(tag)
    out += [
        {"role": "user", "name": "ana", "content": [{"type": "text", "text": f"{tag} look"},
                                                    {"type": "image_url", "image_url": {"url": "data:,x"}}]},
        {"role": "assistant", "content": "", "function_call": {"name": "grep", "arguments": '{"q": "x"}'},
         "items": [{"type": "reasoning", "summary": [{"type": "summary_text", "text": f"{tag} think"}]}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [{"type": "text",
                                                                                            "text": "ok"}]},
                                     {"type": "tool_use", "id": "u", "name": "ls", "input": {"path": "/"}},
                                     {"type": "other", "data": [1, 2]}]},
        {"role": "assistant", "content": None},
        # A door's own key (the Gemini door's original turn: not counted, not sent to a worker)
        # and a string under a key no other message has (counted, so sent).
        {"role": "user", "content": f"{tag} go", "gemini": [{"text": f"{tag} go"}], "origin": f"{tag} aside"},
    ]
    return out


def metric(gw: Gateway, name: str) -> float:
    status, text = gw.get("/metrics", METRICS_HEADERS)
    assert status == 200
    found = re.search(rf"^{name} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def started(gw: Gateway) -> None:
    """The gateway's count workers started (by a first large count, in a thread) and ready."""
    if metric(gw, "ctxgate_count_workers_idle") < 1:
        messages = large(uuid.uuid4().hex)
        got = send(gw, messages, f"start-{uuid.uuid4().hex}", False)
        assert int(got["x-ctx-tokens-in"]) == COUNTER.count_messages(messages)
    wait_until(lambda: metric(gw, "ctxgate_count_workers_idle") >= 1, 60, "a count worker ready")


def workers_of(gw: Gateway) -> list[int]:
    """The pids of the gateway's count workers (its children running count_pool)."""
    children = Path(f"/proc/{gw.proc.pid}/task/{gw.proc.pid}/children").read_text().split()
    out = []
    for pid in children:
        try:
            if b"count_pool" in Path(f"/proc/{pid}/cmdline").read_bytes():
                out.append(int(pid))
        except FileNotFoundError:
            continue
    return out


def alive(pid: int) -> bool:
    try:
        return "Z" not in Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return False


def test_cuts_are_contiguous_runs_of_about_equal_text() -> None:
    assert _balanced([5, 5, 5, 5], 2) == [0, 2, 4]
    assert _balanced([100, 1, 1, 1], 2) == [0, 1, 4]
    assert _balanced([7], 3) == [0, 1]  # never an empty run
    assert _balanced([1, 1, 1, 1, 1, 1], 3) == [0, 2, 4, 6]


def test_the_pool_counts_every_kind_of_message_as_one_thread_does() -> None:
    messages = shapes(uuid.uuid4().hex)
    expected = HistoryIndex.build(messages, TokenizerRegistry().counter(SPEC)).cumulative_tokens
    registry = TokenizerRegistry()
    counter = registry.counter(SPEC)
    counter.count_structured(messages[0])  # one count kept already: not sent to a worker
    used: list[int] = []
    first = large(uuid.uuid4().hex)

    async def run() -> tuple[list[int], list[int]]:
        pool = CountPool(size=2, on_workers=lambda: used.append(1))
        pool.enable(registry.loaded())
        try:
            index = HistoryIndex.build([], counter).extend(first, 0, counter, count=False)
            in_thread = (await pool.counted(index, first, counter)).cumulative_tokens  # and the workers start
            assert used == []
            deadline = asyncio.get_running_loop().time() + 60
            while pool.ready < 2 and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.05)
            assert pool.ready == 2
            index = HistoryIndex.build([], counter).extend(messages, 0, counter, count=False)
            counted = await pool.counted(index, messages, counter)
            assert pool.ready == 2  # both back, idle
            return in_thread, counted.cumulative_tokens
        finally:
            await pool.close()

    in_thread, on_workers = asyncio.run(run())
    assert on_workers == expected
    assert in_thread[-1] + REPLY_PRIMING == COUNTER.count_messages(first)
    assert used == [1]
    # Each message's count is kept, as a thread's count keeps it.
    assert [counter.cached(fp) for fp in HistoryIndex.build([], counter).extend(messages, 0, counter, count=False)
            .fingerprints] == [b - a for a, b in zip(expected, expected[1:])]


def test_a_count_sent_ahead_of_the_fingerprints_is_the_same_count_and_kept() -> None:
    """`ahead`: the workers count a new conversation before its fingerprints are taken; the
    index they then go into, and the counts kept by fingerprint, are a thread's."""
    messages = shapes(uuid.uuid4().hex)
    expected = HistoryIndex.build(messages, TokenizerRegistry().counter(SPEC)).cumulative_tokens
    registry = TokenizerRegistry()
    counter = registry.counter(SPEC)

    async def run() -> tuple[bool, list[int]]:
        pool = CountPool(size=2)
        pool.enable(registry.loaded())
        try:
            none_idle = pool.ahead(messages, counter) is None  # the first starts the workers
            deadline = asyncio.get_running_loop().time() + 60
            while pool.ready < 2 and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.05)
            ahead = pool.ahead(messages, counter)
            assert ahead is not None and pool.ready == 0  # sent: both workers count it
            index = HistoryIndex.build([], counter).extend(messages, 0, counter, count=False)
            counted = await pool.counted(index, messages, counter, ahead)
            assert pool.ready == 2
            return none_idle, counted.cumulative_tokens
        finally:
            await pool.close()

    none_idle, counted = asyncio.run(run())
    assert none_idle and counted == expected
    fingerprints = HistoryIndex.build([], counter).extend(messages, 0, counter, count=False).fingerprints
    assert [counter.cached(fp) for fp in fingerprints] == [b - a for a, b in zip(expected, expected[1:])]


def test_with_no_worker_started_the_count_is_a_threads() -> None:
    messages = large(uuid.uuid4().hex)
    counter = TokenizerRegistry().counter(SPEC)
    used: list[int] = []

    async def run() -> int:
        pool = CountPool(size=2, on_workers=lambda: used.append(1))  # never started
        index = HistoryIndex.build([], counter).extend(messages, 0, counter, count=False)
        return (await pool.counted(index, messages, counter)).tokens()

    assert asyncio.run(run()) == COUNTER.count_messages(messages)
    assert used == []


@pytest.fixture(scope="module")
def pooled(upstream: ScriptedUpstream, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """`ctxgate serve` with two count workers (`auto`: one per core, which may be one)."""
    gw = start_gateways({"pooled": (tmp_path_factory.mktemp("pooled"),
                                    main_config(upstream.url, "auto", count_workers=2))})["pooled"]
    yield gw
    gw.stop()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_serve_counts_a_large_new_conversation_on_its_workers_exactly(pooled: Gateway, up: ScriptedUpstream,
                                                                       stream: bool) -> None:
    gateway = pooled
    started(gateway)
    messages = large(uuid.uuid4().hex)
    before = metric(gateway, "ctxgate_counts_on_workers_total")
    session = f"pool-{uuid.uuid4().hex}"
    # A budget far over the conversation: forwarded first, counted beside the upstream call.
    got = send(gateway, messages, session, stream, {"X-Ctx-Budget": "1000000"})
    assert metric(gateway, "ctxgate_counts_on_workers_total") == before + 1
    exact = COUNTER.count_messages(messages)
    assert int(got["x-ctx-tokens-in"]) == int(got["x-ctx-tokens-out"]) == exact
    _, response = last_turn(logged(gateway, session))
    assert (response["tokens_in"], response["tokens_out"]) == (exact, exact)


def test_a_killed_worker_is_replaced_and_the_workers_end_with_the_server(up: ScriptedUpstream,
                                                                         tmp_path: Path) -> None:
    gw = start_gateways({"pool": (tmp_path / "pool", main_config(up.url, "auto", count_workers=2))})["pool"]
    replaced: list[int] = []
    try:
        started(gw)
        first = workers_of(gw)
        assert first
        for pid in first:
            os.kill(pid, signal.SIGKILL)
        wait_until(lambda: not any(alive(pid) for pid in first), 30, "the workers gone")
        before = metric(gw, "ctxgate_counts_on_workers_total")
        messages = large(uuid.uuid4().hex)
        got = send(gw, messages, f"killed-{uuid.uuid4().hex}", False)
        assert int(got["x-ctx-tokens-in"]) == COUNTER.count_messages(messages)  # counted in a thread
        assert metric(gw, "ctxgate_counts_on_workers_total") == before

        wait_until(lambda: metric(gw, "ctxgate_count_workers_idle") >= 1, 60, "a worker started again")
        again = large(uuid.uuid4().hex)
        got = send(gw, again, f"replaced-{uuid.uuid4().hex}", True)
        assert int(got["x-ctx-tokens-in"]) == COUNTER.count_messages(again)
        assert metric(gw, "ctxgate_counts_on_workers_total") == before + 1
        replaced = workers_of(gw)
        assert replaced and not set(replaced) & set(first)
    finally:
        gw.stop()
    assert not any(alive(pid) for pid in replaced)


def test_with_no_count_workers_a_large_conversation_is_counted_in_a_thread(up: ScriptedUpstream,
                                                                          tmp_path: Path) -> None:
    gw = start_gateways({"none": (tmp_path / "none", main_config(up.url, "auto", count_workers=0))})["none"]
    try:
        for stream in (False, True):
            messages = large(uuid.uuid4().hex)
            got = send(gw, messages, f"none-{uuid.uuid4().hex}", stream)
            assert int(got["x-ctx-tokens-in"]) == COUNTER.count_messages(messages)
        assert metric(gw, "ctxgate_counts_on_workers_total") == 0
        assert metric(gw, "ctxgate_count_workers_idle") == 0 and workers_of(gw) == []
    finally:
        gw.stop()
