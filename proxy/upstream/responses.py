"""Sending a Responses API request upstream.

To an OpenAI-compatible route: `POST {api_base}/responses` over the pooled direct
client, reply bytes untouched (a response object, or its SSE events). To any other
provider: litellm's Responses bridge (`litellm.aresponses`), its objects serialised back
to the Responses wire format. Errors as on the chat path: `UpstreamError`, and
`ContextTooLong` when the prompt does not fit (the engine then compacts).
"""
from __future__ import annotations

import functools
import inspect
from typing import Any, AsyncIterator

import orjson

from ..errors import ErrorKind, GatewayError
from .forwarders import CALL_CONTROLS, DirectForwarder, Reply, call_litellm, litellm_params, stream_error
from .routing import Route


class ResponsesForwarder:
    def __init__(self, direct: DirectForwarder) -> None:
        self._direct = direct

    async def send(self, route: Route, payload: dict[str, Any], *, stream: bool, api_key: str | None,
                   raw: bytes | None = None) -> Reply:
        """`raw`: `payload` as the client's bytes, sent as they are on a direct route."""
        if route.demo:
            raise GatewayError(ErrorKind.INVALID_REQUEST,
                               f"the model {route.model_name} does not speak the Responses API; "
                                "configure a real upstream in the model_list", param="model",
                           code="model_not_supported")
        if route.direct:
            return await self._direct.send(route, payload, stream=stream, api_key=api_key, path="responses", raw=raw)
        return await self._via_litellm(route, payload, stream, api_key)

    async def _via_litellm(self, route: Route, payload: dict[str, Any], stream: bool, api_key: str | None) -> Reply:
        import litellm

        params = litellm_params(route, payload, _aresponses_params(), api_key)
        return await call_litellm(self._direct.retrier, litellm.aresponses, route, params, stream,
                                  lambda result: orjson.dumps(_wire(result)), _events)


@functools.lru_cache(maxsize=1)
def _aresponses_params() -> frozenset[str]:
    import litellm

    named = {p for p in inspect.signature(litellm.aresponses).parameters if p not in ("model", "kwargs")}
    return frozenset(named - CALL_CONTROLS - {"extra_headers", "extra_query", "extra_body", "custom_llm_provider"})


def _wire(obj: Any) -> dict[str, Any]:
    data: dict[str, Any] = obj.model_dump(mode="json", exclude_none=True) if hasattr(obj, "model_dump") else dict(obj)
    data.pop("_hidden_params", None)
    return data


async def _events(stream: Any, route: Route) -> AsyncIterator[bytes]:
    """litellm's event objects as the Responses stream sends them: `event:` and `data:` lines."""
    try:
        async for event in stream:
            data = _wire(event)  # mode="json": an enum `type` becomes its string
            yield f"event: {data.get('type', 'message')}\n".encode() + b"data: " + orjson.dumps(data) + b"\n\n"
    except Exception as e:
        raise stream_error(e, route) from None
