"""The three front doors of the overhead bench (each non-stream and streamed): one conversation,
three wire formats.

bench/overhead.py builds its conversations as chat-completions messages (real trajectory
messages, see common.build_conversation); each door here turns such a list into the body
its API takes, in code:

- chat: `{"model", "messages"}` as is.
- messages (Anthropic): the system messages become `system`; user and tool messages become
  user turns (a tool message a `tool_result` block, consecutive ones merged into one turn, a
  user message following tool results joins that turn), an assistant message an assistant
  turn (its text, then one `tool_use` block per tool call, `input` the parsed arguments), so
  the turns alternate and start with the user; `tools` lists every tool name used (the API
  refuses `tool_use` blocks without them), `max_tokens` 1024.
- responses (OpenAI Responses): the system messages become `instructions`; user and
  assistant messages `message` items (`input_text` / `output_text` parts), a tool call a
  `function_call` item, a tool message a `function_call_output` item; `store: false`, as
  Codex sends it.
- chat-stream, messages-stream, responses-stream: the same bodies with `stream: true`; the reply
  is that API's SSE stream, read back as its text (chat: the chunks' `delta.content`; Messages:
  the `text_delta`s; Responses: the `response.output_text.delta`s), and a stream that does not
  end on its terminator (`[DONE]`, `message_stop`, `response.completed`) fails the check.

`model_list` gives the bench's routes (an OpenAI one for chat and Responses, an Anthropic
one for Messages, both on the scripted upstream); `served` tells whether a running ctxgate
has a door; `litellm_proxy_command` finds a LiteLLM proxy to compare with.

    .venv/bin/python bench/doors.py      # converts the bench's conversations and checks them
"""
from __future__ import annotations

import os
import re
import subprocess
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import orjson

Message = dict[str, Any]

CHAT_MODEL = "gpt-4o"
CLAUDE_MODEL = "claude-sonnet-4-5"
ANTHROPIC_VERSION = "2023-06-01"


def _text(content: Any) -> str:
    """A chat message's content as one string (a list of parts: their text, joined)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(p.get("text", "") for p in content if isinstance(p, dict))


_ID_BAD = re.compile(r"[^A-Za-z0-9_-]")


def _tool_id(raw: Any, n: int) -> str:
    """Anthropic's ids match ^[a-zA-Z0-9_-]+$; the trajectories' are already that way."""
    return _ID_BAD.sub("_", str(raw)) if raw else f"toolu_bench_{n}"


def _arguments(raw: Any) -> dict[str, Any]:
    if isinstance(raw, dict):
        return raw
    try:
        parsed = orjson.loads(raw or "{}")
    except orjson.JSONDecodeError:
        return {"raw": raw}
    return parsed if isinstance(parsed, dict) else {"value": parsed}


# ---------------------------------------------------------------------------------------
# Anthropic Messages


def to_anthropic(messages: list[Message], model: str = CLAUDE_MODEL) -> dict[str, Any]:
    system: list[str] = []
    turns: list[dict[str, Any]] = []
    tools: dict[str, None] = {}
    n = 0

    def add(role: str, blocks: list[dict[str, Any]]) -> None:
        if turns and turns[-1]["role"] == role:
            turns[-1]["content"].extend(blocks)
        else:
            turns.append({"role": role, "content": blocks})

    for m in messages:
        role, text = m.get("role"), _text(m.get("content"))
        if role in ("system", "developer"):
            system.append(text)
        elif role == "user":
            add("user", [{"type": "text", "text": text or "(empty)"}])
        elif role == "tool":
            add("user", [{"type": "tool_result", "tool_use_id": _tool_id(m.get("tool_call_id"), n),
                          "content": text or "(no output)"}])
        elif role == "assistant":
            blocks: list[dict[str, Any]] = [{"type": "text", "text": text}] if text.strip() else []
            for tc in m.get("tool_calls") or []:
                n += 1
                fn = tc.get("function") or {}
                tools[fn.get("name") or "tool"] = None
                blocks.append({"type": "tool_use", "id": _tool_id(tc.get("id"), n), "name": fn.get("name") or "tool",
                               "input": _arguments(fn.get("arguments"))})
            add("assistant", blocks or [{"type": "text", "text": "(empty)"}])
    if turns and turns[0]["role"] != "user":
        turns.insert(0, {"role": "user", "content": [{"type": "text", "text": "(start)"}]})
    body: dict[str, Any] = {"model": model, "max_tokens": 1024, "messages": turns}
    if system:
        body["system"] = "\n\n".join(system)
    if tools:
        body["tools"] = [{"name": name, "description": f"the {name} tool",
                          "input_schema": {"type": "object", "additionalProperties": True}} for name in tools]
    return body


def to_responses(messages: list[Message], model: str = CHAT_MODEL) -> dict[str, Any]:
    instructions: list[str] = []
    items: list[dict[str, Any]] = []
    for m in messages:
        role, text = m.get("role"), _text(m.get("content"))
        if role in ("system", "developer"):
            instructions.append(text)
        elif role == "user":
            items.append({"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]})
        elif role == "assistant":
            if text or not m.get("tool_calls"):
                items.append({"type": "message", "role": "assistant",
                              "content": [{"type": "output_text", "text": text}]})
            for tc in m.get("tool_calls") or []:
                fn = tc.get("function") or {}
                items.append({"type": "function_call", "call_id": tc.get("id"), "name": fn.get("name") or "tool",
                              "arguments": fn.get("arguments") or "{}"})
        elif role == "tool":
            items.append({"type": "function_call_output", "call_id": m.get("tool_call_id"), "output": text})
    body: dict[str, Any] = {"model": model, "input": items, "store": False}
    if instructions:
        body["instructions"] = "\n\n".join(instructions)
    return body


def _chat_reply(raw: bytes) -> str:
    return orjson.loads(raw)["choices"][0]["message"]["content"]


def _sse_data(raw: bytes) -> list[Any]:
    """The parsed `data:` payloads of an SSE stream, in order (`[DONE]` as the string "[DONE]";
    a payload that is not JSON as the string "<not JSON>", so a check on the text fails)."""
    out: list[Any] = []
    for line in raw.splitlines():
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            out.append("[DONE]")
            continue
        try:
            out.append(orjson.loads(data))
        except orjson.JSONDecodeError:
            out.append("<not JSON>")
    return out


def _unterminated(text: str, terminator: str) -> str:
    """A stream's text with a mark when its terminator never came: the text check then fails."""
    return f"{text} [stream ended without {terminator}]"


