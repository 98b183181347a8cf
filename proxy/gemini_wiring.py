"""What `ctxgate run` sets for Gemini CLI, which reads none of the OpenAI or Anthropic variables.

- `GOOGLE_GEMINI_BASE_URL`: ctxgate with the session in the path, without `/v1` (the CLI
  adds `/v1beta/models/...`); the session also as `X-Ctx-Session` in
  `GEMINI_CLI_CUSTOM_HEADERS`, beside the user's own headers.
- API-key auth: with a base URL set, Gemini CLI 0.61 takes its auth type from the settings
  only, so it is given a system settings file of ctxgate's (`GEMINI_CLI_SYSTEM_SETTINGS_PATH`):
  the system settings it would have read, with `security.auth.selectedType` set to
  `gemini-api-key`. The user's own settings files are not touched. The key is the user's
  `GEMINI_API_KEY` (their tenant key); a stand-in when none is set, which an open gateway takes.
- `GEMINI_CLI_TRUST_WORKSPACE=true` unless the user set it: run headless in a folder it has not
  been told to trust, the CLI stops and asks.
"""
from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from pathlib import Path
from typing import Any, Mapping

API_KEY_AUTH = "gemini-api-key"
NO_KEY = "ctxgate-no-key"
SHOWN = ("GOOGLE_GEMINI_BASE_URL", "GEMINI_CLI_CUSTOM_HEADERS", "GEMINI_CLI_SYSTEM_SETTINGS_PATH",
         "GEMINI_CLI_TRUST_WORKSPACE")
_SYSTEM_SETTINGS = {"darwin": "/Library/Application Support/GeminiCli/settings.json",
                    "win32": "C:\\ProgramData\\gemini-cli\\settings.json"}


def gemini_env(environ: Mapping[str, str], base: str, session: str) -> tuple[dict[str, str], dict[Path, str]]:
    """The variables to set, and the files to write before the CLI starts (path -> text)."""
    headers = [h.strip() for h in environ.get("GEMINI_CLI_CUSTOM_HEADERS", "").split(",")
               if h.strip() and not h.strip().lower().startswith("x-ctx-session:")]
    settings = _settings_path(session)
    env = {"GOOGLE_GEMINI_BASE_URL": f"{base}/s/{session}",
           "GEMINI_CLI_CUSTOM_HEADERS": ", ".join([*headers, f"X-Ctx-Session: {session}"]),
           "GEMINI_CLI_SYSTEM_SETTINGS_PATH": str(settings),
           "GEMINI_CLI_TRUST_WORKSPACE": environ.get("GEMINI_CLI_TRUST_WORKSPACE", "true"),
           "GEMINI_API_KEY": environ.get("GEMINI_API_KEY") or NO_KEY}
    return env, {settings: json.dumps(api_key_settings(_system_settings(environ)), indent=2)}


def api_key_settings(system: dict[str, Any]) -> dict[str, Any]:
    """`system` with API-key auth selected, everything else as it was."""
    security = dict(system.get("security") or {})
    security["auth"] = {**(security.get("auth") or {}), "selectedType": API_KEY_AUTH}
    return {**system, "security": security}


def _system_settings(environ: Mapping[str, str]) -> dict[str, Any]:
    """The system settings Gemini CLI would read without ctxgate; {} when there are none."""
    path = Path(environ.get("GEMINI_CLI_SYSTEM_SETTINGS_PATH") or _SYSTEM_SETTINGS.get(
        sys.platform, "/etc/gemini-cli/settings.json"))
    try:
        found = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def _settings_path(session: str) -> Path:
    """One file per session, named by a hash (a session id is the user's text)."""
    digest = hashlib.sha256(session.encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"ctxgate-gemini-{digest}" / "settings.json"
