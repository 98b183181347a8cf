"""Client connections, bounded: read timeouts, a cap on open connections, and malformed HTTP
answered in OpenAI's error shape.

aiohttp alone waits forever for a request's headers or body and accepts connections until the
process runs out of file descriptors, so one client trickling bytes (slowloris) or holding idle
sockets could take the gateway offline. Here every connection is a `GuardedConnection` (aiohttp's
own RequestHandler plus a header timer) made by a `ConnectionGuard`, which owns the listening
socket and counts what is open; the `guard_requests` middleware ends the header timer, bounds
the body read and answers connections past the cap.
"""
from __future__ import annotations

import asyncio
import logging
import resource
import time
from enum import Enum
from typing import Any, Awaitable, Callable, cast

import orjson
from aiohttp import web
from aiohttp.http_exceptions import (BadHttpMessage, BadHttpMethod, BadStatusLine, ContentEncodingError,
                                     ContentLengthError, HttpProcessingError, InvalidHeader, InvalidURLError,
                                     LineTooLong, TransferEncodingError)
from aiohttp.web_protocol import RequestHandler, RequestPayloadError
from aiohttp.web_request import BaseRequest
from aiohttp.streams import StreamReader
from aiohttp.typedefs import Middleware

from .config import ConnectionSettings

log = logging.getLogger("ctxgate.connections")
HEALTH_PATHS = frozenset({"/healthz", "/readyz"})
"""Answered even past the connection cap: an orchestrator must still see the process is alive."""
FD_SHARE = 0.8
"""The default cap's share of the open-file limit; the rest is for upstream sockets and files."""
UNLIMITED_FDS = 1 << 20
"""What an unlimited open-file limit counts as (the kernel's own ceiling, nr_open, by default)."""

# What the client is told, per parser error: a fixed sentence, never the bytes it sent.
_DESCRIPTIONS: tuple[tuple[type[HttpProcessingError], str, str], ...] = (
    (LineTooLong, "a request line or header is longer than the server accepts", "line_too_long"),
    (InvalidURLError, "the request's URL is not valid", "invalid_url"),
    (BadHttpMethod, "the request's method is not valid", "invalid_method"),
    (BadStatusLine, "the request line is not valid HTTP/1.1 (method, URL or version)", "invalid_request_line"),
    (InvalidHeader, "a header name or value holds characters HTTP does not allow", "invalid_header"),
    (ContentLengthError, "the body does not match its Content-Length", "invalid_content_length"),
    (TransferEncodingError, "the chunked body is not valid", "invalid_chunked_body"),
    (ContentEncodingError, "the body does not decode as its Content-Encoding says", "invalid_content_encoding"),
    (BadHttpMessage, "the request is not valid HTTP/1.1", "invalid_http"),
)


def error_response(status: int, message: str, code: str, kind: str = "invalid_request_error",
                   headers: dict[str, str] | None = None) -> web.Response:
    """OpenAI's error shape, on a connection that closes after it."""
    body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    resp = web.Response(status=status, body=orjson.dumps(body), content_type="application/json", headers=headers)
    resp.force_close()
    return resp


# aiohttp's C parser (llhttp) raises a plain BadHttpMessage; its message says which part failed.
_LLHTTP_HINTS = (("content-length", ContentLengthError), ("chunk", TransferEncodingError),
                 ("header", InvalidHeader), ("url", InvalidURLError), ("method", BadHttpMethod))


def describe(exc: BaseException | None) -> tuple[str, str]:
    """(message for the client, code) of a parser error."""
    kind: type[BaseException] | None = type(exc) if exc is not None else None
    if kind is BadHttpMessage:
        text = str(getattr(exc, "message", "")).lower()
        kind = next((cls for hint, cls in _LLHTTP_HINTS if hint in text), kind)
    for cls, message, code in _DESCRIPTIONS:
        if kind is not None and issubclass(kind, cls):
            return message, code
    return "the request is not valid HTTP/1.1", "invalid_http"


