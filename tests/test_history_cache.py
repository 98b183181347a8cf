"""A steady turn pays only for what is new: the per-message facts of a session's last
request are extended rather than recomputed (pipeline/history_index.py), the door checks
only the new messages (proxy/engine/history.py). What the client sees must not depend on
whether the cache knew the history: the same counts, the same refusals, at the right index."""
from __future__ import annotations

import random
import uuid
from typing import Any

import openai
import pytest

from clients import MESSAGES, client, reference_tokens
from ctxgate.pipeline.fingerprint import message_fingerprint, prefix_hashes
from ctxgate.pipeline.history_index import HistoryIndex
from ctxgate.pipeline.tokens import TokenizerRegistry
from ctxgate.proxy.engine.history import HistoryCache
from servers import Gateway
from upstream import ScriptedUpstream

COUNTER = TokenizerRegistry().for_model("gpt-4o")


def _history(n: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    out: list[dict[str, Any]] = [{"role": "system", "content": "You are terse."}]
    for i in range(n):
        role = "user" if i % 2 == 0 else "assistant"
        out.append({"role": role, "content": " ".join(rng.choice(["alpha", "beta", "gamma", "δ", "🚀", "x" * 9])
                                                      for _ in range(rng.randrange(1, 30)))})
    return out


# -- the index, as a unit -----------------------------------------------------------------

@pytest.mark.parametrize("seed", range(5))
def test_an_extended_index_is_the_index_built_from_scratch(seed: int) -> None:
    messages = _history(40, seed)
    index = HistoryIndex.build(messages[:1], COUNTER)
    for n in range(2, len(messages) + 1, 3):
        index = index.extend(messages[:n], len(index), COUNTER)
        fresh = HistoryIndex.build(messages[:n], COUNTER)
        assert index == fresh
        assert index.fingerprints == [message_fingerprint(m) for m in messages[:n]]
        assert index.prefix_hashes == prefix_hashes(index.fingerprints)
        assert index.tokens() == COUNTER.count_messages(messages[:n])
        assert index.tokens(n // 2) == COUNTER.count_messages(messages[n // 2:n])


def test_an_index_in_another_tokenizer_is_rebuilt_not_reused() -> None:
    messages = _history(10, 1)
    other = TokenizerRegistry().counter("estimate")
    index = HistoryIndex.build(messages, other).extend(messages + [{"role": "user", "content": "more"}], 11, COUNTER)
    assert index == HistoryIndex.build(messages + [{"role": "user", "content": "more"}], COUNTER)


def _bodies() -> list[dict[str, Any]]:
    """Chat bodies with what costs most per byte: short strings, many messages, tool calls,
    images, non-ASCII text, a tools schema."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    return [
        {"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}]},
        {"model": "gpt-4o", "messages": [{"role": "user", "content": ""}] * 50},
        {"model": "gpt-4o", "messages": [{"role": "assistant", "content": None, "tool_calls": [call] * 20},
                                         *({"role": "tool", "tool_call_id": "c1", "content": "1"} for _ in range(20))]},
        {"model": "gpt-4o", "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "x"}}, {"type": "text", "text": "a"}] * 10}]},
        {"model": "gpt-4o", "messages": [{"role": "user", "content": "東京 🚀 naïve " * 400, "name": "n"}],
         "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}] * 5},
        *({"model": "gpt-4o", "messages": _history(60, seed)} for seed in range(3)),
    ]


@pytest.mark.parametrize("counter_name", ["tiktoken:o200k_base", "tiktoken:cl100k_base", "estimate"])
def test_the_json_bound_is_at_least_the_count(counter_name: str) -> None:
    import orjson

    from ctxgate.pipeline.tokens import holds_parts, json_bound

    counter = TokenizerRegistry().counter(counter_name)
    assert counter.byte_bounded
    for body in _bodies():
        raw = orjson.dumps(body)
        # As the chat door bounds it: the scan for images only when a message holds parts.
        bound = json_bound(raw, holds_parts(body["messages"]))
        assert counter.count_request(body["messages"], body.get("tools")) <= bound, body["messages"][:2]


def test_the_json_bound_holds_for_recorded_runs() -> None:
    import orjson

    from ctxgate.pipeline.tokens import holds_parts, json_bound
    from trajectories import every_dialect

    for t in every_dialect():
        raw = orjson.dumps({"model": "gpt-4o", "messages": t.messages, "tools": t.tools})
        assert COUNTER.count_request(t.messages, t.tools) <= json_bound(raw, holds_parts(t.messages)), t.name


# -- the cache, as a unit -----------------------------------------------------------------

def test_the_cache_knows_a_grown_history_a_retry_and_nothing_else() -> None:
    cache = HistoryCache()
    messages = _history(6, 2)
    index = HistoryIndex.build(messages, COUNTER)
    cache.remember("t", "s", messages, index, 100)
    messages.append({"role": "user", "content": "appended to the caller's list after"})
    grown = [*messages[:7], {"role": "assistant", "content": "ok"}]
    assert cache.match("t", "s", grown).length == 7
    assert cache.match("t", "s", messages[:4]).length == 4  # a retry of an earlier turn
    edited = [dict(messages[0], content="rewritten"), *messages[1:7]]
    assert cache.match("t", "s", edited).length == 0
    assert cache.match("t", "other", grown).length == 0
    assert cache.match("other", "s", grown).length == 0


def test_the_cache_is_bounded_by_bytes_and_sessions_oldest_first() -> None:
    from ctxgate.proxy.engine.history import ENTRY_OVERHEAD

    cache = HistoryCache(max_bytes=2 * (100 + ENTRY_OVERHEAD) + 50)
    index = HistoryIndex.build([], COUNTER)
    for i in range(4):
        cache.remember("t", f"s{i}", [], index, 100)
    assert len(cache) == 2
    assert cache.match("t", "s0", []).length == 0 and cache.match("t", "s0", []).index is None
    assert cache.match("t", "s3", []).index is index
    cache.remember("t", "huge", [], index, 10_000)  # over the whole bound: not kept
    assert cache.match("t", "huge", []).index is None
    few = HistoryCache(max_sessions=3)
    for i in range(5):
        few.remember("t", f"s{i}", [], index, 1)
    assert len(few) == 3 and few.match("t", "s1", []).index is None and few.match("t", "s4", []).index is index


# -- through the gateway ------------------------------------------------------------------

def _tokens_in(gw: Gateway, session: str, messages: list[dict[str, Any]]) -> int:
    raw = client(gw).chat.completions.with_raw_response.create(model="gpt-4o", messages=messages,
                                                               extra_headers={"X-Ctx-Session": session})
    raw.parse()
    return int(raw.headers["x-ctx-tokens-in"])


def test_a_steady_session_counts_what_a_new_one_counts(gateway: Gateway, up: ScriptedUpstream) -> None:
    session = f"steady-{uuid.uuid4().hex[:8]}"
    messages = list(MESSAGES)
    for turn in range(4):
        messages += [{"role": "assistant", "content": f"answer {turn}"},
                     {"role": "user", "content": f"next {turn} 東京"}]
        steady = _tokens_in(gateway, session, messages)
        fresh = _tokens_in(gateway, f"fresh-{uuid.uuid4().hex[:8]}", messages)
        assert steady == fresh == reference_tokens(messages)


def test_a_bad_new_message_in_a_known_history_is_refused_at_its_index(gateway: Gateway, up: ScriptedUpstream) -> None:
    session = f"bad-new-{uuid.uuid4().hex[:8]}"
    messages = list(MESSAGES)
    _tokens_in(gateway, session, messages)
    before = len(up.chats())
    bad = [*messages, {"role": "assistant", "content": "ok"},
           {"role": "user", "content": [{"type": "text", "text": 5}]}]
    with pytest.raises(openai.BadRequestError) as e:
        _tokens_in(gateway, session, bad)
    where = f"messages.{len(messages) + 1}.content.0.text"
    assert e.value.body["param"] == where, e.value.body
    bad_role = [*messages, {"role": "wizard", "content": "hi"}]
    with pytest.raises(openai.BadRequestError) as e:
        _tokens_in(gateway, session, bad_role)
    assert e.value.body["param"] == f"messages.{len(messages)}.role", e.value.body
    assert len(up.chats()) == before  # nothing forwarded


def test_a_rewritten_old_message_is_checked_again(gateway: Gateway, up: ScriptedUpstream) -> None:
    session = f"rewrite-{uuid.uuid4().hex[:8]}"
    messages = list(MESSAGES)
    _tokens_in(gateway, session, messages)
    rewritten = [messages[0], {"role": "user", "content": None}, *messages[2:], {"role": "user", "content": "go"}]
    with pytest.raises(openai.BadRequestError) as e:
        _tokens_in(gateway, session, rewritten)
    assert e.value.body["param"] == "messages.1.content", e.value.body


# -- a large new conversation, counted beside its upstream call ------------------------------

def _large_conversation(tag: str) -> list[dict[str, Any]]:
    """~30 KB of JSON (over the inline bound), ~7K tokens (far below gpt-4o's trigger)."""
    return [{"role": "system", "content": f"{tag}: you are a careful engineer."},
            *({"role": "user" if i % 2 == 0 else "assistant",
               "content": f"step {i}: " + "the parser reads each token and checks its span. " * 60}
              for i in range(11))]


def _wal_events(gw: Gateway, session: str) -> list[dict[str, Any]]:
    from ctxgate.wal.paths import WalPaths
    from ctxgate.wal.reader import scan_file

    assert gw.data_dir is not None
    return scan_file(WalPaths(gw.data_dir).live("acme", session)).events


def test_a_large_new_conversation_is_logged_and_counted_before_its_reply(gateway: Gateway,
                                                                         up: ScriptedUpstream) -> None:
    session = f"late-{uuid.uuid4().hex[:8]}"
    messages = _large_conversation(session)
    raw = client(gateway).chat.completions.with_raw_response.create(model="gpt-4o", messages=messages,
                                                                    extra_headers={"X-Ctx-Session": session})
    raw.parse()
    expected = reference_tokens(messages)
    assert int(raw.headers["x-ctx-tokens-in"]) == expected
    assert int(raw.headers["x-ctx-tokens-out"]) == expected
    events = _wal_events(gateway, session)
    kinds = [e["type"] for e in events]
    assert kinds.count("USER_INPUT") == 6 and kinds.index("RESPONSE") > max(
        i for i, k in enumerate(kinds) if k == "USER_INPUT")  # the request is logged before its reply
    reply = next(e for e in events if e["type"] == "RESPONSE")
    assert reply["tokens_in"] == reply["tokens_out"] == expected
    # The next turn extends what the late count left: the same figures as a session that counted it all.
    grown = [*messages, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "next"}]
    assert _tokens_in(gateway, session, grown) == reference_tokens(grown)


def test_a_large_new_streamed_conversation_logs_its_count(gateway: Gateway, up: ScriptedUpstream) -> None:
    session = f"late-stream-{uuid.uuid4().hex[:8]}"
    messages = _large_conversation(session)
    stream = client(gateway).chat.completions.create(model="gpt-4o", messages=messages, stream=True,
                                                     extra_headers={"X-Ctx-Session": session})
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    reply = next(e for e in _wal_events(gateway, session) if e["type"] == "RESPONSE")
    assert reply["tokens_in"] == reference_tokens(messages)


def test_a_large_new_conversation_the_upstream_fails_is_still_logged(gateway: Gateway, up: ScriptedUpstream) -> None:
    session = f"late-failed-{uuid.uuid4().hex[:8]}"
    messages = _large_conversation(session)
    with pytest.raises(openai.APIStatusError):
        client(gateway).with_options(max_retries=0).chat.completions.create(
            model="error-500", messages=messages, extra_headers={"X-Ctx-Session": session})
    from servers import wait_until

    events = wait_until(lambda: _wal_events(gateway, session), what="the failed turn's log")
    assert [e["type"] for e in events].count("USER_INPUT") == 6
    assert not any(e["type"] == "RESPONSE" for e in events)

