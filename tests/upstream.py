"""A scripted upstream: a real aiohttp server speaking the OpenAI API, for the tests.

It runs in a background thread of the test process (`ScriptedUpstream().start()`), or on
its own (`python tests/upstream.py 8999`). What it does is chosen by the model name
it receives:

- any name: a deterministic `chat.completion` ("ok"), honouring `stream` (with a usage
  chunk when `stream_options.include_usage`), `n`, `stop` and `response_format`;
  `usage.prompt_tokens` is OpenAI's published formula over o200k_base (`prompt_tokens`);
- a name containing `tools`: a tool call to the first tool of the request;
- `agent-steps-N`: a model for real agents, N steps of shell commands whose next one depends
  on the newest observation that reached it (tests/agent_steps.py), on chat and Responses;
  on chat without tools, a text reply whose ```bash block is the next step (aider's protocol);
- `agent-edit-N`: N such steps, then a SEARCH/REPLACE edit of calc.py copied from aider's
  files-in-chat message (tests/agent_edit.py);
- `error-<status>`: that HTTP status with an OpenAI error object (a 429 with `retry-after: 1`);
- `overflow`, or a prompt over the instance's `limit`: 400 `context_length_exceeded`;
- a name containing `slow`: sleeps `slow_s` before answering, or between stream chunks;
- a name containing `summarizer`: a fixed six-field summary;
- a name containing `expand`, when the request offers the gateway's `ctxgate_expand` tool and a
  message names a `ref ctx:HEX` no tool result answered yet: a call of that tool with that ref
  (`expand-mixed`: with a call of the request's first tool beside it; `expand-greedy`: the
  first ref named, answered or not, every time: the limits' test);
- faults, on every door (`fault_reply`, `faulty_stream`): `fault-notjson` answers 200 with an
  HTML body; `fault-shape` 200 with JSON that is not the API's reply; `fault-brokensse` streams
  an event whose data is not JSON after the first one; `fault-unterminated` stops the stream
  before its last events (chat: the finish reason, usage and `[DONE]`); `flaky-<status>`
  answers that status (a 429 with `retry-after: 1`) to the first request with these exact
  bytes, and normally to the next; `fault-reset` (not streamed) sends half its body and drops
  the connection.

It also speaks Anthropic's Messages (`POST /v1/messages`, `POST /v1/messages/count_tokens`)
and OpenAI's Responses (`POST /v1/responses`), with the same model-name rules: see
tests/upstream_doors.py, which holds those doors and their token counts
(`anthropic_input_tokens`, `responses_input_tokens`).

Every request lands in `.log` (raw bytes, body, headers, prompt tokens, the bytes answered,
whether the handler saw its client go away, and its `door`: "chat", "embeddings", "messages",
"count_tokens" or "responses"), also at `GET /_log`; `POST /_reset` clears it.
"""
from __future__ import annotations

import asyncio
import hashlib
import importlib.util
import json
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from aiohttp import web

from agent_edit import edit_choice, is_edit_model
from agent_steps import chat_choice, is_steps_model, text_choice

_spec = importlib.util.find_spec("litellm")
if _spec is not None and _spec.origin:  # tiktoken's BPE files from the litellm wheel: never downloaded
    os.environ.setdefault("TIKTOKEN_CACHE_DIR", str(Path(_spec.origin).parent / "litellm_core_utils" / "tokenizers"))
import tiktoken  # noqa: E402

O200K = tiktoken.get_encoding("o200k_base")
CREATED = 1_700_000_000
REPLY = "ok"
SUMMARY = ("1. Goal: finish the task the user gave.\n2. Completed steps: read the files, ran the tests.\n"
           "3. Key decisions: used read_file and bash to inspect the project.\n4. Open issues: one failing test.\n"
           "5. Files: src/app.py, tests/test_app.py.\n6. Skill/tool context: none active.")
RATE_LIMIT = {"x-ratelimit-remaining-requests": "99", "x-request-id": "req_scripted"}
"""Sent with every JSON answer, as providers send them; a 429 also says when to come back."""
RATE_LIMITED = {**RATE_LIMIT, "retry-after": "1", "x-ratelimit-remaining-requests": "0"}
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 429: "rate_limit_error"}


