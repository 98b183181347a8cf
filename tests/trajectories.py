"""Load the recorded agent runs in ../shared/trajectories as OpenAI chat messages.

The files are never edited; this converts them in memory: fields the OpenAI API does not
take (`index`, null values) are dropped, and SWE-agent's histories keep their shape
(commands in assistant text, observations in user turns, or real `tool_calls`).

Every run carries a `dialect`, read from its file format (not from ctxgate's own
detection): how its agent sends actions and receives observations. `all_trajectories()`
is the tool-call and SWE-agent set the tests and most benchmarks were written against;
`every_dialect()` adds the text-protocol runs (OpenHands text, mini-swe-agent).
"""
from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

ROOT = os.environ.get("CTXGATE_TRAJECTORIES") or os.path.normpath(
    os.path.join(os.path.dirname(__file__), "..", "..", "shared", "trajectories"))

_KEEP = ("role", "content", "tool_calls", "tool_call_id", "name")

TOOL_CALLS = "tool calls"
"""OpenAI `tool_calls` in assistant messages, results in `role: "tool"` messages."""
OPENHANDS_TEXT = "OpenHands text"
"""`<function=NAME><parameter=KEY>…` in assistant text, `EXECUTION RESULT of [NAME]:` user turns."""
SWE_AGENT_TEXT = "SWE-agent text"
"""A fenced command in assistant text, the observation as the next user turn."""
MINI_SWE_AGENT = "mini-swe-agent"
"""`THOUGHT:` + one ```` ```bash ```` block per assistant turn, `<returncode>` user turns."""
DIALECTS = (TOOL_CALLS, OPENHANDS_TEXT, SWE_AGENT_TEXT, MINI_SWE_AGENT)


@dataclass(frozen=True)
class Trajectory:
    name: str
    source: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    dialect: str = ""
    """One of DIALECTS, from the file format; empty only for a Trajectory made elsewhere (see dialect_of)."""


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


def clean_message(m: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in m.items() if k in _KEEP and v is not None}
    if out.get("role") == "tool":
        out.pop("name", None)
    if "tool_calls" in out:
        calls = []
        for tc in out["tool_calls"]:
            fn = tc.get("function") or {}
            args = fn.get("arguments")
            calls.append({"id": tc.get("id"), "type": "function",
                          "function": {"name": fn.get("name"),
                                       "arguments": args if isinstance(args, str) else json.dumps(args)}})
        out["tool_calls"] = calls
        out.setdefault("content", None)
        if out["content"] is None:
            out["content"] = ""
    if out.get("content") is None:
        out["content"] = ""
    if isinstance(out.get("content"), list):
        out["content"] = "".join(p.get("text", "") for p in out["content"] if isinstance(p, dict))
    return out


def _swe_agent_history(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    msgs = [clean_message(m) for m in history if m.get("role") in ("system", "user", "assistant", "tool")]
    return msgs


@lru_cache(maxsize=None)
def openhands() -> tuple[Trajectory, ...]:
    _require()
    path = os.path.join(ROOT, "swe-gym-openhands", "sample_raw.json")
    out = []
    for rec in json.load(open(path)):
        out.append(Trajectory(name=f"openhands/{rec['instance_id']}", source="swe-gym-openhands",
                              messages=[clean_message(m) for m in rec["messages"]], tools=rec.get("tools"),
                              dialect=TOOL_CALLS))
    return tuple(out)


@lru_cache(maxsize=None)
def tau_bench(limit: int | None = None) -> tuple[Trajectory, ...]:
    _require()
    path = os.path.join(ROOT, "tau-bench", "gpt-4o-airline.json")
    out = []
    for rec in json.load(open(path))[:limit]:
        out.append(Trajectory(name=f"tau-bench/{rec['task_id']}", source="tau-bench",
                              messages=[clean_message(m) for m in rec["traj"]], tools=None, dialect=TOOL_CALLS))
    return tuple(out)


@lru_cache(maxsize=None)
def swe_agent() -> tuple[Trajectory, ...]:
    _require()
    out = []
    for path in sorted(glob.glob(os.path.join(ROOT, "swe-agent", "**", "*.traj"), recursive=True)):
        data = json.load(open(path))
        history = data.get("history") or []
        msgs = _swe_agent_history(history)
        if len(msgs) >= 3:
            dialect = TOOL_CALLS if any(m.get("tool_calls") for m in msgs) else SWE_AGENT_TEXT
            out.append(Trajectory(name="swe-agent/" + os.path.relpath(path, os.path.join(ROOT, "swe-agent")),
                                  source="swe-agent", messages=msgs, tools=None, dialect=dialect))
    return tuple(out)


_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system",
          "tool": "user", "observation": "user", "function": "user"}
"""ShareGPT speakers as chat roles. The two files hold only human/gpt; a tool/observation
turn would be an observation of a text-protocol agent, which it sends as a user message."""


@lru_cache(maxsize=None)
def openhands_text() -> tuple[Trajectory, ...]:
    """OpenHands' non-function-calling format (ShareGPT-style SFT records): the system
    prompt, then human/gpt turns; actions are `<function=…>` blocks in the assistant text."""
    _require()
    out = []
    for path in sorted(glob.glob(os.path.join(ROOT, "openhands-text", "*.json"))):
        stem = os.path.basename(path).removesuffix("_sample_sft_openhands.json")
        with open(path) as f:
            records = json.load(f)
        for rec in records:
            msgs: list[dict[str, Any]] = [{"role": "system", "content": rec["system"]}] if rec.get("system") else []
            for turn in rec["conversations"]:
                speaker = turn.get("from")
                if speaker not in _ROLES:
                    raise ValueError(f"{path}: record {rec.get('id')}: unknown speaker {speaker!r}")
                msgs.append({"role": _ROLES[speaker], "content": turn.get("value") or ""})
            out.append(Trajectory(name=f"openhands-text/{stem}/{rec['id']}", source="openhands-text",
                                  messages=msgs, tools=None, dialect=OPENHANDS_TEXT))
    return tuple(out)


@lru_cache(maxsize=None)
def mini_swe_agent() -> tuple[Trajectory, ...]:
    _require()
    path = os.path.join(ROOT, "mini-swe-agent", "mini-coder_sample_raw.json")
    with open(path) as f:
        data = json.load(f)
    records = data if isinstance(data, list) else [data]
    out = []
    for k, rec in enumerate(records):
        msgs = [clean_message(m) for m in rec["messages"] if m.get("role") in ("system", "user", "assistant")]
        out.append(Trajectory(name=f"mini-swe-agent/mini-coder#{k}", source="mini-swe-agent", messages=msgs,
                              tools=None, dialect=MINI_SWE_AGENT))
    return tuple(out)


def all_trajectories() -> list[Trajectory]:
    return [*openhands(), *swe_agent(), *tau_bench()]


def every_dialect() -> list[Trajectory]:
    """all_trajectories() and the text-protocol runs: every recorded run, each with its dialect."""
    return [*all_trajectories(), *openhands_text(), *mini_swe_agent()]
