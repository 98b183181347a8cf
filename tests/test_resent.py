"""A body that resends the last one's bytes has only its tail parsed (proxy/resent.py): what it
parses to must be what the whole body parses to, whatever the client's spacing, key order or
fields after the history; anything else is parsed whole. End to end, a steady turn through
the chat door forwards the client's bytes and counts what a new session counts."""
from __future__ import annotations

import json
import uuid
from typing import Any

import httpx
import orjson
from hypothesis import given, settings, strategies as st

from clients import KEYS, MESSAGES, reference_tokens
from ctxgate.proxy.resent import MIN_BYTES, ResentBodies
from servers import Gateway
from upstream import ScriptedUpstream

KEY = ("acme", "chat", "s1")
PAD = "x" * MIN_BYTES
"""A first message long enough that every body is kept."""
text = st.one_of(st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=30),
                st.text(st.sampled_from('[]{}",:\\ am'), max_size=12))  # JSON's own characters, often
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "tool"]),
                                 "content": st.one_of(text, st.none(), st.lists(st.fixed_dictionaries(
                                     {"type": st.just("text"), "text": text}), max_size=3))},
                                optional={"name": text, "tool_call_id": text})
nested = st.lists(st.dictionaries(st.sampled_from(["a", "type"]), text), max_size=3)
trailing = st.dictionaries(st.sampled_from(["stream", "tools", "user", "temperature", "n"]),
                           st.one_of(st.booleans(), st.integers(-1000, 1000), text, nested), max_size=4)


def _encode(body: dict[str, Any], style: int) -> bytes:
    """The body as different clients write it: orjson, Python's json with spaces, indented."""
    if style == 0:
        return orjson.dumps(body)
    if style == 1:
        return json.dumps(body).encode()
    return json.dumps(body, indent=2, ensure_ascii=False).encode()


def _body(head: dict[str, Any], messages: list[dict[str, Any]], tail: dict[str, Any]) -> dict[str, Any]:
    return {**head, "messages": messages, **tail}


def _bodies(old: list[dict[str, Any]], tail1: dict[str, Any], tail2: dict[str, Any], model_first: bool,
            same_tail: bool) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, Any], dict[str, Any]]:
    """The fields before the history, its first messages and the two bodies' fields after it:
    `model` before the history or after it, the second body's trailing fields the first's or not."""
    head = {"model": "gpt-4o"} if model_first else {}
    first = [{"role": "system", "content": PAD}, *old]
    if not model_first:
        tail1, tail2 = {**tail1, "model": "gpt-4o"}, {**tail2, "model": "gpt-4o"}
    return head, first, tail1, tail1 if same_tail else tail2


@settings(max_examples=200, deadline=None)
@given(st.lists(message, min_size=0, max_size=6), st.lists(message, min_size=0, max_size=4), trailing, trailing,
       st.booleans(), st.integers(0, 2), st.booleans())
def test_a_resent_body_parses_as_the_whole_body(old: list[dict[str, Any]], new: list[dict[str, Any]],
                                                tail1: dict[str, Any], tail2: dict[str, Any], model_first: bool,
                                                style: int, same_tail: bool) -> None:
    head, first, tail1, tail2 = _bodies(old, tail1, tail2, model_first, same_tail)
    resent = ResentBodies()
    raw1 = _encode(_body(head, first, tail1), style)
    parsed1 = orjson.loads(raw1)
    resent.keep(KEY, raw1, parsed1, "messages")
    assert len(resent) == 1
    raw2 = _encode(_body(head, first + new, tail2), style)
    found = resent.parse(KEY, raw2, "messages")
    assert found is not None and resent.hits == 1
    assert found.body == orjson.loads(raw2)
    assert all(m is k for m, k in zip(found.body["messages"], parsed1["messages"]))  # the kept ones themselves
    assert found.body["messages"][:len(first)] == first
    if same_tail:  # the fields after the history resent as they were: the kept objects themselves
        assert found.cut is not None and all(found.body[k] is parsed1[k] for k in tail1)
    # The next turn goes on from this one's tail.
    resent.keep(KEY, raw2, found.body, "messages", found)
    raw3 = _encode(_body(head, first + new + [{"role": "user", "content": "more"}], tail1), style)
    third = resent.parse(KEY, raw3, "messages")
    assert third is not None and third.body == orjson.loads(raw3)
    assert all(m is k for m, k in zip(third.body["messages"], found.body["messages"]))
    if same_tail:
        assert third.cut is not None and all(third.body[k] is parsed1[k] for k in tail1)


