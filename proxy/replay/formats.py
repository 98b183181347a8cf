"""Recorded agent sessions read into chat messages, whatever tool recorded them.

A file holds one session or several. Its format is told by its content (`detect`), or
named (`FORMATS`). The files are never changed: fields the OpenAI API does not take
(`index`, null values) are dropped in memory, text-protocol histories keep their shape
(commands in assistant text, observations in user turns), and a Claude Code transcript
becomes what the Messages door makes of a request: Anthropic content blocks as sent.

Every session carries a `dialect`, read from its file format (not from ctxgate's own
detection): how its agent sends actions and receives observations.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Callable

from ..doors.messages_model import conversation_of

Message = dict[str, Any]

TOOL_CALLS = "tool calls"
"""OpenAI `tool_calls` in assistant messages, results in `role: "tool"` messages."""
OPENHANDS_TEXT = "OpenHands text"
"""`<function=NAME><parameter=KEY>…` in assistant text, `EXECUTION RESULT of [NAME]:` user turns."""
SWE_AGENT_TEXT = "SWE-agent text"
"""A fenced command in assistant text, the observation as the next user turn."""
MINI_SWE_AGENT = "mini-swe-agent"
"""`THOUGHT:` + one ```` ```bash ```` block per assistant turn, `<returncode>` user turns."""
ANTHROPIC_BLOCKS = "Anthropic blocks"
"""`tool_use` blocks in assistant turns, `tool_result` blocks in user turns (Claude Code)."""
PLAIN_CHAT = "plain chat"
"""No tool protocol the file format names: ctxgate's own detection reads it."""

_KEEP = ("role", "content", "tool_calls", "tool_call_id", "name")


class FormatError(ValueError):
    """A file no reader can take: the message says which file and why."""


@dataclass(frozen=True)
class Recording:
    """One recorded session as chat messages."""
    name: str
    source: str
    """The format (or, for the shared recordings, the folder) it came from."""
    messages: list[Message]
    tools: list[dict[str, Any]] | None
    dialect: str = ""
    """From the file format; empty only for a Recording made elsewhere."""
    model: str = ""
    """The model the agent used, when the file says."""


def clean_message(m: Message) -> Message:
    """An OpenAI chat message as the API takes it: known fields, no nulls, string content."""
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
    if out.get("content") is None:
        out["content"] = ""
    if isinstance(out.get("content"), list):
        out["content"] = "".join(p.get("text", "") for p in out["content"] if isinstance(p, dict))
    return out


def _stem(path: str) -> str:
    return os.path.basename(path).split(".")[0]


def _has_tool_calls(messages: list[Message]) -> bool:
    return any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)


def _text_dialect(messages: list[Message]) -> str:
    """The text protocol a chat history's content shows (tool calls first: they are structural)."""
    if _has_tool_calls(messages):
        return TOOL_CALLS
    users = [str(m["content"]) for m in messages if m.get("role") == "user" and isinstance(m.get("content"), str)]
    if any("<returncode>" in u for u in users):
        return MINI_SWE_AGENT
    if any(u.startswith("EXECUTION RESULT of [") for u in users):
        return OPENHANDS_TEXT
    return PLAIN_CHAT


def openai_messages(path: str, data: Any) -> list[Recording]:
    """A JSON list of chat messages, an object with `messages` (and maybe `tools`), or JSONL of messages."""
    if isinstance(data, dict):
        messages, tools, model = data["messages"], data.get("tools"), str(data.get("model") or "")
    else:
        messages, tools, model = data, None, ""
    msgs = [clean_message(m) for m in messages if m.get("role") in ("system", "developer", "user", "assistant", "tool")]
    dialect = _text_dialect(msgs)
    source = "mini-swe-agent" if dialect == MINI_SWE_AGENT else "openai"
    return [Recording(_stem(path), source, msgs, tools, dialect, model)]


def openhands_records(path: str, data: Any) -> list[Recording]:
    """OpenHands SWE-Gym records: `[{instance_id, messages, tools, ...}]`, OpenAI tool calls."""
    out = []
    for rec in data:
        msgs = [clean_message(m) for m in rec["messages"]]
        out.append(Recording(f"openhands/{rec['instance_id']}", "swe-gym-openhands", msgs, rec.get("tools"),
                             TOOL_CALLS))
    return out


def mini_swe_agent_records(path: str, data: Any) -> list[Recording]:
    """mini-swe-agent runs: `{messages}` or a list of them; text protocol, `<returncode>` observations."""
    records = data if isinstance(data, list) else [data]
    out = []
    for k, rec in enumerate(records):
        msgs = [clean_message(m) for m in rec["messages"] if m.get("role") in ("system", "user", "assistant")]
        out.append(Recording(f"mini-swe-agent/{_stem(path).removesuffix('_sample_raw')}#{k}", "mini-swe-agent",
                             msgs, None, MINI_SWE_AGENT, str(rec.get("model") or "")))
    return out


def tau_bench(path: str, data: Any) -> list[Recording]:
    """tau-bench results: `[{task_id, traj, ...}]`, `traj` OpenAI messages with tool calls."""
    return [Recording(f"tau-bench/{rec['task_id']}", "tau-bench", [clean_message(m) for m in rec["traj"]], None,
                      TOOL_CALLS) for rec in data]


def swe_agent(path: str, data: Any) -> list[Recording]:
    """A SWE-agent `.traj`: its `history` is the chat the model saw (demonstrations included)."""
    msgs = [clean_message(m) for m in data["history"] if m.get("role") in ("system", "user", "assistant", "tool")]
    dialect = TOOL_CALLS if any(m.get("tool_calls") for m in msgs) else SWE_AGENT_TEXT
    return [Recording(f"swe-agent/{_stem(path)}", "swe-agent", msgs, None, dialect)]


_SPEAKERS = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system",
             "tool": "user", "observation": "user", "function": "user"}
"""ShareGPT speakers as chat roles. A tool/observation turn is an observation of a
text-protocol agent, which it sends as a user message."""


def openhands_text(path: str, data: Any) -> list[Recording]:
    """OpenHands' non-function-calling SFT records: `[{id, system, conversations: [{from, value}]}]`."""
    stem = _stem(path).removesuffix("_sample_sft_openhands")
    out = []
    for rec in data:
        msgs: list[Message] = [{"role": "system", "content": rec["system"]}] if rec.get("system") else []
        for turn in rec["conversations"]:
            speaker = turn.get("from")
            if speaker not in _SPEAKERS:
                raise FormatError(f"{path}: record {rec.get('id')}: unknown speaker {speaker!r}")
            msgs.append({"role": _SPEAKERS[speaker], "content": turn.get("value") or ""})
        out.append(Recording(f"openhands-text/{stem}/{rec['id']}", "openhands-text", msgs, None, OPENHANDS_TEXT))
    return out


def _conversation_lines(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The user and assistant lines of the branch the session ended on. Claude Code links
    every line to its parent (`uuid`, `parentUuid`); a rewound or edited turn leaves the
    abandoned branch in the file, and its own compaction starts a new chain. When every
    such line is linked, the chain is walked back from the last one; otherwise the lines
    are taken in file order."""
    talk = [line for line in lines if line.get("type") in ("user", "assistant") and not line.get("isSidechain")]
    if not talk or not all(line.get("uuid") for line in talk):
        return talk
    by_uuid = {line["uuid"]: line for line in lines if line.get("uuid")}
    chain, seen = [], set()
    line: dict[str, Any] | None = talk[-1]
    while line is not None and line["uuid"] not in seen:
        seen.add(line["uuid"])
        chain.append(line)
        line = by_uuid.get(line.get("parentUuid") or "")
    return [line for line in reversed(chain) if line.get("type") in ("user", "assistant")]


def claude_code(path: str, lines: Any) -> list[Recording]:
    """A Claude Code transcript: JSONL, one `user` or `assistant` line per content the client
    logged (an assistant reply is often split over several lines of one message id, tool
    results arrive as their own user lines). Meta, sidechain, summary and other lines are
    skipped; consecutive lines of one role are one Messages API turn, as Claude Code sends
    them. Only the branch the session ended on is read (`_conversation_lines`); after Claude
    Code's own compaction (an `isCompactSummary` line) the history starts again from its
    summary, as Claude Code's requests then do. The turns then go through the Messages
    door's own reading (`conversation_of`)."""
    turns: list[Message] = []
    model = ""
    for line in _conversation_lines([line for line in lines if isinstance(line, dict)]):
        if line.get("isMeta"):
            continue
        message = line.get("message") or {}
        role, content = message.get("role"), message.get("content")
        if role not in ("user", "assistant") or content in (None, "", []):
            continue
        model = str(message.get("model") or model)
        blocks = content if isinstance(content, list) else [{"type": "text", "text": content}]
        if line.get("isCompactSummary"):
            turns = []  # Claude Code's own /compact: its later requests start from this summary
        if turns and turns[-1]["role"] == role:
            turns[-1]["content"].extend(blocks)
        else:
            turns.append({"role": role, "content": list(blocks)})
    if not turns:
        raise FormatError(f"{path}: a Claude Code transcript with no user or assistant messages")
    neutral = conversation_of({"model": model or "claude", "messages": turns}).neutral
    return [Recording(_stem(path), "claude-code", neutral, None, ANTHROPIC_BLOCKS, model)]


Reader = Callable[[str, Any], list[Recording]]
FORMATS: dict[str, Reader] = {
    "openai": openai_messages, "claude-code": claude_code, "swe-agent": swe_agent, "openhands": openhands_records,
    "openhands-text": openhands_text, "mini-swe-agent": mini_swe_agent_records, "tau-bench": tau_bench,
}


def _records_of(data: Any) -> list[dict[str, Any]]:
    return data if isinstance(data, list) and data and all(isinstance(r, dict) for r in data) else []


def detect(data: Any, jsonl: bool) -> str:
    """The format of a parsed file; FormatError when none fits."""
    records = _records_of(data)
    if jsonl:
        if records and any(r.get("type") in ("user", "assistant") and isinstance(r.get("message"), dict)
                           for r in records):
            return "claude-code"
        if records and all("role" in r for r in records):
            return "openai"
    elif isinstance(data, dict):
        if isinstance(data.get("history"), list):
            return "swe-agent"
        if isinstance(data.get("messages"), list):
            texts = [m for m in data["messages"] if isinstance(m, dict)]
            return "mini-swe-agent" if _text_dialect(texts) == MINI_SWE_AGENT else "openai"
    elif records:
        first = records[0]
        if all("role" in r for r in records):
            return "openai"
        if "traj" in first:
            return "tau-bench"
        if "conversations" in first:
            return "openhands-text"
        if isinstance(first.get("messages"), list):
            texts = [m for r in records for m in r["messages"] if isinstance(m, dict)]
            return "mini-swe-agent" if _text_dialect(texts) == MINI_SWE_AGENT else "openhands"
    raise FormatError("not a recorded session ctxgate can read (OpenAI messages, Claude Code JSONL, SWE-agent "
                      ".traj, OpenHands, mini-swe-agent or tau-bench)")


def parse(path: str) -> tuple[Any, bool]:
    """The file's JSON, or its JSONL lines as a list; and whether it was JSONL."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise FormatError(f"{path}: cannot read: {e}") from None
    try:
        return json.loads(text), False
    except json.JSONDecodeError:
        pass
    lines = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                lines.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise FormatError(f"{path}: neither JSON nor JSONL (line {n}: {e.msg})") from None
    return lines, True


def read_recordings(path: str, fmt: str | None = None) -> tuple[str, list[Recording]]:
    """The format of the file at `path` (as named, or as its content shows) and every session in it."""
    data, jsonl = parse(path)
    try:
        name = fmt or detect(data, jsonl)
    except FormatError as e:
        raise FormatError(f"{path}: {e}") from None
    if name not in FORMATS:
        raise FormatError(f"unknown format {name!r} (one of {', '.join(FORMATS)})")
    try:
        found = FORMATS[name](path, data)
    except FormatError:
        raise
    except (KeyError, TypeError, AttributeError, IndexError) as e:
        raise FormatError(f"{path}: cannot be read as {name} ({type(e).__name__}: {e})") from None
    found = [r for r in found if sum(m.get("role") == "assistant" for m in r.messages) > 0]
    if not found:
        raise FormatError(f"{path}: no session with an assistant turn in it")
    return name, found
