"""What `ctxgate run` sets for the agent it starts, agent by agent.

Every agent gets the variables the OpenAI and Anthropic SDKs read (`agent_env`), with the
session in the base URLs. An agent that reads none of them gets what it does read:

- **Codex** ignores `OPENAI_BASE_URL` and talks to its own host, first over a WebSocket: it
  gets a model provider of its own through `-c` overrides (`wire_api = "responses"`, HTTP),
  made the one it uses. The user's `~/.codex/config.toml` is not touched. Codex compacts
  on the server only with a provider it takes for OpenAI's (named "OpenAI"): with
  `remote_compaction` the provider is given that name, and Codex asks ctxgate for
  `/responses/compact` instead of compacting locally (docs/native-context.md).
- **OpenHands** (the `openhands` CLI) reads `LLM_BASE_URL` only when given
  `--override-with-envs`, else the settings it saved under `~/.openhands` (their own base
  URL): it gets the OpenAI base URL there (the Anthropic one when `LLM_MODEL` names an
  `anthropic/` model) and the flag, which overrides for this run only.
- **aider** and **mini-swe-agent** call models through litellm, which prefers
  `ANTHROPIC_API_BASE` to `ANTHROPIC_BASE_URL` and `OPENAI_BASE_URL` to `OPENAI_API_BASE`:
  every agent gets all four, so a user's own `ANTHROPIC_API_BASE` cannot send one around
  ctxgate.
- **Claude Code** and programs on the OpenAI or Anthropic SDKs read the variables every
  agent gets.
- **Gemini CLI** reads none of them: it gets its own base URL, headers, auth and workspace
  trust (`gemini_wiring.py`), its settings files untouched.
"""
from __future__ import annotations

import json
import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from .gemini_wiring import SHOWN as GEMINI_SHOWN, gemini_env

CODEX_PROVIDER = "ctxgate"
"""The model provider `ctxgate run` gives Codex."""
CODEX_OPENAI_NAME = "OpenAI"
"""The provider name Codex's remote compaction requires."""
OPENHANDS_ENV_FLAG = "--override-with-envs"
"""What makes OpenHands take `LLM_BASE_URL` (and `LLM_MODEL`, `LLM_API_KEY`) over its saved settings."""
SHOWN_VARIABLES = ("OPENAI_BASE_URL", "OPENAI_API_BASE", "ANTHROPIC_BASE_URL", "ANTHROPIC_API_BASE",
                   "ANTHROPIC_CUSTOM_HEADERS", "LLM_BASE_URL", *GEMINI_SHOWN, "CTXGATE_URL", "CTXGATE_SESSION",
                   "NO_PROXY")
AGENTS = {"claude": "Claude Code", "codex": "Codex", "aider": "aider", "mini": "mini-swe-agent",
          "mini-extra": "mini-swe-agent", "mini-swe-agent": "mini-swe-agent", "openhands": "OpenHands",
          "gemini": "Gemini CLI"}
"""The agents recognised by their command's name."""


@dataclass
class Wiring:
    """The agent's command line and environment, and what `--explain` says of them."""
    argv: list[str]
    env: dict[str, str]
    added_args: list[str] = field(default_factory=list)
    agent: str = "generic"
    files: dict[Path, str] = field(default_factory=dict)
    """Files to write before the agent starts (Gemini CLI's settings of ctxgate's)."""
    links: dict[Path, Path] = field(default_factory=dict)
    """Links to make before it starts (link -> target: the rest of Gemini CLI's own folder)."""

    def explain(self) -> str:
        lines = [f"ctxgate run: agent recognised as {self.agent}", "  variables set:"]
        lines += [f"    {name}={shlex.quote(self.env[name])}" for name in SHOWN_VARIABLES if name in self.env]
        if self.added_args:
            lines += ["  arguments added:", "    " + shlex.join(self.added_args)]
        lines += [f"  file written: {path} (the user's settings with API-key auth; theirs untouched)"
                  for path in self.files]
        if self.links:
            lines.append(f"  {len(self.links)} links beside it to the user's own entries")
        return "\n".join(lines)


