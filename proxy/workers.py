"""`ctxgate serve --workers N`: N worker processes on one port.

The parent opens nothing: it starts N children (`python -m ctxgate.proxy.cli serve` with
the hidden `--worker-index`), each with its own Gateway, each binding the same host:port
with SO_REUSEPORT, so the kernel spreads connections over them. Each child writes one
line to a pipe when it listens; the parent then prints one line, forwards SIGINT/SIGTERM,
waits, and stops the others (exit 1) if one dies unexpectedly.

Session state must be shared: with `ctxgate.state: memory` every worker would hold its
own copy of a session (and its own lock), so two turns of one session on two workers
would each build on a stale history. That combination is refused. With Redis, one
session's turns are serialised by the session lock in Redis, whichever worker serves them.
"""
from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from types import FrameType

STOP_GRACE_S = 15.0


class WorkersError(Exception):
    """A --workers value or combination that cannot run (exit code 2)."""


def cpu_count() -> int:
    counter = getattr(os, "process_cpu_count", None)  # Python 3.13+: the cores this process may use
    if counter is not None:
        return int(counter() or 1)
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def parse_workers(value: str) -> int:
    """`--workers`: a count, or 0 / `auto` for the number of cores."""
    if value.strip().lower() == "auto":
        return cpu_count()
    try:
        n = int(value)
    except ValueError:
        raise WorkersError(f"--workers {value}: give a number of processes, or 0/auto for one per core") from None
    if n < 0:
        raise WorkersError(f"--workers {value}: give a number of processes, or 0/auto for one per core")
    return n or cpu_count()


def check(workers: int, state: str, port: int) -> None:
    """Refuse what would lose turns (per-process state) or not share a port (port 0)."""
    if workers <= 1:
        return
    if state == "memory":
        raise WorkersError(
            f"--workers {workers} needs a shared state backend: set ctxgate.state to a Redis URL "
            f"(redis:// or redis+cluster://): with state 'memory' each worker would keep its own copy of a session, "
            f"and turns would be lost")
    if port == 0:
        raise WorkersError(f"--workers {workers} needs a fixed --port (with port 0 each worker would get its own)")


def child_argv(index: int, ready_fd: int, host: str, port: int, log_level: str, config: str | None,
               data_dir: str | None) -> list[str]:
    argv = [sys.executable, "-m", "ctxgate.proxy.cli", "serve", "--host", host, "--port", str(port),
            "--log-level", log_level, "--worker-index", str(index), "--ready-fd", str(ready_fd)]
    if config is not None:
        argv += ["--config", config]
    if data_dir is not None:
        argv += ["--data-dir", data_dir]
    return argv


def supervise(workers: int, host: str, port: int, log_level: str, config: str | None, data_dir: str | None) -> int:
    """Run `workers` children until a signal (exit 0) or one of them dies (exit 1)."""
    read_fd, write_fd = os.pipe()
    stopping: list[int] = []
    children: list[subprocess.Popen[bytes]] = []

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        stopping.append(signum)
        for child in children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        for index in range(workers):
            children.append(subprocess.Popen(child_argv(index, write_fd, host, port, log_level, config, data_dir),
                                             pass_fds=(write_fd,)))
    except OSError as e:
        print(f"ctxgate: could not start a worker: {e}", file=sys.stderr)
        _stop(children)
        return 1
    finally:
        os.close(write_fd)
    summary = _wait_ready(read_fd, children, stopping)
    os.close(read_fd)
    if summary is None:
        return _finish(children, stopping, "before all workers were listening")
    pids = ", ".join(str(c.pid) for c in children)
    print(f"ctxgate listening on http://{host}:{port}/v1 with {workers} workers (pids {pids}; {summary})",
          flush=True)
    while not stopping and all(c.poll() is None for c in children):
        time.sleep(0.1)
    return _finish(children, stopping, "while serving")


def _wait_ready(read_fd: int, children: list[subprocess.Popen[bytes]], stopping: list[int]) -> str | None:
    """One line per worker on the pipe; the first worker's summary (models, state, data dir)."""
    buf, lines = b"", list[bytes]()
    while len(lines) < len(children):
        if stopping or any(c.poll() is not None for c in children):
            return None
        try:
            readable, _, _ = select.select([read_fd], [], [], 0.1)
        except InterruptedError:
            continue
        if readable:
            chunk = os.read(read_fd, 65536)
            if not chunk:  # every writer closed without saying ready: they are exiting
                time.sleep(0.1)
                continue
            buf += chunk
            *done, buf = buf.split(b"\n")
            lines += done
    return lines[0].decode(errors="replace").split(" ", 1)[-1]


def _finish(children: list[subprocess.Popen[bytes]], stopping: list[int], when: str) -> int:
    dead = [c for c in children if c.poll() is not None]
    if not stopping and dead:
        for c in dead:
            print(f"ctxgate: worker {c.pid} exited with {c.returncode} {when}; stopping the others", file=sys.stderr,
                  flush=True)
    codes = _stop(children)
    if stopping:
        return 0 if all(code in (0, -signal.SIGTERM, -signal.SIGINT) for code in codes) else 1
    return 1


def _stop(children: list[subprocess.Popen[bytes]]) -> list[int]:
    """SIGTERM every live child, wait up to STOP_GRACE_S, then SIGKILL what is left."""
    for c in children:
        if c.poll() is None:
            c.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for c in children:
        try:
            c.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            c.kill()
            c.wait()
    return [int(c.returncode) for c in children]
