"""A recording reverse proxy for the tests: what an agent sent, byte for byte, before ctxgate.

It runs in a background thread (`Recorder(target).start()`), passes every request on to
`target` unchanged (method, path, query, body, headers but Host) and streams the answer back
as it comes. `.log` keeps each request's path, lower-cased headers and raw body; `.levels` each
reply's `X-Ctx-Levels` (what ctxgate compacted; "" when the reply has none).
"""
from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

_HOP = {"host", "content-length", "transfer-encoding", "connection", "keep-alive"}


@dataclass
class Sent:
    path: str
    headers: dict[str, str]
    raw: bytes


class Recorder:
    def __init__(self, target: str) -> None:
        self.target = target.rstrip("/")
        self.log: list[Sent] = []
        self.levels: list[str] = []
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _relay(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        self.log.append(Sent(request.path, {k.lower(): v for k, v in headers.items()}, raw))
        assert self._session is not None
        async with self._session.request(request.method, self.target + request.path_qs, data=raw,
                                         headers=headers) as upstream:
            self.levels.append(upstream.headers.get("X-Ctx-Levels", ""))
            response = web.StreamResponse(status=upstream.status, headers={
                k: v for k, v in upstream.headers.items() if k.lower() not in _HOP | {"content-encoding"}})
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    async def _serve(self) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None), auto_decompress=False)
        app = web.Application(client_max_size=512 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._relay)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.port = self._runner.addresses[0][1]

    def start(self) -> "Recorder":
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, name="recorder", daemon=True).start()
        asyncio.run_coroutine_threadsafe(self._serve(), self._loop).result(10)
        return self

    def stop(self) -> None:
        loop = self._loop
        if loop is None or self._runner is None or self._session is None:
            return

        async def close(runner: Any, session: Any) -> None:
            await runner.cleanup()
            await session.close()

        asyncio.run_coroutine_threadsafe(close(self._runner, self._session), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        self._loop = None
