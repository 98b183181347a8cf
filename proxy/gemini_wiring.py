"""What `ctxgate run` sets for Gemini CLI, which reads none of the OpenAI or Anthropic variables.

- `GOOGLE_GEMINI_BASE_URL`: ctxgate with the session in the path, without `/v1` (the CLI
  adds `/v1beta/models/...`); the session also as `X-Ctx-Session` in
  `GEMINI_CLI_CUSTOM_HEADERS`, beside the user's own headers.
- API-key auth: with a base URL set, Gemini CLI 0.61 takes its auth type from its settings
  only (its system settings count only when root owns them and every folder above them), so it
  is given a home of ctxgate's (`GEMINI_CLI_HOME`): a `.gemini` whose `settings.json` is the
  user's with `security.auth.selectedType` set to `gemini-api-key`, every other entry a link to
  the user's own (history, memory, extensions). The user's files are not touched. The key is
  the user's `GEMINI_API_KEY` (their tenant key); a stand-in when none is set, which an open
  gateway takes.
- `GEMINI_CLI_TRUST_WORKSPACE=true` unless the user set it: run headless in a folder it has not
  been told to trust, the CLI stops and asks.
"""
from __future__ import annotations

import hashlib
import json
import tempfile
from pathlib import Path
from typing import Any, Mapping

API_KEY_AUTH = "gemini-api-key"
NO_KEY = "ctxgate-no-key"
SHOWN = ("GOOGLE_GEMINI_BASE_URL", "GEMINI_CLI_CUSTOM_HEADERS", "GEMINI_CLI_HOME", "GEMINI_CLI_TRUST_WORKSPACE")


def gemini_env(environ: Mapping[str, str], base: str,
               session: str) -> tuple[dict[str, str], dict[Path, str], dict[Path, Path]]:
    """The variables to set, the files to write (path -> text) and the links to make (link ->
    target) before the CLI starts."""
    headers = [h.strip() for h in environ.get("GEMINI_CLI_CUSTOM_HEADERS", "").split(",")
               if h.strip() and not h.strip().lower().startswith("x-ctx-session:")]
    home = _home_of(session)
    env = {"GOOGLE_GEMINI_BASE_URL": f"{base}/s/{session}",
           "GEMINI_CLI_CUSTOM_HEADERS": ", ".join([*headers, f"X-Ctx-Session: {session}"]),
           "GEMINI_CLI_HOME": str(home),
           "GEMINI_CLI_TRUST_WORKSPACE": environ.get("GEMINI_CLI_TRUST_WORKSPACE", "true"),
           "GEMINI_API_KEY": environ.get("GEMINI_API_KEY") or NO_KEY}
    own = _user_dir(environ)
    settings = api_key_settings(_read(own / "settings.json"))
    links = {home / ".gemini" / entry.name: entry for entry in _entries(own) if entry.name != "settings.json"}
    return env, {home / ".gemini" / "settings.json": json.dumps(settings, indent=2)}, links


def api_key_settings(system: dict[str, Any]) -> dict[str, Any]:
    """`system` with API-key auth selected, everything else as it was."""
    security = dict(system.get("security") or {})
    security["auth"] = {**(security.get("auth") or {}), "selectedType": API_KEY_AUTH}
    return {**system, "security": security}


def _user_dir(environ: Mapping[str, str]) -> Path:
    """The `.gemini` folder Gemini CLI would use without ctxgate."""
    return Path(environ.get("GEMINI_CLI_HOME") or environ.get("HOME") or Path.home()) / ".gemini"


def _entries(folder: Path) -> list[Path]:
    try:
        return sorted(folder.iterdir())
    except OSError:
        return []


def _read(path: Path) -> dict[str, Any]:
    try:
        found = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def _home_of(session: str) -> Path:
    """One home per session, named by a hash (a session id is the user's text)."""
    digest = hashlib.sha256(session.encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"ctxgate-gemini-{digest}"
