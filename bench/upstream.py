"""The benches' scripted upstream: a fixed "ok" from `POST /v1/chat/completions`,
`/v1/messages` and `/v1/responses`, each in its API's shape and, with `stream: true`, as its
API's SSE events (those tests/upstream_doors.py scripts). No input `usage`: counting 200K
tokens would add upstream time and spread, and a guess would steer ctxgate, which anchors its
budget on the provider's count.

    .venv/bin/python bench/upstream.py --port 8999
"""
from __future__ import annotations

import argparse
import time

import orjson
from aiohttp import web

REPLY = "ok"


def _chunk(body: dict, delta: dict, finish: str | None) -> bytes:
    chunk = {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": int(time.time()),
             "model": body.get("model", "bench"), "system_fingerprint": "fp_bench",
             "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


async def chat_stream(request: web.Request, body: dict) -> web.StreamResponse:
    return await _send_stream(request, _chunk(body, {"role": "assistant", "content": ""}, None)
                              + _chunk(body, {"content": REPLY}, None) + _chunk(body, {}, "stop")
                              + b"data: [DONE]\n\n")


async def _send_stream(request: web.Request, frames: bytes) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    await resp.write(frames)
    await resp.write_eof()
    return resp


def _event(kind: str, data: dict) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **data}) + b"\n\n"


def _messages_events(message: dict) -> bytes:
    start = {**message, "content": [], "stop_reason": None}
    return b"".join([
        _event("message_start", {"message": start}),
        _event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}),
        _event("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": REPLY}}),
        _event("content_block_stop", {"index": 0}),
        _event("message_delta", {"delta": {"stop_reason": "end_turn", "stop_sequence": None},
                                 "usage": {"output_tokens": 1}}),
        _event("message_stop", {}),
    ])


def _responses_events(response: dict) -> bytes:
    item = response["output"][0]
    part = item["content"][0]
    ids = {"item_id": item["id"], "output_index": 0, "content_index": 0}
    events = [
        ("response.created", {"response": {**response, "status": "in_progress", "output": []}}),
        ("response.output_item.added", {"output_index": 0, "item": {**item, "status": "in_progress", "content": []}}),
        ("response.content_part.added", {**ids, "part": {**part, "text": ""}}),
        ("response.output_text.delta", {**ids, "delta": REPLY}),
        ("response.output_text.done", {**ids, "text": REPLY}),
        ("response.content_part.done", {**ids, "part": part}),
        ("response.output_item.done", {"output_index": 0, "item": item}),
        ("response.completed", {"response": response}),
    ]
    return b"".join(_event(kind, {**data, "sequence_number": n}) for n, (kind, data) in enumerate(events))


async def chat(request: web.Request) -> web.StreamResponse:
    raw = await request.read()
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return web.json_response({"error": {"message": "invalid JSON", "type": "invalid_request_error",
                                            "param": None, "code": None}}, status=400)
    if body.get("stream"):
        return await chat_stream(request, body)
    reply = {
        "id": "chatcmpl-bench", "object": "chat.completion", "created": int(time.time()),
        "model": body.get("model", "bench"), "system_fingerprint": "fp_bench",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": REPLY}, "logprobs": None,
                     "finish_reason": "stop"}],
    }
    return web.Response(body=orjson.dumps(reply), content_type="application/json")


async def messages(request: web.Request) -> web.StreamResponse:
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError:
        return web.json_response({"type": "error", "error": {"type": "invalid_request_error",
                                                             "message": "invalid JSON"}}, status=400)
    reply = {"id": "msg_bench", "type": "message", "role": "assistant", "model": body.get("model", "bench"),
             "content": [{"type": "text", "text": REPLY}], "stop_reason": "end_turn", "stop_sequence": None}
    if body.get("stream"):
        return await _send_stream(request, _messages_events(reply))
    return web.Response(body=orjson.dumps(reply), content_type="application/json")


async def responses(request: web.Request) -> web.StreamResponse:
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError:
        return web.json_response({"error": {"message": "invalid JSON", "type": "invalid_request_error",
                                            "param": None, "code": None}}, status=400)
    reply = {
        "id": "resp_bench", "object": "response", "created_at": int(time.time()), "status": "completed",
        "model": body.get("model", "bench"), "error": None, "incomplete_details": None,
        "output": [{"id": "msg_bench", "type": "message", "status": "completed", "role": "assistant",
                    "content": [{"type": "output_text", "text": REPLY, "annotations": []}]}],
        "parallel_tool_calls": True, "tool_choice": "auto", "tools": [],
    }
    if body.get("stream"):
        return await _send_stream(request, _responses_events({**reply, "usage": None}))
    return web.Response(body=orjson.dumps(reply), content_type="application/json")


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


def make_app() -> web.Application:
    app = web.Application(client_max_size=256 * 1024 * 1024)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/chat/completions", chat)
    app.router.add_post("/v1/messages", messages)
    app.router.add_post("/v1/responses", responses)
    app.router.add_post("/responses", responses)
    app.router.add_get("/healthz", healthz)
    return app


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8999)
    args = p.parse_args()
    loop = None
    try:
        import uvloop

        loop = uvloop.new_event_loop()
    except ImportError:
        pass
    print(f"bench upstream on http://{args.host}:{args.port}/v1", flush=True)
    web.run_app(make_app(), host=args.host, port=args.port, access_log=None, print=None, loop=loop)


if __name__ == "__main__":
    main()
