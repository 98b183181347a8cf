"""`ctxgate-demo`: the built-in offline model, so a fresh `make run` answers at once.

It says what it received and how to configure a real upstream; it never calls out.
"""
from __future__ import annotations

import time
import uuid
from typing import Any, AsyncIterator

import orjson

from .routing import Route
from .forwarders import Reply

HINT = ("ctxgate is running with its offline demo model. To use a real model, start it with "
        "`ctxgate serve --config ctxgate.yaml` where the file has a litellm `model_list`.")


class DemoForwarder:
    async def send(self, route: Route, payload: dict[str, Any], *, stream: bool, api_key: str | None) -> Reply:
        messages = payload.get("messages") or []
        text = f"[{route.model_name}] received {len(messages)} messages. {HINT}"
        rid, created = f"chatcmpl-demo-{uuid.uuid4().hex[:12]}", int(time.time())
        usage = {"prompt_tokens": 0, "completion_tokens": len(text.split()), "total_tokens": len(text.split())}
        if not stream:
            body = {"id": rid, "object": "chat.completion", "created": created, "model": route.model_name,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                 "finish_reason": "stop"}],
                    "usage": usage}
            return Reply(status=200, content_type="application/json", body=orjson.dumps(body))
        include_usage = bool((payload.get("stream_options") or {}).get("include_usage"))
        return Reply(status=200, content_type="text/event-stream",
                     chunks=_chunks(rid, created, route.model_name, text, usage if include_usage else None))

    async def close(self) -> None:
        return None


async def _chunks(rid: str, created: int, model: str, text: str, usage: dict[str, int] | None) -> AsyncIterator[bytes]:
    def frame(choices: list[dict[str, Any]], **extra: Any) -> bytes:
        chunk = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                 "choices": choices, **extra}
        return b"data: " + orjson.dumps(chunk) + b"\n\n"

    words = text.split(" ")
    for i, word in enumerate(words):
        delta = {"content": word if i == 0 else " " + word}
        if i == 0:
            delta["role"] = "assistant"
        yield frame([{"index": 0, "delta": delta, "finish_reason": None}])
    yield frame([{"index": 0, "delta": {}, "finish_reason": "stop"}])
    if usage is not None:
        yield frame([], usage=usage)
    yield b"data: [DONE]\n\n"
