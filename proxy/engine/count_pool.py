"""A large new conversation counted on all cores, exactly.

tiktoken counts 107K tokens in ~20 ms of one core. Threads do not share that out: a
conversation is hundreds of short texts and each call takes the GIL back around its result,
so two threads take turns (measured and removed in 47cafd4). Processes have a GIL each: the
uncounted messages go to worker processes in slices of about equal text, each counts its
slice with the same tokenizer (`TokenCounter.count_message`, the BPE files the litellm wheel
ships, nothing downloaded), and the per-message counts come back. A count is per message, so
the slices' counts are exactly the whole's.

Only for tiktoken (a Hugging Face tokenizer would load transformers into every worker) and
only past `POOL_CHARACTERS` of text (below it the pipes cost what they save). With no idle
worker (busy with another request's count, dead, not started yet) the count runs in a thread
as before. The workers are `python -m ctxgate.proxy.engine.count_pool <tokenizer>...`, one per
core. `serve` enables them for its models' tokenizers (`enable`), and they start at the first
count they would take (that one in a thread): each costs ~0.5 s of CPU and ~100 MB, which a
gateway that never sees a large new conversation (or a test's) need not pay. They speak
length-prefixed JSON frames on their stdin and stdout and end when their input does (`close`,
or the gateway gone).
"""
from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import struct
import sys
from typing import Any, BinaryIO, Callable, Iterable, Iterator, NamedTuple

import orjson

from ctxgate.pipeline.history_index import HistoryIndex
from ctxgate.pipeline.tokens import TokenCounter, TokenizerRegistry
from .quiet import QUIET

log = logging.getLogger("ctxgate.count_pool")

POOL_CHARACTERS = 100_000
"""Messages' JSON (about 25K tokens, ~5 ms of tiktoken) below which a count stays in one thread."""
_LENGTH = struct.Struct(">Q")
SLICES_PER_WORKER = 3
"""A count is cut in this many slices per worker, handed out as workers answer: a worker that
shares its core with the gateway or the upstream counts fewer (with one slice each, the
slower finished ~4 ms after the other on a new 107K conversation)."""
PIPE_BYTES = 1 << 20
"""A worker's input pipe is made this large (Linux's default most, /proc/sys/fs/pipe-max-size)."""
_READY = b'"ready"'
_WARM = "def f(x):\n    return {'a': [1, 2.5, None]}  # ctxgate warms its tokenizer, \u00e9\u4e2d\n" * 64
"""Counted by a worker before it says it is ready: tiktoken's first calls are several times slower."""


def cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class _Worker:
    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process
        assert process.stdin is not None and process.stdout is not None
        self.stdin = process.stdin
        self.stdout = process.stdout

    def send(self, frame: bytes) -> None:
        """Written at once: the pipe holds a whole frame (`_widen`)."""
        self.stdin.write(_LENGTH.pack(len(frame)))
        self.stdin.write(frame)

    async def reply(self) -> Any:
        await self.stdin.drain()
        return await self.answer()

    async def answer(self) -> Any:
        (size,) = _LENGTH.unpack(await self.stdout.readexactly(_LENGTH.size))
        return orjson.loads(await self.stdout.readexactly(size))

    def kill(self) -> None:
        if self.process.returncode is None:
            self.process.kill()


