"""Forwarding a Gemini generateContent body natively to a `gemini/` route: Google's own API,
the key as `x-goog-api-key`, the reply's bytes untouched (whole, or its SSE events).

A stream is always asked for as SSE (`alt=sse`): the door frames it as the client asked. When
the door changed nothing it sends the client's own request bytes, so Google's implicit prompt
cache sees exactly what the client would have sent.
"""
from __future__ import annotations

from typing import Any

import orjson

from .forwarders import DirectForwarder, Reply
from .routing import Route

DEFAULT_API_BASE = "https://generativelanguage.googleapis.com"


def gemini_url(api_base: str | None, model: str, stream: bool) -> str:
    """`{api_base}/v1beta/models/{model}:…`, for an api_base given with or without its version."""
    base = (api_base or DEFAULT_API_BASE).rstrip("/").removesuffix("/v1beta").removesuffix("/v1")
    method = "streamGenerateContent?alt=sse" if stream else "generateContent"
    return f"{base}/v1beta/models/{model.removeprefix('models/')}:{method}"


async def send_native(pool: DirectForwarder, route: Route, body: dict[str, Any], raw: bytes | None, *,
                      stream: bool, api_key: str | None) -> Reply:
    """`raw`: the client's own bytes, when `body` is exactly what it sent."""
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream" if stream else "application/json"}
    if api_key:
        headers["x-goog-api-key"] = api_key
    url = gemini_url(route.api_base, route.upstream_model, stream)
    data = raw if raw is not None else orjson.dumps(body)
    return await pool.post(route, url, data, headers, stream=stream, where=url.split("?")[0])
