"""Real agents, unmodified, through `ctxgate run`: installed from PyPI (pinned, kept between
runs: tests/real_agents.py), each runs against a scripted model whose next step depends on
the newest observation that reached it (tests/agent_steps.py), well past its context limit
and through several compaction points, to its final answer.

Each test checks the agent's exit status and answer (`DONE-N`: every step arrived whole;
`LOST`: the newest step did not), that every request the upstream received was valid for its
API and under the limit, that compaction happened (the prompt shrank more than once), and
that in the last request every step the agent took is named in a note's step ledger or is
still there verbatim (tests/ledger_checks.py).
"""
from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from agent_steps import BULK_LINES, steps_of
from ctxgate.pipeline.conversation import read_conversation
from ctxgate.pipeline.turns import is_valid_sequence
from ledger_checks import assert_every_step_named
from real_agents import npm_agent, pypi_agent
from recorder import Recorder, Sent
from servers import KEYS, UPSTREAM_KEY, Gateway, _model, child_env, ctxgate_command, main_config, start_gateways
from upstream import ScriptedUpstream

LIMIT = 24_000
"""The model's context limit in tokens: at the upstream (a request over it is refused) and in
the route ctxgate compacts for. Each step adds about 5K."""
STEPS = 14
MODEL = f"agent-steps-{STEPS}"


def _limited(tmp_path: Path, limit: int, model: str) -> tuple[ScriptedUpstream, Path]:
    upstream = ScriptedUpstream(limit=limit).start()
    config = main_config(upstream.url, "auto")
    config["model_list"].append(_model(model, f"{upstream.url}/v1", max_input_tokens=limit))
    # The scripted upstream counts with o200k, as a provider whose tokenizer ctxgate knows: the
    # estimate for an unknown model (UTF-8 bytes / 3) under-counts `seq`'s digits by half.
    config["ctxgate"]["tokenizers"] = [{"pattern": "agent-steps-*", "tokenizer": "tiktoken:o200k_base"}]
    path = tmp_path / "ctxgate.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return upstream, path


@pytest.fixture
def limited(tmp_path: Path) -> Any:
    upstream, path = _limited(tmp_path, LIMIT, MODEL)
    yield upstream, path
    upstream.stop()


def _launch(config: Path | None, session: str, argv: list[str], cwd: Path, url: str | None = None,
            **env: str) -> tuple[list[str], dict[str, str]]:
    """The command line and environment to `ctxgate run` the agent, as a user would, with the
    tenant's key as its OpenAI key: with a gateway of its own from `config`, or through the one
    at `url`."""
    home = cwd / "home"  # the agents write their own config and caches under HOME: not the tester's
    home.mkdir(exist_ok=True)
    where = ["--url", url] if url else ["--config", str(config)]
    return ([*ctxgate_command(), "run", *where, "--session", session, "--", *argv],
            {**child_env(), "HOME": str(home), "OPENAI_API_KEY": KEYS["acme"], **env})


def _run(config: Path | None, session: str, argv: list[str], cwd: Path, url: str | None = None,
         **env: str) -> subprocess.CompletedProcess[str]:
    """`ctxgate run` the agent (see `_launch`), its output captured."""
    command, environ = _launch(config, session, argv, cwd, url, **env)
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=600, env=environ)


def _compacted_turns(prompts: list[int]) -> int:
    """Requests that grew by less than half a step on the one before, though the agent added
    a step to its history in between: each is a compaction point. The scripted model's steps
    are all about the same size, so a step is the largest growth seen. (Counting only prompts
    that shrink would miss a run whose points land at about the same size each turn: aider,
    which reorders its history every turn so that each turn is compacted afresh, lands one
    ledger line higher each time.)"""
    grown = [after - before for before, after in zip(prompts, prompts[1:])]
    step = max(grown, default=0)
    return sum(1 for g in grown if g < step / 2)


def _check_upstream(upstream: ScriptedUpstream, door: str, model: str = MODEL, limit: int = LIMIT) -> list[Any]:
    received = [r for r in upstream.log if r.door == door and isinstance(r.body, dict) and r.body.get("model") == model]
    assert len(received) >= steps_of(model) + 1, len(received)
    prompts = [r.prompt_tokens for r in received]
    assert all(p is not None and p <= limit for p in prompts), prompts  # never refused for its size
    assert _compacted_turns([p for p in prompts if p is not None]) >= 2, str(prompts)  # several points
    assert_every_step_named(received)  # the step ledger: no step lost from the agent's picture
    return received


