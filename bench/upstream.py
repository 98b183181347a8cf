"""The benches' scripted upstream: a fixed "ok" from `POST /v1/chat/completions`,
`/v1/messages` and `/v1/responses`, each in its API's shape and, with `stream: true`, as its
API's SSE events (those tests/upstream_doors.py scripts), and from Gemini's
`/v1beta/models/{model}:generateContent` (`:streamGenerateContent`: its SSE events).
No input `usage`: counting the tokens would add upstream time and spread (the suite's
tests/upstream.py, which counts them, answered a 100K-token chat in 73 ms p50 and a 400K one
in 303 ms, this one in 9 and 16 ms), and a guess would steer ctxgate, which anchors its budget on the provider's count.
`--delay-ms N`: every reply (a stream's first byte) waits N ms after the body is read, as a
model takes time to answer; what a proxy does meanwhile costs its client nothing.

    .venv/bin/python bench/upstream.py --port 8999 [--delay-ms 200]
"""
from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any, Callable

import orjson
from aiohttp import web

REPLY = "ok"
Frames = Callable[[dict[str, Any], dict[str, Any]], list[bytes]]
"""A door's stream: its SSE frames from the request's body and the reply it would send whole."""


def _event(kind: str, data: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **data}) + b"\n\n"


def _chat(body: dict[str, Any]) -> dict[str, Any]:
    return {"id": "chatcmpl-bench", "object": "chat.completion", "created": int(time.time()),
            "model": body.get("model", "bench"), "system_fingerprint": "fp_bench",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": REPLY}, "logprobs": None,
                         "finish_reason": "stop"}]}


def _chat_frames(body: dict[str, Any], reply: dict[str, Any]) -> list[bytes]:
    def chunk(delta: dict[str, Any], finish: str | None) -> bytes:
        return b"data: " + orjson.dumps({**reply, "object": "chat.completion.chunk", "choices": [
            {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}) + b"\n\n"

    return [chunk({"role": "assistant", "content": ""}, None), chunk({"content": REPLY}, None), chunk({}, "stop"),
            b"data: [DONE]\n\n"]


def _messages(body: dict[str, Any]) -> dict[str, Any]:
    return {"id": "msg_bench", "type": "message", "role": "assistant", "model": body.get("model", "bench"),
            "content": [{"type": "text", "text": REPLY}], "stop_reason": "end_turn", "stop_sequence": None}


def _messages_frames(body: dict[str, Any], message: dict[str, Any]) -> list[bytes]:
    return [_event("message_start", {"message": {**message, "content": [], "stop_reason": None}}),
            _event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}),
            _event("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": REPLY}}),
            _event("content_block_stop", {"index": 0}),
            _event("message_delta", {"delta": {"stop_reason": "end_turn", "stop_sequence": None},
                                     "usage": {"output_tokens": 1}}),
            _event("message_stop", {})]


def _responses(body: dict[str, Any]) -> dict[str, Any]:
    return {"id": "resp_bench", "object": "response", "created_at": int(time.time()), "status": "completed",
            "model": body.get("model", "bench"), "error": None, "incomplete_details": None,
            "output": [{"id": "msg_bench", "type": "message", "status": "completed", "role": "assistant",
                        "content": [{"type": "output_text", "text": REPLY, "annotations": []}]}],
            "parallel_tool_calls": True, "tool_choice": "auto", "tools": []}


def _responses_frames(body: dict[str, Any], response: dict[str, Any]) -> list[bytes]:
    response = {**response, "usage": None}
    item = response["output"][0]
    part = item["content"][0]
    ids = {"item_id": item["id"], "output_index": 0, "content_index": 0}
    events: list[tuple[str, dict[str, Any]]] = [
        ("response.created", {"response": {**response, "status": "in_progress", "output": []}}),
        ("response.output_item.added", {"output_index": 0, "item": {**item, "status": "in_progress", "content": []}}),
        ("response.content_part.added", {**ids, "part": {**part, "text": ""}}),
        ("response.output_text.delta", {**ids, "delta": REPLY}),
        ("response.output_text.done", {**ids, "text": REPLY}),
        ("response.content_part.done", {**ids, "part": part}),
        ("response.output_item.done", {"output_index": 0, "item": item}),
        ("response.completed", {"response": response})]
    return [_event(kind, {**data, "sequence_number": n}) for n, (kind, data) in enumerate(events)]


