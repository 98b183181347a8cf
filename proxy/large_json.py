"""JSON request bodies parsed off the event loop when they are large.

orjson parses about half a gigabyte a second while holding the GIL, so a 36 MB body stalls
every other request (and `/healthz`) for ~70 ms, and three at once for three times that. A
thread would not help, since the GIL is held throughout. A worker process does: the body
goes to it as bytes, the parsed object comes back pickled, and unpickling it (a copy,
several times faster than parsing) runs in a thread. Large bodies are parsed one at a
time, so a small request waits behind at most one of them.

The worker is `python -m ctxgate.proxy.large_json`, started at the first large body. It
speaks length-prefixed frames on its stdin and stdout: a body in, `(object, error)` out.
"""
from __future__ import annotations

import asyncio
import logging
import pickle
import struct
import subprocess
import sys
from typing import Any, BinaryIO

import orjson

log = logging.getLogger("ctxgate.large_json")

LARGE_BODY_BYTES = 4 * 1024 * 1024
"""Below this a body is parsed in place: a few milliseconds, less than the trip to a process."""
_LENGTH = struct.Struct(">Q")


class BodyNotJson(ValueError):
    pass


def _parse(raw: bytes) -> tuple[Any, str | None]:
    """The object, or why the bytes are not JSON (the worker sends back a message, not the document)."""
    try:
        return orjson.loads(raw), None
    except orjson.JSONDecodeError as e:
        return None, str(e)


class JsonParser:
    def __init__(self, large_bytes: int = LARGE_BODY_BYTES) -> None:
        self.large_bytes = large_bytes
        self._worker: subprocess.Popen[bytes] | None = None
        self._one_at_a_time = asyncio.Lock()

    async def loads(self, raw: bytes) -> Any:
        """`raw` parsed; BodyNotJson when it is not JSON."""
        if len(raw) < self.large_bytes:
            parsed, error = _parse(raw)
        else:
            async with self._one_at_a_time:
                # In a thread: the pipe's reads and writes release the GIL, and the event loop
                # never copies the body or its reply.
                parsed, error = await asyncio.to_thread(self._parse_in_worker, raw)
        if error is not None:
            raise BodyNotJson(error)
        return parsed

    def _parse_in_worker(self, raw: bytes) -> tuple[Any, str | None]:
        try:
            worker = self._started()
            assert worker.stdin is not None and worker.stdout is not None
            worker.stdin.write(_LENGTH.pack(len(raw)))
            worker.stdin.write(raw)
            worker.stdin.flush()
            header = worker.stdout.read(_LENGTH.size)
            (size,) = _LENGTH.unpack(header) if len(header) == _LENGTH.size else (-1,)
            reply = worker.stdout.read(size) if size >= 0 else b""
            if size < 0 or len(reply) != size:
                raise EOFError("the worker's reply ended early")
        except (OSError, EOFError) as e:  # it died (out of memory?): a new one next time
            log.error("the JSON worker process failed (%r); parsing a %d-byte body in place", e, len(raw))
            self.close()
            return _parse(raw)
        result: tuple[Any, str | None] = pickle.loads(reply)
        return result

    def _started(self) -> subprocess.Popen[bytes]:
        if self._worker is None or self._worker.poll() is not None:
            self._worker = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE,
                                            stdout=subprocess.PIPE)
        return self._worker

    def close(self) -> None:
        worker, self._worker = self._worker, None
        if worker is not None and worker.poll() is None:
            worker.kill()
            worker.wait()


def serve(source: BinaryIO, sink: BinaryIO) -> None:
    """The worker's loop: a body in, its parse out, until its input ends."""
    while header := source.read(_LENGTH.size):
        (size,) = _LENGTH.unpack(header)
        reply = pickle.dumps(_parse(source.read(size)), protocol=pickle.HIGHEST_PROTOCOL)
        sink.write(_LENGTH.pack(len(reply)))
        sink.write(reply)
        sink.flush()


if __name__ == "__main__":
    serve(sys.stdin.buffer, sys.stdout.buffer)