def _outputs_answer_calls(items: list[dict[str, Any]]) -> None:
    """Every function call output of a Responses input answers a call the input holds."""
    calls = {i["call_id"] for i in items if i.get("type") == "function_call"}
    assert {i["call_id"] for i in items if i.get("type") == "function_call_output"} <= calls, items


def test_mini_swe_agent_runs_past_its_limit_to_its_answer(limited: Any, tmp_path: Path) -> None:
    upstream, config = limited
    bin_dir = pypi_agent("mini-swe-agent")
    trajectory = tmp_path / "trajectory.json"
    done = _run(config, "mini-1", [str(bin_dir / "mini"), "--model", f"openai/{MODEL}", "--task",
                                  "Run the steps you are given, one at a time.", "--yolo", "--exit-immediately",
                                  "--cost-limit", "0", "--output", str(trajectory)], tmp_path,
                MSWEA_CONFIGURED="true", MSWEA_COST_TRACKING="ignore_errors", MSWEA_SILENT_STARTUP="1")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    info = json.loads(trajectory.read_text())["info"]
    assert info["exit_status"] == "Submitted" and info["submission"].strip() == f"DONE-{STEPS}", info
    for r in _check_upstream(upstream, "chat"):
        assert is_valid_sequence(r.body["messages"]), r.body["messages"]
        assert r.body["tools"][0]["function"]["name"] == "bash"  # the agent's tool reached the model
    _reads_its_commands(upstream, "tool_calls")


def _reads_its_commands(upstream: ScriptedUpstream, dialect: str) -> None:
    """ctxgate reads mini-swe-agent's requests in its dialect, every step's command with it:
    the first request after step 1 is what the agent sent (nothing to compact yet)."""
    first = next(r.body["messages"] for r in upstream.log if r.door == "chat" and isinstance(r.body, dict)
                 and r.body.get("model") == MODEL and "STEP-1-OK" in json.dumps(r.body.get("messages")))
    read = read_conversation(first)
    assert read.dialect == dialect, read.dialect
    assert [a.command for info in read.infos for a in info.actions] == [f"echo STEP-1-OK && seq 1 {BULK_LINES}"]


def test_mini_swe_agent_text_protocol_gets_its_commands_read(limited: Any, tmp_path: Path) -> None:
    """mini-swe-agent 2.x's text mode (`mini_textbased.yaml`): commands in the ```mswea_bash_command
    fence its system prompt shows, outputs as <returncode>/<output> user turns."""
    upstream, config = limited
    bin_dir = pypi_agent("mini-swe-agent")
    trajectory = tmp_path / "trajectory.json"
    done = _run(config, "mini-text-1", [str(bin_dir / "mini"), "-c", "mini_textbased.yaml", "--model-class",
                                        "litellm_textbased", "--model", f"openai/{MODEL}", "--task",
                                        "Run the steps you are given, one at a time.", "--yolo", "--exit-immediately",
                                        "--cost-limit", "0", "--output", str(trajectory)], tmp_path,
                MSWEA_CONFIGURED="true", MSWEA_COST_TRACKING="ignore_errors", MSWEA_SILENT_STARTUP="1")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    info = json.loads(trajectory.read_text())["info"]
    assert info["exit_status"] == "Submitted" and info["submission"].strip() == f"DONE-{STEPS}", info
    for r in _check_upstream(upstream, "chat"):
        assert "```mswea_bash_command" in r.body["messages"][0]["content"] and not r.body.get("tools")
    _reads_its_commands(upstream, "mini_swe_agent")


AGENTS_SDK_PROGRAM = '''
import subprocess, sys
from agents import Agent, Runner, function_tool, set_tracing_disabled

set_tracing_disabled(True)  # no trace export to OpenAI's own host


@function_tool
def bash(command: str) -> str:
    """Run a shell command; returns its output."""
    return subprocess.run(command, shell=True, capture_output=True, text=True).stdout


agent = Agent(name="stepper", instructions="Run the steps you are given, one at a time.", tools=[bash],
              model=sys.argv[1])
print("ANSWER:", Runner.run_sync(agent, "Run the steps.", max_turns=40).final_output)
'''


