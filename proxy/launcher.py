"""`ctxgate run -- COMMAND`: an unmodified agent behind ctxgate, in one command.

Starts `ctxgate serve` on a free local port (or uses a running gateway with --url), runs
COMMAND with the base-URL variables the OpenAI and Anthropic SDKs read pointing at it, and
stops the gateway when the agent exits. Exit codes follow `env`/`timeout`: the agent's own
code (128+N if signal N killed it), 125 when ctxgate itself could not be started or reached,
126/127 when COMMAND could not be run.
"""
from __future__ import annotations

import argparse
import os
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, Callable, Iterator

from .agent_wiring import Wiring, wire
from .config import Config
from .ids import InvalidId, validate_id

START_TIMEOUT_S = 90.0
"""A cold start imports litellm and loads tokenizers: seconds, more on a slow disk."""
STOP_TIMEOUT_S = 10.0
LOG_NAME = "ctxgate-run.log"
LOG_TAIL_BYTES = 3000
EXIT_LAUNCH_FAILED, EXIT_CANNOT_RUN, EXIT_NOT_FOUND = 125, 126, 127
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))
"""For our own child on 127.0.0.1: a user's HTTP(S)_PROXY must not swallow the health check."""


class LaunchError(Exception):
    """ctxgate could not be started or reached: the agent is not run."""


class _Stopped(Exception):
    """A signal arrived before the agent ran: give up the launch, but still stop the gateway."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def add_command(sub: Any, common: Callable[[argparse.ArgumentParser], None]) -> argparse.ArgumentParser:
    p = sub.add_parser("run", help="run an agent with its OpenAI/Anthropic base URLs pointing at ctxgate",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                       usage="%(prog)s [options] -- COMMAND [ARGS...]")
    common(p)
    p.add_argument("--url", default=None, help="use this running ctxgate (e.g. http://127.0.0.1:8787) instead of "
                                               "starting one")
    p.add_argument("--session", default=None, help="the session id the agent's requests carry (default: run-<hex>)")
    p.add_argument("--explain", action="store_true", help="print what was set for the agent (variables, "
                                                          "arguments) before running it")
    p.add_argument("--codex-remote-compaction", action="store_true",
                   help="Codex asks ctxgate to compact (/responses/compact) instead of compacting itself")
    # REMAINDER: everything from COMMAND on is the agent's, even flags ctxgate also has (--config, --url).
    p.add_argument("agent", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return p


def check_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Usage errors (exit 2) before anything starts: no COMMAND, a session id the gateway would refuse."""
    if args.agent[:1] == ["--"]:
        args.agent = args.agent[1:]
    if not args.agent:
        parser.error("missing the agent's COMMAND, e.g. ctxgate run -- claude")
    if args.session is not None:
        try:
            validate_id(args.session, "session")
        except InvalidId as e:
            parser.error(f"--session: {e}")


def run(args: argparse.Namespace, config: Config) -> int:
    session = args.session or f"run-{secrets.token_hex(6)}"
    signals = _Signals()
    served: _Served | None = None
    with signals.installed():
        try:
            if args.url:
                base = _gateway_root(args.url)
                if not _healthy(base, direct=False):
                    raise LaunchError(f"no ctxgate answers {base}/healthz; is `ctxgate serve` running there?")
                where = f"using {base} (session {session})"
            else:
                served = _spawn(Path(args.data_dir or config.ctxgate.data_dir), args.config, session)
                served.wait_ready()
                base = served.base
                where = f"listening on {base} (session {session}; its log: {served.log})"
            wired = wire(args.agent, os.environ, base, session, args.codex_remote_compaction)
            _prepare(wired)
            print(f"ctxgate: {where}; running: {shlex.join(wired.argv)}", file=sys.stderr, flush=True)
            if args.explain:
                print(wired.explain(), file=sys.stderr, flush=True)
            return signals.run_agent(wired.argv, wired.env)
        except LaunchError as e:
            print(f"ctxgate run: {e}", file=sys.stderr)
            return EXIT_LAUNCH_FAILED
        except _Stopped as e:
            return 128 + e.signum
        finally:
            signals.launching = False  # a signal during the stop below must not cut it short
            if served is not None:
                served.stop()


def _prepare(wired: Wiring) -> None:
    """The files and links the agent's wiring needs, made anew."""
    for path, text in wired.files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    for link, target in wired.links.items():
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(target, target_is_directory=target.is_dir())


