"""Sending a chat request upstream and handing back the reply as bytes.

Two forwarders share one interface. `DirectForwarder` posts the body as is to an
upstream that speaks the OpenAI API, over a pooled aiohttp session, and returns its bytes
untouched (ids, fields, SSE framing). `LitellmForwarder` goes through
`litellm.acompletion` for every other provider and serialises litellm's objects back to
OpenAI's wire format. Both raise `UpstreamError` for an error reply, `ContextTooLong`
when the provider says the prompt does not fit (`errors.py`). Both try again as the route's `RetryPolicy`
says (`retry.py`), and only until the reply is handed back: never once a byte may have
reached the client.
"""
from __future__ import annotations

import asyncio
import functools
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, Protocol

import aiohttp
import orjson

from ..errors import ErrorKind, GatewayError
from .errors import BAD_REPLY, ContextTooLong, UpstreamError, passed_headers, raise_for_error
from .pieces import Pieces
from .retry import Retrier
from .routing import Route

@dataclass
class Reply:
    """An upstream's success: whole bytes, or an async iterator of SSE bytes."""
    status: int
    content_type: str
    body: bytes | None = None
    chunks: AsyncIterator[bytes] | None = None
    upstream_ms: float = 0.0
    headers: dict[str, str] = field(default_factory=dict)
    close: Any = None


class Forwarder(Protocol):
    async def send(self, route: Route, payload: dict[str, Any], *, stream: bool, api_key: str | None) -> Reply: ...
    async def close(self) -> None: ...


class DirectForwarder:
    """The pooled client: one aiohttp session for all OpenAI-compatible upstreams."""

    def __init__(self, connect_timeout_s: float, retrier: Retrier) -> None:
        self._connect_timeout_s = connect_timeout_s
        self.retrier = retrier
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=60)
            self._session = aiohttp.ClientSession(connector=connector, auto_decompress=True,
                                                  skip_auto_headers=("User-Agent",))
        return self._session

    async def send(self, route: Route, payload: dict[str, Any], *, stream: bool, api_key: str | None,
                   path: str = "chat/completions", raw: bytes | Pieces | None = None) -> Reply:
        """POST to `{api_base}/{path}`: chat completions, or another OpenAI endpoint (`responses`).
        `raw`: the client's own bytes, when `payload` is exactly what it sent (no re-serialising,
        and the upstream's prompt cache sees what the client would have sent), or `payload`'s
        JSON made already, in pieces."""
        headers = {"Content-Type": "application/json", "Accept": "text/event-stream" if stream else "application/json"}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        data = raw if raw is not None else orjson.dumps(payload)
        return await self.post(route, f"{route.api_base}/{path}", data, headers, stream=stream,
                               where=str(route.api_base))

    async def post(self, route: Route, url: str, data: bytes | Pieces, headers: dict[str, str], *, stream: bool,
                   where: str) -> Reply:
        """POST `data` on the pooled session: the reply's bytes untouched, an error reply raised
        (`raise_for_error`), retried as `route.retry` says until a reply is handed back. Shared by
        every door that forwards natively; `where` names the upstream."""
        # A whole reply must arrive within the timeout; a stream must start within it and then
        # never stall longer (the client is reading it as it comes).
        timeout = aiohttp.ClientTimeout(total=None if stream else route.retry.timeout_s,
                                        sock_connect=self._connect_timeout_s, sock_read=route.retry.timeout_s)
        return await self.retrier.run(route.retry, route.model_name,
                                      lambda: self._attempt(url, data, headers, stream, where, timeout))

    async def _attempt(self, url: str, data: bytes | Pieces, headers: dict[str, str], stream: bool, where: str,
                       timeout: aiohttp.ClientTimeout) -> Reply:
        started = time.perf_counter()
        try:
            resp = await self._client().post(url, data=data, headers=headers, timeout=timeout)
        except asyncio.TimeoutError:
            raise GatewayError(ErrorKind.TIMEOUT,
                               f"upstream {where} did not answer in time", code="upstream_timeout") from None
        except aiohttp.ClientError as e:
            raise GatewayError(ErrorKind.UPSTREAM_UNREACHABLE,
                               f"upstream {where} is unreachable: {e}", code="upstream_unreachable") from None
        ctype = resp.headers.get("Content-Type", "application/json")
        if resp.status >= 400 or not stream or "text/event-stream" not in ctype:
            try:
                raw = await resp.read()
            except asyncio.TimeoutError:
                raise GatewayError(ErrorKind.TIMEOUT,
                                   f"upstream {where} timed out mid-reply", code="upstream_timeout") from None
            except aiohttp.ClientError as e:
                raise GatewayError(ErrorKind.UPSTREAM_UNREACHABLE, f"upstream {where} broke off its reply: {e}",
                               code="upstream_unreachable") from None
            finally:
                resp.release()
            elapsed = (time.perf_counter() - started) * 1000
            if resp.status >= 400:
                try:
                    parsed = orjson.loads(raw)
                except orjson.JSONDecodeError:
                    parsed = None
                raise_for_error(resp.status, parsed,
                                raw[:500].decode("utf-8", "replace") or f"upstream HTTP {resp.status}",
                                passed_headers(resp.headers))
            return Reply(status=resp.status, content_type=ctype, body=raw, upstream_ms=elapsed,
                         headers=passed_headers(resp.headers))
        return Reply(status=resp.status, content_type=ctype, chunks=_sse_bytes(resp),
                     upstream_ms=(time.perf_counter() - started) * 1000, close=resp.release,
                     headers=passed_headers(resp.headers))

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