class RateLimitedLog:
    """One line per kind per interval; the lines dropped in between are counted in the next."""

    def __init__(self, logger: logging.Logger, interval_s: float) -> None:
        self._logger = logger
        self._interval_s = interval_s
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def warning(self, kind: str, message: str) -> None:
        now = time.monotonic()
        last = self._last.get(kind)
        if last is not None and now - last < self._interval_s:
            self._suppressed[kind] = self._suppressed.get(kind, 0) + 1
            return
        self._last[kind] = now
        dropped = self._suppressed.pop(kind, 0)
        more = f" ({dropped} more of this kind in the last {now - last:.0f} s)" if dropped and last else ""
        self._logger.warning("%s%s", message, more)


def raise_fd_limit() -> int:
    """Raise the open-file soft limit to the hard limit where allowed; the soft limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as e:
            log.info("open-file limit stays at %d (raising it to %d failed: %s)", soft, hard, e)
    return UNLIMITED_FDS if soft == resource.RLIM_INFINITY else soft


class Phase(Enum):
    AWAITING_HEADERS = "awaiting_headers"
    IN_REQUEST = "in_request"
    IDLE = "idle"
    """Between requests: aiohttp's keep-alive timeout closes it."""


class GuardedConnection(RequestHandler):
    """aiohttp's request handler, with a header-read timer and OpenAI-shaped parser errors."""

    def __init__(self, manager: web.Server, guard: ConnectionGuard, over_cap: bool, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self.guard = guard
        self.over_cap = over_cap
        """Opened past the cap: only /healthz and /readyz are answered, then it closes."""
        self.phase = Phase.AWAITING_HEADERS
        self._header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.guard.opened(self)
        super().connection_made(transport)
        self._arm_header_timer()

    def connection_lost(self, exc: BaseException | None) -> None:
        self.guard.closed(self)
        self._cancel_header_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.phase is Phase.IDLE and data:  # the next request on a keep-alive connection starts
            self.phase = Phase.AWAITING_HEADERS
            self._arm_header_timer()
        super().data_received(data)

    def request_started(self) -> None:
        self.phase = Phase.IN_REQUEST
        self._cancel_header_timer()

    def request_finished(self) -> None:
        self.phase = Phase.IDLE

    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        self._header_timer = self._loop.call_later(self.guard.settings.header_read_timeout_s, self._headers_late)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if self.phase is Phase.AWAITING_HEADERS:
            self.guard.count_refusal("header_timeout")
            self.force_close()

    def handle_error(self, request: BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        """aiohttp's answer to a request its parser refused (or a failure past every middleware):
        JSON in OpenAI's shape, without the input, and a rate-limited line instead of a traceback."""
        if request.writer.output_size > 0:
            raise ConnectionError("the response has begun; no error can be sent")
        if status == 400:
            return self.reject(request, exc)
        log.error("request from %s failed outside every handler (%d)", request.remote, status, exc_info=exc)
        return error_response(status, "internal error in ctxgate; it is logged on the server", "internal_error",
                              "api_error")

    def log_exception(self, *args: Any, **kw: Any) -> None:
        """aiohttp drains an unread body after the reply ("lingering"); a body that timed out or
        does not decode fails there, after it was answered: not worth a traceback."""
        if isinstance(kw.get("exc_info"), (BodyReadTimeout, RequestPayloadError)):
            log.debug("unread request body dropped: %r", kw["exc_info"])
            return
        super().log_exception(*args, **kw)

    def reject(self, request: BaseRequest, exc: BaseException | None) -> web.Response:
        """A 400 for a request the parser refused: its kind, never its bytes, to client and log."""
        text, code = describe(exc)
        self.guard.rejected(code, request.remote, exc)
        return error_response(400, f"malformed HTTP request: {text}", code)


class _Refused(asyncio.Protocol):
    """Past the cap and its overflow: reset at once, so the descriptor is free again."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        cast(asyncio.Transport, transport).abort()  # uvloop's transports are not asyncio.Transport subclasses


class ConnectionGuard:
    """The listening socket's protocol factory: counts connections and sorts them at accept."""

    def __init__(self, settings: ConnectionSettings, fd_limit: int) -> None:
        self.settings = settings
        self.max_connections = settings.max_connections or max(1, int(fd_limit * FD_SHARE))
        self.overflow_limit = max(16, self.max_connections // 10)
        """Connections past the cap still answered (health checks, a 503); beyond these, reset."""
        self.open = 0
        self.overflow_open = 0
        self.refusals: dict[str, int] = {}
        self.rejections: dict[str, int] = {}
        self._log = RateLimitedLog(log, settings.rejection_log_interval_s)
        self._server: asyncio.AbstractServer | None = None
        log.info("connections: at most %d (open-file limit %d), headers within %g s, bodies within %g s, idle "
                 "keep-alive %g s", self.max_connections, fd_limit, settings.header_read_timeout_s,
                 settings.body_read_timeout_s, settings.keepalive_timeout_s)

    def protocol_factory(self, manager: web.Server, **handler_kwargs: Any) -> Callable[[], asyncio.Protocol]:
        def make() -> asyncio.Protocol:
            if self.open < self.max_connections:
                return GuardedConnection(manager, self, False, **handler_kwargs)
            if self.overflow_open < self.overflow_limit:
                self.count_refusal("over_cap")
                return GuardedConnection(manager, self, True, **handler_kwargs)
            self.count_refusal("reset")
            return _Refused()
        return make

    async def listen(self, runner: web.AppRunner, host: str, port: int, reuse_port: bool) -> None:
        """Serve `runner`'s app on host:port (in place of aiohttp's TCPSite, whose factory is fixed)."""
        assert runner.server is not None, "runner.setup() first"
        loop = asyncio.get_running_loop()
        factory = self.protocol_factory(runner.server, loop=loop, access_log=None,
                                        keepalive_timeout=self.settings.keepalive_timeout_s)
        self._server = await loop.create_server(factory, host, port, reuse_address=True, reuse_port=reuse_port,
                                                backlog=1024)

    async def stop_listening(self) -> None:
        """Accept no more; the runner's cleanup then closes the open connections gracefully."""
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    def opened(self, conn: GuardedConnection) -> None:
        if conn.over_cap:
            self.overflow_open += 1
        else:
            self.open += 1

    def closed(self, conn: GuardedConnection) -> None:
        if conn.over_cap:
            self.overflow_open -= 1
        else:
            self.open -= 1

    def count_refusal(self, reason: str) -> None:
        self.refusals[reason] = self.refusals.get(reason, 0) + 1

    def rejected(self, code: str, remote: str | None, exc: BaseException | None) -> None:
        self.rejections[code] = self.rejections.get(code, 0) + 1
        detail = repr(getattr(exc, "message", None) or type(exc).__name__)[:200]
        self._log.warning(code, f"malformed HTTP request from {remote}: {code} ({detail})")


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class BodyReadTimeout(Exception):
    """Set on a request's body stream when it did not arrive in time: the handler's read raises it."""


def _body_late(body: StreamReader) -> None:
    if not body.is_eof():
        body.set_exception(BodyReadTimeout())


def guard_requests(body_read_timeout_s: float) -> Middleware:
    """The middleware: headers are in (the header timer stops), past the cap only health checks
    are answered, and the body must arrive within `body_read_timeout_s` (else a 408)."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        conn = request.protocol
        if not isinstance(conn, GuardedConnection):  # an app served some other way (none in ctxgate)
            return await handler(request)
        conn.request_started()
        # A deadline on the body stream, not a read here: a handler may still clone the request
        # (aiohttp refuses to clone one whose body was read) and reads the body itself.
        deadline = None
        if request.body_exists and not request.content.is_eof():
            deadline = asyncio.get_running_loop().call_later(body_read_timeout_s, _body_late, request.content)
        try:
            if conn.over_cap and request.path not in HEALTH_PATHS:
                return error_response(503, f"ctxgate has {conn.guard.max_connections} connections open, its limit; "
                                      "retry shortly", "too_many_connections", "service_unavailable",
                                      {"Retry-After": "1"})
            resp = await handler(request)
            if conn.over_cap:
                resp.force_close()
            return resp
        except BodyReadTimeout:
            conn.guard.count_refusal("body_timeout")
            return error_response(408, f"the request body did not arrive within {body_read_timeout_s:g} s",
                                  "body_timeout")
        except RequestPayloadError as e:  # the body's framing or encoding, found while reading it
            return conn.reject(request, e.__cause__)
        finally:
            if deadline is not None:
                deadline.cancel()
            conn.request_finished()

    return middleware
