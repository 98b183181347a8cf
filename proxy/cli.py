"""The `ctxgate` command."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

from . import launcher, wal_cli
from .config import ConfigError, load_config


def _serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=os.environ.get("CTXGATE_CONFIG"),
                   help="YAML config: litellm model_list + ctxgate: section (env CTXGATE_CONFIG)")
    p.add_argument("--data-dir", default=None, help="where the WAL and memory files live (default ./.ctxgate)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ctxgate", description="Context management as an OpenAI-compatible gateway.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the gateway")
    _serve_args(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8787)
    serve.add_argument("--log-level", default=os.environ.get("CTXGATE_LOG_LEVEL", "INFO"))
    wal_cli.add_commands(sub, _serve_args)
    run_parser = launcher.add_command(sub, _serve_args)
    args = parser.parse_args(argv)
    if args.command == "run":
        launcher.check_args(args, run_parser)
    level = getattr(args, "log_level", os.environ.get("CTXGATE_LOG_LEVEL", "WARNING"))
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = load_config(args.config)
    except ConfigError as e:
        print(f"ctxgate: refusing to start: {e}", file=sys.stderr)
        return 2
    if args.command == "run":
        return launcher.run(args, config)
    if args.command != "serve":
        return wal_cli.run(args, config)
    return _serve(config, args.host, args.port, args.data_dir)


def _serve(config, host: str, port: int, data_dir: str | None) -> int:  # type: ignore[no-untyped-def]
    import uvloop
    from aiohttp import web

    from .app import create_app
    from .gateway import Gateway

    async def run() -> None:
        try:
            gw = Gateway.build(config, data_dir)
        except (ConfigError, ValueError) as e:
            raise SystemExit(f"ctxgate: refusing to start: {e}") from None
        runner = web.AppRunner(create_app(gw), handler_cancellation=True, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, host, port).start()
        where = f"http://{host}:{port}/v1"
        if gw.router.demo_only:
            print(f"ctxgate listening on {where} with no upstream configured: answering from the offline demo "
                  f"model `ctxgate-demo`. To use a real model: ctxgate serve --config ctxgate.yaml (a litellm "
                  f"model_list; see README.md, 'Configuration').", flush=True)
        else:
            print(f"ctxgate listening on {where} (models: {', '.join(gw.router.model_names())}; state: "
                  f"{config.ctxgate.state}; data: {gw.data_dir})", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await runner.cleanup()

    uvloop.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
