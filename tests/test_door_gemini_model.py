"""The Gemini door's reading and rendering rules on their own: what compaction leaves is
rendered back as the Gemini API accepts it, and what it left alone goes back as sent."""
from __future__ import annotations

import copy
import json
from typing import Any

import orjson
import pytest
from hypothesis import given, settings, strategies as st

from ctxgate.pipeline.notes import NOTICE, SNIP, context_note, notice_message
from ctxgate.pipeline.tokens import TokenizerRegistry
from ctxgate.proxy.doors.gemini_chat import chat_body, chat_fields, chat_json, chat_tools
from ctxgate.proxy.upstream.pieces import JOINED_BELOW, Pieces
from ctxgate.proxy.doors.gemini_replies import GeminiStream
from ctxgate.proxy.doors.gemini_model import conversation_of, count_bound, known_turns, read_contents
from ctxgate.proxy.doors.gemini_render import COMPACTED_OPENING, CONTEXT_ACK, render
from ctxgate.proxy.doors.nesting import shallow
from ctxgate.proxy.doors.validation import MAX_NESTING, check_nesting
from ctxgate.proxy.errors import GatewayError


def _step(i: int, signed: bool = False) -> list[dict[str, Any]]:
    call: dict[str, Any] = {"functionCall": {"name": "run_shell_command", "args": {"command": f"ls {i}"}}}
    if signed:
        call["thoughtSignature"] = f"sig{i}"
    return [{"role": "model", "parts": [{"text": f"step {i}", "thought": True}, {"text": f"Step {i}."}, call]},
            {"role": "user", "parts": [{"functionResponse": {"name": "run_shell_command",
                                                             "response": {"output": f"out {i}"}}}]}]


def _body(steps: int = 6, signed: bool = True) -> dict[str, Any]:
    contents: list[dict[str, Any]] = [{"role": "user", "parts": [{"text": "the task"}]}]
    for i in range(steps):
        contents += _step(i, signed)
    return {"systemInstruction": {"parts": [{"text": "You are an agent."}]}, "contents": contents}


def _check_valid(contents: list[dict[str, Any]]) -> None:
    assert contents[0]["role"] == "user"
    assert all(a["role"] != b["role"] for a, b in zip(contents, contents[1:]))
    for i, turn in enumerate(contents):
        calls = [p["functionCall"]["name"] for p in turn["parts"] if "functionCall" in p]
        answers = [p["functionResponse"]["name"] for p in turn["parts"] if "functionResponse" in p]
        if answers:
            before = contents[i - 1]["parts"]
            assert sorted(answers) == sorted(p["functionCall"]["name"] for p in before if "functionCall" in p)
        if calls and i + 1 < len(contents):
            after = contents[i + 1]["parts"]
            assert sorted(calls) == sorted(p["functionResponse"]["name"] for p in after if "functionResponse" in p)


def test_reading_the_conversation() -> None:
    body = _body(2)
    neutral = conversation_of(body)
    assert [m["role"] for m in neutral] == ["system", "user", "assistant", "tool", "assistant", "tool"]
    assert neutral[2]["content"] == "Step 0." and neutral[2]["tool_calls"][0]["id"] == "gc1_0"  # thoughts left out
    assert neutral[3]["tool_call_id"] == "gc1_0" and neutral[3]["content"] == "out 0"


def test_an_untouched_conversation_goes_back_as_sent() -> None:
    body = _body()
    neutral = conversation_of(body)
    system, contents = render(body, list(neutral))
    assert system is body["systemInstruction"] and contents == body["contents"]
    assert all(a is b for a, b in zip(contents[1::2], body["contents"][1::2]))  # the model turns, the same objects


def test_a_compacted_conversation_stays_valid_and_keeps_signed_turns_byte_for_byte() -> None:
    body = _body(8)
    original = copy.deepcopy(body)
    neutral = conversation_of(body)
    # What the pipeline makes of it: the notice at system level, the first steps cut for a note.
    note = context_note(SNIP, "compaction: snip", "[ctxgate: context snipped] 6 messages")
    compacted = [neutral[0], notice_message(), neutral[1], note, *neutral[8:]]
    system, contents = render(body, compacted)
    assert body == original  # the client's body is never changed
    assert system == {"parts": [{"text": "You are an agent."}, {"text": NOTICE}]}
    _check_valid(contents)
    assert contents[0]["parts"][0] == {"text": "the task"} and "snipped" in contents[0]["parts"][1]["text"]
    kept = [t for t in contents if t["role"] == "model"]
    assert kept and all(any(t is c for c in body["contents"]) for t in kept)


