"""Record what the suite's real agents send, for tests/test_memory_redteam.py.

Each agent the suite pins (tests/real_agents.py: Claude Code, Codex, aider, OpenHands) runs
once through `ctxgate run`, as the real-agent tests run it, on a small project (`calc.py`
with a failing test, a CLAUDE.md, an AGENTS.md, a Claude Code skill, an aider conventions
file) against the scripted model (`agent-steps-1`: one shell step, then its answer). The
human states one preference and, in a later turn where the agent takes one (Claude Code
`--continue`, `codex exec resume --last`, aider's next prompt), one correction; OpenHands runs
one task only, so its task prompt carries both.

A relay in front of the gateway (tests/recorder.py) keeps what the agent sent, byte for
byte. `tests/fixtures/scaffolding/<agent>.json` gets the agent's first requests to the model
(and the first that carries the correction): the door, the path (without the `/s/<session>`
prefix `ctxgate run` adds), the body verbatim but for keys (none is expected in a body: any
of the test keys found is replaced), and the human's own words.

Claude Code is recorded a second time at CLAUDE_CODE_OLD, the version issue 34 was found with
(`claude-code-2.1.197`), beside the suite's pin.

Re-record (the agents install on first use, into CTXGATE_AGENTS_DIR):

    .venv/bin/python tests/record_scaffolding.py              # all of them
    .venv/bin/python tests/record_scaffolding.py claude-code  # or some of them

Re-record when an agent's pin in tests/real_agents.py moves, then run
tests/test_memory_redteam.py.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from functools import partial
from pathlib import Path
from typing import Any, Callable

import orjson

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pexpect.popen_spawn import PopenSpawn  # noqa: E402

from real_agents import NPM_AGENTS, PYPI_AGENTS, npm_agent, pypi_agent  # noqa: E402
from recorder import Recorder  # noqa: E402
from servers import KEYS, UPSTREAM_KEY, Gateway, main_config, start_gateways  # noqa: E402
from test_real_agent_aider import ADD_OUTPUT, AIDER_FLAGS, READY, RUN_SHELL  # noqa: E402
from test_real_agent_openhands import NO_GITHUB  # noqa: E402
from test_real_agents import CLAUDE_ENV, _launch, _run  # noqa: E402
from upstream import ScriptedUpstream  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures" / "scaffolding"
MODEL = "agent-steps-1"
PREFERENCE = "From now on always answer in French."
TASK = "Fix the failing test in calc.py."
CORRECTION = "No, use pytest instead of unittest to run the tests."
FIRST = f"{PREFERENCE} {TASK}"
ONE_SHOT = f"{PREFERENCE} {TASK} {CORRECTION}"
KEEP = 2
"""The agent's first requests kept, beside the first that carries the correction."""
CLAUDE_CODE_OLD = "2.1.197"
"""The Claude Code whose `<system-reminder>` blocks issue 34 found captured as corrections."""
DOORS = {"/v1/messages": "messages", "/v1/chat/completions": "chat", "/v1/responses": "responses"}

PROJECT = {
    "calc.py": "def add(a, b):\n    return a - b\n",
    "test_calc.py": "import unittest\n\nfrom calc import add\n\n\nclass TestAdd(unittest.TestCase):\n"
                    "    def test_add(self):\n        self.assertEqual(add(2, 3), 5)\n",
    "CLAUDE.md": "# calc\n\n- Always use `uv run` for Python commands; never use pip directly.\n"
                 "- Prefer small focused commits with imperative subject lines.\n"
                 "- Don't use print for diagnostics, use the logging module instead of print.\n",
    "AGENTS.md": "# Contributor notes for calc\n\n- Always write docstrings for every public function you add.\n"
                 "- From now on new modules need complete type hints on every signature.\n"
                 "- Do not use tabs for indentation, use four spaces instead of tabs.\n",
    "CONVENTIONS.md": "# Conventions\n\n- Always use f-strings rather than percent formatting in new code.\n"
                      "- Never use wildcard imports anywhere in this repository.\n",
    ".claude/skills/release-notes/SKILL.md":
        "---\nname: release-notes\ndescription: Writes release notes from the git log. Always use it when the "
        "user asks for a changelog. Do NOT use it for code review; use the reviewer agent instead of this "
        "skill.\n---\n\nRead `git log` since the last tag and group the commits by kind.\n",
}
"""A small project as a user has it: the instruction files are the agents' scaffolding."""


def project(root: Path) -> Path:
    work = root / "calc"
    for name, text in PROJECT.items():
        path = work / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return work


def recording(route: str) -> tuple[ScriptedUpstream, Gateway, Recorder, Path]:
    """The scripted upstream, a gateway routing MODEL to it on `route`'s API, a recorder in front."""
    upstream = ScriptedUpstream().start()
    config = main_config(upstream.url, "auto")
    config["model_list"].append({"model_name": MODEL, "litellm_params": {
        "model": f"{route}/{MODEL}", "api_base": upstream.url if route == "anthropic" else f"{upstream.url}/v1",
        "api_key": UPSTREAM_KEY}, "model_info": {"max_input_tokens": 200_000}})
    root = Path(tempfile.mkdtemp(prefix="ctxgate-record-"))
    gateway = start_gateways({"record": (root / "gateway", config)})["record"]
    return upstream, gateway, Recorder(gateway.base).start(), root


def checked(done: subprocess.CompletedProcess[str]) -> None:
    if done.returncode != 0:
        raise RuntimeError(f"the agent exited with {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")


