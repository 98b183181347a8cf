"""A Gemini request sent to a chat-completions upstream, and its reply read back as Gemini's.

Every route but a native Gemini one speaks chat completions to ctxgate (directly, or through
litellm): the forwarded Gemini body (`systemInstruction`, `contents`, `tools`,
`generationConfig`) becomes a chat body, and the chat reply, whole or streamed, becomes a
`GenerateContentResponse` (candidates of `parts`, `functionCall`s, `finishReason`,
`usageMetadata`), streamed as SSE (`alt=sse`) or as one JSON array written as it comes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, AsyncIterator

import orjson

from ctxgate.pipeline.notes import TAG
from ..errors import ErrorKind, GatewayError
from ..upstream.errors import BAD_REPLY
from ..upstream.pieces import JOINED_BELOW, Pieces
from .gemini_model import ORIGIN, ReadContents, conversation_of

FINISH = {"stop": "STOP", "length": "MAX_TOKENS", "tool_calls": "STOP", "function_call": "STOP",
          "content_filter": "SAFETY"}
_CONFIG = {"temperature": "temperature", "topP": "top_p", "maxOutputTokens": "max_tokens", "stopSequences": "stop",
           "candidateCount": "n", "presencePenalty": "presence_penalty", "frequencyPenalty": "frequency_penalty",
           "seed": "seed"}
_MODES = {"AUTO": "auto", "ANY": "required", "NONE": "none"}


def chat_body(payload: dict[str, Any], model: str, stream: bool) -> dict[str, Any]:
    """`payload` as a chat completion: its conversation read into chat messages, its tools and
    generation settings turned into chat's."""
    return {**chat_fields(payload, model, stream), "messages": chat_messages(conversation_of(payload))}


