"""Load the recorded agent runs in ../shared/trajectories as OpenAI chat messages.

The readers are `ctxgate replay`'s (`proxy/replay/formats.py`); this names the shared
files and keeps the sets the tests and benchmarks use. The files are never edited.

Every run carries a `dialect`, read from its file format (not from ctxgate's own
detection): how its agent sends actions and receives observations. `all_trajectories()`
is the tool-call and SWE-agent set the tests and most benchmarks were written against;
`every_dialect()` adds the text-protocol runs (OpenHands text, mini-swe-agent).
"""
from __future__ import annotations

import dataclasses
import glob
import os
from functools import lru_cache

from ctxgate.proxy.replay import formats
from ctxgate.proxy.replay.formats import (MINI_SWE_AGENT, OPENHANDS_TEXT, SWE_AGENT_TEXT, TOOL_CALLS,
                                          clean_message)
from ctxgate.proxy.replay.formats import Recording as Trajectory

__all__ = ["ROOT", "DIALECTS", "TOOL_CALLS", "OPENHANDS_TEXT", "SWE_AGENT_TEXT", "MINI_SWE_AGENT", "Trajectory",
           "clean_message", "dialect_of", "openhands", "tau_bench", "swe_agent", "openhands_text", "mini_swe_agent",
           "all_trajectories", "every_dialect"]

ROOT = os.environ.get("CTXGATE_TRAJECTORIES") or os.path.normpath(
    os.path.join(os.path.dirname(__file__), "..", "..", "shared", "trajectories"))
DIALECTS = (TOOL_CALLS, OPENHANDS_TEXT, SWE_AGENT_TEXT, MINI_SWE_AGENT)
_BY_SOURCE = {"openhands-text": OPENHANDS_TEXT, "mini-swe-agent": MINI_SWE_AGENT, "swe-agent": SWE_AGENT_TEXT}


def _require() -> None:
    """The recorded runs live beside the repository, not in it: on a bare clone every test
    that needs them is skipped, with this message, and the rest of the suite runs."""
    if not os.path.isdir(ROOT):
        import pytest  # only under pytest: a benchmark without the runs stops here, saying why
        pytest.skip(f"the recorded agent runs are not at {ROOT} (../shared/trajectories beside the repository, "
                    "or CTXGATE_TRAJECTORIES)", allow_module_level=True)


def dialect_of(trajectory: Trajectory) -> str:
    """The run's dialect: its own label; for a Trajectory made without one, tool calls if
    its messages have any, else the text protocol its source folder holds."""
    if trajectory.dialect:
        return trajectory.dialect
    if any(m.get("tool_calls") or m.get("role") == "tool" for m in trajectory.messages):
        return TOOL_CALLS
    return _BY_SOURCE.get(trajectory.source, SWE_AGENT_TEXT)


@lru_cache(maxsize=None)
def openhands() -> tuple[Trajectory, ...]:
    _require()
    path = os.path.join(ROOT, "swe-gym-openhands", "sample_raw.json")
    return tuple(formats.read_recordings(path, "openhands")[1])


@lru_cache(maxsize=None)
def tau_bench(limit: int | None = None) -> tuple[Trajectory, ...]:
    _require()
    path = os.path.join(ROOT, "tau-bench", "gpt-4o-airline.json")
    data, _ = formats.parse(path)
    return tuple(formats.tau_bench(path, data[:limit]))


@lru_cache(maxsize=None)
def swe_agent() -> tuple[Trajectory, ...]:
    _require()
    folder = os.path.join(ROOT, "swe-agent")
    out = []
    for path in sorted(glob.glob(os.path.join(folder, "**", "*.traj"), recursive=True)):
        data, _ = formats.parse(path)
        for run in formats.swe_agent(path, data):
            if len(run.messages) >= 3:
                out.append(dataclasses.replace(run, name="swe-agent/" + os.path.relpath(path, folder)))
    return tuple(out)


@lru_cache(maxsize=None)
def openhands_text() -> tuple[Trajectory, ...]:
    """OpenHands' non-function-calling format (ShareGPT-style SFT records): the system
    prompt, then human/gpt turns; actions are `<function=…>` blocks in the assistant text."""
    _require()
    out: list[Trajectory] = []
    for path in sorted(glob.glob(os.path.join(ROOT, "openhands-text", "*.json"))):
        out += formats.read_recordings(path, "openhands-text")[1]
    return tuple(out)


@lru_cache(maxsize=None)
def mini_swe_agent() -> tuple[Trajectory, ...]:
    _require()
    path = os.path.join(ROOT, "mini-swe-agent", "mini-coder_sample_raw.json")
    return tuple(formats.read_recordings(path, "mini-swe-agent")[1])


def all_trajectories() -> list[Trajectory]:
    return [*openhands(), *swe_agent(), *tau_bench()]


def every_dialect() -> list[Trajectory]:
    """all_trajectories() and the text-protocol runs: every recorded run, each with its dialect."""
    return [*all_trajectories(), *openhands_text(), *mini_swe_agent()]
