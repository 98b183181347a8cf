"""The bench's front doors (each also streamed): a chat-completions conversation as
the body each API takes, and its reply read back as text.

- chat: `{"model", "messages", "tools"}`: the messages as is, `tools` naming every tool used
  (the same declarations as the Gemini body's, as chat tools: the two doors are sent the same
  content at the same size);
- messages (Anthropic): system messages in `system`, tool results as `tool_result` blocks in
  user turns, tool calls as `tool_use` blocks, turns alternating from the user, `tools` naming
  every tool used, `max_tokens` 1024;
- responses: system messages in `instructions`, `message` / `function_call` /
  `function_call_output` items, `store: false` (as Codex sends it);
- gemini (Google's `generateContent`, key in `x-goog-api-key`): system messages in
  `systemInstruction`, `contents` alternating `user` / `model` from the user, tool calls as
  `functionCall` parts, tool results as `functionResponse` parts (`{"output": text}`) of the
  user turn after them, `tools[0].functionDeclarations` naming every tool used;
- gemini-native: the same body to a `gemini/` route (`gemini-2.5-flash` on the bench upstream's
  own generateContent), which ctxgate forwards natively, the client's bytes as they came below
  the trigger;
- messages-cc: the messages body as Claude Code sends it: `system` as a text block and the
  newest message's last block each with a `cache_control` breakpoint, so every turn resends the
  last turn's newest message without its breakpoint (other bytes than last time);
- `<door>-stream`: the same with `stream: true` (Gemini's: `:streamGenerateContent?alt=sse`); a
  stream not ending on its API's terminator (`[DONE]`, `message_stop`, `response.completed`, a
  Gemini chunk with a `finishReason`) fails the reply check.

Also the bench's routes (`model_list`) and a server it sends to (`Target`).
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Any, Callable

import orjson

Message = dict[str, Any]

CHAT_MODEL = "gpt-4o"
CLAUDE_MODEL = "claude-sonnet-4-5"
GEMINI_MODEL = "gemini-2.5-flash"
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


def to_claude_code(messages: list[Message]) -> dict[str, Any]:
    """`to_anthropic` with Claude Code's breakpoints: on the system prompt and on the newest
    message's last block (moved there every turn)."""
    body = to_anthropic(messages)
    mark = {"type": "ephemeral"}
    if "system" in body:
        body["system"] = [{"type": "text", "text": body["system"], "cache_control": mark}]
    last = body["messages"][-1]
    last["content"] = [*last["content"][:-1], {**last["content"][-1], "cache_control": mark}]
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


def _tools_used(messages: list[Message]) -> list[tuple[str, str]]:
    """(name, description) of every tool the conversation calls, in the order first called: the
    tools a chat or Gemini body declares (the same in both)."""
    names = dict.fromkeys((tc.get("function") or {}).get("name") or "tool"
                          for m in messages if m.get("role") == "assistant" for tc in m.get("tool_calls") or [])
    return [(name, f"the {name} tool") for name in names]


def to_chat(messages: list[Message], stream: bool = False) -> dict[str, Any]:
    body: dict[str, Any] = {"model": CHAT_MODEL, "messages": messages}
    tools = _tools_used(messages)
    if tools:
        body["tools"] = [{"type": "function", "function": {"name": name, "description": what,
                                                           "parameters": {"type": "object"}}} for name, what in tools]
    if stream:
        body["stream"] = True
    return body


def to_gemini(messages: list[Message]) -> dict[str, Any]:
    system: list[str] = []
    turns: list[dict[str, Any]] = []
    names: dict[str, str] = {}  # tool_call_id -> the name its functionResponse must carry

    def add(role: str, parts: list[dict[str, Any]]) -> None:
        if turns and turns[-1]["role"] == role:
            turns[-1]["parts"].extend(parts)
        else:
            turns.append({"role": role, "parts": parts})

    for m in messages:
        role, text = m.get("role"), _text(m.get("content"))
        if role in ("system", "developer"):
            system.append(text)
        elif role == "user":
            add("user", [{"text": text or "(empty)"}])
        elif role == "tool":
            call_id = str(m.get("tool_call_id"))
            add("user", [{"functionResponse": {"id": call_id, "name": names.get(call_id, "tool"),
                                               "response": {"output": text}}}])
        elif role == "assistant":
            parts: list[dict[str, Any]] = [{"text": text}] if text.strip() else []
            for tc in m.get("tool_calls") or []:
                fn = tc.get("function") or {}
                name = fn.get("name") or "tool"
                names[str(tc.get("id"))] = name
                parts.append({"functionCall": {"id": str(tc.get("id")), "name": name,
                                               "args": _arguments(fn.get("arguments"))}})
            add("model", parts or [{"text": "(empty)"}])
    if turns and turns[0]["role"] != "user":
        turns.insert(0, {"role": "user", "parts": [{"text": "(start)"}]})
    body: dict[str, Any] = {"contents": turns}
    if system:
        body["systemInstruction"] = {"parts": [{"text": "\n\n".join(system)}]}
    tools = _tools_used(messages)
    if tools:
        body["tools"] = [{"functionDeclarations": [
            {"name": name, "description": what, "parametersJsonSchema": {"type": "object"}} for name, what in tools]}]
    return body


