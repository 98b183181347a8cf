"""The benches' bare relay: an aiohttp server that forwards each POST's bytes to the same path
on the upstream and the reply's bytes back (a stream chunk by chunk, as they come), with the
request's auth headers and content type, and nothing else: no parsing, no counting, no
logging. What any proxy in Python on aiohttp pays for the two hops, the floor ctxgate is
measured against.

    .venv/bin/python bench/relay.py --upstream http://127.0.0.1:8999 --port 8998
"""
from __future__ import annotations

import argparse

import aiohttp
from aiohttp import web

PASSED = ("Authorization", "x-api-key", "anthropic-version", "x-goog-api-key", "Content-Type")
"""The request headers the upstream needs (its key, the API version, the body's type)."""
HTTP = web.AppKey("http", aiohttp.ClientSession)


def make_app(upstream: str) -> web.Application:
    app = web.Application(client_max_size=256 * 1024 * 1024)

    async def start(app: web.Application) -> None:
        app[HTTP] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                            timeout=aiohttp.ClientTimeout(total=600), auto_decompress=False)

    async def stop(app: web.Application) -> None:
        await app[HTTP].close()

    async def relay(request: web.Request) -> web.StreamResponse:
        headers = {h: request.headers[h] for h in PASSED if h in request.headers}
        async with app[HTTP].post(upstream + request.path_qs, data=await request.read(), headers=headers) as up:
            kind = up.headers.get("Content-Type", "application/json")
            if not kind.startswith("text/event-stream"):
                return web.Response(status=up.status, body=await up.read(), headers={"Content-Type": kind})
            resp = web.StreamResponse(status=up.status, headers={"Content-Type": kind, "Cache-Control": "no-cache"})
            await resp.prepare(request)
            async for chunk in up.content.iter_any():
                await resp.write(chunk)
            await resp.write_eof()
            return resp

    async def healthz(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    app.router.add_get("/healthz", healthz)
    app.router.add_post("/{path:.*}", relay)
    return app


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--upstream", required=True, help="the upstream's base URL (no path)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8998)
    args = p.parse_args()
    try:
        import uvloop

        loop = uvloop.new_event_loop()
    except ImportError:
        loop = None
    print(f"bench relay on http://{args.host}:{args.port} -> {args.upstream}", flush=True)
    web.run_app(make_app(args.upstream.rstrip("/")), host=args.host, port=args.port, access_log=None, print=None,
                loop=loop)


if __name__ == "__main__":
    main()
