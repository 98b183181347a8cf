"""`ctxgate run -- COMMAND`: real launcher, gateway and agent processes over real sockets.

The agent is a `python -c` script: it writes what it saw (its environment, the reply it got
through ctxgate with the openai SDK) to a JSON file the test reads.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml
from servers import KEYS, Gateway, child_env, ctxgate_command, free_port, main_config, start_gateways, stop_all, \
    wait_until
from upstream import REPLY, ScriptedUpstream

SEEN = ("OPENAI_BASE_URL", "OPENAI_API_BASE", "ANTHROPIC_BASE_URL", "ANTHROPIC_CUSTOM_HEADERS", "CTXGATE_URL",
        "CTXGATE_SESSION", "OPENAI_API_KEY")

# argv[1]: where to write what it saw; argv[2]: its exit code.
AGENT = f"""
import json, os, sys
import openai
env = {{k: os.environ.get(k) for k in {SEEN!r}}}
client = openai.OpenAI(max_retries=0, timeout=30)  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment
raw = client.chat.completions.with_raw_response.create(  # no session header: the base URL names it
    model="gpt-4o", messages=[{{"role": "user", "content": "hi"}}])
seen = {{"env": env, "reply": raw.parse().choices[0].message.content, "session": raw.headers.get("x-ctx-session")}}
open(sys.argv[1], "w").write(json.dumps(seen))
sys.exit(int(sys.argv[2]))
"""

# argv[1]: the file it writes once it waits; argv[2]: "handle" to exit 42 on SIGTERM, else die of it.
SLEEPER = """
import json, os, signal, sys, time
if sys.argv[2] == "handle":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(42))
open(sys.argv[1], "w").write(json.dumps({"url": os.environ["CTXGATE_URL"], "pid": os.getpid()}))
time.sleep(60)
"""


@pytest.fixture
def config_file(tmp_path: Path, up: ScriptedUpstream) -> Path:
    path = tmp_path / "ctxgate.yaml"
    path.write_text(yaml.safe_dump(main_config(up.url, "auto"), sort_keys=False))
    return path


@pytest.fixture
def running(tmp_path: Path, up: ScriptedUpstream) -> Iterator[Gateway]:
    gateways = start_gateways({"running": (tmp_path / "running", main_config(up.url, "auto"))})
    yield gateways["running"]
    stop_all(gateways.values())


def _launcher_env() -> dict[str, str]:
    return {**child_env(), "OPENAI_API_KEY": KEYS["acme"], "ANTHROPIC_CUSTOM_HEADERS": "X-Team: blue"}


def ctxgate_run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*ctxgate_command(), "run", *args], cwd=cwd, env=_launcher_env(), capture_output=True,
                          text=True, timeout=120)


def port_closed(url: str) -> bool:
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except ConnectionRefusedError:
        return True
    return False


def read_json(path: Path) -> Any:
    return json.loads(path.read_text())


def test_agent_reaches_the_started_gateway_and_its_exit_code_is_the_launchers(
        tmp_path: Path, config_file: Path, up: ScriptedUpstream) -> None:
    seen_file = tmp_path / "seen.json"
    done = ctxgate_run(["--config", str(config_file), "--session", "launch-1", "--",
                        sys.executable, "-c", AGENT, str(seen_file), "7"], tmp_path)
    assert done.returncode == 7, done.stderr
    seen = read_json(seen_file)
    env = seen["env"]
    base = env["CTXGATE_URL"]
    assert base.startswith("http://127.0.0.1:")
    assert env["ANTHROPIC_BASE_URL"] == f"{base}/s/launch-1"
    assert env["OPENAI_BASE_URL"] == env["OPENAI_API_BASE"] == f"{base}/s/launch-1/v1"
    assert env["CTXGATE_SESSION"] == "launch-1" == seen["session"]
    assert env["ANTHROPIC_CUSTOM_HEADERS"] == "X-Team: blue\nX-Ctx-Session: launch-1"
    assert env["OPENAI_API_KEY"] == KEYS["acme"]
    assert seen["reply"] == REPLY
    assert any(isinstance(e.body, dict) and e.body.get("model") == "gpt-4o" for e in up.log), "reached the upstream"
    log = tmp_path / ".ctxgate" / "ctxgate-run.log"  # the config has no data_dir: the default, under cwd
    assert f"ctxgate: listening on {base} (session launch-1; its log: .ctxgate/ctxgate-run.log)" in done.stderr
    assert "ctxgate listening on" in log.read_text(), "the gateway's own output goes to its log"
    assert "ctxgate listening on" not in done.stdout + done.stderr, "...and not to the agent's terminal"
    assert port_closed(base), "the gateway is stopped once the agent exits"


def test_url_uses_the_running_gateway_and_starts_none(tmp_path: Path, running: Gateway) -> None:
    seen_file, data_dir = tmp_path / "seen.json", tmp_path / "run-data"
    done = ctxgate_run(["--url", running.url, "--data-dir", str(data_dir), "--",
                        sys.executable, "-c", AGENT, str(seen_file), "0"], tmp_path)
    assert done.returncode == 0, done.stderr
    seen = read_json(seen_file)
    session = seen["env"]["CTXGATE_SESSION"]
    assert seen["env"]["OPENAI_BASE_URL"] == f"{running.base}/s/{session}/v1"  # the /v1 it was given is not doubled
    assert seen["env"]["ANTHROPIC_BASE_URL"] == f"{running.base}/s/{session}"
    assert seen["env"]["CTXGATE_SESSION"].startswith("run-") and seen["session"] == seen["env"]["CTXGATE_SESSION"]
    assert seen["reply"] == REPLY
    assert f"ctxgate: using {running.base}" in done.stderr
    assert not data_dir.exists(), "nothing was started"
    assert running.proc.poll() is None, "the running gateway is not the launcher's to stop"


@pytest.mark.parametrize("agent_mode, expected", [("die", 128 + signal.SIGTERM), ("handle", 42)])
def test_sigterm_reaches_the_agent_and_stops_the_gateway(
        tmp_path: Path, config_file: Path, agent_mode: str, expected: int) -> None:
    ready = tmp_path / "ready.json"
    launcher = subprocess.Popen([*ctxgate_command(), "run", "--config", str(config_file), "--",
                                 sys.executable, "-c", SLEEPER, str(ready), agent_mode],
                                cwd=tmp_path, env=_launcher_env(), stderr=subprocess.PIPE, text=True)
    try:
        wait_until(ready.exists, 60, "the agent to start")
        wait_until(lambda: read_json(ready) if ready.stat().st_size else None, 5, "the agent's ready file")
        launcher.send_signal(signal.SIGTERM)
        _, stderr = launcher.communicate(timeout=30)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    assert launcher.returncode == expected, stderr
    assert port_closed(read_json(ready)["url"])


def test_a_launcher_killed_outright_leaves_no_gateway_running(tmp_path: Path, config_file: Path) -> None:
    """SIGKILL gives the launcher no chance to stop its gateway: the gateway sees its parent gone
    and stops itself. The agent, in the launcher's process group, is the terminal's to end."""
    ready = tmp_path / "ready.json"
    launcher = subprocess.Popen([*ctxgate_command(), "run", "--config", str(config_file), "--",
                                 sys.executable, "-c", SLEEPER, str(ready), "handle"],
                                cwd=tmp_path, env=_launcher_env(), stderr=subprocess.PIPE, text=True)
    agent = None
    try:
        wait_until(ready.exists, 60, "the agent to start")
        seen = wait_until(lambda: read_json(ready) if ready.stat().st_size else None, 5, "the agent's ready file")
        agent = seen["pid"]
        assert not port_closed(seen["url"]), "the gateway serves while the launcher lives"
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(timeout=30)  # its stderr stays open in the agent, which lives on
        wait_until(lambda: port_closed(seen["url"]), 30, "the orphaned gateway to stop")
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
        if agent is not None:
            try:
                os.kill(agent, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.mark.parametrize("args", [[], ["--"], ["--session", "s1", "--"]])
def test_no_command_is_a_usage_error(tmp_path: Path, args: list[str]) -> None:
    done = ctxgate_run(args, tmp_path)
    assert done.returncode == 2
    assert "usage: ctxgate run" in done.stderr and "missing the agent's COMMAND" in done.stderr
    assert not (tmp_path / ".ctxgate").exists()


def test_an_agent_that_cannot_be_started_exits_127_or_126_with_one_line(tmp_path: Path, running: Gateway) -> None:
    script = tmp_path / "agent.sh"
    script.write_text("#!/bin/sh\necho ran\n")  # not executable
    missing = ctxgate_run(["--url", running.url, "--", str(tmp_path / "no-such-agent")], tmp_path)
    denied = ctxgate_run(["--url", running.url, "--", str(script)], tmp_path)
    assert missing.returncode == 127 and denied.returncode == 126
    assert missing.stderr.strip().splitlines()[-1] == f"ctxgate run: command not found: {tmp_path / 'no-such-agent'}"
    assert denied.stderr.strip().splitlines()[-1] == f"ctxgate run: cannot run {script}: Permission denied"
    assert "Traceback" not in missing.stderr + denied.stderr


def test_unreachable_url_is_refused_before_the_agent_runs(tmp_path: Path) -> None:
    marker = tmp_path / "agent-ran"
    url = f"http://127.0.0.1:{free_port()}"
    done = ctxgate_run(["--url", url, "--", sys.executable, "-c", f"open({str(marker)!r}, 'w')"], tmp_path)
    assert done.returncode == 125
    assert f"no ctxgate answers {url}/healthz" in done.stderr
    assert not marker.exists()


# A program named `codex` on PATH that reads its provider the way Codex does (`-c` overrides,
# TOML strings), records what it was given, and asks its provider over the Responses API.
CODEX_STAND_IN = """#!{python}
import json, os, sys
import openai
overrides = {{}}
args = sys.argv[1:]
while args and args[0] == "-c":
    key, _, value = args[1].partition("=")
    overrides[key] = json.loads(value)
    args = args[2:]
