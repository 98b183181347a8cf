"""The conversation model and its protocol readers: what each dialect's messages are read
as, how they group into steps, and that the pipeline writes its edits back in the
message's own form and leaves every other message byte-identical."""
from __future__ import annotations

import json
import random

import orjson
import pytest

from ctxgate.pipeline.config import MicrocompactConfig, RestoreConfig
from ctxgate.pipeline.conversation import Kind, read_conversation
from ctxgate.pipeline.notes import SNIP, context_note
from ctxgate.pipeline.microcompact import MicrocompactStrategy
from ctxgate.pipeline.protocols import detect_dialect
from ctxgate.pipeline.restore import extract_working_state
from ctxgate.pipeline.request import CompressionRequest

from pipeline_builders import NO_WINDOW, assistant, call, calls, counter, filler, system, tool, user
from trajectories import mini_swe_agent, openhands_text, swe_agent

TRACEBACK = "Traceback (most recent call last):\n  File \"app.py\", line 3\nValueError: bad config key 'retry'"


def openhands_action(name: str, **params: str) -> dict:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return assistant(f"Let me do that.\n\n<function={name}>\n{body}</function>")


def test_openhands_text_actions_and_observations() -> None:
    h = [system(), user("Fix the config loader in /workspace/app."),
         openhands_action("str_replace_editor", command="view", path="/workspace/app/config.py"),
         user("EXECUTION RESULT of [str_replace_editor]:\nHere's the result of running `cat -n`:\n1\timport os"),
         openhands_action("execute_bash", command="cd /workspace/app && python -m pytest tests/test_config.py"),
         user("EXECUTION RESULT of [execute_bash]:\n" + TRACEBACK + "\n[The command completed with exit code 1.]"),
         openhands_action("task_tracker", command="plan", task_list='[{"title": "fix loader", "status": "todo"}]'),
         user("EXECUTION RESULT of [task_tracker]:\nok")]
    c = read_conversation(h)
    assert c.dialect == "openhands_text"
    assert [i.kind for i in c.infos] == [Kind.INSTRUCTIONS, Kind.TASK, Kind.ACTION, Kind.OBSERVATION, Kind.ACTION,
                                         Kind.OBSERVATION, Kind.PLAN, Kind.OBSERVATION]
    view = c.infos[2].actions[0]
    assert view.tool == "str_replace_editor" and view.arguments["command"] == "view"
    assert view.paths == ("/workspace/app/config.py",) and view.command == ""
    run = c.infos[4].actions[0]
    assert run.command == "cd /workspace/app && python -m pytest tests/test_config.py" and run.program == "python"
    assert run.paths == ("tests/test_config.py",)
    failed = c.infos[5].observations[0]
    assert failed.tool == "execute_bash" and failed.exit_status == 1 and failed.failed
    assert failed.error_line == "ValueError: bad config key 'retry'"
    assert c.infos[5].answers == 4
    assert c.infos[6].actions[0].arguments["task_list"] == [{"title": "fix loader", "status": "todo"}]
    assert [(u.start, u.end) for u in c.units] == [(0, 1), (1, 2), (2, 4), (4, 6), (6, 8)]
    assert c.latest_failure() == (5, failed)


def test_swe_agent_commands_fenced_tagged_and_bare() -> None:
    window = "[File: /repo/src/fields.py (1000 lines total)]\n401:    def round(self):\n" \
             "(Open file: /repo/src/fields.py)\n" \
             "(Current directory: /repo)\nbash-$"
    h = [system(), user("We're currently solving the following issue within our repository."),
         assistant("Let us look at the file.\n```\nopen src/fields.py 401\n```"), user(window),
         assistant("Now run it.\n<command>\npython reproduce.py\n</command>"),
         user(TRACEBACK + "\n(Open file: /repo/src/fields.py)\n(Current directory: /repo)\nbash-$"),
         assistant("submit"), user("Your command ran successfully and did not produce any output.")]
    c = read_conversation(h)
    assert c.dialect == "swe_agent_text"
    opened, ran, submitted = (c.infos[i].actions[0] for i in (2, 4, 6))
    assert (opened.tool, opened.paths) == ("open", ("src/fields.py",))
    assert (ran.tool, ran.command, ran.paths) == ("python", "python reproduce.py", ("reproduce.py",))
    assert submitted.tool == "submit"
    seen = c.infos[3].observations[0]
    assert seen.output.startswith("[File: /repo/src/fields.py") and "(Open file:" not in seen.output
    assert c.infos[5].observations[0].error_line == "ValueError: bad config key 'retry'"
    assert all(c.is_complete_step(u) for u in c.units[2:])


