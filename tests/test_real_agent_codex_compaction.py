"""Codex, unmodified, through `ctxgate run`, its own compaction forced early by a low
`model_auto_compact_token_limit`, both ways (docs/native-context.md): with
`--codex-remote-compaction` it asks ctxgate (WAL reason `client`); without, it compacts
locally, by a summary request of its own that goes through ctxgate to the upstream. Either
way the run goes on past it to its answer, on each of two routes (ROUTES): one that speaks
the Responses API, and one that speaks Chat Completions only, where ctxgate answers Codex's
compaction all the same and the upstream sees nothing but chats.

Codex's manual compaction (`/compact`) is not a command of `codex exec`: its app server's
`thread/compact/start` drives it in tests/test_real_agent_codex_manual_compaction.py."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from real_agents import npm_agent
from servers import KEYS, child_env, ctxgate_command
from test_real_agents import LIMIT, MODEL, STEPS, _limited
from upstream import ScriptedUpstream

ROUTES = ("openai", "chat")
"""`openai`: an OpenAI-compatible route, to which ctxgate forwards `/responses` as they are;
`chat`: a provider with no Responses API (`deepseek/`), to which litellm's bridge speaks Chat
Completions, so every turn and Codex's own summary request reach the model as chats."""


CHECKPOINT = "CONTEXT CHECKPOINT COMPACTION"
"""Codex's own summary prompt (its local compaction)."""


def _route(tmp_path: Path, route: str) -> tuple[ScriptedUpstream, Path]:
    """The scripted upstream and ctxgate's config, `MODEL` routed as `route` (ROUTES) says."""
    upstream, path = _limited(tmp_path, LIMIT, MODEL)
    if route == "chat":
        config = yaml.safe_load(path.read_text())
        entry = next(e for e in config["model_list"] if e["model_name"] == MODEL)
        entry["litellm_params"]["model"] = f"deepseek/{MODEL}"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
    return upstream, path


def _codex(tmp_path: Path, session: str, route: str, *launcher: str) -> tuple[subprocess.CompletedProcess[str],
                                                                              ScriptedUpstream]:
    """Codex run to its end through `ctxgate run` (`launcher`: its options) on `route`,
    compaction forced at 12K tokens."""
    codex = npm_agent("@openai/codex", "codex")
    upstream, config = _route(tmp_path, route)
    home = tmp_path / "home"
    home.mkdir()
    try:
        done = subprocess.run(
            [*ctxgate_command(), "run", "--config", str(config), "--session", session, *launcher,
             "--", str(codex), "exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox",
             "--model", MODEL, "-c", "model_auto_compact_token_limit=12000",
             "Run the steps you are given, one at a time."],
            cwd=tmp_path, capture_output=True, text=True, timeout=600,
            env={**child_env(), "HOME": str(home), "OPENAI_API_KEY": KEYS["acme"]})
    finally:
        upstream.stop()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"DONE-{STEPS}" in done.stdout, done.stdout[-3000:]
    served = {r.door for r in upstream.log if r.body and r.body.get("model") == MODEL}
    assert served == ({"responses"} if route == "openai" else {"chat"}), served
    return done, upstream


def _client_compactions(tmp_path: Path, session: str) -> list[dict[str, Any]]:
    wal = tmp_path / ".ctxgate" / "wal" / "acme" / f"wal_{session}.jsonl"
    events = [orjson.loads(line) for line in wal.read_text().splitlines() if line.strip()]
    return [e for e in events if e.get("reason") == "client" or (e.get("data") or {}).get("reason") == "client"]


def _summary_requests(upstream: ScriptedUpstream) -> list[Any]:
    """The requests carrying Codex's summary prompt: Responses `input`, or the chat `messages` of the bridge."""
    return [r for r in upstream.log if isinstance(r.body, dict)
            and CHECKPOINT in json.dumps(r.body.get("input") or r.body.get("messages"))]


@pytest.mark.parametrize("route", ROUTES)
def test_codex_compacts_locally_through_ctxgate_and_finishes(tmp_path: Path, route: str) -> None:
    _, upstream = _codex(tmp_path, "codex-local", route)
    summaries = _summary_requests(upstream)
    assert summaries, "Codex's own summary request never reached the upstream"
    for r in summaries:  # Codex asks for its summary with no tools: ctxgate adds none of its own
        assert not r.body.get("tools") and "ctxgate_expand" not in r.raw.decode(errors="replace")
    assert not _client_compactions(tmp_path, "codex-local")  # nothing asked of ctxgate's compaction


@pytest.mark.parametrize("route", ROUTES)
def test_codex_asks_ctxgate_to_compact_and_finishes(tmp_path: Path, route: str) -> None:
    _, upstream = _codex(tmp_path, "codex-remote", route, "--codex-remote-compaction")
    assert _client_compactions(tmp_path, "codex-remote"), "Codex never asked ctxgate to compact"
    assert not _summary_requests(upstream)  # it compacted on the server, not by a summary of its own
    assert not [r for r in upstream.log if "compaction" in r.raw.decode(errors="replace")
                and "ctxs1." in r.raw.decode(errors="replace")]  # the sealed item never went upstream