def _chat_reply(raw: bytes) -> str:
    return orjson.loads(raw)["choices"][0]["message"]["content"]


def _anthropic_reply(raw: bytes) -> str:
    return "".join(b.get("text", "") for b in orjson.loads(raw)["content"] if b.get("type") == "text")


def _responses_reply(raw: bytes) -> str:
    return "".join(c.get("text", "") for it in orjson.loads(raw)["output"] if it.get("type") == "message"
                   for c in it.get("content", []) if c.get("type") == "output_text")


def _gemini_reply(raw: bytes) -> str:
    return "".join(p.get("text", "") for c in orjson.loads(raw)["candidates"]
                   for p in (c.get("content") or {}).get("parts", []))


def _gemini_stream_reply(raw: bytes) -> str:
    """A Gemini SSE stream's text, marked when its last chunk carries no `finishReason`."""
    chunks = [orjson.loads(line[5:]) for line in raw.splitlines() if line.startswith(b"data:")]
    text = "".join(_gemini_reply(orjson.dumps(c)) for c in chunks)
    done = bool(chunks) and any(c.get("finishReason") for c in chunks[-1].get("candidates") or [])
    return text if done else f"{text} [stream ended without a finishReason]"


def _delta(event: dict[str, Any]) -> str:
    """The text one SSE event adds, in whichever of the three APIs' shapes."""
    kind = event.get("type")
    if kind == "content_block_delta":
        return (event.get("delta") or {}).get("text", "")
    if kind == "response.output_text.delta":
        return event.get("delta", "")
    return "".join((c.get("delta") or {}).get("content") or "" for c in event.get("choices") or [])


def _stream_reply(terminator: str) -> Callable[[bytes], str]:
    """A stream's text, marked when its last event is not `terminator` (an event type, or
    "[DONE]"), so the text check fails; a payload that is not JSON fails it too."""
    def read(raw: bytes) -> str:
        events: list[Any] = []
        for line in raw.splitlines():
            data = line[5:].strip() if line.startswith(b"data:") else None
            if data == b"[DONE]":
                events.append("[DONE]")
            elif data is not None:
                try:
                    events.append(orjson.loads(data))
                except orjson.JSONDecodeError:
                    events.append("<not JSON>")
        text = "".join(_delta(e) if isinstance(e, dict) else e for e in events if e != "[DONE]")
        if terminator != "[DONE]":  # the LiteLLM proxy 1.108.7 appends a [DONE] the Responses API does not send
            events = [e for e in events if e != "[DONE]"]
        last = events[-1] if events else None
        done = last == terminator or (isinstance(last, dict) and last.get("type") == terminator)
        return text if done else f"{text} [stream ended without {terminator}]"

    return read


@dataclass(frozen=True)
class Door:
    name: str
    path: str
    """The URL path below a target's base URL (no trailing slash on the base)."""
    model: str
    body: Callable[[list[Message]], dict[str, Any]]
    reply_text: Callable[[bytes], str]
    anthropic: bool = False
    google: bool = False

    def payload(self, messages: list[Message]) -> bytes:
        return orjson.dumps(self.body(messages))

    def headers(self, api_key: str) -> dict[str, str]:
        h = {"Content-Type": "application/json"}
        if self.anthropic:
            h.update({"x-api-key": api_key, "anthropic-version": ANTHROPIC_VERSION})
        elif self.google:
            h["x-goog-api-key"] = api_key
        else:
            h["Authorization"] = f"Bearer {api_key}"
        return h

    async def post(self, http: Any, base: str, messages: list[Message], api_key: str, session: str | None = None,
                   body: bytes | None = None, extra: dict[str, str] | None = None) -> tuple[str | None, float, Any]:
        """`messages` (or their `body`) through this door of the server at `base`, with `extra`
        headers: (None when it answered "ok", else the error; ms to the reply's last byte; the
        reply's headers)."""
        headers = self.headers(api_key) | ({"X-Ctx-Session": session} if session else {}) | (extra or {})
        started = time.perf_counter()
        async with http.post(base + self.path, data=self.payload(messages) if body is None else body,
                             headers=headers) as r:
            raw = await r.read()
            ms = (time.perf_counter() - started) * 1000
        ok = r.status == 200 and self.reply_text(raw) == "ok"
        return (None if ok else f"HTTP {r.status}: {raw[:300]!r}"), ms, r.headers


CHAT = Door("chat", "/v1/chat/completions", CHAT_MODEL, to_chat, _chat_reply)
CHAT_STREAM = Door("chat-stream", "/v1/chat/completions", CHAT_MODEL, lambda msgs: to_chat(msgs, stream=True),
                   _stream_reply("[DONE]"))
