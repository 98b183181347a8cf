"""Real agents for the tests, installed from their registries, pinned, and kept between runs.

Each agent gets a virtualenv of its own under `CTXGATE_AGENTS_DIR` (default
`~/.cache/ctxgate/agents`): their dependencies (their own litellm, openai) never meet the
gateway's. A registry that cannot be reached skips the test with one line; any other
failure to install fails it.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

AGENTS_DIR = Path(os.environ.get("CTXGATE_AGENTS_DIR") or Path.home() / ".cache" / "ctxgate" / "agents")
PYPI_AGENTS = {"mini-swe-agent": "2.4.6", "openai-agents": "0.24.0"}
NPM_AGENTS = {"@openai/codex": "0.171.0", "@anthropic-ai/claude-code": "2.1.332"}
"""Pinned: a new release is taken on purpose, with the tests run against it."""
_UNREACHABLE = re.compile(r"Temporary failure in name resolution|Failed to establish a new connection|"
                          r"Network is unreachable|Connection refused|timed out|Could not fetch URL|"
                          r"No route to host|Name or service not known", re.I)


def pypi_agent(package: str) -> Path:
    """The bin directory of a virtualenv holding `package` at its pinned version."""
    version = PYPI_AGENTS[package]
    venv = AGENTS_DIR / f"{package}-{version}"
    installed = venv / ".installed"
    if installed.exists():
        return venv / "bin"
    AGENTS_DIR.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True, timeout=300)
    _install(f"{package}=={version}", [str(venv / "bin" / "pip"), "install", "--quiet",
                                        "--disable-pip-version-check", f"{package}=={version}"])
    installed.touch()
    return venv / "bin"


def npm_agent(package: str, command: str) -> Path:
    """The path of `command` from `package` at its pinned version, installed with npm."""
    version = NPM_AGENTS[package]
    if shutil.which("npm") is None:
        pytest.skip(f"{package}@{version}: npm is not installed")
    prefix = AGENTS_DIR / f"npm-{package.replace('/', '-').lstrip('@')}-{version}"
    installed = prefix / ".installed"
    if not installed.exists():
        prefix.mkdir(parents=True, exist_ok=True)
        _install(f"{package}@{version}", ["npm", "install", "--prefix", str(prefix), "--no-audit", "--no-fund",
                                          "--loglevel=error", f"{package}@{version}"])
        installed.touch()
    return prefix / "node_modules" / ".bin" / command


def _install(what: str, argv: list[str]) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["failed"])[-1]
        if _UNREACHABLE.search(done.stderr) or "ENOTFOUND" in done.stderr or "EAI_AGAIN" in done.stderr:
            pytest.skip(f"{what}: the package registry cannot be reached ({last})")
        raise AssertionError(f"installing {what} failed: {done.stderr[-2000:]}")