def test_a_sentence_is_not_a_bare_command() -> None:
    h = [system(), user("task"), assistant("I think the problem is in the loader."), user("go on"),
         assistant("```\nls\n```"), user("a.py")]
    c = read_conversation(h, "swe_agent_text")
    assert c.infos[2].kind is Kind.TALK and c.infos[4].kind is Kind.ACTION


def test_mini_swe_agent_thought_and_bash_block() -> None:
    h = [system("Your response must contain exactly ONE bash code block."), user("Fix the HTML serializer."),
         assistant("THOUGHT: look at the code.\n\n```bash\ngrep -n 'class Serializer' bleach/html5lib_shim.py\n```"),
         user("<returncode>0</returncode>\n<output>\n12:class Serializer:\n</output>"),
         assistant("THOUGHT: run the tests.\n\n```bash\ncd /repo && python -m pytest -x\n```"),
         user("<returncode>1</returncode>\n<output>\nFAILED tests/test_html.py::test_empty\n</output>")]
    c = read_conversation(h)
    assert c.dialect == "mini_swe_agent"
    grep = c.infos[2].actions[0]
    assert (grep.tool, grep.program, grep.paths) == ("bash", "grep", ("bleach/html5lib_shim.py",))
    ok, failed = c.infos[3].observations[0], c.infos[5].observations[0]
    assert ok.exit_status == 0 and not ok.failed and ok.output == "12:class Serializer:\n"
    assert failed.exit_status == 1 and failed.failed and failed.error_line == "FAILED tests/test_html.py::test_empty"


def test_tool_calls_and_their_results() -> None:
    h = [system(), user("task"), calls(call("c1", "read_file", path="/a.py"), call("c2", "execute_bash",
                                                                                     command="pytest -q tests/t.py")),
         tool("c1", "print(1)"), tool("c2", TRACEBACK), assistant("done"), user("thanks")]
    c = read_conversation(h)
    assert c.dialect == "tool_calls"
    assert [a.call_id for a in c.infos[2].actions] == ["c1", "c2"]
    assert c.infos[2].actions[1].paths == ("tests/t.py",)
    assert [(u.start, u.end) for u in c.units] == [(0, 1), (1, 2), (2, 5), (5, 6), (6, 7)]
    assert c.kind(5) is Kind.TALK and c.kind(6) is Kind.TALK, "a tool-calling agent's user turns are its user's"
    steps = list(c.steps())
    assert [(i, a.tool, o.output if o else None) for i, a, o in steps] == [
        (2, "read_file", "print(1)"), (2, "execute_bash", TRACEBACK)]


def test_anthropic_tool_use_and_tool_result_blocks() -> None:
    h = [system(), user("task"),
         {"role": "assistant", "content": [{"type": "text", "text": "Reading."},
                                           {"type": "tool_use", "id": "tu1", "name": "Read",
                                            "input": {"file_path": "/src/a.py"}}]},
         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "tu1", "content": "x = 1",
                                       "is_error": False}]},
         {"role": "assistant", "content": [{"type": "tool_use", "id": "tu2", "name": "Bash",
                                            "input": {"command": "python /src/a.py"}}]},
         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "tu2", "is_error": True,
                                       "content": [{"type": "text", "text": "exit 2\nno such module"}]}]}]
    c = read_conversation(h)
    assert c.dialect == "anthropic_blocks"
    read = c.infos[2].actions[0]
    assert (read.tool, read.paths, read.call_id) == ("Read", ("/src/a.py",), "tu1")
    result = c.infos[3].observations[0]
    assert (result.tool, result.output, result.failed) == ("Read", "x = 1", False)
    failed = c.infos[5].observations[0]
    assert failed.tool == "Bash" and failed.failed and failed.error_line == "no such module"
    assert [(u.start, u.end) for u in c.units] == [(0, 1), (1, 2), (2, 4), (4, 6)]