provider = overrides["model_providers." + overrides["model_provider"] + ".base_url"]
client = openai.OpenAI(base_url=provider, api_key=os.environ.get("OPENAI_API_KEY", "none"), max_retries=0)
reply = client.responses.create(model="gpt-4o", input=" ".join(args[1:]))
json.dump({{"overrides": overrides, "rest": args, "reply": reply.output_text,
            "session": os.environ["CTXGATE_SESSION"], "url": os.environ["CTXGATE_URL"]}}, open({seen!r}, "w"))
"""


def test_codex_gets_a_responses_provider_over_http_through_overrides(tmp_path: Path, config_file: Path) -> None:
    """Codex reads no base-URL variable: the launcher gives it a model provider of its own with
    `-c` overrides, and leaves the user's ~/.codex alone."""
    bin_dir, home, seen = tmp_path / "bin", tmp_path / "home", tmp_path / "codex.json"
    bin_dir.mkdir()
    home.mkdir()
    codex = bin_dir / "codex"
    codex.write_text(CODEX_STAND_IN.format(python=sys.executable, seen=str(seen)))
    codex.chmod(0o755)
    env = {**_launcher_env(), "PATH": f"{bin_dir}:{os.environ['PATH']}", "HOME": str(home)}
    done = subprocess.run([*ctxgate_command(), "run", "--config", str(config_file), "--session", "codex-1",
                           "--explain", "--", "codex", "exec", "say hello"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    got = read_json(seen)
    assert got["overrides"] == {"model_provider": "ctxgate", "model_providers.ctxgate.name": "ctxgate",
                                "model_providers.ctxgate.base_url": f"{got['url']}/s/codex-1/v1",
                                "model_providers.ctxgate.wire_api": "responses",
                                "model_providers.ctxgate.env_key": "OPENAI_API_KEY"}
    assert got["rest"] == ["exec", "say hello"] and got["session"] == "codex-1"
    assert got["reply"] == REPLY, "the Responses door answered through the provider it was given"
    assert "agent recognised as Codex" in done.stderr and "model_providers.ctxgate.wire_api" in done.stderr
    assert not (home / ".codex").exists(), "the user's Codex config is not written"