MESSAGES = Door("messages", "/v1/messages", CLAUDE_MODEL, to_anthropic, _anthropic_reply, anthropic=True)
MESSAGES_STREAM = Door("messages-stream", "/v1/messages", CLAUDE_MODEL,
                       lambda msgs: {**to_anthropic(msgs), "stream": True}, _stream_reply("message_stop"),
                       anthropic=True)
MESSAGES_CC = Door("messages-cc", "/v1/messages", CLAUDE_MODEL, to_claude_code, _anthropic_reply, anthropic=True)
RESPONSES = Door("responses", "/v1/responses", CHAT_MODEL, to_responses, _responses_reply)
RESPONSES_STREAM = Door("responses-stream", "/v1/responses", CHAT_MODEL,
                        lambda msgs: {**to_responses(msgs), "stream": True},
                        _stream_reply("response.completed"))
GEMINI = Door("gemini", f"/v1beta/models/{CHAT_MODEL}:generateContent", CHAT_MODEL, to_gemini, _gemini_reply,
              google=True)
GEMINI_STREAM = Door("gemini-stream", f"/v1beta/models/{CHAT_MODEL}:streamGenerateContent?alt=sse", CHAT_MODEL,
                     to_gemini, _gemini_stream_reply, google=True)
GEMINI_NATIVE = Door("gemini-native", f"/v1beta/models/{GEMINI_MODEL}:generateContent", GEMINI_MODEL, to_gemini,
                     _gemini_reply, google=True)
GEMINI_NATIVE_STREAM = Door("gemini-native-stream", f"/v1beta/models/{GEMINI_MODEL}:streamGenerateContent?alt=sse",
                            GEMINI_MODEL, to_gemini, _gemini_stream_reply, google=True)
DOORS = {d.name: d for d in (CHAT, CHAT_STREAM, MESSAGES, MESSAGES_STREAM, MESSAGES_CC, RESPONSES, RESPONSES_STREAM,
                              GEMINI, GEMINI_STREAM, GEMINI_NATIVE, GEMINI_NATIVE_STREAM)}
"""`<door>-stream` is that door with `stream: true` (the bench upstream streams each API's SSE events);
its reply parser also checks the stream ended on the API's terminator."""


def model_list(upstream: str, api_key: str, max_input_tokens: int | None = None) -> list[dict[str, Any]]:
    """The bench's three deployments, all on the scripted upstream: `gpt-4o` as an OpenAI
    route (chat and Responses forward natively to `{upstream}/v1/...`), the Claude model
    as an Anthropic route (Messages forwards natively to `{upstream}/v1/messages`) and the
    Gemini model as a `gemini/` route (`{upstream}/v1beta/models/...`)."""
    info = {"model_info": {"max_input_tokens": max_input_tokens}} if max_input_tokens else {}
    return [
        {"model_name": CHAT_MODEL, "litellm_params": {"model": f"openai/{CHAT_MODEL}", "api_base": f"{upstream}/v1",
                                                      "api_key": api_key}, **info},
        {"model_name": CLAUDE_MODEL, "litellm_params": {"model": f"anthropic/{CLAUDE_MODEL}", "api_base": upstream,
                                                        "api_key": api_key}, **info},
        {"model_name": GEMINI_MODEL, "litellm_params": {"model": f"gemini/{GEMINI_MODEL}", "api_base": upstream,
                                                        "api_key": api_key}, **info},
    ]


@dataclass(frozen=True)
class Target:
    """A server the bench sends to, with the session header or without (a new conversation
    gets none: ctxgate derives one)."""
    name: str
    base: str
    api_key: str
    session_header: bool = False

    async def post(self, http: Any, door: Door, messages: list[Message], session: str | None,
                   body: bytes | None = None, extra: dict[str, str] | None = None) -> tuple[str | None, float, Any]:
        return await door.post(http, self.base, messages, self.api_key, session if self.session_header else None,
                               body, extra)

    async def sample(self, http: Any, door: Door, messages: list[Message], session: str | None,
                     body: bytes | None = None, extra: dict[str, str] | None = None) -> Sample:
        """One request that must be answered: its time and ctxgate's own headers."""
        error, ms, headers = await self.post(http, door, messages, session, body, extra)
        if error:
            raise RuntimeError(f"{self.name} ({door.name}): {error}")
        over = headers.get("X-Ctx-Overhead-Ms")
        return Sample(ms, float(over) if over else None, headers.get("X-Ctx-Levels"), headers.get("X-Ctx-Tokenizer"))


@dataclass
class Sample:
    ms: float
    """To the reply's last byte."""
    overhead_ms: float | None = None
    """`X-Ctx-Overhead-Ms`: ctxgate's own time, upstream excluded (None from another server)."""
    levels: str | None = None
    tokenizer: str | None = None