def test_an_edited_signed_turn_goes_whole_with_its_answer() -> None:
    body = _body(3)
    neutral = conversation_of(body)
    edited = [*neutral[:4], {**neutral[4], "content": "shortened"}, *neutral[5:]]
    system, contents = render(body, edited)
    _check_valid(contents)
    assert orjson.dumps(contents).count(b"sig1") == 0  # dropped, not re-signed
    assert all(any(t is c for c in body["contents"]) for t in contents if t["role"] == "model")
    assert {"text": "[tool result run_shell_command]\nout 1"} in contents[2]["parts"]  # its answer made text


def test_an_unsigned_turn_is_edited_and_a_shortened_result_keeps_its_call() -> None:
    body = _body(3, signed=False)
    neutral = conversation_of(body)
    edited = [*neutral[:4], {**neutral[4], "content": "shortened"}, {**neutral[5], "content": "[output cleared]"},
              *neutral[6:]]
    _, contents = render(body, edited)
    _check_valid(contents)
    assert contents[3]["parts"][0] == {"text": "shortened"} and "functionCall" in contents[3]["parts"][1]
    assert contents[4]["parts"][0]["functionResponse"] == {"name": "run_shell_command",
                                                           "response": {"output": "[output cleared]"}}


def test_a_note_before_the_newest_turn_is_not_merged_into_it() -> None:
    body = {"contents": [{"role": "user", "parts": [{"text": "first"}]}, {"role": "model", "parts": [{"text": "a"}]},
                         {"role": "user", "parts": [{"text": "newest"}]}]}
    neutral = conversation_of(body)
    note = context_note(SNIP, "memory", "remembered")
    _, contents = render(body, [note, *neutral[2:]])
    assert [t["role"] for t in contents] == ["user", "model", "user"]
    assert contents[1]["parts"] == [{"text": CONTEXT_ACK}] and contents[2] is body["contents"][2]


def test_a_conversation_cut_to_a_model_turn_opens_with_the_user() -> None:
    body = _body(2, signed=False)
    neutral = conversation_of(body)
    _, contents = render(body, [neutral[0], *neutral[4:]])
    _check_valid(contents)
    assert contents[0]["parts"] == [{"text": COMPACTED_OPENING}]


def test_the_chat_body_a_route_is_sent() -> None:
    body = {**_body(1), "tools": [{"functionDeclarations": [{"name": "f", "parameters": {
        "type": "OBJECT", "properties": {"x": {"type": "STRING"}}}}]}],
        "toolConfig": {"functionCallingConfig": {"mode": "ANY"}},
        "generationConfig": {"temperature": 0.1, "maxOutputTokens": 9, "stopSequences": ["z"],
                             "thinkingConfig": {"thinkingBudget": 0}}}
    chat = chat_body(body, "m", stream=True)
    assert chat["tools"] == [{"type": "function", "function": {"name": "f", "description": "", "parameters": {
        "type": "object", "properties": {"x": {"type": "string"}}}}}]
    assert chat["tool_choice"] == "required" and chat["stream_options"] == {"include_usage": True}
    assert (chat["temperature"], chat["max_tokens"], chat["stop"]) == (0.1, 9, ["z"])
    assert chat["messages"][2] == {"role": "assistant", "content": "Step 0.", "tool_calls": [
        {"id": "gc1_0", "type": "function",
         "function": {"name": "run_shell_command", "arguments": '{"command":"ls 0"}'}}]}


def _reads_alike(body: dict[str, Any], last: Any) -> Any:
    """`body` read on from `last` (as a steady turn is) reads as `body` read afresh."""
    known = known_turns(last, body["contents"])
    read = read_contents(body, last, known)
    assert read.messages == conversation_of(copy.deepcopy(body))
    assert read.contents == body["contents"]
    return read, known


def test_a_next_turn_is_read_on_from_the_last_and_reads_as_afresh() -> None:
    """A steady turn reuses the messages of the turns the session's last request had; a new
    response answers the call of the last known model turn by that call's id."""
    body = _body(3, signed=False)
    first = read_contents(body)
    body = copy.deepcopy(body)
    body["contents"] = body["contents"][:-1]  # ends on a model turn with a call
    second, known = _reads_alike(body, first)
    assert known == 0  # a retry of an earlier turn is no continuation
    body = copy.deepcopy(_body(5, signed=False))
    third, known = _reads_alike(body, first)
    assert known == len(first.contents) and all(a is b for a, b in zip(third.messages, first.messages))
    del body["contents"][-1]
    fourth, _ = _reads_alike(body, read_contents({**body, "contents": body["contents"][:-2]}))
    assert fourth.messages[-1]["role"] == "assistant"
    body["contents"].append({"role": "user", "parts": [{"functionResponse": {"name": "run_shell_command",
                                                                            "response": {"output": "late"}}}]})
    fifth, known = _reads_alike(body, fourth)
    assert known and fifth.messages[-1]["tool_call_id"] == fifth.messages[-2]["tool_calls"][0]["id"]