class CountPool:
    """Worker processes that count a large conversation's messages, a slice each."""

    def __init__(self, size: int | None = None, on_workers: Callable[[], None] | None = None) -> None:
        """`size`: that many workers; None: one per core."""
        self.size = cores() if size is None else size
        self._on_workers = on_workers
        """Told of each count done on the workers (`ctxgate_counts_on_workers_total`)."""
        self.specs: frozenset[str] = frozenset()
        """The tokenizers the workers load; a count with another stays in a thread."""
        self._started = False
        self._idle: list[_Worker] = []
        self._workers: set[_Worker] = set()
        self._spawning: set["asyncio.Task[None]"] = set()
        self._closed = False

    def enable(self, specs: Iterable[str]) -> None:
        """Count with these tokenizers on the workers, once started."""
        self.specs = frozenset(s for s in specs if s.startswith("tiktoken:"))

    @property
    def ready(self) -> int:
        """Workers idle now."""
        return len(self._idle)

    def _spawn(self) -> None:
        if not self._closed:
            task = asyncio.ensure_future(self._start_one())
            self._spawning.add(task)
            task.add_done_callback(self._spawning.discard)

    async def _start_one(self) -> None:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", __name__, *sorted(self.specs),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, limit=1 << 20)
        worker = _Worker(process)
        self._workers.add(worker)
        _widen(worker.stdin)
        try:
            if await worker.answer() != "ready":
                raise EOFError("the count worker did not start")
        except (OSError, EOFError, asyncio.IncompleteReadError, orjson.JSONDecodeError) as e:
            log.error("a count worker could not start (%r): counting in threads", e)
            self._drop(worker)
            return
        if self._closed:
            self._drop(worker)
        else:
            self._idle.append(worker)

    def _drop(self, worker: _Worker) -> None:
        self._workers.discard(worker)
        worker.kill()

    def ahead(self, messages: list[dict[str, Any]], counter: TokenCounter
              ) -> "asyncio.Future[list[int] | None] | None":
        """Every message of a conversation none of which is counted, sent to the idle workers
        now: they count while its fingerprints are taken, which `counted(..., ahead)` needs
        only to keep the counts. Each message's count (None if a worker failed), or None when
        not sent (not for the workers, none idle): `counted` then counts as usual."""
        if counter.name not in self.specs or len(messages) < 2:
            return None
        sent = self._send(counter, messages)
        return None if sent is None else asyncio.ensure_future(QUIET.around(self._answers(sent)))

    async def counted(self, index: HistoryIndex, messages: list[dict[str, Any]], counter: TokenCounter,
                      ahead: "asyncio.Future[list[int] | None] | None" = None) -> HistoryIndex:
        """`index.counted(messages, counter)`: on the workers when it is large and they are
        free, else in a thread; either way a count in flight for `QUIET`. `ahead`: the
        messages' counts started before `index` held their fingerprints (`ahead`)."""
        return await QUIET.around(self._counted(index, messages, counter, ahead))

    async def _counted(self, index: HistoryIndex, messages: list[dict[str, Any]], counter: TokenCounter,
                       ahead: "asyncio.Future[list[int] | None] | None") -> HistoryIndex:
        start = len(index.cumulative_tokens) - 1
        counts = await ahead if ahead is not None and start == 0 else None
        if counts is not None:
            for fingerprint, n in zip(index.fingerprints, counts):
                counter.keep(fingerprint, n)
        elif counter.name in self.specs and len(messages) - start > 1:
            counts = await self._worker_counts(counter, messages[start:], index.fingerprints[start:])
        if counts is not None:
            if self._on_workers is not None:
                self._on_workers()
            return index.with_counts(counts)
        return await asyncio.to_thread(index.counted, messages, counter)

    async def _worker_counts(self, counter: TokenCounter, messages: list[dict[str, Any]],
                             fingerprints: list[str]) -> list[int] | None:
        """Each message's count, the ones not kept already counted by the idle workers; None
        when that is not worth it or fails (the caller counts in a thread)."""
        counts = [counter.cached(fp) for fp in fingerprints]
        todo = [i for i, n in enumerate(counts) if n is None]
        found = await self._pooled(counter, [messages[i] for i in todo])
        if found is None:
            return None
        for i, n in zip(todo, found):
            counts[i] = n
            counter.keep(fingerprints[i], n)
        return [n for n in counts if n is not None]

    async def _pooled(self, counter: TokenCounter, messages: list[dict[str, Any]]) -> list[int] | None:
        """Each of `messages`' counts from the idle workers; None when that is not worth it
        (below `POOL_CHARACTERS`), none is idle, or it fails."""
        sent = self._send(counter, messages)
        return None if sent is None else await self._answers(sent)

    def _send(self, counter: TokenCounter, messages: list[dict[str, Any]]) -> "_Sent | None":
        """`messages` in `SLICES_PER_WORKER` slices of about equal text per idle worker taken for
        them, the first slice of each sent at once (`_asked` hands out the rest); None when that
        is not worth it (below `POOL_CHARACTERS`) or none is idle."""
        try:  # each message as its frame will hold it, weighed by its JSON's length
            sent = [orjson.dumps(_counted(m)) for m in messages]
        except TypeError:  # not JSON (no wire body gives this): the thread counts it
            return None
        weights = [len(m) for m in sent]
        if sum(weights) < POOL_CHARACTERS:
            return None
        if not self._started:  # in the background; this count in a thread
            self._started = True
            for _ in range(self.size):
                self._spawn()
        if not self._idle:
            return None
        workers, self._idle = self._idle, []
        cuts = _balanced(weights, len(workers) * SLICES_PER_WORKER)
        name = orjson.dumps(counter.name)
        frames = [b"[" + name + b",[" + b",".join(sent[a:b]) + b"]]" for a, b in zip(cuts, cuts[1:])]
        batch = _Sent(frames, workers[:len(frames)], iter(range(len(frames))))
        self._idle += workers[len(frames):]
        try:
            for worker in batch.workers:
                worker.send(frames[next(batch.unsent)])
        except Exception as e:  # a pipe gone: those taken may hold part of a frame
            log.error("a count worker could not be sent its slice (%r): counting in a thread, starting others", e)
            for worker in batch.workers:
                self._drop(worker)
                self._spawn()
            return None
        return batch

    async def _answers(self, batch: "_Sent") -> list[int] | None:
        """The counts of the slices `_send` cut, in order; None if one failed."""
        # Shielded: a cancelled request does not leave a worker half way through a frame.
        answers = await asyncio.shield(self._asked(batch))
        return None if answers is None else [n for answer in answers for n in answer]

    async def _asked(self, batch: "_Sent") -> list[list[int]] | None:
        """Each slice's counts: a worker that answers is sent the next slice not sent yet, so
        one slowed (its core shared with the gateway or the upstream) counts fewer. A worker
        that fails is replaced, and the count is None: the caller counts it again."""
        answers: list[list[int] | None] = [None] * len(batch.frames)

        async def served(worker: _Worker, slice_: int) -> Any:
            while True:
                answer = await worker.reply()
                if not isinstance(answer, list):
                    return answer  # `{"error"}`: its count raised (the thread will say why)
                answers[slice_] = answer
                following = next(batch.unsent, None)
                if following is None:
                    return None
                slice_ = following
                worker.send(batch.frames[slice_])

        ended = await asyncio.gather(*(served(w, i) for i, w in enumerate(batch.workers)), return_exceptions=True)
        for worker, end in zip(batch.workers, ended):
            if end is None or isinstance(end, dict):
                self._idle.append(worker)
            else:
                log.error("a count worker failed (%r): counting in a thread, starting another", end)
                self._drop(worker)
                self._spawn()
        if self._closed:
            self._stop_idle()
        return None if any(a is None for a in answers) else [a for a in answers if a is not None]

    def _stop_idle(self) -> None:
        for worker in self._idle:
            worker.stdin.close()  # its input ends: it exits
        self._idle = []

    async def close(self) -> None:
        """The workers end (their input closed; killed if they linger); counts run in threads."""
        self._closed = True
        for task in list(self._spawning):
            task.cancel()
        await asyncio.gather(*self._spawning, return_exceptions=True)
        self._stop_idle()
        for worker in list(self._workers):
            try:
                await asyncio.wait_for(worker.process.wait(), 2.0)
            except asyncio.TimeoutError:
                worker.kill()
                await worker.process.wait()
        self._workers.clear()


