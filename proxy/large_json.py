"""JSON request bodies parsed off the event loop when they are large.

orjson parses about half a gigabyte a second while holding the GIL, so a 36 MB body stalls
every other request (and `/healthz`) for ~70 ms, and three at once for three times that. A
thread would not help, since the GIL is held throughout. A worker process does: the body
goes to it as bytes, the parsed object comes back pickled, and unpickling it (a copy,
several times faster than parsing) runs in a thread, a long list a slice at a time (one
`pickle.loads` holds the GIL too). Large bodies are parsed one at a time, so a small
request waits behind at most one of them.

The worker is `python -m ctxgate.proxy.large_json`, started at the first large body. It
speaks length-prefixed frames on its stdin and stdout: a body in, `(object, error)` out
with the object's long lists apart, in slices (`_frames`).
"""
from __future__ import annotations

import asyncio
import logging
import pickle
import struct
import subprocess
import sys
from functools import partial
from typing import IO, Any, BinaryIO

import orjson

log = logging.getLogger("ctxgate.large_json")

LARGE_BODY_BYTES = 1024 * 1024
"""Below this a body is parsed in place: 10 ms for a megabyte of text, 40 ms for one of 30,000
one-word messages on a loaded machine (4 MiB of those held the event loop 170 ms)."""
_LENGTH = struct.Struct(">Q")
LIST_SLICE = 5_000
"""A long list (a body's messages) comes back from the worker in slices of this many items."""


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
            head, error, long = pickle.loads(_frame(worker.stdout))
            for key, frames in long:
                # A slice at a time: one `pickle.loads` of a million messages would hold the
                # GIL, and so the event loop, for a second; between slices it may change hands.
                items: list[Any] = []
                for _ in range(frames):
                    items += pickle.loads(_frame(worker.stdout))
                head[key] = items
        except (OSError, EOFError) as e:  # it died (out of memory?): a new one next time
            log.error("the JSON worker process failed (%r); parsing a %d-byte body in place", e, len(raw))
            self.close()
            return _parse(raw)
        return head, error

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


def _frame(source: IO[bytes]) -> bytes:
    header = source.read(_LENGTH.size)
    (size,) = _LENGTH.unpack(header) if len(header) == _LENGTH.size else (-1,)
    data = source.read(size) if size >= 0 else b""
    if size < 0 or len(data) != size:
        raise EOFError("the worker's reply ended early")
    return data


def _frames(parsed: Any, error: str | None) -> list[bytes]:
    """The reply: `(head, error, [(key, slices)])`, then each long list's slices. `head` is the
    object with its long lists (an object's values of over LIST_SLICE items) left as None."""
    dump = partial(pickle.dumps, protocol=pickle.HIGHEST_PROTOCOL)
    long = {k: v for k, v in parsed.items() if type(v) is list and len(v) > LIST_SLICE} \
        if isinstance(parsed, dict) else {}
    head = {k: None if k in long else v for k, v in parsed.items()} if long else parsed
    frames = [dump((head, error, [(k, -(-len(v) // LIST_SLICE)) for k, v in long.items()]))]
    for items in long.values():
        frames += [dump(items[at:at + LIST_SLICE]) for at in range(0, len(items), LIST_SLICE)]
    return frames


def serve(source: BinaryIO, sink: BinaryIO) -> None:
    """The worker's loop: a body in, its parse out (`_frames`), until its input ends."""
    while header := source.read(_LENGTH.size):
        (size,) = _LENGTH.unpack(header)
        for reply in _frames(*_parse(source.read(size))):
            sink.write(_LENGTH.pack(len(reply)))
            sink.write(reply)
        sink.flush()


if __name__ == "__main__":
    serve(sys.stdin.buffer, sys.stdout.buffer)
