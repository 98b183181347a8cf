"""Previews for every kind of block (pipeline/previews.py, issue 36 item 2): what a note shows
of a message it cut, on every door's shape of it."""
from __future__ import annotations

import json

import pytest

from ctxgate.pipeline.previews import key_argument, output_body, preview
from ctxgate.pipeline.protocols.base import Action

CODEX_EXEC = ("Chunk ID: eaec1e\nWall time: 0.0000 seconds\nProcess exited with code 0\nOriginal token count: 2851\n"
              "Output:\nWarning: truncated output (original token count: 2851)\nTotal output lines: 250\n1\n2\n")


def test_an_anthropic_tool_result_shows_its_nested_output() -> None:
    message = {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "3 passed in 0.2s"}]},
        {"type": "tool_result", "tool_use_id": "t2", "content": "collected 3 items"}]}
    assert preview(message, 80) == "result: 3 passed in 0.2s result: collected 3 items"


def test_an_anthropic_tool_use_shows_its_tool_and_key_argument() -> None:
    message = {"role": "assistant", "content": [
        {"type": "text", "text": "Running the tests."},
        {"type": "tool_use", "id": "t1", "name": "Bash", "input": {"command": "pytest -q", "description": "run"}}]}
    assert preview(message, 80) == "Running the tests. called Bash(pytest -q)"


def test_a_chat_tool_call_shows_its_key_argument_in_order_command_path_query() -> None:
    def call(name: str, **args: str) -> dict:
        return {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}]}
    assert preview(call("bash", command="ls -la  src"), 80) == "called bash(ls -la src)"
    assert preview(call("read_file", path="src/app.py", limit="20"), 80) == "called read_file(src/app.py)"
    assert preview(call("search", query="needle", limit="20"), 80) == "called search(needle)"
    assert preview(call("think"), 80) == "called think"


def test_responses_items_show_the_call_and_the_output() -> None:
    assert preview({"type": "function_call", "call_id": "c1", "name": "shell",
                    "arguments": json.dumps({"command": ["bash", "-lc", "seq 1 3"]})}, 80) == "called shell(seq 1 3)"
    shown = preview({"type": "function_call_output", "call_id": "c1", "output": CODEX_EXEC}, 80)
    assert shown.startswith("result: Warning: truncated output (original token count: 2851) Total")
    assert "Chunk ID" not in shown and "Wall time" not in shown
    inside = {"role": "user", "content": [{"type": "function_call_output", "call_id": "c1", "output": "done"}]}
    assert preview(inside, 80) == "result: done"


@pytest.mark.parametrize("text, code, body", [
    (CODEX_EXEC, 0, CODEX_EXEC.split("Output:\n", 1)[1]),
    ("Exit code: 2\nWall time: 0.1 seconds\nOutput:\nls: cannot access 'x'\n", 2, "ls: cannot access 'x'\n"),
    ('{"output": "hello\\n", "metadata": {"exit_code": 1, "duration_seconds": 0.1}}', 1, "hello\n"),
    ("EXECUTION RESULT of [execute_bash]:\nhello\n[The command completed with exit code 0]", None,
     "hello\n[The command completed with exit code 0]"),
    ("OBSERVATION:\nhello\n", None, "hello\n"),
    ("<returncode>1</returncode>\n<output>\nTraceback\n</output>", 1, "Traceback\n"),
    ("plain output", None, "plain output"),
])
def test_an_observation_is_read_without_its_wrapper(text: str, code: int | None, body: str) -> None:
    assert output_body(text) == (code, body)


def test_codex_exec_output_shows_its_output_not_its_header() -> None:
    shown = preview({"role": "tool", "tool_call_id": "c1", "content": CODEX_EXEC}, 80)
    assert shown.startswith("Warning: truncated output") and "Wall time" not in shown and "Chunk ID" not in shown
    failed = preview({"role": "tool", "tool_call_id": "c1",
                      "content": CODEX_EXEC.replace("code 0", "code 1")}, 80)
    assert failed.startswith("exit 1: Warning")


@pytest.mark.parametrize("content", ["EXECUTION RESULT of [execute_bash]:\nSTEP-3-OK\n1\n2",
                                     "OBSERVATION:\nSTEP-3-OK\n1\n2",
                                     "<returncode>0</returncode>\n<output>\nSTEP-3-OK\n1\n2\n</output>"])
def test_a_text_protocol_observation_shows_its_output(content: str) -> None:
    assert preview({"role": "user", "content": content}, 80) == "STEP-3-OK 1 2"


def test_a_preview_ends_at_a_word() -> None:
    text = "some words that take room in the preview and then some more words after them"
    shown = preview({"role": "user", "content": text}, 33)
    assert text.startswith(shown) and len(shown) <= 33 and text[len(shown)] == " "


def test_a_codex_shell_call_names_its_command() -> None:
    assert key_argument(Action("shell", {"command": ["bash", "-lc", "cat  a.py"]})) == "cat a.py"
    assert key_argument(Action("shell", {"command": ["rg", "needle"]})) == "rg needle"