def chat_fields(payload: dict[str, Any], model: str, stream: bool,
                tools: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Every field of `chat_body` but its messages; `tools`: `payload`'s as chat tools, made already."""
    body: dict[str, Any] = {"model": model}
    config = payload.get("generationConfig") or {}
    body.update({theirs: config[ours] for ours, theirs in _CONFIG.items() if ours in config})
    if config.get("responseMimeType") == "application/json":
        body["response_format"] = {"type": "json_object"}
    tools = chat_tools(payload.get("tools")) if tools is None else tools
    if tools:
        body["tools"] = tools
        mode = ((payload.get("toolConfig") or {}).get("functionCallingConfig") or {}).get("mode")
        if mode in _MODES:
            body["tool_choice"] = _MODES[mode]
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    return body


def chat_messages(neutral: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [_plain_message(m) for m in neutral]


@dataclass(frozen=True)
class ChatJson:
    """The JSON of a conversation's first `count` messages as chat messages, a piece per turn
    that added some, small ones grown into one (each comma-separated within, and each but the
    first led by its comma),
    kept with the session's history (`ReadContents.chat`): a steady turn serialises only its
    new messages, and the body is sent as these pieces, never joined (`Pieces`)."""
    pieces: tuple[bytes, ...]
    count: int


def chat_json(fields: dict[str, Any], read: ReadContents) -> Pieces:
    """`fields` (`chat_fields`) with `read`'s conversation as chat messages, as JSON."""
    done = read.chat if isinstance(read.chat, ChatJson) else ChatJson((), 0)
    if done.count < len(read.messages):
        new = orjson.dumps(chat_messages(read.messages[done.count:]))[1:-1]
        pieces = done.pieces
        if pieces and len(pieces[-1]) < JOINED_BELOW:  # small turns grow one piece: little to join each turn
            pieces = (*pieces[:-1], pieces[-1] + b"," + new)
        else:
            pieces = (*pieces, b"," + new if pieces else new)
        done = read.chat = ChatJson(pieces, len(read.messages))
    # The settings first, small: aiohttp joins the first piece with the request's headers.
    return Pieces((orjson.dumps(fields)[:-1] + b',"messages":[', *done.pieces, b"]}"))


def _plain_message(m: dict[str, Any]) -> dict[str, Any]:
    """A neutral message as chat takes it: no keys of ctxgate's; a model turn of thoughts only
    (no visible text, no call) as an empty text, which every chat API accepts."""
    out = m.copy()  # then the keys dropped: in C, twice as fast as a comprehension over every key
    out.pop(ORIGIN, None)
    out.pop(TAG, None)
    if out["role"] == "assistant" and out.get("content") is None and not out.get("tool_calls"):
        out["content"] = ""
    return out


def chat_tools(tools: Any) -> list[dict[str, Any]]:
    """`functionDeclarations` as chat tools (Gemini's other tools, search and code execution, have none)."""
    out = []
    for tool in tools or []:
        for fn in tool.get("functionDeclarations") or []:
            schema = fn.get("parametersJsonSchema") or _json_schema(fn.get("parameters")) \
                or {"type": "object", "properties": {}}
            out.append({"type": "function", "function": {"name": fn["name"], "description": fn.get("description", ""),
                                                         "parameters": schema}})
    return out


def _json_schema(schema: Any) -> Any:
    """Gemini's OpenAPI-style schema (`"type": "OBJECT"`) as JSON Schema."""
    if isinstance(schema, dict):
        return {k: (v.lower() if k == "type" and isinstance(v, str) else _json_schema(v)) for k, v in schema.items()}
    if isinstance(schema, list):
        return [_json_schema(v) for v in schema]
    return schema


def usage_metadata(usage: Any) -> dict[str, int]:
    if not isinstance(usage, dict):
        return {}
    found = {"promptTokenCount": usage.get("prompt_tokens"), "candidatesTokenCount": usage.get("completion_tokens"),
             "totalTokenCount": usage.get("total_tokens"),
             "cachedContentTokenCount": (usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
             "thoughtsTokenCount": (usage.get("completion_tokens_details") or {}).get("reasoning_tokens")}
    return {k: v for k, v in found.items() if isinstance(v, int) and v > 0}


def _call_part(call: dict[str, Any]) -> dict[str, Any]:
    fn = call.get("function") or {}
    try:
        args = orjson.loads(fn.get("arguments") or "{}")
    except orjson.JSONDecodeError:
        args = {"arguments": fn.get("arguments")}
    found: dict[str, Any] = {"name": fn.get("name"), "args": args if isinstance(args, dict) else {"value": args}}
    if call.get("id"):
        found["id"] = call["id"]
    return {"functionCall": found}


def gemini_reply(body: bytes, model: str) -> dict[str, Any] | None:
    """A chat completion as a `GenerateContentResponse`; None for a body that is not one, which
    passes as it came (the edge answers it with a 502, `gemini_replies.reply_facts`)."""
    try:
        chat = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(chat, dict) or not isinstance(chat.get("choices"), list):
        return None
    candidates = []
    for i, choice in enumerate(c for c in chat["choices"] if isinstance(c, dict)):
        message = choice.get("message") or {}
        parts: list[dict[str, Any]] = []
        if message.get("reasoning_content"):
            parts.append({"text": message["reasoning_content"], "thought": True})
        if message.get("content"):
            parts.append({"text": message["content"]})
        parts += [_call_part(c) for c in message.get("tool_calls") or [] if isinstance(c, dict)]
        candidates.append({"content": {"role": "model", "parts": parts or [{"text": ""}]},
                           "finishReason": FINISH.get(choice.get("finish_reason") or "stop", "OTHER"),
                           "index": choice.get("index", i)})
    return {"candidates": candidates, "usageMetadata": usage_metadata(chat.get("usage")),
            "modelVersion": chat.get("model") or model, "responseId": chat.get("id")}


class Frames:
    """Gemini's stream framing: SSE events, or the elements of one JSON array."""

    def __init__(self, sse: bool) -> None:
        self.sse = sse
        self.opened = False

    def frame(self, obj: dict[str, Any]) -> bytes:
        if self.sse:
            return b"data: " + orjson.dumps(obj) + b"\r\n\r\n"
        start, self.opened = b"," if self.opened else b"[", True
        return start + orjson.dumps(obj) + b"\n\n"

    def close(self) -> bytes:
        if self.sse:
            return b""
        return b"]" if self.opened else b"[]"

    def error(self, body: dict[str, Any]) -> bytes:
        """An error after the headers went out: the last event, or the array's last element."""
        if self.sse:
            return self.frame(body)
        return (b"," if self.opened else b"[") + orjson.dumps(body) + b"]"


async def reframed(chunks: AsyncIterator[bytes], frames: Frames) -> AsyncIterator[bytes]:
    """A native Gemini SSE stream framed as the client asked: its events' JSON as they are."""
    pending = b""
    async for data in chunks:
        pending += data.replace(b"\r\n", b"\n")
        *events, pending = pending.split(b"\n\n")
        out = [frames.frame(orjson.loads(raw)) for e in events
               if (raw := b"\n".join(line[5:].strip() for line in e.split(b"\n") if line.startswith(b"data:")))]
        if out:
            yield b"".join(out)
    yield frames.close()


async def gemini_stream(chunks: AsyncIterator[bytes], frames: Frames, model: str,
                        error: Any) -> AsyncIterator[bytes]:
    """Chat-completion SSE as Gemini chunks: a chunk per text delta, then one with the calls
    (their arguments arrive in pieces), the finish reason and the usage, once `[DONE]` came.
    `error(obj)`: a chat error object mid-stream as Gemini's error body."""
    pending, calls = b"", {}  # type: tuple[bytes, dict[int, dict[str, Any]]]
    state: dict[str, Any] = {"finish": None, "usage": None, "id": None, "model": model}

    def final() -> bytes:
        parts = [_call_part(calls[k]) for k in sorted(calls)] or [{"text": ""}]
        candidate = {"content": {"role": "model", "parts": parts},
                     "finishReason": FINISH.get(state["finish"], "OTHER"), "index": 0}
        return frames.frame({"candidates": [candidate], "usageMetadata": usage_metadata(state["usage"]),
                             "modelVersion": state["model"], "responseId": state["id"]}) + frames.close()

    async for data in chunks:
        pending += data.replace(b"\r\n", b"\n")
        *events, pending = pending.split(b"\n\n")
        out = []
        for event in events:
            raw = b"\n".join(line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:"))
            if not raw:
                continue
            if raw == b"[DONE]":
                if state["finish"] is not None:
                    out.append(final())
                    state["finish"] = None
                continue
            try:
                chunk = orjson.loads(raw)
            except orjson.JSONDecodeError:
                raise GatewayError(ErrorKind.UPSTREAM_UNREACHABLE, f"upstream for {model} sent an event whose data "
                                   f"is not JSON: {raw[:200]!r}", code=BAD_REPLY) from None
            if isinstance(chunk, dict) and isinstance(chunk.get("error"), dict):
                out.append(frames.error(error(chunk["error"])))
                continue
            out += _read_chunk(chunk, state, calls, frames)
        if out:
            yield b"".join(out)
    if state["finish"] is not None:  # an upstream that sends no `[DONE]`
        yield final()


def _read_chunk(chunk: Any, state: dict[str, Any], calls: dict[int, dict[str, Any]], frames: Frames) -> list[bytes]:
    if not isinstance(chunk, dict):
        return []
    state["id"] = state["id"] or chunk.get("id")
    state["model"] = chunk.get("model") or state["model"]
    if isinstance(chunk.get("usage"), dict):
        state["usage"] = chunk["usage"]
    out = []
    for choice in chunk.get("choices") or []:
        if not isinstance(choice, dict) or choice.get("index", 0) != 0:
            continue
        delta = choice.get("delta") or {}
        parts = []
        if delta.get("reasoning_content"):
            parts.append({"text": delta["reasoning_content"], "thought": True})
        if delta.get("content"):
            parts.append({"text": delta["content"]})
        if parts:
            out.append(frames.frame({"candidates": [{"content": {"role": "model", "parts": parts}, "index": 0}],
                                     "modelVersion": state["model"], "responseId": state["id"]}))
        for piece in delta.get("tool_calls") or []:
            call = calls.setdefault(int(piece.get("index") or 0), {"id": None, "function": {"name": "",
                                                                                             "arguments": ""}})
            call["id"] = piece.get("id") or call["id"]
            fn = piece.get("function") or {}
            call["function"]["name"] += fn.get("name") or ""
            call["function"]["arguments"] += fn.get("arguments") or ""
        if choice.get("finish_reason"):
            state["finish"] = choice["finish_reason"]
    return out
