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
import urllib.request
from pathlib import Path
from typing import Callable

import pytest

AGENTS_DIR = Path(os.environ.get("CTXGATE_AGENTS_DIR") or Path.home() / ".cache" / "ctxgate" / "agents")
PYPI_AGENTS = {"mini-swe-agent": "2.4.6", "openai-agents": "0.24.0", "aider-chat": "0.86.2",
               "openhands": "1.16.0"}
NPM_AGENTS = {"@openai/codex": "0.171.0", "@anthropic-ai/claude-code": "2.1.332", "@google/gemini-cli": "0.61.0"}
"""Pinned: a new release is taken on purpose, with the tests run against it."""
PYTHONS = {"openhands": "3.12"}
"""Agents that install only on another Python than the tests' own (OpenHands: 3.12 alone)."""
_UNREACHABLE = re.compile(r"Temporary failure in name resolution|Failed to establish a new connection|"
                          r"Network is unreachable|Connection refused|timed out|Could not fetch URL|"
                          r"No route to host|Name or service not known|ECONNREFUSED|ENOTFOUND|EAI_AGAIN|"
                          r"ETIMEDOUT|ECONNRESET|ENETUNREACH", re.I)


def pypi_agent(package: str) -> Path:
    """The bin directory of a virtualenv holding `package` at its pinned version."""
    version = PYPI_AGENTS[package]
    venv = AGENTS_DIR / f"{package}-{version}"
    installed = venv / ".installed"
    if installed.exists():
        return venv / "bin"
    AGENTS_DIR.mkdir(parents=True, exist_ok=True)
    subprocess.run([_python(package), "-m", "venv", "--clear", str(venv)], check=True, timeout=300)
    pip = str(venv / "bin" / "pip")
    _install(f"{package}=={version}", [pip, "install", "--quiet", "--disable-pip-version-check",
                                        f"{package}=={version}"], lambda: _index_unreachable(pip, package))
    installed.touch()
    return venv / "bin"


def _python(package: str) -> str:
    """The interpreter of `package`'s virtualenv: the tests' own, or the version it needs
    (`pythonX.Y` on PATH, else pyenv's); the test skips when none runs."""
    version = PYTHONS.get(package)
    if version is None:
        return sys.executable
    pyenv = Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv")
    installed = sorted(pyenv.glob(f"versions/{version}.*/bin/python{version}"))
    candidates = [shutil.which(f"python{version}"), *map(str, installed)]
    for candidate in candidates:  # a pyenv shim is on PATH but fails where that version is not selected
        if candidate and subprocess.run([candidate, "-c", ""], capture_output=True, timeout=60).returncode == 0:
            return candidate
    pytest.skip(f"{package}=={PYPI_AGENTS[package]}: needs Python {version}, which is not installed")


def npm_agent(package: str, command: str, version: str | None = None) -> Path:
    """The path of `command` from `package` at its pinned version (or `version`), installed with npm."""
    version = version or NPM_AGENTS[package]
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


_UNREACHED: dict[str, str] = {}
"""What could not be installed for want of its registry, and why: the next test needing it
skips at once instead of waiting for the registry again."""


def _install(what: str, argv: list[str], unreachable: Callable[[], bool] = lambda: False) -> None:
    if what in _UNREACHED:
        pytest.skip(_UNREACHED[what])
    done = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or ["failed"]
        why = next((line for line in lines if _UNREACHABLE.search(line)), lines[-1]).strip()
        if _UNREACHABLE.search(done.stderr) or unreachable():
            _UNREACHED[what] = f"{what}: the package registry cannot be reached ({why})"
            pytest.skip(_UNREACHED[what])
        raise AssertionError(f"installing {what} failed: {done.stderr[-2000:]}")


def _index_unreachable(pip: str, package: str) -> bool:
    """Whether pip's index does not answer for `package` (pip, quiet, says only that it found
    no version when it cannot connect)."""
    configured = subprocess.run([pip, "config", "get", "global.index-url"], capture_output=True, text=True)
    index = os.environ.get("PIP_INDEX_URL") or configured.stdout.strip() or "https://pypi.org/simple"
    try:
        with urllib.request.urlopen(f"{index.rstrip('/')}/{package}/", timeout=15):
            return False
    except (OSError, ValueError):
        return True
