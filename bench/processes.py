"""The servers of a bench run, each its own process in one temporary folder: `ctxgate serve`,
the scripted upstream (bench/upstream.py), the bare relay (bench/relay.py) and the LiteLLM
proxy, with the bench's routes.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

import common  # noqa: F401  (the environment first, and tests/ on sys.path)
import doors
from servers import free_port  # tests/servers.py

BENCH = Path(__file__).resolve().parent
CLIENT_KEEPALIVE_S = 2.0
"""Below the LiteLLM proxy's idle keep-alive (uvicorn: 5 s), so no request goes out on a
connection the server is closing."""

VENV_BIN = Path(sys.executable).parent
UPSTREAM_KEY = "sk-bench-upstream"
SERVER_ENV = {"LITELLM_LOCAL_MODEL_COST_MAP": "True"}


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    url: str

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)


class Servers:
    """A run's processes, in a temporary folder: each started and healthy, all stopped (last
    first) and the folder removed on leaving the `with`."""

    def __init__(self, prefix: str) -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix=prefix))
        self.procs: list[Proc] = []

    def __enter__(self) -> "Servers":
        return self

    def __exit__(self, *exc: object) -> None:
        for p in reversed(self.procs):
            p.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def start(self, name: str, argv: list[str], port: int, health: str = "/healthz",
              env: dict[str, str] | None = None, timeout: float = 120.0) -> Proc:
        base, log = f"http://127.0.0.1:{port}", self.workdir / f"{name}.log"
        popen = subprocess.Popen(argv, stdout=open(log, "wb"), stderr=subprocess.STDOUT, cwd=self.workdir,
                                 env={**os.environ, **(env or {})})
        self.procs.append(Proc(name, popen, log, base))
        deadline = time.monotonic() + timeout
        while True:
            if popen.poll() is not None:
                raise RuntimeError(f"{name} exited with {popen.returncode}:\n{log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(base + health, timeout=1) as r:
                    if r.status == 200:
                        return self.procs[-1]
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not become healthy in {timeout}s:\n{log.read_text()[-3000:]}")
            time.sleep(0.1)

    def upstream(self, delay_ms: float = 0.0) -> Proc:
        """bench/upstream.py, each reply `delay_ms` late."""
        port = free_port()
        return self.start("upstream", [sys.executable, str(BENCH / "upstream.py"), "--port", str(port),
                                       "--delay-ms", str(delay_ms)], port)

    def relay(self, upstream: str) -> Proc:
        """bench/relay.py in front of `upstream`: the bytes forwarded and nothing else."""
        port = free_port()
        return self.start("relay", [sys.executable, str(BENCH / "relay.py"), "--upstream", upstream,
                                    "--port", str(port)], port)

    def ctxgate(self, config: dict[str, Any], name: str = "ctxgate", workers: int | None = None,
                env: dict[str, str] | None = None) -> Proc:
        port, path = free_port(), self.workdir / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config))
        argv = [str(VENV_BIN / "ctxgate"), "serve", "--config", str(path), "--port", str(port),
                "--log-level", "WARNING"] + (["--workers", str(workers)] if workers else [])
        return self.start(name, argv, port, env={**SERVER_ENV, **(env or {})})

    def litellm_proxy(self, path: str | None, upstream: str, workers: int | None = None) -> doors.Target | str:
        """The LiteLLM proxy on the bench's routes, as a target with its master key, or why it
        did not start (see `litellm_proxy_command`)."""
        argv, version = litellm_proxy_command(path)
        if argv is None:
            return version
        port, path, master = free_port(), str(self.workdir / "litellm-proxy.yaml"), f"sk-bench-{os.urandom(16).hex()}"
        Path(path).write_text(yaml.safe_dump({"model_list": doors.model_list(upstream, UPSTREAM_KEY),
                                              "general_settings": {"master_key": master}}))
        extra = ["--num_workers", str(workers)] if workers else []
        proc = self.start("litellm-proxy", [*argv, "--config", path, "--port", str(port), *extra], port,
                          "/health/liveliness", SERVER_ENV, timeout=180)
        return doors.Target(f"LiteLLM proxy {version}", proc.url, master)


def proxy_note(proxy: doors.Target | str) -> str:
    """A section's word on the LiteLLM proxy: its version, or why it did not run."""
    return f"litellm {proxy.name.split()[-1]}." if isinstance(proxy, doors.Target) else f"**not run** ({proxy})."


def litellm_proxy_command(path: str | None) -> tuple[list[str] | None, str]:
    """How to start the LiteLLM proxy and its litellm version, or (None, why not).

    `path` (--litellm-proxy, else $CTXGATE_BENCH_LITELLM_PROXY) is the `litellm` script of an
    environment with `litellm[proxy]`, or that environment's python; without it, .venv's own
    `litellm` if `litellm.proxy.proxy_server` imports there."""
    path = path or os.environ.get("CTXGATE_BENCH_LITELLM_PROXY")
    if path:
        exe = Path(path).absolute()  # the servers start in a temporary folder
        if not exe.exists():
            return None, f"{path} does not exist"
        is_python = exe.name.startswith("python")
        python = exe if is_python else exe.parent / "python"
        argv = [str(exe), "-m", "litellm.proxy.proxy_cli"] if is_python else [str(exe)]
    else:
        python, argv = VENV_BIN / "python", [str(VENV_BIN / "litellm")]
    r = subprocess.run([str(python), "-c", "import importlib.metadata as m, litellm.proxy.proxy_server; "
                        "print(m.version('litellm'))"], capture_output=True, text=True, timeout=300,
                       env={**os.environ, **SERVER_ENV})
    if r.returncode != 0:
        return None, f"`import litellm.proxy.proxy_server` fails with {python}: " \
                     f"{(r.stderr.strip().splitlines() or ['?'])[-1]}"
    return argv, r.stdout.strip().splitlines()[-1]


def ctxgate_config(upstream: str, workdir: Path, forwarding: str = "auto", state: str | None = None,
                   max_input_tokens: int = 1_000_000, **settings: Any) -> dict[str, Any]:
    """The bench's routes on `upstream` (nothing compacted at 1,000,000), its own data folder;
    `state`: a redis:// URL; `settings`: more of the `ctxgate` section."""
    ctx: dict[str, Any] = {"forwarding": forwarding, "data_dir": str(workdir / f"data-{forwarding}"), **settings}
    if state:
        ctx["state"] = state
    return {"model_list": doors.model_list(upstream, UPSTREAM_KEY, max_input_tokens=max_input_tokens),
            "ctxgate": ctx}
