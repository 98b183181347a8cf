"""Forwarding an Anthropic Messages body: natively to an Anthropic route, through litellm's
Anthropic-messages adapter to any other provider.

The native path posts on `DirectForwarder`'s pooled session and hands back the reply's
bytes untouched (whole or SSE); when the door changed nothing it sends the client's own
request bytes, so the upstream's prompt cache sees exactly what the client would have sent.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, AsyncIterator

import orjson

from ..errors import ErrorKind, GatewayError
from .errors import UpstreamError
from .forwarders import DirectForwarder, Reply, call_litellm, route_params, stream_error
from .routing import Route

DEFAULT_API_BASE = "https://api.anthropic.com"
DEFAULT_VERSION = "2023-06-01"
# The Messages API's own parameters, the only fields handed to litellm: any other field of a
# client's body (api_base, api_key, mock_response ...) would steer litellm's call and its key.
_ADAPTER_PARAMS = ("max_tokens", "messages", "metadata", "stop_sequences", "stream", "system", "temperature",
                   "thinking", "tool_choice", "tools", "top_k", "top_p")


@dataclass(frozen=True)
class MessagesCall:
    """One Messages request to forward."""
    body: dict[str, Any]
    raw: bytes | None
    """The client's request bytes, when `body` is exactly what the client sent."""
    version: str | None
    """The client's `anthropic-version` header."""
    beta: str | None
    """The client's `anthropic-beta` header."""


    bearer: bool = False
    """Send the key as `Authorization: Bearer` (a client's OAuth token passed through), not `x-api-key`."""


# What count_tokens takes besides the messages: the rest of a Messages body it refuses.
COUNTED_FIELDS = ("system", "tools", "tool_choice", "thinking")


def messages_url(api_base: str | None, endpoint: str = "messages") -> str:
    """`{api_base}/v1/messages` (or `/v1/messages/count_tokens`), for an api_base given with or without its `/v1`."""
    base = (api_base or DEFAULT_API_BASE).rstrip("/").removesuffix("/v1")
    return f"{base}/v1/{endpoint}"


def _headers(call: MessagesCall, api_key: str | None, stream: bool) -> dict[str, str]:
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream" if stream else "application/json",
               "anthropic-version": call.version or DEFAULT_VERSION}
    if call.beta:
        headers["anthropic-beta"] = call.beta
    if api_key and call.bearer:
        headers["Authorization"] = f"Bearer {api_key}"
    elif api_key:
        headers["x-api-key"] = api_key
    return headers


async def send_native(pool: DirectForwarder, route: Route, call: MessagesCall, *, stream: bool,
                      api_key: str | None) -> Reply:
    data = call.raw if call.raw is not None else orjson.dumps(call.body)
    url = messages_url(route.api_base)
    return await pool.post(route, url, data, _headers(call, api_key, stream), stream=stream, where=url)


async def count_native(pool: DirectForwarder, route: Route, call: MessagesCall, api_key: str | None) -> int:
    """Anthropic's own count of `call.body`'s prompt (its `count_tokens` endpoint: free, and
    the only exact count there is for Claude models): the client's own bytes when they are a
    count_tokens request ctxgate left as it was (`call.raw`)."""
    url = messages_url(route.api_base, "messages/count_tokens")
    if call.raw is not None:
        data = call.raw
    else:
        body = {k: call.body[k] for k in COUNTED_FIELDS if k in call.body}
        body.update(model=call.body["model"], messages=call.body["messages"])
        data = orjson.dumps(body)
    # Asked inside the session's lock, and only an aid (the estimate answers without it): never waited for.
    once = replace(route, retry=replace(route.retry, num_retries=0))
    try:
        reply = await pool.post(once, url, data, _headers(call, api_key, False), stream=False,
                                where=url)
    except UpstreamError as e:  # a GatewayError is what the engine takes for "no count": the estimate answers
        raise e.to_api_error() from None
    try:
        tokens = orjson.loads(reply.body or b"{}").get("input_tokens")
    except (orjson.JSONDecodeError, AttributeError):
        tokens = None
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0:
        raise GatewayError(ErrorKind.UPSTREAM_UNREACHABLE, f"{url} answered no input_tokens", code="upstream_error")
    return tokens


async def send_litellm(pool: DirectForwarder, route: Route, call: MessagesCall, *, stream: bool,
                       api_key: str | None) -> Reply:
    """Through litellm's adapter, retried by the pool's retrier as the native path is."""
    import litellm

    # A model_list deployment of another provider is a chat-completions deployment: many
    # OpenAI-compatible servers have no Responses API, which litellm would use for OpenAI.
    litellm.use_chat_completions_url_for_anthropic_messages = True
    params = route_params(route, api_key)
    params.update({k: call.body[k] for k in _ADAPTER_PARAMS if k in call.body})
    return await call_litellm(pool.retrier, litellm.anthropic_messages, route, params, stream,
                              lambda result: orjson.dumps(result, default=_plain), _adapter_sse)


def _plain(obj: Any) -> Any:
    """litellm's typed objects inside a reply, as JSON."""
    if hasattr(obj, "model_dump"):
        return obj.model_dump(exclude_none=True)
    raise TypeError(f"{type(obj).__name__} is not JSON serialisable")


async def _adapter_sse(stream: Any, route: Route) -> AsyncIterator[bytes]:
    """The adapter's stream is Anthropic SSE already (bytes); an event object is framed as one."""
    try:
        async for chunk in stream:
            if isinstance(chunk, (bytes, bytearray)):
                yield bytes(chunk)
            elif isinstance(chunk, str):
                yield chunk.encode()
            else:
                event = orjson.loads(orjson.dumps(chunk, default=_plain))
                yield f"event: {event.get('type', 'message')}\ndata: ".encode() + orjson.dumps(event) + b"\n\n"
    except Exception as e:
        raise stream_error(e, route) from None