BROKEN_EVENT = b'data: {"choices": [{"delta": {"content": "cut\n\n'
"""An SSE event whose data is not JSON (a proxy in between cut it)."""
NOT_JSON = b"<html><body><h1>502 Bad Gateway</h1></body></html>"


def fault_reply(model: str) -> web.Response | None:
    """A 200 that is not the API's reply, for the `fault-notjson` and `fault-shape` models."""
    if "fault-notjson" in model:
        return web.Response(body=NOT_JSON, content_type="text/html")
    if "fault-shape" in model:
        return web.Response(body=b'{"id": "x", "object": "unexpected"}', content_type="application/json")
    return None


def faulty_stream(model: str, frames: list[bytes], ending: int) -> list[bytes]:
    """`fault-brokensse`: an event that is not JSON after the first; `fault-unterminated`: the
    stream without its last `ending` frames."""
    if "fault-brokensse" in model:
        return [frames[0], BROKEN_EVENT, *frames[1:]]
    if "fault-unterminated" in model:
        return frames[:-ending]
    return frames


def flaky_status(model: str, entry: "Received", log: list["Received"]) -> int | None:
    """`flaky-<status>`: the status for the first request with these bytes (`entry` is logged last)."""
    found = re.fullmatch(r"flaky-(\d{3})", model)
    if found is None or any(r.raw == entry.raw and r.door == entry.door for r in log[:-1]):
        return None
    return int(found.group(1))


EXPAND_TOOL = "ctxgate_expand"
_REF = re.compile(r"ref (ctx:[0-9a-f]{12})")


def offered_tools(body: dict[str, Any]) -> list[str]:
    """The names of the tools a request offers, in any door's form."""
    tools = body.get("tools")
    return [(t.get("function") or {}).get("name") or t.get("name") for t in tools or [] if isinstance(t, dict)]


def ref_to_expand(body: dict[str, Any], model: str, answered: set[str]) -> str | None:
    """The ref an `expand` model asks for: the first one its messages name that no result in
    `answered` (call ids) answered yet; None when the tool is not offered or nothing is left."""
    if "expand" not in model or EXPAND_TOOL not in offered_tools(body):
        return None
    said = [body.get(k) for k in ("system", "messages", "instructions", "input")]  # every door's conversation
    for ref in _REF.findall(json.dumps(said)):
        if "greedy" in model or f"call_expand_{ref[4:]}" not in answered:
            return ref
    return None


def expansion_call(body: dict[str, Any], model: str) -> list[dict[str, Any]] | None:
    """The chat tool calls of an `expand` model's reply, or None (see `ref_to_expand`)."""
    messages = body.get("messages") or []
    answered = {m.get("tool_call_id") for m in messages if isinstance(m, dict) and m.get("role") == "tool"}
    ref = ref_to_expand(body, model, answered)
    if ref is None:
        return None
    rounds = sum(1 for m in messages if isinstance(m, dict) and m.get("role") == "tool"
                 and str(m.get("tool_call_id")).startswith("call_expand_"))
    call_id = f"call_expand_{ref[4:]}" + (f"_{rounds}" if "greedy" in model else "")
    calls = [{"id": call_id, "type": "function",
              "function": {"name": EXPAND_TOOL, "arguments": json.dumps({"ref": ref})}}]
    if "mixed" in model:
        first = offered_tools(body)[0]
        calls.append({"id": "call_agent_0", "type": "function", "function": {"name": first, "arguments": "{}"}})
    return calls


def encode(text: str) -> list[int]:
    return O200K.encode(text, disallowed_special=())


def prompt_tokens(messages: Any, count: Callable[[str], int] = lambda s: len(encode(s))) -> int:
    """OpenAI's formula: 3 per message, every string value, 1 more for a name, 3 to prime."""
    n = 3
    for m in messages if isinstance(messages, list) else []:
        if not isinstance(m, dict):
            continue
        n += 3 + (1 if "name" in m else 0)
        for value in m.values():
            if isinstance(value, str):
                n += count(value)
            elif isinstance(value, list):  # content parts
                n += sum(count(p["text"]) for p in value if isinstance(p, dict) and isinstance(p.get("text"), str))
    return n


