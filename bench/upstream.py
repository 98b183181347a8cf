"""A minimal scripted OpenAI-compatible upstream for the benchmarks.

`POST /v1/chat/completions` parses the JSON body and answers a fixed
small `chat.completion` ("ok") without `usage.prompt_tokens` (with `stream: true`: the
same reply as server-sent `chat.completion.chunk` events — role, "ok", finish — then
`data: [DONE]`): counting 200K tokens exactly
would add ~60 ms of upstream time to every call and widen the spread of the figures, and
an estimate would steer ctxgate, which anchors its budget decisions on the provider's count.
`POST /v1/messages` (Anthropic) and `POST /v1/responses` (OpenAI Responses) answer the same
fixed "ok" in their own shapes, non-stream only (a 400 to `stream: true`), without usage for the same reason.

    .venv/bin/python bench/upstream.py --port 8999

It may be replaced by tests/upstream.py; it is kept small on purpose.
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
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    await resp.write(_chunk(body, {"role": "assistant", "content": ""}, None)
                     + _chunk(body, {"content": REPLY}, None) + _chunk(body, {}, "stop") + b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


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


async def messages(request: web.Request) -> web.Response:
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError:
        return web.json_response({"type": "error", "error": {"type": "invalid_request_error",
                                                             "message": "invalid JSON"}}, status=400)
    if body.get("stream"):
        return web.json_response({"type": "error", "error": {"type": "invalid_request_error",
                                                             "message": "bench upstream: stream not supported"}},
                                 status=400)
    reply = {"id": "msg_bench", "type": "message", "role": "assistant", "model": body.get("model", "bench"),
             "content": [{"type": "text", "text": REPLY}], "stop_reason": "end_turn", "stop_sequence": None}
    return web.Response(body=orjson.dumps(reply), content_type="application/json")


async def responses(request: web.Request) -> web.Response:
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError:
        return web.json_response({"error": {"message": "invalid JSON", "type": "invalid_request_error",
                                            "param": None, "code": None}}, status=400)
    if body.get("stream"):
        return web.json_response({"error": {"message": "bench upstream: stream not supported",
                                            "type": "invalid_request_error", "param": "stream", "code": None}},
                                 status=400)
    reply = {
        "id": "resp_bench", "object": "response", "created_at": int(time.time()), "status": "completed",
        "model": body.get("model", "bench"), "error": None, "incomplete_details": None,
        "output": [{"id": "msg_bench", "type": "message", "status": "completed", "role": "assistant",
                    "content": [{"type": "output_text", "text": REPLY, "annotations": []}]}],
        "parallel_tool_calls": True, "tool_choice": "auto", "tools": [],
    }
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