heavy = st.lists(st.sampled_from(['},{', '"},{"', ', ', '],[', '\\', '\\"', '{"a":[', ']}', ',', '"', 'x']),
                 max_size=10).map("".join)
"""Strings made of JSON's brackets, commas, quotes and backslashes: what a lexer could take for structure."""
marked = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]), "content": st.lists(
    st.fixed_dictionaries({"type": st.just("text"), "text": st.one_of(text, heavy)},
                          optional={"cache_control": st.just({"type": "ephemeral"}), "z": nested}),
    min_size=1, max_size=4)}, optional={"name": heavy})


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(message, marked), min_size=1, max_size=5), marked, marked,
       st.lists(st.one_of(message, marked), max_size=3), trailing, trailing, st.booleans(), st.integers(0, 3),
       st.booleans())
def test_a_body_whose_last_item_changed_parses_from_the_second_cut_as_the_whole_body(
        old: list[dict[str, Any]], last: dict[str, Any], changed: dict[str, Any], new: list[dict[str, Any]],
        tail1: dict[str, Any], tail2: dict[str, Any], model_first: bool, style: int, same_tail: bool) -> None:
    """The last turn's newest message sent again with other bytes (a breakpoint moved off it, or
    anything else): the body is read from the end of the message before it, and parses exactly
    as the whole body does, whatever the spacing, key order, fields after the history and
    strings full of brackets and commas; the next turn goes on the same way."""
    head, first, tail1, tail2 = _bodies(old, tail1, tail2, model_first, same_tail)
    encode = (lambda b: json.dumps(b, separators=(" ,\n", " :\t")).encode()) if style == 3 else \
        (lambda b: _encode(b, style))
    resent = ResentBodies()
    raw1 = encode(_body(head, [*first, last], tail1))
    parsed1 = orjson.loads(raw1)
    resent.keep(KEY, raw1, parsed1, "messages")
    raw2 = encode(_body(head, [*first, changed, *new], tail2))
    found = resent.parse(KEY, raw2, "messages")
    assert found is not None and found.body == orjson.loads(raw2)
    assert resent.second_hits == (0 if raw2.startswith(raw1[:resent._kept[KEY][0].cut]) else 1)
    assert all(m is k for m, k in zip(found.body["messages"][:len(first)], parsed1["messages"]))
    resent.keep(KEY, raw2, found.body, "messages", found)
    raw3 = encode(_body(head, [*first, changed, *new[:-1], last, {"role": "user", "content": "more"}], tail1))
    third = resent.parse(KEY, raw3, "messages")
    if new or changed == last:  # the message before the changed one is kept: the third is read from a cut
        assert third is not None
    if third is not None:
        assert third.body == orjson.loads(raw3)


def _kept(body: dict[str, Any]) -> tuple[ResentBodies, bytes]:
    resent, raw = ResentBodies(), orjson.dumps(body)
    resent.keep(KEY, raw, orjson.loads(raw), "messages")
    return resent, raw


def test_a_changed_history_or_another_key_is_parsed_whole() -> None:
    """A changed last message is read from the second cut; a change before it, or another key, parses whole."""
    messages = [{"role": "system", "content": PAD}, {"role": "user", "content": "hi"}, {"role": "user", "content": "x"}]
    resent, _ = _kept({"model": "m", "messages": messages})
    changed = orjson.dumps({"model": "m", "messages": [*messages[:2], {"role": "user", "content": "y"}]})
    found = resent.parse(KEY, changed, "messages")
    assert found is not None and found.body == orjson.loads(changed) and resent.second_hits == 1
    earlier = orjson.dumps({"model": "m", "messages": [messages[0], {"role": "user", "content": "ho"}, messages[2]]})
    assert resent.parse(KEY, earlier, "messages") is None
    assert resent.parse(("acme", "chat", "s2"), orjson.dumps({"model": "m", "messages": messages}), "messages") is None


