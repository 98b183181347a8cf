"""A client of `codex app-server` for the tests: Codex's JSON-RPC over stdio, one JSON object
a line (the protocol's schema: `codex app-server generate-json-schema --out DIR`).

It is how the suite reaches what `codex exec` cannot: a thread of several turns, and the
manual compaction of the TUI's `/compact` (`thread/compact/start`). The app server is started
under `ctxgate run` like any Codex command, so it gets the same provider overrides.
"""
from __future__ import annotations

import json
import queue
import subprocess
import threading
import time
from pathlib import Path
from typing import IO, Any

TURN_TIMEOUT = 300.0
"""Seconds a turn (or a compaction) may take before the test fails."""


class AppServer:
    """`argv` (a command ending in `codex app-server`) run in `cwd` with `env`, spoken to as a client."""

    def __init__(self, argv: list[str], cwd: Path, env: dict[str, str]) -> None:
        self.stderr = cwd / "app-server.stderr"
        with self.stderr.open("w") as err:
            self.proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=err, text=True)
        self._messages: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._ids = 0
        assert self.proc.stdout is not None
        threading.Thread(target=self._read, args=(self.proc.stdout,), daemon=True).start()

    def _read(self, stdout: IO[str]) -> None:
        for line in stdout:
            if line.strip():
                self._messages.put(json.loads(line))
        self._messages.put(None)  # the server has gone

    def _send(self, message: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"jsonrpc": "2.0", **message}) + "\n")
        self.proc.stdin.flush()

    def _next(self, deadline: float, waiting_for: str) -> dict[str, Any]:
        try:
            message = self._messages.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise AssertionError(f"no {waiting_for} from the app server in time:\n{self._tail()}") from None
        if message is None:
            raise AssertionError(f"the app server exited waiting for {waiting_for}:\n{self._tail()}")
        if "id" in message and "method" in message:  # approvals are off: any request of its own is a failure
            raise AssertionError(f"the app server asked {message['method']}: {message}")
        return message

    def _tail(self) -> str:
        return self.stderr.read_text(errors="replace")[-3000:]

    def request(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        """`method`'s result; a JSON-RPC error fails the test with it."""
        self._ids += 1
        sent = self._ids
        self._send({"id": sent, "method": method, "params": params})
        deadline = time.monotonic() + TURN_TIMEOUT
        while True:
            message = self._next(deadline, f"answer to {method}")
            if message.get("id") == sent:
                assert "error" not in message, f"{method}: {message['error']}"
                return dict(message["result"])

    def start(self, **thread: Any) -> str:
        """Initialise the connection and start a thread (`thread`: its ThreadStartParams); its id."""
        self.request("initialize", {"clientInfo": {"name": "ctxgate-tests", "version": "0"}})
        self._send({"method": "initialized"})
        return str(self.request("thread/start", thread)["thread"]["id"])

    def until_turn_completed(self) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """The `turn/completed` turn, and the items completed in it."""
        deadline = time.monotonic() + TURN_TIMEOUT
        items: list[dict[str, Any]] = []
        while True:
            message = self._next(deadline, "turn/completed")
            if message.get("method") == "item/completed":
                items.append(message["params"]["item"])
            if message.get("method") == "turn/completed":
                return dict(message["params"]["turn"]), items

    def turn(self, thread: str, text: str, **options: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """A user turn of `text` (`options`: more TurnStartParams), run to its end."""
        self.request("turn/start", {"threadId": thread, "input": [{"type": "text", "text": text}], **options})
        return self.until_turn_completed()

    def compact(self, thread: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """The manual compaction (the TUI's `/compact`), run to its end: a turn of its own."""
        self.request("thread/compact/start", {"threadId": thread})
        return self.until_turn_completed()

    def close(self) -> int:
        """Close its input (the app server ends with it) and wait: its exit code (`ctxgate run`'s)."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(10)