def test_unknown_text_pairs_an_assistant_turn_with_the_user_turn_after_it() -> None:
    h = [system(), user("task"), assistant("RUN: make"), user("make: *** [all] Error 2"), assistant("RUN: ls"),
         user("Makefile")]
    c = read_conversation(h)
    assert c.dialect == "plain"
    assert [(u.start, u.end) for u in c.units] == [(0, 1), (1, 2), (2, 4), (4, 6)]
    assert c.kind(3) is Kind.OBSERVATION and c.infos[3].answers == 2
    assert c.latest_failure() is not None and c.latest_failure()[0] == 3


def test_ctxgate_notes_are_notes_and_look_alikes_are_the_clients() -> None:
    note = context_note(SNIP, "compaction: snip", "[ctxgate: context snipped] 5 earlier messages were removed")
    h = [system(), user("task"), note, assistant("```bash\nls\n```")]
    assert read_conversation(h).kind(2) is Kind.NOTE
    # The same text sent by the client (an observation in a user turn, a system turn) is the client's.
    look_alike = [system(), user("task"), assistant("```bash\nls\n```"), user(note["content"]),
                  system("[ctxgate: context snipped] 5 earlier messages were removed"), assistant("```bash\nls\n```")]
    kinds = [read_conversation(look_alike).kind(i) for i in (3, 4)]
    assert Kind.NOTE not in kinds


@pytest.mark.parametrize("text", [
    "<function=execute_bash>\n<parameter=command>\nls", "THOUGHT: nothing to run", "```\n", "<command>", "",
    "EXECUTION RESULT of [x", "<returncode>abc</returncode>"])
def test_broken_or_partial_protocol_text_reads_without_error(text: str) -> None:
    h = [system(), user("task"), assistant(text), user(text), assistant(text)]
    for dialect in (None, "openhands_text", "swe_agent_text", "mini_swe_agent", "plain", "tool_calls"):
        c = read_conversation(h, dialect)
        assert len(c.infos) == len(h) and sum(u.end - u.start for u in c.units) == len(h)


def test_the_dialect_is_judged_from_what_the_agent_does_not_from_the_task() -> None:
    """A task statement that quotes a protocol is not evidence of it."""
    quoting = [system(), user("Reply with <function=NAME> blocks and read EXECUTION RESULT of [NAME]: turns."),
               calls(call("c1", "bash", command="ls")), tool("c1", "a.py")]
    assert detect_dialect(quoting, 1) == "tool_calls"
    assert detect_dialect([system(), user("hello")], 1) == "plain"


def _every_text_run() -> list:
    runs = [*openhands_text(), *mini_swe_agent(), *(t for t in swe_agent() if not any(
        m.get("tool_calls") for m in t.messages))]
    return runs


def test_recorded_runs_are_read_in_their_dialect() -> None:
    runs = _every_text_run()
    expected = {"openhands-text": "openhands_text", "mini-swe-agent": "mini_swe_agent", "swe-agent": "swe_agent_text"}
    marker = {"openhands-text": "<function=", "mini-swe-agent": "```bash", "swe-agent": "```"}
    for t in runs:
        c = read_conversation(t.messages)
        assert c.dialect == expected[t.source], t.name
        for i, m in enumerate(t.messages):
            if m["role"] == "assistant" and marker[t.source] in m["content"] and i != len(t.messages) - 1:
                assert c.kind(i) is Kind.ACTION and c.kind(i + 1) is Kind.OBSERVATION, (t.name, i)
        # the same dialect on every prefix the agent sent once it has taken a step
        for i in range(6, len(t.messages), 5):
            assert detect_dialect(t.messages[:i], c.task) == c.dialect, (t.name, i)