async def _sse_bytes(resp: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    try:
        async for data in resp.content.iter_any():
            yield data
    except asyncio.TimeoutError:
        raise GatewayError(ErrorKind.TIMEOUT, "upstream stalled mid-stream", code="upstream_timeout") from None
    except aiohttp.ClientError as e:
        raise GatewayError(ErrorKind.UPSTREAM_UNREACHABLE,
                           f"upstream broke off the stream: {e}", code="upstream_unreachable") from None
    finally:
        resp.release()


# litellm's list of OpenAI chat-completion parameters also holds these, which choose where the
# call goes and with which credentials: only the config may set them, never a client's body.
CALL_CONTROLS = {"api_base", "base_url", "api_key", "api_version", "organization", "deployment_id",
                  "default_headers", "extra_headers", "timeout", "request_timeout", "max_retries"}


@functools.lru_cache(maxsize=1)
def _openai_params() -> frozenset[str]:
    import litellm

    return frozenset({"messages", *litellm.OPENAI_CHAT_COMPLETION_PARAMS} - CALL_CONTROLS)


def route_params(route: Route, api_key: str | None) -> dict[str, Any]:
    """What every litellm call of `route` takes from the config: its `litellm_params` (but
    the model, and the retries, which `call_litellm` makes), its key and its timeout."""
    params = {k: v for k, v in route.litellm_params.items() if k not in ("model", "num_retries")}
    if api_key:
        params["api_key"] = api_key
    params["timeout"] = route.retry.timeout_s
    params["max_retries"] = 0  # ctxgate retries, as on the direct path: litellm's would multiply them
    return params


def litellm_params(route: Route, payload: dict[str, Any], allowed: frozenset[str],
                   api_key: str | None) -> dict[str, Any]:
    """The keyword arguments of one litellm call: the route's own parameters, the client's
    fields litellm takes (`allowed`), and every other client field in `extra_body`."""
    params = route_params(route, api_key)
    extra: dict[str, Any] = {}
    for k, v in payload.items():
        if k in allowed:
            params[k] = v
        elif k != "model" and k not in route.litellm_params:
            # The client's own fields are data for the upstream, never litellm's controls
            # (api_base, extra_headers, mock_response ... would steer the call and its key).
            extra[k] = v
    if extra:
        params["extra_body"] = {**(params.get("extra_body") or {}), **extra}
    return params


async def call_litellm(retrier: Retrier, call: Callable[..., Awaitable[Any]], route: Route, params: dict[str, Any],
                       stream: bool, whole: Callable[[Any], bytes],
                       events: Callable[[Any, Route], AsyncIterator[bytes]]) -> Reply:
    """One litellm call (`acompletion`, `aresponses`, `anthropic_messages`) as a `Reply`: the
    whole reply as `whole` writes it, or the stream as `events` frames it; its failure as
    `map_litellm_error` says, retried as `route.retry` says until the stream is handed back."""
    started = time.perf_counter()

    async def attempt() -> Any:
        try:
            return await call(model=route.litellm_params["model"], **params)
        except Exception as e:
            raise map_litellm_error(e, route) from None

    result = await retrier.run(route.retry, route.model_name, attempt)
    elapsed = (time.perf_counter() - started) * 1000
    if not stream:
        return Reply(status=200, content_type="application/json", body=whole(result), upstream_ms=elapsed)
    return Reply(status=200, content_type="text/event-stream", chunks=events(result, route), upstream_ms=elapsed)


class LitellmForwarder:
    """Every provider litellm knows; replies re-serialised to OpenAI's wire format."""

    def __init__(self, retrier: Retrier) -> None:
        self._retrier = retrier

    async def send(self, route: Route, payload: dict[str, Any], *, stream: bool, api_key: str | None) -> Reply:
        import litellm

        params = litellm_params(route, payload, _openai_params(), api_key)
        return await call_litellm(self._retrier, litellm.acompletion, route, params, stream,
                                  lambda result: orjson.dumps(_wire(result)), _litellm_sse)

    async def close(self) -> None:
        return None


def _wire(obj: Any) -> dict[str, Any]:
    """litellm's objects as OpenAI sends them: no litellm-only or unset fields."""
    data = obj.model_dump(exclude_none=True)
    data.pop("provider_specific_fields", None)
    for choice in data.get("choices", []):
        for key in ("message", "delta"):
            if isinstance(choice.get(key), dict):
                choice[key].pop("provider_specific_fields", None)
    return data


async def _litellm_sse(stream: Any, route: Route) -> AsyncIterator[bytes]:
    try:
        async for chunk in stream:
            yield b"data: " + orjson.dumps(_wire(chunk)) + b"\n\n"
    except Exception as e:
        raise stream_error(e, route) from None
    yield b"data: [DONE]\n\n"


def stream_error(e: Exception, route: Route) -> GatewayError:
    """A litellm failure in the middle of a stream: the reply's headers are gone, so it can
    only become the API's stream error event, which the edge writes for a GatewayError."""
    err = map_litellm_error(e, route)
    if isinstance(err, UpstreamError):
        return err.to_api_error()
    return err if isinstance(err, GatewayError) else GatewayError(ErrorKind.UPSTREAM_UNREACHABLE, str(err))


# litellm reports an upstream 2xx it could not read (not JSON, no `choices`) as a 500 of its own.
_BAD_REPLY_MARKERS = ("Empty or invalid response from LLM endpoint", "provider returned a response with no")


def map_litellm_error(e: Exception, route: Route) -> Exception:
    import litellm

    if isinstance(e, GatewayError):
        return e
    if any(marker in str(e) for marker in _BAD_REPLY_MARKERS):  # as the direct path's edge check says it
        return GatewayError(ErrorKind.UPSTREAM_UNREACHABLE, f"upstream for {route.model_name} answered with a "
                            f"body that is not the API's reply: {e}", code=BAD_REPLY)
    if isinstance(e, litellm.Timeout):
        return GatewayError(ErrorKind.TIMEOUT,
                            f"upstream for {route.model_name} did not answer in time", code="upstream_timeout")
    if isinstance(e, litellm.APIConnectionError) or _refused(e):
        return GatewayError(ErrorKind.UPSTREAM_UNREACHABLE,
                            f"upstream for {route.model_name} is unreachable: {e}", code="upstream_unreachable")
    status = getattr(e, "status_code", None) or 502
    message = getattr(e, "message", None) or str(e)
    response = getattr(e, "response", None)
    body = getattr(response, "text", None)
    try:
        parsed = orjson.loads(body) if body else None
    except (orjson.JSONDecodeError, TypeError):
        parsed = None
    try:
        raise_for_error(int(status), parsed, message, passed_headers(getattr(response, "headers", None)))
    except UpstreamError as err:
        if isinstance(e, litellm.ContextWindowExceededError) and not isinstance(err, ContextTooLong):
            return ContextTooLong(err.status, err.body, err.headers)
        return err
    return GatewayError(ErrorKind.UPSTREAM_UNREACHABLE, message)


def _refused(e: BaseException) -> bool:
    """litellm reports a refused connection as a 500 InternalServerError; its cause chain says what it was."""
    import openai

    cause = e.__cause__ or e.__context__
    for _ in range(10):
        if cause is None:
            return False
        if isinstance(cause, (openai.APIConnectionError, ConnectionError, aiohttp.ClientConnectionError)):
            return True
        cause = cause.__cause__ or cause.__context__
    return False