class _Sent(NamedTuple):
    """A count's slices (frames), the workers taken for them, and the slices not sent yet."""
    frames: list[bytes]
    workers: list[_Worker]
    unsent: Iterator[int]


def _widen(stdin: asyncio.StreamWriter) -> None:
    """A pipe that holds a whole slice (Linux: 64 KiB, at most `PIPE_BYTES`): written at once,
    rather than a pipe's worth each time the worker is scheduled to read one, which on a busy
    machine is a wait each."""
    pipe = stdin.get_extra_info("pipe")
    try:
        fcntl.fcntl(pipe.fileno(), getattr(fcntl, "F_SETPIPE_SZ", 1031), PIPE_BYTES)
    except (OSError, AttributeError, ValueError):  # not Linux, or over the system's pipe-max-size
        pass


_READ = frozenset(("content", "tool_calls", "function_call", "items", "name"))
"""The fields `TokenCounter.count_message` looks into (besides every string)."""
_PLAIN = _READ | {"role", "tool_call_id"}


def _counted(message: dict[str, Any]) -> dict[str, Any]:
    """What of `message` `TokenCounter.count_message` reads: its strings and the fields it looks
    into. A door's own keys are neither (the Gemini door keeps each message's original turn
    under one, as large as the message): a worker is not sent them, nor are they weighed."""
    if message.keys() <= _PLAIN:
        return message
    return {k: v for k, v in message.items() if k in _READ or isinstance(v, str)}


def _balanced(weights: list[int], parts: int) -> list[int]:
    """Cut points of `weights` into at most `parts` runs of about equal sum, each non-empty:
    `[0, ..., len(weights)]`."""
    total = sum(weights) or 1
    cuts = [0]
    running = 0
    for i, w in enumerate(weights):
        running += w
        if len(cuts) < parts and running * parts >= total * len(cuts) and i + 1 < len(weights):
            cuts.append(i + 1)
    cuts.append(len(weights))
    return cuts


def serve(specs: list[str], source: BinaryIO, sink: BinaryIO) -> None:
    """A worker's loop: `[tokenizer, messages]` in, each message's count out (or `{"error"}`),
    until its input ends."""
    registry = TokenizerRegistry()
    for spec in specs:
        registry.counter(spec).count(_WARM)
    _send(sink, _READY)
    while header := source.read(_LENGTH.size):
        (size,) = _LENGTH.unpack(header)
        try:
            spec, messages = orjson.loads(source.read(size))
            reply = orjson.dumps([registry.counter(spec).count_message(m) for m in messages])
        except Exception as e:  # the parent's thread counts it again and meets the same error
            reply = orjson.dumps({"error": repr(e)})
        _send(sink, reply)


def _send(sink: BinaryIO, frame: bytes) -> None:
    sink.write(_LENGTH.pack(len(frame)))
    sink.write(frame)
    sink.flush()


if __name__ == "__main__":
    serve(sys.argv[1:], sys.stdin.buffer, sys.stdout.buffer)
