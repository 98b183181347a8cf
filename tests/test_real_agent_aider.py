"""aider, unmodified, through `ctxgate run`, its prompts answered as a user would answer them.

aider offers the model no tools: it sends Chat Completions with plain text, and runs the
```bash blocks of a reply once the user agrees ("Run shell command?"; `--yes-always` never
agrees to that), then offers to add their output to the chat ("Add command output to the
chat?"), which it does as a user turn followed by its own "Ok". It does not go back to the
model by itself: the user's next message does. So the test answers aider's prompts through
pipes (pexpect's PopenSpawn): yes to both questions, then `continue`, step after step, past the
context limit, until the scripted model's reply is an answer (`DONE-N`, or `LOST` when the
newest step's output did not reach it: tests/agent_steps.py, `text_reply`). Pipes, not a
terminal: at a terminal aider copies a command's output only while the command runs, so how
much of a fast command's output reached the chat depended on the machine's speed.

aider summarises its history itself only once it has applied a file edit (its "done" messages
grow only then); the scripted model never edits, so every compaction point is ctxgate's.
"""
from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import orjson
import pexpect
import yaml
import pytest
from pexpect.popen_spawn import PopenSpawn

from agent_steps import asked_step
from ctxgate.pipeline.protocols.base import text_of
from ctxgate.pipeline.turns import is_valid_sequence
from real_agents import pypi_agent
from recorder import Recorder
from servers import KEYS, Gateway, _model, main_config, start_gateways
from test_real_agents import LIMIT, MODEL, STEPS, _check_upstream, _launch, _limited
from upstream import Received, ScriptedUpstream

AIDER_FLAGS = ["--edit-format", "diff", "--no-git", "--no-check-update", "--analytics-disable",
               "--no-show-release-notes", "--no-show-model-warnings", "--no-pretty", "--no-fancy-input"]
"""`diff`: the edit format whose coder runs shell blocks (aider gives a model it does not know
`whole`, which ignores them); no git repository to offer to create, no update check, no
analytics or release-notes question, no warning about the unknown model, plain terminal
output and input, so that its prompts can be read and answered."""
PROMPT_TIMEOUT_S = 120
"""Per prompt of aider: generous, for a loaded machine (a step takes a few seconds)."""
RUN_SHELL = r"Run shell commands?\? .*: $"
ADD_OUTPUT = r"Add command output to the chat\? .*: $"
READY = r"\n(diff)?> $"
"""aider's input prompt, named by its edit format when that is not the model's own."""
ANSWER = re.compile(r"^(DONE-\d+|LOST)\s*$", re.M)
TASK = "Run the steps you are given, one at a time."
EXAMPLE = "Change get_factorial() to use math.factorial"
"""The first of aider's worked examples of its edit format, sent before the task every turn."""


def _drive(child: PopenSpawn, task: str, steps: int) -> str:
    """Give aider `task`, agree to each command the model proposes and to adding its output, ask
    it to continue, until a reply proposes no command: that reply's text."""
    child.expect(READY)
    child.sendline(task)
    for _ in range(steps + 2):  # a reply per step, then the answer; a reply more is a runaway
        if child.expect([RUN_SHELL, READY]) == 1:
            return str(child.before)
        child.sendline("y")
        child.expect(ADD_OUTPUT)
        child.sendline("y")
        child.expect(READY)
        child.sendline("continue")
    raise AssertionError(f"aider still running steps after {steps + 2} replies")


def recorded_gateway(where: Path, model: str, limit: int) -> tuple[ScriptedUpstream, Gateway, Recorder]:
    """The scripted upstream refusing past `limit`, a gateway routing `model` to it (counted
    with o200k, as the upstream counts) and a recorder in front of the gateway keeping what
    aider sent and each reply's X-Ctx-Levels."""
    upstream = ScriptedUpstream(limit=limit).start()
    config = main_config(upstream.url, "auto")
    config["model_list"].append(_model(model, f"{upstream.url}/v1", max_input_tokens=limit))
    config["ctxgate"]["tokenizers"] = [{"pattern": model, "tokenizer": "tiktoken:o200k_base"}]
    gateway = start_gateways({"aider": (where / "gateway", config)})["aider"]
    return upstream, gateway, Recorder(gateway.base).start()