@dataclass
class Received:
    path: str
    raw: bytes
    headers: dict[str, str]
    """Lower-cased names."""
    body: Any = None
    prompt_tokens: int | None = None
    response: bytes = b""
    """The bytes this upstream answered (every SSE frame, for a stream)."""
    cancelled: bool = False
    """The handler saw its client go away (cancelled, or the connection reset mid-write)."""
    done: bool = False
    door: str = "chat"
    """Which API: "chat", "embeddings", "messages", "count_tokens" or "responses"."""

    def __post_init__(self) -> None:
        # Parsed before the entry joins the log: tests read the log from another thread while
        # the handler runs, and must never see a request whose body is not there yet.
        if self.body is None:
            try:
                self.body = json.loads(self.raw)
            except ValueError:
                self.body = None

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "raw": self.raw.decode("utf-8", "replace"), "body": self.body,
                "headers": self.headers, "prompt_tokens": self.prompt_tokens, "cancelled": self.cancelled,
                "done": self.done, "door": self.door, "response": self.response.decode("utf-8", "replace")}


def _json(data: Any) -> bytes:
    return json.dumps(data, separators=(",", ":")).encode()


def error_object(status: int, message: str, code: str | None, param: str | None = None) -> dict[str, Any]:
    etype = _ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": etype, "param": param, "code": code}}


