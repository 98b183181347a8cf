"""OpenHands, unmodified, through `ctxgate run`: the `openhands` CLI from PyPI (pinned, kept
between runs: tests/real_agents.py), headless on one task in a local workspace (no Docker, no
browser), against the scripted model (tests/agent_steps.py) well past its context limit and
through several compaction points, to its final answer, as tests/test_real_agents.py runs the
other agents.

OpenHands takes `LLM_BASE_URL` only with `--override-with-envs`, which `ctxgate run` adds: the
command here is the one a user types.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ctxgate.pipeline.turns import is_valid_sequence
from real_agents import pypi_agent
from servers import KEYS
from test_real_agents import LIMIT, MODEL, STEPS, _check_upstream, _limited, _run

NO_GITHUB = {"GIT_CONFIG_COUNT": "1", "GIT_CONFIG_KEY_0": "url.file:///nonexistent/.insteadOf",
             "GIT_CONFIG_VALUE_0": "https://github.com/"}
"""OpenHands clones its public skills from GitHub at every start, and carries on without them
when it cannot: git is sent nowhere, so nothing is downloaded and the prompt is the same online
and offline."""


def _events(home: Path) -> list[dict[str, Any]]:
    """The events of the one conversation OpenHands saved under `home`, in order."""
    conversations = list((home / ".openhands" / "conversations").iterdir())
    assert len(conversations) == 1, conversations
    return [json.loads(p.read_text()) for p in sorted((conversations[0] / "events").glob("event-*.json"))]


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
def test_openhands_runs_past_its_limit_to_its_answer(tmp_path: Path, provider: str) -> None:
    """OpenHands speaks Chat Completions (an `openai/` model) or Messages (an `anthropic/` one)
    with native tool calls (`terminal`, whose `security_risk` is required) and ends when the
    model answers in plain text."""
    bin_dir = pypi_agent("openhands")
    upstream, config = _limited(tmp_path, LIMIT, MODEL)
    try:
        done = _run(config, f"openhands-{provider}", [str(bin_dir / "openhands"), "--headless", "-t",
                                            "Run the steps you are given, one at a time."], tmp_path,
                    LLM_MODEL=f"{provider}/{MODEL}", LLM_API_KEY=KEYS["acme"], **NO_GITHUB)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert f"DONE-{STEPS}" in done.stdout, done.stdout[-3000:]
        events = _events(tmp_path / "home")
        final = events[-1]
        assert final["kind"] == "MessageEvent" and final["source"] == "agent", final
        assert [c["text"] for c in final["llm_message"]["content"]] == [f"DONE-{STEPS}"], final
        # The prompt shrank by ctxgate's compaction, not by OpenHands' own condenser.
        assert not [e for e in events if e["kind"].startswith("Condensation")]
        for r in _check_upstream(upstream, "chat"):
            assert is_valid_sequence(r.body["messages"]), r.body["messages"]
            assert r.body["tools"][0]["function"]["name"] == "terminal"  # the agent's tool reached the model
    finally:
        upstream.stop()
