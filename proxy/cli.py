"""The `ctxgate` command."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

from . import gc_policy, launcher, wal_cli, workers
from ctxgate.redis_backend import RedisTarget, RedisUrlError, is_redis_url
from .config import Config, ConfigError, load_config
from .replay import command as replay_command

SWITCH_INTERVAL_S = 0.001
"""The GIL's switch interval while serving (Python's default: 5 ms)."""


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
    serve.add_argument("--workers", default="1",
                       help="worker processes on the one port (SO_REUSEPORT); 0 or auto: one per core. "
                            "More than one needs ctxgate.state set to a Redis URL (default 1)")
    serve.add_argument("--worker-index", type=int, default=None, help=argparse.SUPPRESS)
    serve.add_argument("--ready-fd", type=int, default=None, help=argparse.SUPPRESS)
    # `ctxgate run` passes its pid: killed even with SIGKILL, it leaves no gateway behind.
    serve.add_argument("--exit-with-parent", type=int, default=None, help=argparse.SUPPRESS)
    wal_cli.add_commands(sub, _serve_args)
    run_parser = launcher.add_command(sub, _serve_args)
    replay_command.add_command(sub)
    args = parser.parse_args(argv)
    if args.command == "run":
        launcher.check_args(args, run_parser)
    level = getattr(args, "log_level", os.environ.get("CTXGATE_LOG_LEVEL", "WARNING"))
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "replay":  # reads its own config: its errors are a replay's, not a refusal to start
        return replay_command.run(args)
    try:
        config = load_config(args.config)
    except ConfigError as e:
        print(f"ctxgate: refusing to start: {e}", file=sys.stderr)
        return 2
    if args.command == "run":
        return launcher.run(args, config)
    if args.command != "serve":
        return wal_cli.run(args, config)
    if args.worker_index is not None:  # one of `--workers N`'s children
        return _serve(config, args.host, args.port, args.data_dir, worker=(args.worker_index, args.ready_fd))
    try:
        n = workers.parse_workers(args.workers)
        workers.check(n, config.ctxgate.state, args.port)
        check_redis(config)
    except (workers.WorkersError, RedisUrlError) as e:
        print(f"ctxgate: refusing to start: {e}", file=sys.stderr)
        return 2
    if n > 1:
        return workers.supervise(n, args.host, args.port, level, args.config, args.data_dir)
    return _serve(config, args.host, args.port, args.data_dir, parent=args.exit_with_parent)


def check_redis(config: Config) -> None:
    """Every Redis the config names, checked before anything starts: a cluster URL must reach a
    cluster node, a one-node URL must not name one (`RedisTarget.check`)."""
    s = config.ctxgate
    urls = {url for url in (s.state, s.wal.redis_url) if url and is_redis_url(url)}
    for url in sorted(urls):
        RedisTarget.parse(url).check()


def _serve(config, host: str, port: int, data_dir: str | None,  # type: ignore[no-untyped-def]
           worker: tuple[int, int | None] | None = None, parent: int | None = None) -> int:
    """One gateway process; as a worker of `--workers N`, it shares the port (SO_REUSEPORT), tells
    the parent on `ready_fd` when it listens instead of printing, and stops if the parent goes.
    Started by `ctxgate run` (`parent`: the launcher's pid), it stops when the launcher is gone.

    Every worker runs the Gateway's housekeeping, which is safe in each: the WAL recovery at
    start rebuilds a session under its session lock (in Redis) and only if the store lacks it,
    so the second worker finds it there; archive pruning ignores a segment another worker
    removed first; and the memory sweep ends the idle sessions of the worker's own short-term
    buffer, which lives in that process (running it in one worker only would never end the
    others')."""
    import uvloop
    from aiohttp import web

    from .app import create_app
    from .connections import ConnectionGuard, raise_fd_limit
    from .gateway import Gateway

    async def run() -> None:
        try:
            gw = Gateway.build(config, data_dir)
        except (ConfigError, ValueError) as e:
            raise SystemExit(f"ctxgate: refusing to start: {e}") from None
        guard = ConnectionGuard(config.ctxgate.connections, raise_fd_limit())
        gw.metrics.watch_connections(guard)
        runner = web.AppRunner(create_app(gw), handler_cancellation=True, access_log=None)
        await runner.setup()
        gc_policy.settle()  # the process's start built: never walked by a full collection again
        await guard.listen(runner, host, port, reuse_port=worker is not None)
        where = f"http://{host}:{port}/v1"
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        if worker is not None:
            index, ready_fd = worker
            summary = (f"models: {', '.join(gw.router.model_names())}; state: {config.ctxgate.state}; "
                       f"data: {gw.data_dir}")
            if ready_fd is not None:
                os.write(ready_fd, f"{index} {summary}\n".encode())
                os.close(ready_fd)
            watcher = asyncio.create_task(_watch_parent(os.getppid(), stop))
            await stop.wait()
            watcher.cancel()
            await guard.stop_listening()
            await runner.cleanup()
            return
        if gw.router.demo_only:
            print(f"ctxgate listening on {where} with no upstream configured: answering from the offline demo "
                  f"model `ctxgate-demo`. To use a real model: ctxgate serve --config ctxgate.yaml (a litellm "
                  f"model_list; see docs/configuration.md).", flush=True)
        else:
            print(f"ctxgate listening on {where} (models: {', '.join(gw.router.model_names())}; state: "
                  f"{config.ctxgate.state}; data: {gw.data_dir})", flush=True)
        watching = asyncio.create_task(_watch_parent(parent, stop)) if parent is not None else None
        await stop.wait()
        if watching is not None:
            watching.cancel()
        await guard.stop_listening()
        await runner.cleanup()

    # A large request's CPU work runs in threads (proxy/heavy.py); each time the event loop
    # waits for the GIL it waits up to one switch interval: 1 ms rather than 5 keeps /healthz
    # and small requests quick beside them, for a few percent of those threads' time.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    uvloop.run(run())
    return 0


async def _watch_parent(parent: int, stop: asyncio.Event) -> None:
    """A worker, or a launcher's gateway, whose parent is gone (killed with SIGKILL) stops rather
    than serve unsupervised: it was reparented, so its parent pid is no longer `parent`."""
    while os.getppid() == parent:
        await asyncio.sleep(1.0)
    stop.set()


if __name__ == "__main__":
    sys.exit(main())