def test_a_tail_that_names_the_history_again_or_a_field_before_it_is_parsed_whole() -> None:
    messages = [{"role": "system", "content": PAD}, {"role": "user", "content": "hi"}]
    resent, raw = _kept({"model": "m", "messages": messages})
    prefix = raw[:-2]  # up to the end of the last message
    again = prefix + b'],"messages":[0,{"role":"user","content":"x"}]}'
    assert orjson.loads(again)["messages"] == [0, {"role": "user", "content": "x"}]
    assert resent.parse(KEY, again, "messages") is None
    model_again = prefix + b'],"model":"other"}'
    assert resent.parse(KEY, model_again, "messages") is None
    escaped = prefix + b'],"mess\\u0061ges":[0,{"role":"user","content":"x"}]}'  # the key spelt otherwise
    assert len(orjson.loads(escaped)["messages"]) == 2
    assert resent.parse(KEY, escaped, "messages") is None
    said = prefix + b',{"role":"user","content":"messages"}]}'  # the word as a string: only an item
    assert (found := resent.parse(KEY, said, "messages")) is not None and found.body == orjson.loads(said)
    broken = prefix + b',{"role":"user","content":"x"}'
    assert resent.parse(KEY, broken, "messages") is None  # the whole parse says where it is broken


def test_what_closes_the_history_before_the_kept_fields_is_no_new_item() -> None:
    """Between a kept prefix and the kept bytes after the history, only items are taken as new
    items: a field named there makes the body's tail parsed as a tail."""
    messages = [{"role": "system", "content": PAD}]
    resent, raw = _kept({"model": "m", "messages": messages, "tools": [{"a": "]}"}]})
    prefix, after = raw[:raw.index(b'],"tools"')], raw[raw.index(b'],"tools"'):]
    for between in (b'],"x":[5', b'],"x":5,"y":[1', b',{"role":"user","content":"]"}'):
        raw2 = prefix + between + after
        found = resent.parse(KEY, raw2, "messages")
        assert found is not None and found.body == orjson.loads(raw2)
        assert (found.cut is not None) == (between[0:1] == b","), between


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from([",", "{", "}", "[", "]", '"', ":", "0", "a", "\\", "null", '"messages"', '"tools"',
                                 ",{}", ",[]", ',"]"', ',{"a":"]}"}']), max_size=8),
       st.sampled_from([{}, {"tools": [{"a": "]}"}]}, {"stream": True, "tools": [[1, [2]]]}]))
def test_whatever_stands_between_the_kept_bytes_is_read_as_the_whole_body_reads_it(tokens: list[str],
                                                                                  tail: dict[str, Any]) -> None:
    """Between a kept prefix and the kept bytes after the history, any bytes: a body taken from
    the kept ones is the whole body's parse, and one that is not JSON is never taken."""
    resent, raw = _kept({"model": "m", "messages": [{"role": "system", "content": PAD}], **tail})
    kept = resent._kept[KEY][0]
    raw2 = kept.raw[:kept.cut] + "".join(tokens).encode() + kept.raw[kept.cut:]
    found = resent.parse(KEY, raw2, "messages")
    if found is not None:
        assert found.body == orjson.loads(raw2)


def test_a_body_repeating_a_field_after_the_history_is_not_kept() -> None:
    """The one way a `]` closing another top-level list could pass for the history's end."""
    messages = [{"role": "system", "content": PAD}]
    raw = orjson.dumps({"messages": messages})[:-1] + b',"tools":[{"a":1}],"tools":[{"b":2}]}'
    resent = ResentBodies()
    resent.keep(KEY, raw, orjson.loads(raw), "messages")
    assert len(resent) == 0
    grown = raw.replace(b'"tools":[{"a":1}]', b'"tools":[{"a":1},{"role":"user","content":"x"}]', 1)
    assert resent.parse(KEY, grown, "messages") is None


def test_a_body_is_kept_as_the_doors_own_bytes_and_replaces_its_conversations_last() -> None:
    """No copy of the body is kept, and the next body of the same conversation (a moved
    breakpoint: only its second cut matches) replaces the last one's entry."""
    resent = ResentBodies()
    messages = [{"role": "system", "content": PAD}, {"role": "user", "content": "a", "mark": 1}]
    raw = orjson.dumps({"messages": messages})
    resent.keep(KEY, raw, orjson.loads(raw), "messages")
    assert resent._kept[KEY][0].raw is raw and resent._bytes == len(raw)
    moved = orjson.dumps({"messages": [messages[0], {"role": "user", "content": "a"},
                                       {"role": "user", "content": "b", "mark": 1}]})
    found = resent.parse(KEY, moved, "messages")
    assert found is not None and resent.second_hits == 1
    resent.keep(KEY, moved, found.body, "messages", found)
    assert len(resent) == 1 and resent._kept[KEY][0].raw is moved and resent._bytes == len(moved)