def _reply(received: Received) -> str:
    """The text the scripted upstream gave back for one request, streamed or whole."""
    if not received.body.get("stream"):
        return "".join(c["message"].get("content") or "" for c in orjson.loads(received.response)["choices"])
    frames = [orjson.loads(line[6:]) for line in received.response.splitlines() if line.startswith(b"data: {")]
    return "".join(c["delta"].get("content") or "" for f in frames for c in f["choices"])


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
def test_aider_runs_past_its_limit_to_its_answer(tmp_path: Path, provider: str) -> None:
    """An `openai/` model comes through the Chat Completions door, an `anthropic/` one (litellm
    inside aider reading ANTHROPIC_API_BASE and ANTHROPIC_API_KEY) through the Messages door,
    its turns as lists of text blocks; the route behind both is the scripted upstream."""
    aider = pypi_agent("aider-chat") / "aider"
    upstream, config = _limited(tmp_path, LIMIT, MODEL)
    # Streaming, aider's litellm leaves each Messages stream unclosed; when the garbage
    # collector finalises one inside httpcore's pool lock, that lock is taken twice and aider
    # hangs before its next request (a stack dump shows it). Not a gateway matter: see docs/agents.md (aider).
    stream = ["--no-stream"] if provider == "anthropic" else []
    command, env = _launch(config, f"aider-{provider}", [str(aider), "--model", f"{provider}/{MODEL}", *AIDER_FLAGS,
                                                         *stream],
                           tmp_path, ANTHROPIC_API_KEY=KEYS["acme"],
                           SHELL="/bin/sh")  # aider runs a command with `$SHELL -i -c`: no rc files of the tester's
    # A session of its own, so a failed run takes the gateway and aider down with the launcher.
    child = PopenSpawn(command, cwd=str(tmp_path), env=env, encoding="utf-8", timeout=PROMPT_TIMEOUT_S,
                       preexec_fn=os.setsid)
    try:
        last = _drive(child, TASK, STEPS)
        child.sendline("/exit")
        child.expect(pexpect.EOF)
        status = child.wait()
        assert status == 0, (status, last[-2000:])
        assert [a.group(1) for a in ANSWER.finditer(last)] == [f"DONE-{STEPS}"], last[-2000:]
        received = _check_upstream(upstream, "chat")
        for r in received:
            assert is_valid_sequence(r.body["messages"]), r.body["messages"]
            assert "summarize this partial conversation" not in r.raw.decode(), "aider summarised by itself"
            said = [text_of(m) for m in r.body["messages"] if m["role"] == "user"]
            assert said[0] == EXAMPLE and any(s.startswith(TASK) for s in said), said[:8]  # compaction kept both
        asked = [asked_step(_reply(r)) for r in received]
        assert [a for a in asked if a is not None] == list(range(1, STEPS + 1)), asked  # none lost, none re-run
    finally:
        if child.proc.poll() is None:
            os.killpg(child.proc.pid, signal.SIGKILL)
        upstream.stop()


EDIT_LIMIT = 3_000
CALC = "".join(f"def f{k}(x):\n    \"\"\"Step {k} of the pipeline.\"\"\"\n    return x + {k}\n\n\n" for k in range(8)) \
    + "def total(*args):\n    return 0\n"
"""calc.py: a few functions before the one the edit changes, so its text takes room."""
NOTES = "".join(f"- note {k}: the pipeline's step {k} adds {k} to its input, as calc.py's f{k} does.\n"
                for k in range(30))
"""A read-only file (`--read`): aider's READ ONLY dump, which may give room before calc.py's text."""


def test_aider_edits_the_file_in_the_chat_past_compaction(tmp_path: Path) -> None:
    """aider at a 3,000-token limit, calc.py in the chat and a read-only file beside it, runs
    commands past compaction, then makes a SEARCH/REPLACE edit that needs calc.py's current
    text: the scripted model copies its SEARCH line from aider's files-in-chat message as it
    received it (tests/agent_edit.py). That message reaches it verbatim, and the edit applies."""
    aider = pypi_agent("aider-chat") / "aider"
    model = "agent-edit-4"
    (tmp_path / "calc.py").write_text(CALC)
    (tmp_path / "notes.md").write_text(NOTES)
    upstream, config = _limited(tmp_path, EDIT_LIMIT, model)
    settings = yaml.safe_load(config.read_text())  # counted with o200k as the upstream counts, as agent-steps-* are
    settings["ctxgate"]["tokenizers"].append({"pattern": "agent-edit-*", "tokenizer": "tiktoken:o200k_base"})
    config.write_text(yaml.safe_dump(settings, sort_keys=False))
    command, env = _launch(config, "aider-edit", [str(aider), "--model", f"openai/{model}", *AIDER_FLAGS,
                                                  "--no-auto-lint", "--read", "notes.md", "calc.py"],
                           tmp_path, SHELL="/bin/sh")
    child = PopenSpawn(command, cwd=str(tmp_path), env=env, encoding="utf-8", timeout=PROMPT_TIMEOUT_S,
                       preexec_fn=os.setsid)
    try:
        last = _drive(child, TASK, 4)
        child.sendline("/exit")
        child.expect(pexpect.EOF)
        assert child.wait() == 0, last[-2000:]
        received = [r for r in upstream.log if r.door == "chat" and isinstance(r.body, dict)
                    and r.body.get("model") == model]
        prompts = [r.prompt_tokens for r in received]
        assert received and all(p is not None and p <= EDIT_LIMIT for p in prompts), (prompts, last[-3000:])
        # the request the edit answered (aider may summarise its history afterwards, in a request of its own)
        edit = next((r for r in reversed(received) if "<<<<<<< SEARCH" in _reply(r)), None)
        assert edit is not None, [_reply(r) for r in received]
        files = [text_of(m) for m in edit.body["messages"] if text_of(m).startswith("I have *added these files")]
        assert len(files) == 1 and f"calc.py\n```\n{CALC}```" in files[0], files
        # compacted before the edit: the first step's output, which aider still sends, is gone
        said = "\n".join(text_of(m) for m in edit.body["messages"])
        assert "STEP-4-OK\n1\n2\n" in said and "STEP-1-OK\n1\n2\n" not in said, said[-3000:]
        assert (tmp_path / "calc.py").read_text() == CALC.replace("return 0", "return sum(args)")
    finally:
        if child.proc.poll() is None:
            os.killpg(child.proc.pid, signal.SIGKILL)
        upstream.stop()