def wire(argv: list[str], environ: Mapping[str, str], base: str, session: str,
         remote_compaction: bool = False) -> Wiring:
    """How to start `argv` so that it talks to the ctxgate at `base` in `session`
    (`remote_compaction`: Codex asks ctxgate to compact, rather than compacting itself)."""
    env = agent_env(environ, base, session)
    agent = AGENTS.get(os.path.basename(argv[0]), "generic")
    if agent == "Codex":
        added = codex_overrides(f"{base}/s/{session}/v1", "OPENAI_API_KEY" if environ.get("OPENAI_API_KEY") else None,
                                remote_compaction)
        return Wiring([argv[0], *added, *argv[1:]], env, added, agent)
    if agent == "OpenHands":
        # litellm inside it appends /v1/messages to an Anthropic model's base URL.
        anthropic = environ.get("LLM_MODEL", "").startswith("anthropic/")
        env["LLM_BASE_URL"] = env["ANTHROPIC_BASE_URL"] if anthropic else env["OPENAI_BASE_URL"]
        added = [] if OPENHANDS_ENV_FLAG in argv else [OPENHANDS_ENV_FLAG]
        return Wiring([argv[0], *added, *argv[1:]], env, added, agent)  # before any subcommand
    if agent == "Gemini CLI":
        own, files, links = gemini_env(environ, base, session)
        env.update(own)
        return Wiring(list(argv), env, agent=agent, files=files, links=links)
    return Wiring(list(argv), env, agent=agent)


def codex_overrides(base_url: str, env_key: str | None, remote_compaction: bool = False) -> list[str]:
    """`-c` overrides (TOML values) that give Codex a Responses provider over HTTP at `base_url`."""
    values = {"model_provider": CODEX_PROVIDER,
              f"model_providers.{CODEX_PROVIDER}.name": CODEX_OPENAI_NAME if remote_compaction else "ctxgate",
              f"model_providers.{CODEX_PROVIDER}.base_url": base_url,
              f"model_providers.{CODEX_PROVIDER}.wire_api": "responses"}
    if env_key:
        values[f"model_providers.{CODEX_PROVIDER}.env_key"] = env_key
    out: list[str] = []
    for key, value in values.items():
        out += ["-c", f"{key}={json.dumps(value)}"]  # a TOML basic string: JSON's string escapes are TOML's
    return out


def agent_env(environ: Mapping[str, str], base: str, session: str) -> dict[str, str]:
    """The user's environment (API keys included, untouched) plus where ctxgate is and which session this is."""
    env = dict(environ)
    # Claude Code sends one `Name: value` per line; an inherited X-Ctx-Session would name another session.
    headers = [line for line in env.get("ANTHROPIC_CUSTOM_HEADERS", "").splitlines()
               if line.strip() and not line.lower().startswith("x-ctx-session:")]
    # The session is in the base URLs (ctxgate serves every door under /s/<session>/ too): an
    # agent that reads its base URL from the environment but no headers still names its session.
    own = f"{base}/s/{session}"
    env.update(
        ANTHROPIC_BASE_URL=own,  # no /v1: the Anthropic SDK and Claude Code append /v1/messages
        ANTHROPIC_API_BASE=own,  # litellm's first choice (aider, mini-swe-agent)
        OPENAI_BASE_URL=f"{own}/v1",
        OPENAI_API_BASE=f"{own}/v1",  # older OpenAI SDKs and tools built on them
        CTXGATE_URL=base,
        CTXGATE_SESSION=session,
        ANTHROPIC_CUSTOM_HEADERS="\n".join([*headers, f"X-Ctx-Session: {session}"]),
    )
    # An agent honouring the user's HTTP(S)_PROXY must still reach a local ctxgate directly.
    for name in ("NO_PROXY", "no_proxy"):
        kept = [h for h in env.get(name, "").split(",") if h.strip()]
        env[name] = ",".join([*kept, *(h for h in ("127.0.0.1", "localhost") if h not in kept)])
    return env
