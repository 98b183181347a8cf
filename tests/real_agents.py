"""Real agents for the tests, installed from their registries, pinned, and kept between runs.

Each agent gets a virtualenv of its own under `CTXGATE_AGENTS_DIR` (default
`~/.cache/ctxgate/agents`): their dependencies (their own litellm, openai) never meet the
gateway's. A registry that cannot be reached skips the test with one line; any other
failure to install fails it.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

AGENTS_DIR = Path(os.environ.get("CTXGATE_AGENTS_DIR") or Path.home() / ".cache" / "ctxgate" / "agents")
PYPI_AGENTS = {"mini-swe-agent": "2.4.6", "openai-agents": "0.24.0"}
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
    done = subprocess.run([str(venv / "bin" / "pip"), "install", "--quiet", "--disable-pip-version-check",
                           f"{package}=={version}"], capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["pip failed"])[-1]
        if _UNREACHABLE.search(done.stderr):
            pytest.skip(f"{package}=={version}: the package registry cannot be reached ({last})")
        raise AssertionError(f"pip install {package}=={version} failed: {done.stderr[-2000:]}")
    installed.touch()
    return venv / "bin"
