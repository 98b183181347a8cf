"""Load the recorded agent runs in ../shared/trajectories as OpenAI chat messages.

The files are never edited; this converts them in memory: fields the OpenAI API does not
take (`index`, null values) are dropped, and SWE-agent's histories keep their shape
(commands in assistant text, observations in user turns, or real `tool_calls`).
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


@dataclass(frozen=True)
class Trajectory:
    name: str
    source: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None


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
    path = os.path.join(ROOT, "swe-gym-openhands", "sample_raw.json")
    out = []
    for rec in json.load(open(path)):
        out.append(Trajectory(name=f"openhands/{rec['instance_id']}", source="swe-gym-openhands",
                              messages=[clean_message(m) for m in rec["messages"]], tools=rec.get("tools")))
    return tuple(out)


@lru_cache(maxsize=None)
def tau_bench(limit: int | None = None) -> tuple[Trajectory, ...]:
    path = os.path.join(ROOT, "tau-bench", "gpt-4o-airline.json")
    out = []
    for rec in json.load(open(path))[:limit]:
        out.append(Trajectory(name=f"tau-bench/{rec['task_id']}", source="tau-bench",
                              messages=[clean_message(m) for m in rec["traj"]], tools=None))
    return tuple(out)


@lru_cache(maxsize=None)
def swe_agent() -> tuple[Trajectory, ...]:
    out = []
    for path in sorted(glob.glob(os.path.join(ROOT, "swe-agent", "**", "*.traj"), recursive=True)):
        data = json.load(open(path))
        history = data.get("history") or []
        msgs = _swe_agent_history(history)
        if len(msgs) >= 3:
            out.append(Trajectory(name="swe-agent/" + os.path.relpath(path, os.path.join(ROOT, "swe-agent")),
                                  source="swe-agent", messages=msgs, tools=None))
    return tuple(out)


def all_trajectories() -> list[Trajectory]:
    return [*openhands(), *swe_agent(), *tau_bench()]