def test_kept_bodies_are_bounded() -> None:
    resent = ResentBodies(max_bytes=5 * MIN_BYTES, max_entries=100)
    for i in range(20):
        raw = orjson.dumps({"messages": [{"role": "user", "content": f"{i}" + PAD}]})
        resent.keep(("acme", "chat", f"s{i}"), raw, orjson.loads(raw), "messages")
    assert 0 < len(resent) <= 5
    kept = [k for ks in resent._kept.values() for k in ks]
    assert resent._bytes == sum(len(k.raw) for k in kept) <= 5 * MIN_BYTES  # what is held is what is counted
    small = orjson.dumps({"messages": [{"role": "user", "content": "hi"}]})
    resent.keep(("acme", "chat", "small"), small, orjson.loads(small), "messages")
    assert resent.parse(("acme", "chat", "small"), small[:-2] + b',{"role":"user","content":"x"}]}',
                        "messages") is None


# -- end to end ------------------------------------------------------------------------------

def _post(gateway: Gateway, session: str, raw: bytes) -> httpx.Response:
    return httpx.post(f"{gateway.url}/chat/completions", content=raw, timeout=60, headers={
        "Authorization": f"Bearer {KEYS['acme']}", "Content-Type": "application/json", "X-Ctx-Session": session})


def test_a_steady_turn_forwards_the_clients_bytes_and_counts_what_a_new_session_counts(
        gateway: Gateway, up: ScriptedUpstream) -> None:
    session = f"resent-{uuid.uuid4().hex[:8]}"
    messages = [{"role": "system", "content": "You are terse. " + PAD}, *MESSAGES[1:]]
    for turn in range(3):
        messages += [{"role": "assistant", "content": f"answer {turn}"},
                     {"role": "user", "content": f"next {turn} 東京"}]
        raw = json.dumps({"messages": messages, "model": "gpt-4o", "stream": False}, indent=1).encode()
        steady = _post(gateway, session, raw)
        assert steady.status_code == 200, steady.text
        if gateway.name.endswith("auto"):
            assert up.chats()[-1].raw == raw  # unchanged: the client's own bytes
        fresh = _post(gateway, f"fresh-{uuid.uuid4().hex[:8]}", raw)
        assert int(steady.headers["x-ctx-tokens-in"]) == int(fresh.headers["x-ctx-tokens-in"]) \
            == reference_tokens(messages)


def test_a_resent_body_with_a_bad_new_message_or_field_is_refused_as_a_whole_one_is(
        gateway: Gateway, up: ScriptedUpstream) -> None:
    session = f"resent-bad-{uuid.uuid4().hex[:8]}"
    messages = [{"role": "system", "content": "You are terse. " + PAD}, *MESSAGES[1:]]
    raw = orjson.dumps({"model": "gpt-4o", "messages": messages})
    assert _post(gateway, session, raw).status_code == 200
    before = len(up.chats())
    bad = raw[:-2] + b',{"role":"user","content":[{"type":"text","text":5}]}]}'
    refused = _post(gateway, session, bad)
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == f"messages.{len(messages)}.content.0.text"
    deep = raw[:-1] + b',"metadata":' + b"[" * 300 + b"]" * 300 + b"}"
    refused = _post(gateway, session, deep)
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "nesting_too_deep"
    assert len(up.chats()) == before


def test_a_steady_responses_turn_sends_what_a_new_session_sends(gateway: Gateway, up: ScriptedUpstream) -> None:
    """The Responses door keeps its bodies by their `input`: a turn that resends the last one's
    bytes forwards what a session seeing the whole conversation for the first time forwards."""
    session = f"resent-resp-{uuid.uuid4().hex[:8]}"
    items: list[dict[str, Any]] = [{"role": "user", "content": "list files " + PAD}]

    def post(name: str) -> dict[str, Any]:
        raw = orjson.dumps({"input": items, "model": "gpt-4o", "instructions": "be brief", "store": False})
        r = httpx.post(f"{gateway.url}/responses", content=raw, timeout=60, headers={
            "Authorization": f"Bearer {KEYS['acme']}", "Content-Type": "application/json", "X-Ctx-Session": name})
        assert r.status_code == 200, r.text
        sent = [e.body for e in up.log if e.door == "responses"]
        return {"tokens": r.headers["x-ctx-tokens-in"], "input": sent[-1]["input"] if sent else None}

    for turn in range(3):
        steady, fresh = post(session), post(f"fresh-{uuid.uuid4().hex[:8]}")
        assert steady == fresh
        items = [*items, {"type": "function_call", "call_id": f"c{turn}", "name": "shell", "arguments": "{}"},
                 {"type": "function_call_output", "call_id": f"c{turn}", "output": "a.py"},
                 {"role": "user", "content": f"next {turn}"}]