def _gateway_root(url: str) -> str:
    """Accept what `ctxgate serve` prints (.../v1) as well as the bare root."""
    base = url.strip().rstrip("/")
    if not base.startswith(("http://", "https://")):
        raise LaunchError(f"--url must be an http:// or https:// URL, not {url!r}")
    return base.removesuffix("/v1")


def _healthy(base: str, direct: bool) -> bool:
    opener = _DIRECT if direct else urllib.request.build_opener()
    try:
        with opener.open(f"{base}/healthz", timeout=2) as r:
            return bool(r.status == 200)
    except OSError:  # refused, timed out, or an HTTP error status (HTTPError is an OSError)
        return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class _Served:
    """The `ctxgate serve` child this launcher owns."""
    proc: subprocess.Popen[bytes]
    base: str
    log: Path
    log_start: int

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _healthy(self.base, direct=True):
            if self.proc.poll() is not None:
                raise LaunchError(f"ctxgate serve exited with code {self.proc.returncode} before it answered; "
                                  f"the end of {self.log}:\n{self._log_tail()}")
            if time.monotonic() > deadline:
                raise LaunchError(f"ctxgate serve did not answer {self.base}/healthz within {START_TIMEOUT_S:.0f}s; "
                                  f"the end of {self.log}:\n{self._log_tail()}")
            time.sleep(0.1)

    def _log_tail(self) -> str:
        with self.log.open("rb") as f:
            f.seek(max(self.log_start, f.seek(0, os.SEEK_END) - LOG_TAIL_BYTES))
            return f.read().decode("utf-8", "replace").rstrip()

    def stop(self) -> None:
        if self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _spawn(data_dir: Path, config: str | None, session: str) -> _Served:
    log = data_dir / LOG_NAME
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
        return _popen_serve(data_dir, config, session, log)
    except OSError as e:
        raise LaunchError(f"cannot start ctxgate serve with its log at {log}: {e}") from None


def _popen_serve(data_dir: Path, config: str | None, session: str, log: Path) -> _Served:
    port = _free_port()
    argv = [sys.executable, "-m", "ctxgate.proxy.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
            "--data-dir", str(data_dir), "--exit-with-parent", str(os.getpid())]
    if config:
        argv += ["--config", config]
    # Appended, so the logs of earlier runs (and of concurrent ones in the same data dir) survive.
    with log.open("ab") as out:
        out.write(f"--- ctxgate run, session {session}, {time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode())
        out.flush()
        start = out.tell()
        # A session of its own: Ctrl-C and a terminal hangup reach the agent's process group, not the
        # gateway, which must outlive an interrupted turn and is stopped by us once the agent exits;
        # if we are killed outright (SIGKILL), it sees us gone and stops itself (--exit-with-parent).
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    return _Served(proc, f"http://127.0.0.1:{port}", log, start)


class _Signals:
    """Signal handling around the agent.

    While launching, a signal aborts the launch (the gateway is still stopped). Once the agent
    runs, SIGTERM and SIGHUP are passed on to it; SIGINT and SIGQUIT are not: the terminal sends
    those to its whole foreground process group, agent included, and an agent like Claude Code
    takes Ctrl-C as "interrupt the turn", so the launcher must neither die of it nor send a second one.
    Handlers, not SIG_IGN: an ignored signal would stay ignored in the agent across exec.
    """
    FORWARDED = (signal.SIGTERM, signal.SIGHUP)
    LEFT_TO_AGENT = (signal.SIGINT, signal.SIGQUIT)

    def __init__(self) -> None:
        self.launching = True
        self.agent: subprocess.Popen[bytes] | None = None

    @contextmanager
    def installed(self) -> Iterator[None]:
        previous = {s: signal.signal(s, self._handle) for s in (*self.FORWARDED, *self.LEFT_TO_AGENT)}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.launching:
            raise _Stopped(signum)
        if self.agent is not None and signum in self.FORWARDED:
            self.agent.send_signal(signum)  # a no-op once the agent has been reaped

    def run_agent(self, argv: list[str], env: dict[str, str]) -> int:
        try:
            self.agent = subprocess.Popen(argv, env=env)
            self.launching = False
        except FileNotFoundError:
            print(f"ctxgate run: command not found: {argv[0]}", file=sys.stderr)
            return EXIT_NOT_FOUND
        except OSError as e:
            print(f"ctxgate run: cannot run {argv[0]}: {e.strerror}", file=sys.stderr)
            return EXIT_CANNOT_RUN
        code = self.agent.wait()
        return 128 - code if code < 0 else code
