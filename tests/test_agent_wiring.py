"""What `ctxgate run` sets for each agent it knows (`proxy/agent_wiring.py`). The launcher's
own tests start a gateway and a Codex stand-in; these check every agent's wiring alone."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from ctxgate.proxy.agent_wiring import wire

BASE = "http://127.0.0.1:8787"
OWN = f"{BASE}/s/s-1"


@pytest.mark.parametrize("command, agent", [
    (["claude", "-p", "hi"], "Claude Code"), (["/usr/local/bin/aider", "--yes"], "aider"),
    (["mini", "-t", "fix it"], "mini-swe-agent"), (["mini-extra"], "mini-swe-agent"),
    (["openhands"], "OpenHands"), (["python", "agent.py"], "generic"),
])
def test_every_agent_gets_the_base_urls_litellm_and_the_sdks_read(command: list[str], agent: str) -> None:
    # A user's own bases (litellm prefers ANTHROPIC_API_BASE) must not send an agent around ctxgate.
    user = {"ANTHROPIC_API_BASE": "https://api.anthropic.com", "OPENAI_BASE_URL": "https://api.openai.com/v1",
            "OPENAI_API_KEY": "sk-user"}
    wired = wire(command, user, BASE, "s-1")
    assert wired.agent == agent and wired.argv == [command[0], *wired.added_args, *command[1:]]
    assert (wired.env["ANTHROPIC_API_BASE"], wired.env["ANTHROPIC_BASE_URL"]) == (OWN, OWN)
    assert (wired.env["OPENAI_BASE_URL"], wired.env["OPENAI_API_BASE"]) == (f"{OWN}/v1", f"{OWN}/v1")
    assert wired.env["OPENAI_API_KEY"] == "sk-user"  # keys untouched
    assert f"agent recognised as {agent}" in wired.explain() and f"ANTHROPIC_API_BASE={OWN}" in wired.explain()


def test_openhands_gets_its_own_variable_and_the_flag_that_makes_it_read_it() -> None:
    # Without the flag OpenHands ignores LLM_BASE_URL for the base URL of its saved settings.
    wired = wire(["openhands", "--headless", "-t", "x"], {}, BASE, "s-1")
    assert wired.env["LLM_BASE_URL"] == f"{OWN}/v1" and f"LLM_BASE_URL={OWN}/v1" in wired.explain()
    assert wired.argv == ["openhands", "--override-with-envs", "--headless", "-t", "x"]
    assert "--override-with-envs" in wired.explain()
    given = ["openhands", "--override-with-envs", "-t", "x"]
    assert wire(given, {}, BASE, "s-1").argv == given  # not twice
    assert "LLM_BASE_URL" not in wire(["aider"], {}, BASE, "s-1").env
    # litellm inside OpenHands appends /v1/messages to an Anthropic model's base URL.
    anthropic = wire(["openhands"], {"LLM_MODEL": "anthropic/claude-sonnet-4-5"}, BASE, "s-1")
    assert anthropic.env["LLM_BASE_URL"] == OWN


def test_codex_gets_overrides_and_an_unknown_agent_none() -> None:
    assert "-c" in wire(["codex", "exec", "hi"], {}, BASE, "s-1").added_args
    generic = wire(["my-agent"], {}, BASE, "s-1")
    assert generic.added_args == [] and "arguments added" not in generic.explain()


def test_gemini_cli_gets_its_own_base_url_headers_auth_and_trust(tmp_path: Path) -> None:
    own = tmp_path / ".gemini"
    (own / "history").mkdir(parents=True)
    (own / "GEMINI.md").write_text("my memory")
    (own / "settings.json").write_text(json.dumps({"general": {"vimMode": True},
                                                   "security": {"auth": {"selectedType": "oauth-personal"}}}))
    user = {"HOME": str(tmp_path), "GEMINI_API_KEY": "sk-tenant",
            "GEMINI_CLI_CUSTOM_HEADERS": "X-Team: red, X-Ctx-Session: old"}
    wired = wire(["gemini", "-p", "hi"], user, BASE, "s-1")
    assert wired.agent == "Gemini CLI" and wired.argv == ["gemini", "-p", "hi"]
    env = wired.env
    assert env["GOOGLE_GEMINI_BASE_URL"] == OWN  # no /v1: the CLI adds /v1beta
    assert env["GEMINI_CLI_CUSTOM_HEADERS"] == "X-Team: red, X-Ctx-Session: s-1"
    assert env["GEMINI_API_KEY"] == "sk-tenant" and env["GEMINI_CLI_TRUST_WORKSPACE"] == "true"
    home = Path(env["GEMINI_CLI_HOME"])
    assert home != tmp_path
    [(path, text)] = wired.files.items()
    assert path == home / ".gemini" / "settings.json"
    assert json.loads(text) == {"general": {"vimMode": True}, "security": {"auth": {"selectedType": "gemini-api-key"}}}
    assert wired.links == {home / ".gemini" / "GEMINI.md": own / "GEMINI.md",
                           home / ".gemini" / "history": own / "history"}  # the rest of the user's folder
    assert "GEMINI_CLI_HOME=" in wired.explain() and f"file written: {path}" in wired.explain()
    mine = wire(["gemini"], {"GEMINI_CLI_TRUST_WORKSPACE": "false"}, BASE, "s-1").env
    assert mine["GEMINI_CLI_TRUST_WORKSPACE"] == "false" and mine["GEMINI_API_KEY"]  # the user's choice kept
    assert not wire(["claude"], {}, BASE, "s-1").files
