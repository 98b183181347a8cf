"""The scripted upstream's two other doors: Anthropic Messages and OpenAI Responses.

`ScriptedUpstream` (tests/upstream.py) mounts them through `Doors(upstream).add_routes(app)`:

- `POST /v1/messages`: Anthropic's Messages API, its exact wire shapes (a `message` object, or
  its SSE events with `event:` lines when `stream` is true), errors as
  `{"type": "error", "error": {"type": ..., "message": ...}}`;
- `POST /v1/messages/count_tokens`: `{"input_tokens": N}`, the count `/v1/messages` would report;
  the context limit and the model-name rules are not applied;
- `POST /v1/responses`: OpenAI's Responses API (a `response` object, or its SSE events). This
  upstream stores nothing: a `previous_response_id` is answered 400 `previous_response_not_found`,
  as OpenAI does for a response created with `store: false`, so the gateway must resolve chains.

The model name chooses the behaviour, as on the chat door: any name answers "ok"; `tools` calls
the first tool of the request with `{"path": "a.py"}`; `thinking` (or Anthropic's `thinking`
enabled) leads with a thinking block carrying a deterministic `signature` (Responses: a
`reasoning` item); `error-<status>` answers that status; the faults of tests/upstream.py (`fault-*`, `flaky-<status>`)
as there; `overflow` (limit: half the input) or an
input over the instance's `limit` answers 400 (Anthropic: `invalid_request_error` "prompt is too
long: N tokens > LIMIT maximum"; OpenAI: `context_length_exceeded`); `slow` sleeps `slow_s`
before answering, or between SSE frames; `summarizer` answers `SUMMARY`. Anthropic's
`max_tokens` (required) truncates the text, with stop_reason `max_tokens`. `expand` models call
the gateway's expansion tool on both doors as on the chat door (`upstream.ref_to_expand`).

Input tokens, counted with o200k_base (`c(s)` = tokens of the string s, `J(x)` = compact JSON):

    anthropic_input_tokens = 3 + c(system text) + J-tokens(tools) + sum over messages of
        (4 + sum over blocks: text -> c(text); thinking -> c(thinking); redacted_thinking -> c(data);
         tool_use -> c(name) + c(J(input)); tool_result -> its string content, or its blocks
         counted alike; image/document -> 85); a string content counts as one text block.
    responses_input_tokens = 3 + c(instructions) + J-tokens(tools) + sum over input items of
        (4 + message -> c(content string) or each part's text (input_image/input_file: 85);
         function_call -> c(name) + c(arguments); function_call_output -> c(output) (or parts);
         reasoning -> c(each summary text)); a string input counts as one user message.

`J-tokens(tools)` is c(J(tools)) when tools is a non-empty list, else 0. Every call is logged in
the upstream's `.log` as a `Received` with `door` "messages", "count_tokens" or "responses" and
`prompt_tokens` the input-token count.
"""
from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import re
import uuid
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from aiohttp import web

from agent_steps import anthropic_content, is_steps_model, responses_output
from upstream import (CREATED, EXPAND_TOOL, O200K, REPLY, SUMMARY, Received, _json, encode, error_object, fault_reply,
                      faulty_stream, flaky_status, offered_tools, ref_to_expand)

if TYPE_CHECKING:
    from upstream import ScriptedUpstream

MEDIA_TOKENS = 85
"""An image or a document block, whatever its size."""
TOOL_INPUT = {"path": "a.py"}
THOUGHT = "The user wants a short answer; answer it."
CONTEXT_EXCEEDED = "Your input exceeds the context window of this model."
_ANTHROPIC_ERRORS = {400: "invalid_request_error", 401: "authentication_error", 402: "billing_error",
                     403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                     429: "rate_limit_error", 500: "api_error", 504: "timeout_error", 529: "overloaded_error"}

Answer = Callable[[web.Request, Received, bytes], Awaitable[web.StreamResponse]]