def test_a_steady_turn_keeps_the_workspace_root_its_first_turns_name() -> None:
    """The workspace root (memory's project) is looked for once in a conversation's first
    messages, and kept by the next turn only when those were all the last request's: a
    conversation too short to hold them is looked at again."""
    def user(text: str) -> dict[str, Any]:
        return {"role": "user", "parts": [{"text": text}]}

    def model(text: str) -> dict[str, Any]:
        return {"role": "model", "parts": [{"text": text}]}

    short = {"contents": [user("hi"), model("hello")]}
    first = read_contents(short)
    assert first.workspace_root(first.messages) is None and first.rooted
    grown = {"contents": [*short["contents"], user("now see /workspace/shop/README"), model("ok")]}
    second = read_contents(grown, first, known_turns(first, grown["contents"]))
    assert second.known == 2 and second.workspace_root(second.messages) == "/workspace/shop"
    longer = {"contents": [*grown["contents"], user("and /workspace/other"), model("ok")]}
    third = read_contents(longer, second, known_turns(second, longer["contents"]))
    assert third.known == 4 and third.rooted and third.workspace_root(third.messages) == "/workspace/shop"
    assert read_contents(longer).workspace_root(third.messages) == "/workspace/shop"  # as found afresh


def test_an_edited_history_is_read_afresh() -> None:
    """A changed earlier turn, or a changed system instruction, reuses nothing stale."""
    body = _body(4, signed=False)
    last = read_contents(body)
    edited = copy.deepcopy(_body(5, signed=False))
    edited["contents"][3]["parts"][1]["text"] = "Step one, done differently."
    edited["contents"][4]["parts"][0]["functionResponse"]["response"] = {"output": "other output"}
    read, known = _reads_alike(edited, last)
    assert known == 0 and read.messages[4]["content"] == "Step one, done differently."
    assert read.messages[5]["content"] == "other output"
    renamed = copy.deepcopy(_body(5, signed=False))
    renamed["systemInstruction"] = {"parts": [{"text": "You are another agent."}]}
    read, known = _reads_alike(renamed, last)
    assert known == len(last.contents) and read.messages[0]["content"] == "You are another agent."
    assert read.messages[1] is not last.messages[1]  # read afresh


def _edge_bodies() -> list[dict[str, Any]]:
    """Bodies where the JSON around what is counted is least: empty turns, bare calls and
    responses with made-up ids, images, non-ASCII text, declarations with no schema."""
    bare = {"functionCall": {"name": "f"}}
    return [
        {"contents": [{"role": "user", "parts": [{"text": "x"}]}]},
        {"contents": [{"role": "user", "parts": [{"text": ""}]}, {"role": "model", "parts": [{"text": ""}]}] * 50},
        {"contents": [{"role": "user", "parts": [{"text": "go"}]}, {"role": "model", "parts": [bare] * 20},
                      {"role": "user", "parts": [{"functionResponse": {"name": "f", "response": {}}}] * 20}]},
        {"contents": [{"role": "user", "parts": [{"inlineData": {"mimeType": "image/png", "data": "x"}},
                                                 {"text": "a"}] * 10}]},
        {"systemInstruction": {"parts": [{"text": "s"}] * 30},
         "contents": [{"role": "user", "parts": [{"text": "東京 🚀 naïve " * 400}]}],
         "tools": [{"functionDeclarations": [{"name": "f"}] * 5}, {"googleSearch": {}}]},
        _body(8),
    ]


@pytest.mark.parametrize("counter_name", ["tiktoken:o200k_base", "tiktoken:cl100k_base", "estimate"])
def test_the_count_bound_is_at_least_the_count(counter_name: str) -> None:
    """What lets a new conversation far below the trigger be counted beside its upstream call."""
    counter = TokenizerRegistry().counter(counter_name)
    for body in _edge_bodies():
        tools = chat_tools(body.get("tools")) or None
        counted = counter.count_request(conversation_of(body), tools)
        assert counted <= count_bound(orjson.dumps(body), body), body["contents"][:2]