def _chat_stream_reply(raw: bytes) -> str:
    """The text of a chat-completions SSE stream: every chunk's delta content, in order; it must
    end with `data: [DONE]`."""
    events = _sse_data(raw)
    parts: list[str] = []
    for e in events:
        if isinstance(e, dict):
            parts.extend((choice.get("delta") or {}).get("content") or "" for choice in e.get("choices") or [])
        elif e != "[DONE]":
            parts.append(e)
    text = "".join(parts)
    return text if events and events[-1] == "[DONE]" else _unterminated(text, "[DONE]")


def _anthropic_stream_reply(raw: bytes) -> str:
    """The text of a Messages SSE stream: every `content_block_delta`'s `text_delta`, in order;
    the last event must be `message_stop` (an `error` event, or anything else, fails the check)."""
    events = [e for e in _sse_data(raw) if e != "[DONE]"]
    text = "".join((e.get("delta") or {}).get("text", "") if isinstance(e, dict) else e for e in events
                   if not isinstance(e, dict) or (e.get("type") == "content_block_delta"
                                                  and (e.get("delta") or {}).get("type") == "text_delta"))
    done = bool(events) and isinstance(events[-1], dict) and events[-1].get("type") == "message_stop"
    return text if done else _unterminated(text, "message_stop")


def _responses_stream_reply(raw: bytes) -> str:
    """The text of a Responses SSE stream: every `response.output_text.delta`, in order; the
    last event must be `response.completed` (a `data: [DONE]` after it is let pass: the LiteLLM proxy
    1.108.7 appends one, which the Responses API does not send)."""
    events = [e for e in _sse_data(raw) if e != "[DONE]"]
    text = "".join(e.get("delta", "") if isinstance(e, dict) else e for e in events
                   if not isinstance(e, dict) or e.get("type") == "response.output_text.delta")
    done = bool(events) and isinstance(events[-1], dict) and events[-1].get("type") == "response.completed"
    return text if done else _unterminated(text, "response.completed")


def _anthropic_reply(raw: bytes) -> str:
    return "".join(b.get("text", "") for b in orjson.loads(raw)["content"] if b.get("type") == "text")


def _responses_reply(raw: bytes) -> str:
    return "".join(c.get("text", "") for it in orjson.loads(raw)["output"] if it.get("type") == "message"
                   for c in it.get("content", []) if c.get("type") == "output_text")