def _count(text: Any) -> int:
    return len(encode(text)) if isinstance(text, str) and text else 0


def _compact(data: Any) -> str:
    return json.dumps(data, separators=(",", ":"), ensure_ascii=False)


def _tools_tokens(tools: Any) -> int:
    return _count(_compact(tools)) if isinstance(tools, list) and tools else 0


def signature(thinking: str) -> str:
    """The deterministic signature of a thinking block (base64, like Anthropic's)."""
    return base64.b64encode(hashlib.sha256(b"scripted-signature:" + thinking.encode()).digest()).decode()


def _chunks(text: str, parts: int = 3) -> list[str]:
    size = max(1, -(-len(text) // parts))
    return [text[i:i + size] for i in range(0, len(text), size)]


# -- token counts --------------------------------------------------------------------------
def _anthropic_block_tokens(block: Any) -> int:
    if isinstance(block, str):
        return _count(block)
    if not isinstance(block, dict):
        return 0
    kind = block.get("type")
    if kind == "text":
        return _count(block.get("text"))
    if kind == "thinking":
        return _count(block.get("thinking"))
    if kind == "redacted_thinking":
        return _count(block.get("data"))
    if kind == "tool_use":
        return _count(block.get("name")) + _count(_compact(block.get("input", {})))
    if kind == "tool_result":
        content = block.get("content")
        if isinstance(content, list):
            return sum(_anthropic_block_tokens(b) for b in content)
        return _count(content)
    if kind in ("image", "document"):
        return MEDIA_TOKENS
    return 0


def anthropic_input_tokens(body: Any) -> int:
    """The input tokens `/v1/messages` reports (and `count_tokens` answers) for this body."""
    if not isinstance(body, dict):
        return 0
    system = body.get("system")
    n = 3 + (sum(_anthropic_block_tokens(b) for b in system) if isinstance(system, list) else _count(system))
    for m in body.get("messages") if isinstance(body.get("messages"), list) else []:
        if not isinstance(m, dict):
            continue
        content = m.get("content")
        blocks = content if isinstance(content, list) else [content]
        n += 4 + sum(_anthropic_block_tokens(b) for b in blocks)
    return n + _tools_tokens(body.get("tools"))


def _responses_part_tokens(part: Any) -> int:
    if isinstance(part, str):
        return _count(part)
    if not isinstance(part, dict):
        return 0
    if part.get("type") in ("input_image", "input_file"):
        return MEDIA_TOKENS
    return _count(part.get("text"))


def _responses_item_tokens(item: Any) -> int:
    if isinstance(item, str):
        return 4 + _count(item)
    if not isinstance(item, dict):
        return 0
    kind = item.get("type", "message")
    if kind == "message":
        content = item.get("content")
        parts = content if isinstance(content, list) else [content]
        return 4 + sum(_responses_part_tokens(p) for p in parts)
    if kind == "function_call":
        return 4 + _count(item.get("name")) + _count(item.get("arguments"))
    if kind == "function_call_output":
        output = item.get("output")
        parts = output if isinstance(output, list) else [output]
        return 4 + sum(_responses_part_tokens(p) for p in parts)
    if kind == "reasoning":
        summary = item.get("summary")
        return 4 + sum(_responses_part_tokens(s) for s in summary if isinstance(summary, list))
    return 4


def responses_input_tokens(body: Any) -> int:
    """The `usage.input_tokens` `/v1/responses` reports for this body."""
    if not isinstance(body, dict):
        return 0
    items = body.get("input")
    n = 3 + _count(body.get("instructions"))
    n += sum(_responses_item_tokens(i) for i in (items if isinstance(items, list) else [items] if items else []))
    return n + _tools_tokens(body.get("tools"))


def anthropic_expansion(body: dict[str, Any], model: str) -> list[dict[str, Any]] | None:
    """An `expand` model's tool_use blocks on the Messages door, or None (`upstream.ref_to_expand`)."""
    results = [b for m in body.get("messages") or [] if isinstance(m, dict) and isinstance(m.get("content"), list)
               for b in m["content"] if isinstance(b, dict) and b.get("type") == "tool_result"]
    ref = ref_to_expand(body, model, {b.get("tool_use_id") for b in results})
    if ref is None:
        return None
    rounds = sum(1 for b in results if str(b.get("tool_use_id")).startswith("call_expand_"))
    call_id = f"call_expand_{ref[4:]}" + (f"_{rounds}" if "greedy" in model else "")
    blocks = [{"type": "tool_use", "id": call_id, "name": EXPAND_TOOL, "input": {"ref": ref}}]
    if "mixed" in model:
        blocks.append({"type": "tool_use", "id": "toolu_agent_0", "name": offered_tools(body)[0], "input": {}})
    return blocks


def responses_expansion(body: dict[str, Any], model: str, suffix: str) -> list[dict[str, Any]] | None:
    """An `expand` model's function_call items on the Responses door, or None (`upstream.ref_to_expand`)."""
    items = body.get("input") if isinstance(body.get("input"), list) else []
    answered = {i.get("call_id") for i in items if isinstance(i, dict) and i.get("type") == "function_call_output"}
    ref = ref_to_expand(body, model, answered)
    if ref is None:
        return None
    rounds = sum(1 for call_id in answered if str(call_id).startswith("call_expand_"))
    call_id = f"call_expand_{ref[4:]}" + (f"_{rounds}" if "greedy" in model else "")
    out = [{"id": f"fc_x{suffix}", "type": "function_call", "status": "completed", "call_id": call_id,
            "name": EXPAND_TOOL, "arguments": json.dumps({"ref": ref})}]
    if "mixed" in model:
        out.append({"id": f"fc_a{suffix}", "type": "function_call", "status": "completed", "call_id": "call_agent_0",
                    "name": offered_tools(body)[0], "arguments": "{}"})
    return out


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    etype = _ANTHROPIC_ERRORS.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": etype, "message": message}}


def _sse(event: str, data: dict[str, Any]) -> bytes:
    return f"event: {event}\ndata: ".encode() + _json(data) + b"\n\n"


class Doors:
    """The Messages, count_tokens and Responses handlers of one `ScriptedUpstream`."""

    def __init__(self, up: "ScriptedUpstream") -> None:
        self.up = up

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/messages", self.messages)
        app.router.add_post("/v1/messages/count_tokens", self.count_tokens)
        app.router.add_post("/v1/responses", self.responses)

    async def messages(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "messages", self._answer_messages)

    async def count_tokens(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "count_tokens", self._answer_count_tokens)

    async def responses(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "responses", self._answer_responses)

    # -- shared ------------------------------------------------------------------------
    async def _handle(self, request: web.Request, door: str, answer: Answer) -> web.StreamResponse:
        raw = await request.read()
        entry = Received(request.path, raw, {k.lower(): v for k, v in request.headers.items()}, door=door)
        self.up.log.append(entry)
        try:
            return await answer(request, entry, raw)
        except (asyncio.CancelledError, ConnectionResetError):
            entry.cancelled = True
            raise
        finally:
            entry.done = True

    async def _stream(self, request: web.Request, entry: Received, frames: list[bytes],
                      slow: bool) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                               "Cache-Control": "no-cache"})
        await response.prepare(request)
        for i, data in enumerate(frames):
            if slow and i:
                await asyncio.sleep(self.up.slow_s)
            await response.write(data)
            entry.response += data
        await response.write_eof()
        return response

    def _limit(self, model: str, used: int) -> int:
        return max(1, used // 2) if "overflow" in model else self.up.limit

    @staticmethod
    def _parse(raw: bytes) -> Any:
        try:
            return json.loads(raw)
        except ValueError:
            return None

    # -- Anthropic Messages --------------------------------------------------------------
    def _anthropic_error(self, entry: Received, status: int, message: str) -> web.Response:
        return self.up._send(entry, anthropic_error(status, message), status)

    async def _answer_count_tokens(self, request: web.Request, entry: Received, raw: bytes) -> web.StreamResponse:
        entry.body = body = self._parse(raw)
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            return self._anthropic_error(entry, 400, "messages: Field required")
        entry.prompt_tokens = used = anthropic_input_tokens(body)
        if status := flaky_status(str(body.get("model")), entry, self.up.log):
            return self._anthropic_error(entry, status, f"scripted flaky error {status}")
        return self.up._send(entry, {"input_tokens": used})

    async def _answer_messages(self, request: web.Request, entry: Received, raw: bytes) -> web.StreamResponse:
        entry.body = body = self._parse(raw)
        if not isinstance(body, dict):
            return self._anthropic_error(entry, 400, "The request body is not valid JSON.")
        if not isinstance(body.get("messages"), list):
            return self._anthropic_error(entry, 400, "messages: Field required")
        max_tokens = body.get("max_tokens")
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            return self._anthropic_error(entry, 400, "max_tokens: Field required")
        model = body.get("model") if isinstance(body.get("model"), str) else ""
        entry.prompt_tokens = used = anthropic_input_tokens(body)
        if found := re.fullmatch(r"error-(\d{3})", model):
            status = int(found.group(1))
            return self._anthropic_error(entry, status, f"scripted upstream error {status}")
        if status := flaky_status(model, entry, self.up.log):
            return self._anthropic_error(entry, status, f"scripted flaky error {status}")
        if (faulty := fault_reply(model)) is not None:
            return faulty
        limit = self._limit(model, used)
        if limit and used > limit:
            return self._anthropic_error(entry, 400, f"prompt is too long: {used} tokens > {limit} maximum")
        content, stop_reason = self._anthropic_content(body, model, max_tokens)
        output = max(1, sum(_anthropic_block_tokens(b) for b in content))
        message = {"id": f"msg_up{len(self.up.log)}_{uuid.uuid4().hex[:12]}", "type": "message",
                   "role": "assistant", "model": model, "content": content, "stop_reason": stop_reason,
                   "stop_sequence": None,
                   "usage": {"input_tokens": used, "output_tokens": output, "cache_creation_input_tokens": 0,
                             "cache_read_input_tokens": 0}}
        if body.get("stream") is True:
            frames = faulty_stream(model, self._anthropic_frames(message), 2)  # message_delta, message_stop
            return await self._stream(request, entry, frames, "slow" in model)
        if "slow" in model:
            await asyncio.sleep(self.up.slow_s)
        return self.up._send(entry, message)

    def _anthropic_content(self, body: dict[str, Any], model: str, max_tokens: int) -> tuple[list[Any], str]:
        content: list[dict[str, Any]] = []
        thinking = body.get("thinking")
        if "thinking" in model or (isinstance(thinking, dict) and thinking.get("type") in ("enabled", "adaptive")):
            content.append({"type": "thinking", "thinking": THOUGHT, "signature": signature(THOUGHT)})
        if (expanding := anthropic_expansion(body, model)) is not None:
            return content + expanding, "tool_use"
        if is_steps_model(model):
            steps, stop_reason = anthropic_content(body, model, str(len(self.up.log)))
            return content + steps, stop_reason
        tools = body.get("tools")
        if "tools" in model and isinstance(tools, list) and tools and isinstance(tools[0], dict):
            content.append({"type": "tool_use", "id": f"toolu_up{len(self.up.log)}",
                            "name": tools[0].get("name", "tool"), "input": dict(TOOL_INPUT)})
            return content, "tool_use"
        text = SUMMARY if "summarizer" in model else REPLY
        tokens = encode(text)
        stop_reason = "end_turn"
        if len(tokens) > max_tokens:
            text, stop_reason = O200K.decode(tokens[:max_tokens]), "max_tokens"
        content.append({"type": "text", "text": text})
        return content, stop_reason

    @staticmethod
    def _anthropic_frames(message: dict[str, Any]) -> list[bytes]:
        usage = message["usage"]
        start = {**message, "content": [], "stop_reason": None,
                 "usage": {**usage, "output_tokens": 1}}
        frames = [_sse("message_start", {"type": "message_start", "message": start})]
        for index, block in enumerate(message["content"]):
            kind = block["type"]
            if kind == "text":
                opening, deltas = {"type": "text", "text": ""}, [
                    {"type": "text_delta", "text": piece} for piece in _chunks(block["text"])]
            elif kind == "thinking":
                opening = {"type": "thinking", "thinking": "", "signature": ""}
                deltas = [{"type": "thinking_delta", "thinking": p} for p in _chunks(block["thinking"])]
                deltas.append({"type": "signature_delta", "signature": block["signature"]})
            else:  # tool_use
                opening = {**block, "input": {}}
                deltas = [{"type": "input_json_delta", "partial_json": p}
                          for p in ["", *_chunks(_compact(block["input"]), 2)]]
            frames.append(_sse("content_block_start",
                               {"type": "content_block_start", "index": index, "content_block": opening}))
            if index == 0:
                frames.append(_sse("ping", {"type": "ping"}))
            frames += [_sse("content_block_delta", {"type": "content_block_delta", "index": index, "delta": d})
                       for d in deltas]
            frames.append(_sse("content_block_stop", {"type": "content_block_stop", "index": index}))
        frames.append(_sse("message_delta", {"type": "message_delta",
                                             "delta": {"stop_reason": message["stop_reason"], "stop_sequence": None},
                                             "usage": {"output_tokens": usage["output_tokens"]}}))
        frames.append(_sse("message_stop", {"type": "message_stop"}))
        return frames

    # -- OpenAI Responses ------------------------------------------------------------------
    def _openai_error(self, entry: Received, status: int, message: str, code: str | None,
                      param: str | None = None) -> web.Response:
        return self.up._send(entry, error_object(status, message, code, param), status)

    async def _answer_responses(self, request: web.Request, entry: Received, raw: bytes) -> web.StreamResponse:
        entry.body = body = self._parse(raw)
        if not isinstance(body, dict):
            return self._openai_error(entry, 400, "We could not parse the JSON body of your request.", "invalid_json")
        previous = body.get("previous_response_id")
        if previous is not None:
            return self._openai_error(entry, 400, f"Previous response with id '{previous}' not found.",
                                      "previous_response_not_found", "previous_response_id")
        if not isinstance(body.get("input"), (str, list)):
            return self._openai_error(entry, 400, "Missing required parameter: 'input'.",
                                      "missing_required_parameter", "input")
        model = body.get("model") if isinstance(body.get("model"), str) else ""
        entry.prompt_tokens = used = responses_input_tokens(body)
        if found := re.fullmatch(r"error-(\d{3})", model):
            status = int(found.group(1))
            return self._openai_error(entry, status, f"scripted upstream error {status}", f"scripted_{status}")
        if status := flaky_status(model, entry, self.up.log):
            return self._openai_error(entry, status, f"scripted flaky error {status}", f"scripted_{status}")
        if (faulty := fault_reply(model)) is not None:
            return faulty
        limit = self._limit(model, used)
        if limit and used > limit:
            return self._openai_error(entry, 400, CONTEXT_EXCEEDED, "context_length_exceeded", "input")
        rid = f"resp_up{len(self.up.log)}_{uuid.uuid4().hex[:16]}"
        output = self._responses_output(body, model, rid)
        reasoning = sum(_count(s["text"]) for o in output if o["type"] == "reasoning" for s in o["summary"])
        emitted = sum(_count(o.get("arguments")) + sum(_count(p.get("text")) for p in o.get("content", []))
                      for o in output if o["type"] != "reasoning")
        out_tokens = max(1, emitted) + reasoning
        response = self._response_object(body, model, rid, output, {
            "input_tokens": used, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": out_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning}, "total_tokens": used + out_tokens})
        if body.get("stream") is True:
            frames = faulty_stream(model, self._responses_frames(response), 1)  # response.completed
            return await self._stream(request, entry, frames, "slow" in model)
        if "slow" in model:
            await asyncio.sleep(self.up.slow_s)
        return self.up._send(entry, response)

    def _responses_output(self, body: dict[str, Any], model: str, rid: str) -> list[dict[str, Any]]:
        suffix = rid.removeprefix("resp_")
        output: list[dict[str, Any]] = []
        if "thinking" in model:
            output.append({"id": f"rs_{suffix}", "type": "reasoning",
                           "summary": [{"type": "summary_text", "text": THOUGHT}],
                           "encrypted_content": signature(THOUGHT)})
        if (expanding := responses_expansion(body, model, suffix)) is not None:
            return output + expanding
        if is_steps_model(model):
            return output + responses_output(body, model, suffix)
        tools = body.get("tools")
        if "tools" in model and isinstance(tools, list) and tools and isinstance(tools[0], dict):
            output.append({"id": f"fc_{suffix}", "type": "function_call", "status": "completed",
                           "call_id": f"call_{suffix}", "name": tools[0].get("name", "tool"),
                           "arguments": _compact(TOOL_INPUT)})
            return output
        text = SUMMARY if "summarizer" in model else REPLY
        output.append({"id": f"msg_{suffix}", "type": "message", "status": "completed", "role": "assistant",
                       "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]})
        return output

    @staticmethod
    def _response_object(body: dict[str, Any], model: str, rid: str, output: list[dict[str, Any]],
                         usage: dict[str, Any] | None) -> dict[str, Any]:
        tools = body.get("tools")
        return {"id": rid, "object": "response", "created_at": CREATED, "status": "completed",
                "background": False, "error": None, "incomplete_details": None,
                "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
                "max_tool_calls": None, "model": model, "output": output,
                "parallel_tool_calls": body.get("parallel_tool_calls", True), "previous_response_id": None,
                "reasoning": {"effort": None, "summary": None}, "service_tier": "default",
                "store": body.get("store", True), "temperature": 1.0, "text": {"format": {"type": "text"}},
                "tool_choice": body.get("tool_choice", "auto"), "tools": tools if isinstance(tools, list) else [],
                "top_p": 1.0, "truncation": "disabled", "usage": usage, "user": None, "metadata": {}}

    @staticmethod
    def _responses_frames(response: dict[str, Any]) -> list[bytes]:
        frames: list[bytes] = []

        def emit(kind: str, **data: Any) -> None:
            frames.append(_sse(kind, {"type": kind, "sequence_number": len(frames), **data}))

        pending = {**response, "status": "in_progress", "output": [], "usage": None}
        emit("response.created", response=pending)
        emit("response.in_progress", response=pending)
        for index, item in enumerate(response["output"]):
            if item["type"] == "message":
                emit("response.output_item.added", output_index=index,
                     item={**item, "status": "in_progress", "content": []})
                for ci, part in enumerate(item["content"]):
                    ids = {"item_id": item["id"], "output_index": index, "content_index": ci}
                    emit("response.content_part.added", **ids, part={**part, "text": ""})
                    for piece in _chunks(part["text"]):
                        emit("response.output_text.delta", **ids, delta=piece, logprobs=[])
                    emit("response.output_text.done", **ids, text=part["text"], logprobs=[])
                    emit("response.content_part.done", **ids, part=part)
            elif item["type"] == "function_call":
                emit("response.output_item.added", output_index=index,
                     item={**item, "status": "in_progress", "arguments": ""})
                for piece in _chunks(item["arguments"], 2):
                    emit("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                         delta=piece)
                emit("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                     name=item["name"], arguments=item["arguments"])
            else:  # reasoning
                emit("response.output_item.added", output_index=index, item={**item, "summary": []})
            emit("response.output_item.done", output_index=index, item=item)
        emit("response.completed", response=response)
        return frames