OPENAI_ERROR = {"error": {"message": "invalid JSON", "type": "invalid_request_error", "param": None, "code": None}}
ANTHROPIC_ERROR = {"type": "error", "error": {"type": "invalid_request_error", "message": "invalid JSON"}}
DELAY_S = web.AppKey("delay_s", float)
GOOGLE_ERROR = {"error": {"code": 400, "message": "invalid JSON", "status": "INVALID_ARGUMENT"}}


async def answering(request: web.Request) -> None:
    """The upstream's time to answer (`--delay-ms`), after the body is read."""
    delay = request.app[DELAY_S]
    if delay > 0:
        await asyncio.sleep(delay)


async def gemini(request: web.Request) -> web.StreamResponse:
    """Google's generateContent (the bench's gemini doors call it directly, and ctxgate forwards
    its `gemini/` route to it), and streamGenerateContent as SSE: the text, then the finish."""
    try:
        orjson.loads(await request.read())
    except orjson.JSONDecodeError:
        return web.json_response(GOOGLE_ERROR, status=400)
    await answering(request)
    model, _, method = request.match_info["call"].partition(":")
    candidate = {"content": {"role": "model", "parts": [{"text": REPLY}]}, "finishReason": "STOP", "index": 0}
    whole = {"candidates": [candidate], "modelVersion": model, "responseId": "bench"}
    if method != "streamGenerateContent":
        return web.Response(body=orjson.dumps(whole), content_type="application/json")
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    first = {**whole, "candidates": [{"content": candidate["content"], "index": 0}]}
    last = {**whole, "candidates": [{**candidate, "content": {"role": "model", "parts": [{"text": ""}]}}]}
    await resp.write(b"".join(b"data: " + orjson.dumps(c) + b"\r\n\r\n" for c in (first, last)))
    await resp.write_eof()
    return resp


def door(reply: Callable[[dict[str, Any]], dict[str, Any]], frames: Frames, error: dict[str, Any]
         ) -> Callable[[web.Request], Any]:
    """A door's handler: its reply whole, or its frames written at once when the body asks to stream."""
    async def handle(request: web.Request) -> web.StreamResponse:
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError:
            return web.json_response(error, status=400)
        await answering(request)
        whole = reply(body)
        if not body.get("stream"):
            return web.Response(body=orjson.dumps(whole), content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        await resp.write(b"".join(frames(body, whole)))
        await resp.write_eof()
        return resp

    return handle


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


def make_app(delay_ms: float = 0.0) -> web.Application:
    app = web.Application(client_max_size=256 * 1024 * 1024)
    app[DELAY_S] = delay_ms / 1000
    chat, responses = door(_chat, _chat_frames, OPENAI_ERROR), door(_responses, _responses_frames, OPENAI_ERROR)
    for path, handler in (("/v1/chat/completions", chat), ("/chat/completions", chat), ("/v1/responses", responses),
                          ("/responses", responses), ("/v1/messages", door(_messages, _messages_frames,
                                                                           ANTHROPIC_ERROR))):
        app.router.add_post(path, handler)
    app.router.add_post("/v1beta/models/{call}", gemini)
    app.router.add_get("/healthz", healthz)
    return app


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8999)
    p.add_argument("--delay-ms", type=float, default=0.0, help="time every reply waits before its first byte")
    args = p.parse_args()
    try:
        import uvloop

        loop = uvloop.new_event_loop()
    except ImportError:
        loop = None
    print(f"bench upstream on http://{args.host}:{args.port}/v1", flush=True)
    web.run_app(make_app(args.delay_ms), host=args.host, port=args.port, access_log=None, print=None, loop=loop)


if __name__ == "__main__":
    main()
