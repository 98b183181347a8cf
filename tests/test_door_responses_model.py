"""The Responses door's data: items -> the neutral model -> items, and the stream watch."""
from __future__ import annotations

from typing import Any

import orjson

from ctxgate.proxy.doors.responses import ResponsesStream
from ctxgate.proxy.doors.responses_model import to_messages, to_request

REASONING = {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "gAAAA-opaque"}
CALL = {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "shell", "arguments": '{"cmd":"ls"}'}
OUTPUT = {"type": "function_call_output", "call_id": "call_1", "output": "a.py"}
ITEMS: list[dict[str, Any]] = [
    {"role": "user", "content": "list files"},
    REASONING, CALL, OUTPUT,
    {"type": "message", "role": "assistant", "id": "msg_1",
     "content": [{"type": "output_text", "text": "a.py is there", "annotations": []}]},
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "thanks"},
                                                    {"type": "input_image", "image_url": "data:image/png;base64,AA"}]},
]


def test_untouched_messages_render_back_to_the_same_items() -> None:
    messages = to_messages("be brief", ITEMS)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "assistant", "user"]
    assert messages[2]["tool_calls"] == [{"id": "call_1", "type": "function",
                                          "function": {"name": "shell", "arguments": '{"cmd":"ls"}'}}]
    assert messages[2]["items"] == [REASONING, CALL] and messages[4]["content"] == "a.py is there"
    assert to_request(messages) == ("be brief", ITEMS)
    assert to_messages("be brief", ITEMS) == messages  # deterministic: stable fingerprints


def test_ctxgate_notes_become_developer_items_and_cut_outputs_keep_their_item() -> None:
    messages = to_messages(None, ITEMS)
    messages.insert(1, {"role": "system", "content": "MEMORY BLOCK"})
    messages[3] = {**messages[3], "content": "a.py [cut]"}
    _, items = to_request(messages)
    assert items[1] == {"role": "developer", "content": "MEMORY BLOCK"}
    assert items[4] == {**OUTPUT, "output": "a.py [cut]"}


def test_an_orphan_output_and_an_unanswered_call_become_text() -> None:
    messages = to_messages(None, ITEMS)
    _, items = to_request([m for m in messages if m["role"] != "assistant" or "items" not in m
                           or m["items"][0]["type"] != "reasoning"])
    assert items[1]["role"] == "user" and "a.py" in items[1]["content"]  # the call went: its output is text
    _, items = to_request([m for m in messages if m["role"] != "tool"])
    kinds = [i.get("type") for i in items]
    assert "reasoning" not in kinds and "function_call" not in kinds  # the call's output went: the turn is text
    assert items[1] == {"role": "assistant", "content": '[called shell({"cmd":"ls"}); no output recorded]'}


def test_an_edited_assistant_turn_drops_its_reasoning_and_carries_the_edit() -> None:
    messages = to_messages(None, ITEMS)
    turn = messages[1]
    messages[1] = {**turn, "tool_calls": [{**turn["tool_calls"][0], "function": {"name": "shell",
                                                                              "arguments": "{}"}}]}
    _, items = to_request(messages)
    # Without its reasoning item the call may not be given by its stored id: the API refuses that.
    assert items[1] == {k: v for k, v in {**CALL, "arguments": "{}"}.items() if k != "id"} and REASONING not in items


def test_custom_tool_calls_pair_like_function_calls() -> None:
    patch = {"type": "custom_tool_call", "id": "ctc_1", "call_id": "call_p", "name": "apply_patch",
             "input": "*** Begin Patch\n*** End Patch"}
    done = {"type": "custom_tool_call_output", "call_id": "call_p", "output": "Done!"}
    messages = to_messages(None, [ITEMS[0], patch, done])
    assert messages[1]["tool_calls"][0]["function"] == {"name": "apply_patch", "arguments": patch["input"]}
    assert messages[2] == {"role": "tool", "tool_call_id": "call_p", "content": "Done!", "item": done}
    assert to_request(messages) == (None, [ITEMS[0], patch, done])


def test_the_stream_watch_finds_the_final_response_in_events_split_anywhere() -> None:
    final = {"id": "resp_1", "output": [CALL], "usage": {"input_tokens": 42}}
    stream = (b'event: response.created\ndata: {"type":"response.created","response":{"id":"resp_1"}}\n\n'
              b'event: response.completed\ndata: ' + orjson.dumps({"type": "response.completed", "response": final})
              + b"\n\n")
    watch = ResponsesStream(keep_all=True)
    for i in range(len(stream)):
        assert not watch.complete
        watch.feed(stream[i:i + 1])
    facts = watch.facts()
    assert watch.complete and watch.body() == stream and facts.response == final and facts.prompt_tokens == 42
    assert facts.tool_calls == [{"id": "call_1", "type": "function",
                                 "function": {"name": "shell", "arguments": '{"cmd":"ls"}'}}]


def test_a_conversion_continued_from_the_last_one_is_the_conversion_from_scratch() -> None:
    """A steady turn converts only what is new (`convert` with the last request's result): the
    messages must be those a whole conversion gives, at every split, also one inside a run of
    reasoning and calls that grows."""
    from ctxgate.proxy.doors.responses_model import convert

    extra = [{"type": "reasoning", "id": "rs_2", "summary": []},
             {"type": "function_call", "id": "fc_2", "call_id": "call_2", "name": "shell", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "call_2", "output": "ok"},
             {"role": "user", "content": "more"}]
    items = ITEMS + extra
    for instructions in (None, "be brief"):
        for cut in range(len(items) + 1):
            last = convert(instructions, items[:cut])
            for end in range(cut, len(items) + 1):
                continued = convert(instructions, items[:end], last)
                assert continued.messages == to_messages(instructions, items[:end]), (instructions, cut, end)
                assert continued.starts == convert(instructions, items[:end]).starts
        assert convert("other", items, convert(instructions, items)).messages == to_messages("other", items)
    rewritten = [{"role": "user", "content": "changed"}, *items[1:]]
    assert convert(None, rewritten, convert(None, items)).messages == to_messages(None, rewritten)