def claude_code(url: str, work: Path, version: str | None = None) -> list[str]:
    claude = str(npm_agent("@anthropic-ai/claude-code", "claude", version))
    flags = ["--dangerously-skip-permissions", "--model", MODEL]
    checked(_run(None, "rec-claude", [claude, "-p", FIRST, *flags], work, url=url, **CLAUDE_ENV))
    checked(_run(None, "rec-claude", [claude, "--continue", "-p", CORRECTION, *flags], work, url=url, **CLAUDE_ENV))
    return [FIRST, CORRECTION]


def codex(url: str, work: Path) -> list[str]:
    binary = str(npm_agent("@openai/codex", "codex"))
    flags = ["--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox", "--model", MODEL]
    checked(_run(None, "rec-codex", [binary, "exec", *flags, FIRST], work, url=url))
    checked(_run(None, "rec-codex", [binary, "exec", *flags, "resume", "--last", CORRECTION], work, url=url))
    return [FIRST, CORRECTION]


def aider(url: str, work: Path) -> list[str]:
    """aider at its prompt, as tests/test_real_agent_aider.py drives it: the task, yes to the
    step's command and to adding its output, then the correction."""
    binary = str(pypi_agent("aider-chat") / "aider")
    command, env = _launch(None, "rec-aider", [binary, "--model", f"openai/{MODEL}", *AIDER_FLAGS,
                                               "--read", "CONVENTIONS.md", "calc.py", "test_calc.py"],
                           work, url, SHELL="/bin/sh")
    child = PopenSpawn(command, cwd=str(work), env=env, encoding="utf-8", timeout=120, preexec_fn=os.setsid)
    try:
        child.expect(READY)
        child.sendline(FIRST)
        child.expect(RUN_SHELL)
        child.sendline("y")
        child.expect(ADD_OUTPUT)
        child.sendline("y")
        child.expect(READY)
        child.sendline(CORRECTION)
        child.expect(READY)
        child.sendline("/exit")
        child.wait()
    finally:
        if child.proc.poll() is None:
            os.killpg(child.proc.pid, signal.SIGKILL)
    return [FIRST, CORRECTION]


def openhands(url: str, work: Path) -> list[str]:
    bin_dir = pypi_agent("openhands")
    checked(_run(None, "rec-openhands", [str(bin_dir / "openhands"), "--headless", "-t", ONE_SHOT], work, url=url,
                 LLM_MODEL=f"openai/{MODEL}", LLM_API_KEY=KEYS["acme"], **NO_GITHUB))
    return [ONE_SHOT]


AGENTS: dict[str, tuple[str, str, Callable[[str, Path], list[str]]]] = {
    "claude-code": ("anthropic", f"@anthropic-ai/claude-code {NPM_AGENTS['@anthropic-ai/claude-code']}", claude_code),
    f"claude-code-{CLAUDE_CODE_OLD}": ("anthropic", f"@anthropic-ai/claude-code {CLAUDE_CODE_OLD}",
                                       partial(claude_code, version=CLAUDE_CODE_OLD)),
    "codex": ("openai", f"@openai/codex {NPM_AGENTS['@openai/codex']}", codex),
    "aider": ("openai", f"aider-chat {PYPI_AGENTS['aider-chat']}", aider),
    "openhands": ("openai", f"openhands {PYPI_AGENTS['openhands']}", openhands),
}

_SESSION_PREFIX = re.compile(r"^/s/[^/]+")


def without_keys(raw: bytes) -> Any:
    """The body, any key of the tests' replaced (a body should carry none: headers do)."""
    text = raw.decode()
    for key in (*KEYS.values(), UPSTREAM_KEY):
        text = re.sub(rf"(?<![\w-]){re.escape(key)}(?![\w-])", "<key>", text)
    return orjson.loads(text)


def chosen(log: list[Any], human: list[str]) -> list[dict[str, Any]]:
    """The first KEEP requests to the model, and the first that carries the correction."""
    sent = []
    for s in log:
        path = _SESSION_PREFIX.sub("", s.path)
        if path in DOORS and orjson.loads(s.raw).get("model") == MODEL:
            sent.append({"door": DOORS[path], "path": path, "body": without_keys(s.raw)})
    picked = sent[:KEEP]
    if len(human) > 1:
        later = next((s for s in sent if human[-1] in json.dumps(s["body"], ensure_ascii=False)), None)
        if later is None:
            raise RuntimeError("no request carried the human's later turn")
        if later not in picked:
            picked.append(later)
    if not picked:
        raise RuntimeError(f"the agent sent nothing to {MODEL}: {[s.path for s in log]}")
    return picked


def record(name: str) -> Path:
    route, version, run = AGENTS[name]
    upstream, gateway, recorder, root = recording(route)
    try:
        human = run(recorder.url, project(root))
        requests = chosen(recorder.log, human)
    finally:
        recorder.stop()
        gateway.stop()
        upstream.stop()
    FIXTURES.mkdir(parents=True, exist_ok=True)
    out = FIXTURES / f"{name}.json"
    out.write_text(json.dumps({
        "agent": name, "version": version, "door": requests[0]["door"], "model": MODEL,
        "recorded_by": "tests/record_scaffolding.py", "human": human, "preference": PREFERENCE,
        "correction": CORRECTION, "project_files": PROJECT, "requests": requests,
    }, indent=1, ensure_ascii=False) + "\n")
    return out


def main(names: list[str]) -> int:
    failed = 0
    for name in names or list(AGENTS):
        try:
            print(f"{name}: recorded {record(name)}", flush=True)
        except BaseException as e:  # pytest.skip (no registry) is a BaseException: report it, go on
            failed += 1
            print(f"{name}: NOT recorded: {type(e).__name__}: {e}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