@dataclass(frozen=True)
class Door:
    name: str
    path: str
    """The URL path below a target's base URL (no trailing slash on the base)."""
    model: str
    body: Callable[[list[Message]], dict[str, Any]]
    reply_text: Callable[[bytes], str]
    anthropic: bool = False

    def payload(self, messages: list[Message]) -> bytes:
        return orjson.dumps(self.body(messages))

    def headers(self, api_key: str) -> dict[str, str]:
        h = {"Content-Type": "application/json"}
        if self.anthropic:
            h.update({"x-api-key": api_key, "anthropic-version": ANTHROPIC_VERSION})
        else:
            h["Authorization"] = f"Bearer {api_key}"
        return h


CHAT = Door("chat", "/v1/chat/completions", CHAT_MODEL, lambda msgs: {"model": CHAT_MODEL, "messages": msgs},
            _chat_reply)
CHAT_STREAM = Door("chat-stream", "/v1/chat/completions", CHAT_MODEL,
                   lambda msgs: {"model": CHAT_MODEL, "messages": msgs, "stream": True}, _chat_stream_reply)
MESSAGES = Door("messages", "/v1/messages", CLAUDE_MODEL, to_anthropic, _anthropic_reply, anthropic=True)
MESSAGES_STREAM = Door("messages-stream", "/v1/messages", CLAUDE_MODEL,
                       lambda msgs: {**to_anthropic(msgs), "stream": True}, _anthropic_stream_reply, anthropic=True)
RESPONSES = Door("responses", "/v1/responses", CHAT_MODEL, to_responses, _responses_reply)
RESPONSES_STREAM = Door("responses-stream", "/v1/responses", CHAT_MODEL,
                        lambda msgs: {**to_responses(msgs), "stream": True}, _responses_stream_reply)
DOORS = {d.name: d for d in (CHAT, CHAT_STREAM, MESSAGES, MESSAGES_STREAM, RESPONSES, RESPONSES_STREAM)}
"""`<door>-stream` is that door with `stream: true` (the bench upstream streams each API's SSE events);
its reply parser also checks the stream ended on the API's terminator."""


def model_list(upstream: str, api_key: str, max_input_tokens: int | None = None) -> list[dict[str, Any]]:
    """The bench's two deployments, both on the scripted upstream: `gpt-4o` as an OpenAI
    route (chat and Responses forward natively to `{upstream}/v1/...`) and the Claude model
    as an Anthropic route (Messages forwards natively to `{upstream}/v1/messages`)."""
    info = {"model_info": {"max_input_tokens": max_input_tokens}} if max_input_tokens else {}
    return [
        {"model_name": CHAT_MODEL, "litellm_params": {"model": f"openai/{CHAT_MODEL}", "api_base": f"{upstream}/v1",
                                                      "api_key": api_key}, **info},
        {"model_name": CLAUDE_MODEL, "litellm_params": {"model": f"anthropic/{CLAUDE_MODEL}", "api_base": upstream,
                                                        "api_key": api_key}, **info},
    ]


# ---------------------------------------------------------------------------------------
# Who serves them


def litellm_proxy_command(path: str | None, venv_bin: Path) -> tuple[list[str] | None, str]:
    """How to start the LiteLLM proxy and its litellm version, or (None, why not).

    `path` (--litellm-proxy, else $CTXGATE_BENCH_LITELLM_PROXY) is the `litellm` script of an
    environment with `litellm[proxy]`, or that environment's python; without it, .venv's own
    `litellm` if `litellm.proxy.proxy_server` imports there."""
    path = path or os.environ.get("CTXGATE_BENCH_LITELLM_PROXY")
    if path:
        exe = Path(path).absolute()  # the servers start in a temporary folder
        if not exe.exists():
            return None, f"{path} does not exist"
        is_python = exe.name.startswith("python")
        python = exe if is_python else exe.parent / "python"
        argv = [str(exe), "-m", "litellm.proxy.proxy_cli"] if is_python else [str(exe)]
    else:
        python, argv = venv_bin / "python", [str(venv_bin / "litellm")]
    r = subprocess.run([str(python), "-c", "import importlib.metadata as m, litellm.proxy.proxy_server; "
                        "print(m.version('litellm'))"], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"})
    if r.returncode != 0:
        return None, f"`import litellm.proxy.proxy_server` fails with {python}: " \
                     f"{(r.stderr.strip().splitlines() or ['?'])[-1]}"
    return argv, r.stdout.strip().splitlines()[-1]


def served(base: str, door: Door, api_key: str) -> bool:
    """Whether a started ctxgate has this door: anything but a 404 to an empty POST."""
    req = urllib.request.Request(base + door.path, data=b"{}", method="POST",
                                 headers=door.headers(api_key))
    try:
        with urllib.request.urlopen(req, timeout=30):
            return True
    except urllib.error.HTTPError as e:
        return e.code != 404
    except OSError:
        return False