class ScriptedUpstream:
    def __init__(self, limit: int = 0, slow_s: float = 3.0, host: str = "127.0.0.1", port: int = 0) -> None:
        self.limit = limit
        """Context limit in prompt tokens; 0: none."""
        self.framing_tokens = 0
        """Tokens counted per message beyond OpenAI's formula: a provider whose framing differs."""
        self.slow_s = slow_s
        self.host, self.port = host, port
        self.log: list[Received] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def reset(self) -> None:
        self.log.clear()

    def chats(self) -> list[Received]:
        return [r for r in self.log if r.door == "chat"]

    # -- lifecycle ---------------------------------------------------------------------
    def app(self) -> web.Application:
        from upstream_doors import Doors  # built on this module: imported once it is complete
        from upstream_gemini import GeminiUpstream

        app = web.Application(client_max_size=512 * 1024 * 1024)
        Doors(self).add_routes(app)
        GeminiUpstream(self).add_routes(app)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/embeddings", self._embeddings)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/_log", self._log)
        app.router.add_post("/_reset", self._log)
        return app

    async def _serve(self) -> None:
        self._runner = web.AppRunner(self.app(), handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port).start()
        self.port = self._runner.addresses[0][1]

    def start(self) -> "ScriptedUpstream":
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="scripted-upstream", daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._serve(), self._loop).result(10)
        return self

    def stop(self) -> None:
        if self._loop is None or self._runner is None:
            return
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(5)
        self._loop.close()
        self._loop = self._runner = None

    # -- handlers ----------------------------------------------------------------------
    async def _log(self, request: web.Request) -> web.Response:
        if request.method == "POST":
            self.reset()
        return web.json_response([e.to_json() for e in self.log])

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": n, "object": "model", "created": CREATED,
                                  "owned_by": "scripted"} for n in ("gpt-4o", "summarizer", "overflow", "slow")]})

    async def _embeddings(self, request: web.Request) -> web.Response:
        raw = await request.read()
        entry = Received(request.path, raw, {k.lower(): v for k, v in request.headers.items()}, door="embeddings")
        self.log.append(entry)
        try:
            entry.body = body = json.loads(raw)
            texts = body["input"] if isinstance(body["input"], list) else [body["input"]]
            texts = [t if isinstance(t, str) else json.dumps(t) for t in texts]
        except (ValueError, KeyError, TypeError):
            return self._error(entry, 400, "input is required", "invalid_request_error", "input")
        data = [{"object": "embedding", "index": i, "embedding": _vector(t)} for i, t in enumerate(texts)]
        used = sum(len(encode(t)) for t in texts)
        return self._send(entry, {"object": "list", "data": data, "model": body.get("model"),
                                  "usage": {"prompt_tokens": used, "total_tokens": used}})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        entry = Received(request.path, raw, {k.lower(): v for k, v in request.headers.items()})
        self.log.append(entry)
        try:
            return await self._answer(request, entry, raw)
        except (asyncio.CancelledError, ConnectionResetError):
            entry.cancelled = True
            raise
        finally:
            entry.done = True

    async def _answer(self, request: web.Request, entry: Received, raw: bytes) -> web.StreamResponse:
        try:
            entry.body = body = json.loads(raw)
        except ValueError:
            return self._error(entry, 400, "We could not parse the JSON body of your request.", "invalid_json")
        if not isinstance(body, dict):
            return self._error(entry, 400, "The body must be a JSON object.", "invalid_json")
        model = body.get("model") if isinstance(body.get("model"), str) else ""
        messages = body.get("messages")
        framing = self.framing_tokens * (len(messages) if isinstance(messages, list) else 0)
        entry.prompt_tokens = used = prompt_tokens(messages) + framing
        if found := re.fullmatch(r"error-(\d{3})", model):
            status = int(found.group(1))
            return self._error(entry, status, f"scripted upstream error {status}", f"scripted_{status}")
        if status := flaky_status(model, entry, self.log):
            return self._error(entry, status, f"scripted flaky error {status}", f"scripted_{status}")
        if (faulty := fault_reply(model)) is not None:
            return faulty
        if "fault-reset" in model and not body.get("stream"):
            return await self._reset_mid_body(request)
        limit = max(1, used // 2) if "overflow" in model else self.limit
        if limit and used > limit:
            return self._error(entry, 400, f"This model's maximum context length is {limit} tokens. However, your "
                               f"messages resulted in {used} tokens.", "context_length_exceeded", "messages")
        n = body.get("n", 1) if body.get("n") is not None else 1
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 16:
            return self._error(entry, 400, "n must be an integer from 1 to 16", "invalid_value", "n")
        choices = [self._choice(body, model, i) for i in range(n)]
        completion = sum(len(encode(c["message"]["content"] or "")) or 1 for c in choices)
        usage = {"prompt_tokens": used, "completion_tokens": completion, "total_tokens": used + completion}
        rid = f"chatcmpl-up-{len(self.log)}"
        if body.get("stream") is True:
            options = body.get("stream_options")
            with_usage = isinstance(options, dict) and options.get("include_usage") is True
            return await self._stream(request, entry, rid, model, choices, usage if with_usage else None,
                                      "slow" in model)
        if "slow" in model:
            await asyncio.sleep(self.slow_s)
        return self._send(entry, {"id": rid, "object": "chat.completion", "created": CREATED, "model": model,
                                  "system_fingerprint": "fp_scripted", "choices": choices, "usage": usage})

    def _choice(self, body: dict[str, Any], model: str, i: int) -> dict[str, Any]:
        if is_edit_model(model):  # aider editing calc.py after N steps (tests/agent_edit.py)
            return edit_choice(body, model, i)
        if is_steps_model(model):  # no tools but the gateway's (aider): a text reply, whose ```bash block it runs
            agents = [name for name in offered_tools(body) if name != EXPAND_TOOL]
            return chat_choice(body, model, i) if agents else text_choice(body, model, i)
        if (expanding := expansion_call(body, model)) is not None:
            return {"index": i, "message": {"role": "assistant", "content": None, "tool_calls": expanding},
                    "logprobs": None, "finish_reason": "tool_calls"}
        tools = body.get("tools")
        if "tools" in model and isinstance(tools, list) and tools and isinstance(tools[0], dict):
            name = (tools[0].get("function") or {}).get("name", "tool")
            call = {"id": f"call_up_{i}", "type": "function",
                    "function": {"name": name, "arguments": '{"path": "a.py"}'}}
            return {"index": i, "message": {"role": "assistant", "content": None, "tool_calls": [call]},
                    "logprobs": None, "finish_reason": "tool_calls"}
        fmt = body.get("response_format")
        if "summarizer" in model:
            text = SUMMARY
        elif isinstance(fmt, dict) and fmt.get("type") in ("json_object", "json_schema"):
            text = '{"ok": true}'
        else:
            text = REPLY if i == 0 else f"{REPLY} {i}"
        stop = body.get("stop")
        for s in [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []:
            if isinstance(s, str) and s and s in text:
                text = text[: text.index(s)]
        return {"index": i, "message": {"role": "assistant", "content": text, "refusal": None},
                "logprobs": None, "finish_reason": "stop"}

    async def _stream(self, request: web.Request, entry: Received, rid: str, model: str,
                      choices: list[dict[str, Any]], usage: dict[str, int] | None, slow: bool) -> web.StreamResponse:
        def frame(chunk_choices: list[dict[str, Any]], **extra: Any) -> bytes:
            chunk = {"id": rid, "object": "chat.completion.chunk", "created": CREATED, "model": model,
                     "system_fingerprint": "fp_scripted", "choices": chunk_choices, **extra}
            if usage is not None:
                chunk.setdefault("usage", None)
            return b"data: " + _json(chunk) + b"\n\n"

        frames = [frame([{"index": c["index"], "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None} for c in choices])]
        for c in choices:
            msg, delta = c["message"], {}
            if msg.get("tool_calls"):
                for k, call in enumerate(msg["tool_calls"]):  # one call, but for `expand-mixed`
                    if delta:
                        frames.append(frame([{"index": c["index"], "delta": delta, "logprobs": None,
                                              "finish_reason": None}]))
                    opening = {"index": k, "id": call["id"], "type": "function",
                               "function": {"name": call["function"]["name"], "arguments": ""}}
                    frames.append(frame([{"index": c["index"], "delta": {"tool_calls": [opening]}, "logprobs": None,
                                          "finish_reason": None}]))
                    delta = {"tool_calls": [{"index": k, "function": {"arguments": call["function"]["arguments"]}}]}
            elif msg["content"]:
                delta = {"content": msg["content"]}
            if delta:
                frames.append(frame([{"index": c["index"], "delta": delta, "logprobs": None, "finish_reason": None}]))
        frames.append(frame([{"index": c["index"], "delta": {}, "logprobs": None, "finish_reason": c["finish_reason"]}
                             for c in choices]))
        if usage is not None:
            frames.append(frame([], usage=usage))
        frames.append(b"data: [DONE]\n\n")
        frames = faulty_stream(model, frames, 3 if usage is not None else 2)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await response.prepare(request)
        for i, data in enumerate(frames):
            if slow and i:
                await asyncio.sleep(self.slow_s)
            entry.response += data  # what it sent, also when the reader hangs up before it is written
            await response.write(data)
        await response.write_eof()
        return response

    @staticmethod
    async def _reset_mid_body(request: web.Request) -> web.StreamResponse:
        """`fault-reset`: a 200 whose body stops halfway, the connection dropped."""
        whole = json.dumps({"id": "chatcmpl-cut", "object": "chat.completion", "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "x" * 2000}, "finish_reason": "stop"}]}).encode()
        response = web.StreamResponse(headers={"Content-Type": "application/json", "Content-Length": str(len(whole))})
        await response.prepare(request)
        await response.write(whole[:len(whole) // 2])
        assert request.transport is not None
        request.transport.close()
        return response

    def _send(self, entry: Received, data: dict[str, Any], status: int = 200) -> web.Response:
        entry.response = _json(data)
        return web.Response(status=status, body=entry.response, content_type="application/json",
                            headers=RATE_LIMITED if status == 429 else RATE_LIMIT)

    def _error(self, entry: Received, status: int, message: str, code: str | None,
               param: str | None = None) -> web.Response:
        return self._send(entry, error_object(status, message, code, param), status)


def _vector(text: str, dims: int = 8) -> list[float]:
    return [round(b / 255.0 - 0.5, 6) for b in hashlib.sha256(text.encode()).digest()[:dims]]


if __name__ == "__main__":  # python tests/upstream.py [port] [limit]
    import sys

    port = int(sys.argv[1]) if len(sys.argv) > 1 else 8999
    limit = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    web.run_app(ScriptedUpstream(limit, port=port).app(), host="127.0.0.1", port=port, handler_cancellation=True)