def test_an_agents_sdk_program_runs_past_its_limit_to_its_answer(limited: Any, tmp_path: Path) -> None:
    """The Agents SDK speaks Responses: the whole input list every turn, function calls and
    their outputs as items."""
    upstream, config = limited
    bin_dir = pypi_agent("openai-agents")
    program = tmp_path / "stepper.py"
    program.write_text(AGENTS_SDK_PROGRAM)
    done = _run(config, "sdk-1", [str(bin_dir / "python"), str(program), MODEL], tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"ANSWER: DONE-{STEPS}" in done.stdout, done.stdout[-3000:]
    for r in _check_upstream(upstream, "responses"):
        _outputs_answer_calls(r.body["input"])


def test_codex_runs_past_its_limit_to_its_answer(limited: Any, tmp_path: Path) -> None:
    """Codex through the provider `ctxgate run` gives it (Responses over HTTP, no WebSocket)."""
    upstream, config = limited
    codex = npm_agent("@openai/codex", "codex")
    done = _run(config, "codex-1", [str(codex), "exec", "--skip-git-repo-check",
                                    "--dangerously-bypass-approvals-and-sandbox", "--model", MODEL,
                                    "Run the steps you are given, one at a time."], tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"DONE-{STEPS}" in done.stdout, done.stdout[-3000:]
    for r in _check_upstream(upstream, "responses"):
        _outputs_answer_calls(r.body["input"])


CLAUDE_LIMIT = 60_000
"""Claude Code's system prompt and tools alone take about 29K tokens."""
CLAUDE_MODEL = "agent-steps-16"
CLAUDE_ENV = {"ANTHROPIC_API_KEY": KEYS["acme"], "IS_SANDBOX": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
              "DISABLE_AUTOUPDATER": "1", "ANTHROPIC_DEFAULT_HAIKU_MODEL": "summarizer",
              "ANTHROPIC_SMALL_FAST_MODEL": "summarizer"}
"""As root in a sandbox, no traffic of its own, its side requests to a model that answers text."""


def test_claude_code_runs_past_its_limit_to_its_answer(tmp_path: Path) -> None:
    """Claude Code speaks Messages: ctxgate's Messages door, the route's chat upstream behind it."""
    claude = npm_agent("@anthropic-ai/claude-code", "claude")
    upstream, config = _limited(tmp_path, CLAUDE_LIMIT, CLAUDE_MODEL)
    try:
        done = _run(config, "claude-1", [str(claude), "-p", "Run the steps you are given, one at a time.",
                                         "--dangerously-skip-permissions", "--model", CLAUDE_MODEL], tmp_path,
                    **CLAUDE_ENV)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert f"DONE-{steps_of(CLAUDE_MODEL)}" in done.stdout, done.stdout[-3000:]
        for r in _check_upstream(upstream, "chat", CLAUDE_MODEL, CLAUDE_LIMIT):
            assert is_valid_sequence(r.body["messages"]), r.body["messages"]
    finally:
        upstream.stop()


def test_gemini_cli_runs_past_its_limit_to_its_answer(limited: Any, tmp_path: Path) -> None:
    """Gemini CLI speaks Gemini's generateContent: ctxgate's Gemini door, the route's chat
    upstream behind it; its settings untouched (`ctxgate run` gives it a home of its own)."""
    upstream, config = limited
    gemini = npm_agent("@google/gemini-cli", "gemini")
    own = tmp_path / "home" / ".gemini"
    own.mkdir(parents=True)
    (own / "settings.json").write_text('{"general": {"vimMode": false}}')
    done = _run(config, "gemini-1", [str(gemini), "-p", "Run the steps you are given, one at a time.", "--yolo",
                                     "-m", MODEL], tmp_path, GEMINI_API_KEY=KEYS["acme"])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"DONE-{STEPS}" in done.stdout, done.stdout[-3000:]
    for r in _check_upstream(upstream, "chat"):
        assert is_valid_sequence(r.body["messages"]), r.body["messages"]
    assert (own / "settings.json").read_text() == '{"general": {"vimMode": false}}'


# -- what agents send, byte for byte below the trigger ---------------------------------------

THINKING = "agent-steps-10-thinking"


def _front(tmp_path: Path, route: str, limit: int) -> tuple[ScriptedUpstream, Gateway, Recorder]:
    """A gateway on a native route of `route`'s API to the scripted upstream, and a recorder in
    front of it: what the agent sent, then what ctxgate forwarded. The route is set native: at
    a host not the vendor's own, `auto` has ctxgate emulate the providers' context management
    (docs/native-context.md) and take Claude Code's `context_management` out of the body."""
    upstream = ScriptedUpstream(limit=limit).start()
    config = main_config(upstream.url, "auto", native_context={"routes": {THINKING: "native"}})
    config["model_list"].append({"model_name": THINKING, "litellm_params": {
        "model": f"{route}/{THINKING}", "api_base": upstream.url if route == "anthropic" else f"{upstream.url}/v1",
        "api_key": UPSTREAM_KEY}, "model_info": {"max_input_tokens": limit}})
    gateway = start_gateways({"front": (tmp_path / "gateway", config)})["front"]
    return upstream, gateway, Recorder(gateway.base).start()


def _below_the_trigger(sent: list[Sent], received: list[Any]) -> list[tuple[Sent, Any]]:
    """The requests up to the session's first compaction point, paired with what the upstream got."""
    assert len(sent) == len(received) >= 3, (len(sent), len(received))
    prompts = [r.prompt_tokens for r in received]
    first = next((i for i in range(1, len(prompts)) if prompts[i] < prompts[i - 1]), len(prompts))
    assert first >= 3, prompts
    return list(zip(sent[:first - 1], received[:first - 1]))  # the request before a point may start it


def _to(log: list[Any], model: str, suffix: str) -> list[Any]:
    return [r for r in log if r.path.endswith(suffix) and orjson.loads(r.raw).get("model") == model]


def test_what_codex_sends_reaches_the_upstream_byte_for_byte(tmp_path: Path) -> None:
    """Responses fields Codex sends (`store`, `prompt_cache_key`, `include`, `client_metadata`,
    `reasoning`, and the encrypted reasoning it hands back) are the agent's own bytes upstream."""
    codex = npm_agent("@openai/codex", "codex")
    upstream, gateway, recorder = _front(tmp_path, "openai", 40_000)
    try:
        done = _run(None, "codex-bytes", [str(codex), "exec", "--skip-git-repo-check",
                                          "--dangerously-bypass-approvals-and-sandbox", "--model", THINKING,
                                          "Run the steps."], tmp_path, url=recorder.url)
        assert done.returncode == 0 and f"DONE-{steps_of(THINKING)}" in done.stdout, done.stdout[-2000:]
        sent = _to(recorder.log, THINKING, "/responses")
        pairs = _below_the_trigger(sent, _to(upstream.log, THINKING, "/responses"))
        first = orjson.loads(sent[0].raw)
        assert {"store", "prompt_cache_key", "include", "client_metadata", "reasoning"} <= set(first), sorted(first)
        assert any(i.get("type") == "reasoning" and i.get("encrypted_content")
                   for s, _ in pairs for i in orjson.loads(s.raw)["input"]), "no encrypted reasoning handed back"
        for s, r in pairs:
            assert r.raw == s.raw
    finally:
        recorder.stop()
        gateway.stop()
        upstream.stop()


def test_what_claude_code_sends_reaches_the_upstream_byte_for_byte(tmp_path: Path) -> None:
    """Claude Code's system blocks, `cache_control` marks, thinking blocks with their signatures
    and `anthropic-beta` headers reach a native Messages upstream as it sent them."""
    claude = npm_agent("@anthropic-ai/claude-code", "claude")
    upstream, gateway, recorder = _front(tmp_path, "anthropic", CLAUDE_LIMIT)
    try:
        done = _run(None, "claude-bytes", [str(claude), "-p", "Run the steps.", "--dangerously-skip-permissions",
                                           "--model", THINKING], tmp_path, url=recorder.url, **CLAUDE_ENV)
        assert done.returncode == 0 and f"DONE-{steps_of(THINKING)}" in done.stdout, done.stdout[-2000:]
        sent = _to(recorder.log, THINKING, "/messages")
        pairs = _below_the_trigger(sent, _to(upstream.log, THINKING, "/messages"))
        first = orjson.loads(sent[0].raw)
        assert isinstance(first["system"], list) and len(first["system"]) > 1
        assert "cache_control" in sent[0].raw.decode() and "anthropic-beta" in sent[0].headers
        assert any(b.get("type") == "thinking" and b.get("signature") for s, _ in pairs
                   for m in orjson.loads(s.raw)["messages"] if isinstance(m["content"], list) for b in m["content"])
        for s, r in pairs:
            assert r.raw == s.raw
            assert r.headers.get("anthropic-beta") == s.headers["anthropic-beta"]
        counted = _to(recorder.log, THINKING, "/count_tokens")
        assert [r.raw for r in _to(upstream.log, THINKING, "/count_tokens")] == [s.raw for s in counted]
    finally:
        recorder.stop()
        gateway.stop()
        upstream.stop()
