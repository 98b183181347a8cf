"""An unexpected exception in a request: an OpenAI-shaped 500 that names a request id the
server's log has too, and no traceback to the client. Driven through the gateway's own error
middleware on a real socket (a handler that raises stands in for a bug)."""
from __future__ import annotations

import asyncio
import logging

import httpx
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from ctxgate.proxy.app import openai_errors


def test_a_bug_is_a_500_with_a_request_id_in_the_answer_and_the_log(caplog: pytest.LogCaptureFixture) -> None:
    async def broken(request: web.Request) -> web.Response:
        raise KeyError("a bug")

    async def run() -> httpx.Response:
        app = web.Application(middlewares=[openai_errors])
        app.router.add_post("/v1/chat/completions", broken)
        async with TestServer(app, host="127.0.0.1") as server:
            async with httpx.AsyncClient() as http:
                return await http.post(str(server.make_url("/v1/chat/completions")), json={})

    with caplog.at_level(logging.ERROR, logger="ctxgate"):
        resp = asyncio.run(run())
    assert resp.status_code == 500
    error = resp.json()["error"]
    request_id = resp.headers["x-request-id"]
    assert error["code"] == "internal_error" and request_id in error["message"]
    assert "Traceback" not in resp.text and "a bug" not in resp.text
    assert any(request_id in r.getMessage() and r.exc_info for r in caplog.records)
