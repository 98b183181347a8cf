"""Codex, unmodified, through `ctxgate run --codex-remote-compaction` on a Chat-Completions-only
route (the scripted upstream): its own compaction, forced early by a low
`model_auto_compact_token_limit`, is asked of ctxgate (`/responses/compact`, docs/native-context.md)
and the run goes on past it to its answer."""
from __future__ import annotations

import subprocess
from pathlib import Path

import orjson

from real_agents import npm_agent
from servers import KEYS, child_env, ctxgate_command
from test_real_agents import MODEL, STEPS, _limited


def test_codex_asks_ctxgate_to_compact_and_finishes(tmp_path: Path) -> None:
    codex = npm_agent("@openai/codex", "codex")
    upstream, config = _limited(tmp_path, 24_000, MODEL)
    home = tmp_path / "home"
    home.mkdir()
    try:
        done = subprocess.run(
            [*ctxgate_command(), "run", "--config", str(config), "--session", "codex-remote",
             "--codex-remote-compaction", "--", str(codex), "exec", "--skip-git-repo-check",
             "--dangerously-bypass-approvals-and-sandbox", "--model", MODEL,
             "-c", "model_auto_compact_token_limit=12000", "Run the steps you are given, one at a time."],
            cwd=tmp_path, capture_output=True, text=True, timeout=600,
            env={**child_env(), "HOME": str(home), "OPENAI_API_KEY": KEYS["acme"]})
    finally:
        upstream.stop()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"DONE-{STEPS}" in done.stdout, done.stdout[-3000:]
    wal = tmp_path / ".ctxgate" / "wal" / "acme" / "wal_codex-remote.jsonl"
    events = [orjson.loads(line) for line in wal.read_text().splitlines() if line.strip()]
    asked = [e for e in events if e.get("reason") == "client" or (e.get("data") or {}).get("reason") == "client"]
    assert asked, "Codex never asked ctxgate to compact"
    assert not [r for r in upstream.log if "compaction" in r.raw.decode(errors="replace")
                and "ctxs1." in r.raw.decode(errors="replace")]  # the sealed item never went upstream