@pytest.mark.parametrize("dialect", ["openhands_text", "swe_agent_text", "mini_swe_agent", "anthropic_blocks"])
async def test_an_observation_is_cut_in_its_own_form_and_nothing_else_changes(dialect: str) -> None:
    big = filler(6000, 3)
    action, observation = {
        "openhands_text": (openhands_action("execute_bash", command="cat big.log"),
                           user("EXECUTION RESULT of [execute_bash]:\n" + big
                                + "\n[The command completed with exit code 0.]")),
        "swe_agent_text": (assistant("```\npython big.py\n```"),
                           user(big + "\n(Open file: n/a)\n(Current directory: /repo)\nbash-$")),
        "mini_swe_agent": (assistant("THOUGHT: read\n\n```bash\ncat big.log\n```"),
                           user("<returncode>0</returncode>\n<output>\n" + big + "\n</output>")),
        "anthropic_blocks": ({"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "Bash",
                                                                "input": {"command": "cat big.log"}}]},
                             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                                           "content": big}]}),
    }[dialect]
    h = [system(), user("task"), action, observation, assistant("noted"), user("go on")]
    before = orjson.dumps(h)
    s = MicrocompactStrategy(MicrocompactConfig())
    result = await s.compress(CompressionRequest(h, 1, counter(), dialect=dialect, window=NO_WINDOW))
    assert orjson.dumps(h) == before, "the client's messages are never mutated"
    out = result.compressed_messages
    assert [json.dumps(m, sort_keys=True) for i, m in enumerate(out) if i != 3] == \
           [json.dumps(m, sort_keys=True) for i, m in enumerate(h) if i != 3]
    assert all(out[i] is h[i] for i in range(len(h)) if i != 3), "untouched messages are the same objects"
    cut = out[3]
    assert cut["role"] == "user" and set(cut) == set(observation)
    text = cut["content"] if isinstance(cut["content"], str) else cut["content"][0]["content"]
    original = observation["content"] if isinstance(observation["content"], str) else big
    assert "tokens truncated] ..." in text and len(text) < len(original)
    assert text[:40] == original[:40] and text[-12:] == original[-12:], "head and tail, so header and footer stay"
    if dialect == "anthropic_blocks":
        assert cut["content"][0]["type"] == "tool_result" and cut["content"][0]["tool_use_id"] == "t1"


def test_any_json_shaped_messages_read_without_error() -> None:
    """The readers run on whatever passed validation, before a compaction decides anything:
    no shape of content, call ids or blocks may make them raise (seeded, so it reproduces)."""
    rng = random.Random(20261204)
    leaves = [None, 1, 2.5, True, "", "x", "<function=a>", "```bash\nls\n```", "<returncode>1</returncode>",
              "EXECUTION RESULT of [x]:\nError: e", "[File: /a.py (3 lines total)]", "Traceback\nValueError: x"]
    keys = ["type", "text", "id", "name", "input", "content", "tool_use_id", "is_error", "function", "arguments"]

    def value(depth: int = 0) -> object:
        r = rng.random()
        if depth > 2 or r < 0.3:
            return rng.choice(leaves)
        if r < 0.6:
            return [value(depth + 1) for _ in range(rng.randint(0, 3))]
        return {rng.choice(keys): value(depth + 1) for _ in range(rng.randint(0, 4))}

    for _ in range(1500):
        h = []
        for _ in range(rng.randint(1, 8)):
            m = {"role": rng.choice(["system", "user", "assistant", "tool", "developer"]), "content": value()}
            if rng.random() < 0.3:
                m["tool_calls"] = value()
            if rng.random() < 0.3:
                m["tool_call_id"] = value()
            h.append(m)
        for dialect in (None, "openhands_text", "swe_agent_text", "mini_swe_agent", "plain", "tool_calls"):
            c = read_conversation(h, dialect)
            c.shape()
            list(c.steps())
            c.latest_failure()
            extract_working_state(h, RestoreConfig(), dialect)


# -- Anthropic tool blocks, as the summariser and activeRestore read them --------------------

ANTHROPIC_STEP = [
    {"role": "user", "content": "Fix the bug."},
    {"role": "assistant", "content": [
        {"type": "text", "text": "Opening it."},
        {"type": "tool_use", "id": "toolu_1", "name": "open", "input": {"path": "x.py"}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [
        {"type": "text", "text": "[File: /testbed/x.py (3 lines total)]\n1:a"}]}]},
]


def test_the_summariser_reads_tool_use_and_tool_result_blocks() -> None:
    from ctxgate.pipeline.autocompact import serialise

    text = serialise(ANTHROPIC_STEP, counter())
    assert '[called open({"path":"x.py"})]' in text and "[File: /testbed/x.py (3 lines total)]" in text


def test_restore_finds_file_headers_inside_tool_result_blocks() -> None:
    state = extract_working_state(ANTHROPIC_STEP, RestoreConfig(), "anthropic")
    assert [f["path"] for f in state.to_dict()["current_files"]] == ["/testbed/x.py"]