def test_a_chat_routes_body_is_serialised_for_the_new_messages_only() -> None:
    """The chat body of a steady turn, its earlier messages' JSON reused, is the JSON of the
    chat body made afresh."""
    read = None
    for steps in (2, 3, 5):
        body = copy.deepcopy(_body(steps, signed=False))
        read = read_contents(body, read, known_turns(read, body["contents"]))
        fields = {"temperature": 0.5, **chat_fields(body, "gpt-4o", True)}
        assert orjson.loads(chat_json(fields, read).joined()) == orjson.loads(orjson.dumps(
            {"temperature": 0.5, **chat_body(copy.deepcopy(body), "gpt-4o", True)}))
    assert read is not None and read.known and read.chat.count == len(read.messages)
    assert len(read.chat.pieces) == 1  # small turns grow one piece: a write each would cost a send()


def test_pieces_join_their_small_neighbours_and_keep_large_ones() -> None:
    big = b"x" * JOINED_BELOW
    made = Pieces((b"{", b"a", big, b"b", b"c", big, b"}"))
    assert made.joined() == b"{a" + big + b"bc" + big + b"}" and made.size == len(made.joined())
    assert made._value == (b"{a", big, b"bc", big, b"}")


json_values = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=3)),
                           lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                   st.dictionaries(st.text(max_size=2), inner, max_size=3)),
                           max_leaves=30)


def _deepest(value: Any, level: int) -> int:
    """The level of the deepest container in `value` (found `level` deep), 0 when it holds none."""
    if not isinstance(value, (dict, list)):
        return 0
    children = value.values() if isinstance(value, dict) else value
    return max([level, *(_deepest(c, level + 1) for c in children)])


@settings(max_examples=300, deadline=None)
@given(st.lists(json_values, max_size=4), st.integers(MAX_NESTING - 12, MAX_NESTING + 1))
def test_the_contents_nesting_is_counted_as_every_door_counts_it(value: list[Any], level: int) -> None:
    """`check_nesting` (its count a level at a time, `nesting.py`) refuses exactly what nests
    deeper than MAX_NESTING, counted container by container."""
    try:
        check_nesting(value, level)
        refused = False
    except GatewayError:
        refused = True
    assert refused == (_deepest(value, level) > MAX_NESTING)


@settings(max_examples=300, deadline=None)
@given(json_values, st.integers(1, 8), st.booleans())
def test_a_small_body_said_shallow_nests_no_deeper(value: Any, limit: int, spaced: bool) -> None:
    """`shallow` (a small body's brackets counted, those in strings too) never passes a body
    nesting deeper than its limit, however it is spaced; and passes one with that few brackets."""
    raw = json.dumps({"contents": value}, indent=2 if spaced else None).encode()
    if shallow(raw, limit):
        assert _deepest({"contents": value}, 1) <= limit
    containers = raw.count(b"{") + raw.count(b"[")
    assert shallow(raw, limit) == (containers <= limit)


@pytest.mark.parametrize("sse", [True, False])
def test_the_stream_watch_reads_the_elements_that_say_something(sse: bool) -> None:
    """Text deltas pass unread; the usage, a call, the finish and an error are read, also with
    a key spelt with an escape, in SSE events or a JSON array's elements, split anywhere."""
    def frame(obj: dict[str, Any], i: int) -> bytes:
        data = orjson.dumps(obj)
        return b"data: " + data + b"\r\n\r\n" if sse else (b"," if i else b"[") + data + b"\n\n"

    text = {"candidates": [{"content": {"role": "model", "parts": [{"text": "he said \"finish\""}]}, "index": 0}]}
    call = {"candidates": [{"content": {"role": "model", "parts": [{"functionCall": {"name": "ls", "args": {}}}]}}]}
    final = {"candidates": [{"content": {"role": "model", "parts": [{"text": ""}]}, "finishReason": "STOP"}],
             "usageMetadata": {"promptTokenCount": 42}}
    stream = b"".join(frame(o, i) for i, o in enumerate((text, call, text, final))) + (b"" if sse else b"]")
    for cut in (1, 7, len(stream) // 2, len(stream)):
        watch = GeminiStream(keep_all=False)
        watch.feed(stream[:cut])
        watch.feed(stream[cut:])
        facts = watch.facts()
        assert watch.complete and not watch.failed and facts.prompt_tokens == 42
        assert [c["function"]["name"] for c in facts.tool_calls] == ["ls"]
    escaped = frame(text, 0).replace(b'"text"', b'"te\\u0078t"') + \
        frame({"candidates": final["candidates"]}, 1).replace(b'"finishReason"', b'"\\u0066inishReason"')
    watch = GeminiStream(keep_all=False)
    watch.feed(escaped)
    assert watch.complete
    failed = GeminiStream(keep_all=False)
    failed.feed(frame({"error": {"code": 503, "message": "x", "status": "UNAVAILABLE"}}, 0))
    assert failed.failed and not failed.complete