REBUILT_LIMIT = 6_000
REBUILT_STEPS = 12


def _common(a: list[dict[str, object]], b: list[dict[str, object]]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _kept(sent: list[dict[str, object]], then: list[dict[str, object]], forwarded: list[dict[str, object]],
          next_forwarded: list[dict[str, object]]) -> bool:
    """Whether the request forwarded next starts with the one forwarded for `sent`, up to the
    first message of `sent` that aider changed or left out in its next request (`then`), where
    that forwarded request has it (anything of ctxgate's before it is part of what must hold)."""
    changed = sent[_common(sent, then):]
    at = min((i for i, m in enumerate(forwarded) if m in changed), default=len(forwarded))
    return _common(forwarded, next_forwarded) >= at


@pytest.mark.parametrize("touch", [False, True])
def test_aider_rebuilding_its_messages_every_turn_is_compacted_rarely(tmp_path: Path, touch: bool) -> None:
    """aider rebuilds its request every turn: its reminder goes on the newest user turn, so the
    turn after, the message that carried it has changed; with `touch`, each step's command also
    appends a line to calc.py, so its files-in-chat message, which a point keeps verbatim before
    the history it compacts, has the file's new text each turn. At a 6,000-token limit, calc.py
    and a read-only file in the chat, 12 steps and then the edit: a compaction point still holds
    for the turns after it (pipeline/stable_head.py, pipeline/rebuilt.py), so the points are
    few, and every forwarded request that is not a point starts with the one before it, but for
    the messages aider itself changed. Before, every turn past the trigger was a point."""
    aider = pypi_agent("aider-chat") / "aider"
    model = f"agent-edit-{REBUILT_STEPS}" + ("-touch" if touch else "")
    (tmp_path / "calc.py").write_text(CALC)
    (tmp_path / "notes.md").write_text(NOTES)
    upstream, gateway, recorder = recorded_gateway(tmp_path, model, REBUILT_LIMIT)
    command, env = _launch(None, "aider-rebuilt", [str(aider), "--model", f"openai/{model}", *AIDER_FLAGS,
                                                   "--no-auto-lint", "--read", "notes.md", "calc.py"],
                           tmp_path, url=recorder.url, SHELL="/bin/sh")
    child = PopenSpawn(command, cwd=str(tmp_path), env=env, encoding="utf-8", timeout=PROMPT_TIMEOUT_S,
                       preexec_fn=os.setsid)
    try:
        last = _drive(child, TASK, REBUILT_STEPS)
        child.sendline("/exit")
        child.expect(pexpect.EOF)
        assert child.wait() == 0, last[-2000:]
        touched = "".join(f"# step {k}\n" for k in range(1, REBUILT_STEPS + 1)) if touch else ""
        assert (tmp_path / "calc.py").read_text() == CALC.replace("return 0", "return sum(args)") + touched
        # aider's turns (its own summary requests, two messages, aside), as sent and as forwarded
        sent = [orjson.loads(s.raw)["messages"] for s in recorder.log if s.path.endswith("/chat/completions")]
        sent = [m for m in sent if len(m) > 2]
        forwarded = [r.body["messages"] for r in upstream.log if r.door == "chat" and isinstance(r.body, dict)
                     and r.body.get("model") == model and len(r.body["messages"]) > 2]
        assert len(sent) == len(forwarded) == REBUILT_STEPS + 1, (len(sent), len(forwarded))
        assert all(r.prompt_tokens is not None and r.prompt_tokens <= REBUILT_LIMIT for r in upstream.log
                   if r.door == "chat" and isinstance(r.body, dict) and r.body.get("model") == model)
        assert all(_common(a, b) < len(a) for a, b in zip(sent, sent[1:]))  # aider changed what it sent every turn
        points = [i + 1 for i in range(len(sent) - 1)
                  if not _kept(sent[i], sent[i + 1], forwarded[i], forwarded[i + 1])]
        compacted = [i for i, (s, f) in enumerate(zip(sent, forwarded)) if s != f]
        assert compacted and 1 <= len(points) <= len(forwarded) // 4, (points, compacted)
    finally:
        if child.proc.poll() is None:
            os.killpg(child.proc.pid, signal.SIGKILL)
        recorder.stop()
        gateway.stop()
        upstream.stop()
