"""MemoryManager: what the proxy calls, plugged into the request path (not the core).

- `context_block`: the loader's block for a turn;
- `observe`: capture from a turn's new messages into the short-term buffer, the project
  scan on a session's first sight, and auto-dream triggers A and C — all in background
  tasks, so a response never waits for memory;
- `end_session` (trigger B: idle timeout or an explicit end), with `end_timeout_s`;
- the tenant's caps on every write (memory/limits.py).
"""
from __future__ import annotations

import asyncio
import logging
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Awaitable, Callable

from .capture import Spans, Truncate, capture, project_id
from .config import MemoryConfig, Shareable
from .dream import Complete, Consolidator, Count, Dream, Head, auto_dream
from .entries import Category, MemoryEntry, Provenance
from .limits import BoundedStore
from .loader import MemoryContextLoader
from .project_scan import describe, scan_project
from .quarantine import retry_quarantined
from .short_term import BufferScope, LocalShortTermStore, SessionBuffer, SessionKey, ShortTermStore
from .store import LongTermStore

log = logging.getLogger("ctxgate.memory")
CompleteWith = Callable[[str, list[dict[str, Any]]], Awaitable[str]]
OnDream = Callable[[SessionKey, dict[str, Any]], Awaitable[None]]
Measure = Callable[[str], tuple[Count, int, Head]]
Sharing = Callable[[str], list[Shareable] | None]
"""A tenant's own `share_captured` setting (None: it has none)."""
"""A model's counter and input limit: what one consolidation call may hold."""
ReadSpans = Callable[[set[int]], Spans]
"""The given messages of a turn, split by source (`pipeline.provenance.message_spans`)."""
_TRIGGER_C_MIN = 5
_INLINE_CAPTURE = 1_000
"""New messages a turn's capture reads on the event loop; more are read in a thread."""
_INLINE_CAPTURE_CHARS = 32_768
"""The same for their text: a new history of a few hundred long tool outputs takes its
capture's regular expressions ~15 ms, which the event loop would otherwise hold."""


def _text_chars(messages: list[dict[str, Any]], indices: set[int]) -> int:
    """About how much text those messages hold (their string contents; a part list counts
    1,000 per part), known without splitting them into spans."""
    total = 0
    for i in indices:
        content = messages[i].get("content")
        total += len(content) if isinstance(content, str) else 1_000 * len(content) if isinstance(content, list) else 0
    return total


CAPTURE_THREADS = 2
"""Long captures read at once (other sessions' wait their turn); each pauses while the gateway counts."""


def _give_back() -> None:
    time.sleep(0)


class MemoryManager:
    def __init__(self, store: LongTermStore, config: MemoryConfig, complete: CompleteWith, on_dream: OnDream,
                 clock: Callable[[], float] = time.time, short_term: ShortTermStore | None = None,
                 measure: Measure | None = None, sharing: Sharing | None = None,
                 pauser: Callable[[], Callable[[], None]] = lambda: _give_back) -> None:
        """`pauser`: makes, for each capture read in a thread, what it calls between messages
        (the gateway's waits while it counts a turn; by default only gives the GIL back)."""
        self.store = BoundedStore(store, config, clock=clock)
        """What the API writes through: a write past the tenant's caps is refused."""
        self._captured = self.store.capturing()
        """What capture writes through: the oldest captured entries make room, or it is skipped."""
        self.config = config
        self.loader = MemoryContextLoader(store)
        self.short_term: ShortTermStore = short_term or LocalShortTermStore()
        self._complete = complete
        self._measure = measure
        self._sharing = sharing
        self._on_dream = on_dream
        self._clock = clock
        self._pauser = pauser
        self._reading = ThreadPoolExecutor(CAPTURE_THREADS, thread_name_prefix="ctxgate-capture")
        """Long captures are read in threads of their own: one paused for the gateway's count
        must not hold a thread of the default pool, which the turn it waits for may need."""
        self._tasks: set[asyncio.Task[Any]] = set()
        self._dreaming: dict[SessionKey, asyncio.Task[Any]] = {}
        self._observing: dict[SessionKey, asyncio.Task[Any]] = {}

    def enabled(self, profile: str) -> bool:
        return self.config.enabled_for(profile)

    async def context_block(self, tenant: str, user: str | None, project: str | None, query: str,
                            budget_tokens: int, count: Callable[[str], int]) -> str:
        return await self.loader.block(tenant, user, project, query, budget_tokens, count, self._clock())

    def observe(self, key: SessionKey, scope: BufferScope, messages: list[dict[str, Any]], fingerprints: list[str],
                truncate: Truncate, spans: ReadSpans) -> None:
        """Capture in the background; the turn goes on at once."""
        if not self.short_term.unseen(key, fingerprints):
            return
        previous = self._observing.get(key)
        task = self._spawn(self._observe(key, scope, messages, fingerprints, truncate, spans, previous))
        self._observing[key] = task
        task.add_done_callback(lambda t: self._observing.pop(key, None) if self._observing.get(key) is t else None)

    async def _observe(self, key: SessionKey, scope: BufferScope, messages: list[dict[str, Any]],
                       fingerprints: list[str], truncate: Truncate, spans: ReadSpans,
                       previous: asyncio.Task[Any] | None) -> None:
        if previous is not None:  # a session's turns are captured in order
            await asyncio.gather(previous, return_exceptions=True)
        now = self._clock()
        unseen = self.short_term.unseen(key, fingerprints)
        if len(unseen) <= _INLINE_CAPTURE and _text_chars(messages, unseen) <= _INLINE_CAPTURE_CHARS:
            found = capture(messages, spans(unseen), truncate, now)
        else:  # a long new history: split and read off the event loop
            pause = self._pauser()
            found = await asyncio.get_running_loop().run_in_executor(
                self._reading, lambda: capture(messages, spans(unseen), truncate, now, pause))
        for _, candidate in found:
            candidate.turn, candidate.door = scope.turn, scope.door
        added = await self.short_term.add(key, scope, fingerprints, found, now)
        buf, size = added.buffer, added.size
        if added.first and self.config.workspace_root:
            await self._refresh_project(buf)
        triggers = self.config.triggers_for(buf.profile)
        if "A" in triggers and size > self.config.threshold_count:
            self._dream(key, "A", None)
        elif "C" in triggers and size > _TRIGGER_C_MIN and now - buf.last_dream_at > self.config.dream_interval_s:
            self._dream(key, "C", None)

    async def _refresh_project(self, buf: SessionBuffer) -> None:
        """Project memory is refreshed by a scan at session start, incrementally by mtime."""
        root = Path(self.config.workspace_root or "")
        if not root.is_dir():
            log.warning("memory.workspace_root %s is not a readable directory: no project scan", root)
            return
        project = buf.project or project_id(str(root.resolve()))
        existing = next((e for e in await self.store.list(buf.tenant, Category.PROJECT)
                         if e.project == project and e.data.get("root_path")), None)
        data = await asyncio.to_thread(scan_project, root, existing.data if existing else None, self._clock())
        if existing is not None and not data["changed_files"] and not data["removed_files"]:
            return
        entry = MemoryEntry(category=Category.PROJECT, tenant=buf.tenant, project=project, content=describe(data),
                            data=data, shared=Category.PROJECT in self._shared(buf.tenant, buf.profile),
                            provenance=[Provenance(
                                tenant=buf.tenant, user=buf.user, project=project, source="scaffolding",
                                span=f"scan of {root}")])
        if existing is not None:
            entry.id, entry.created_at = existing.id, existing.created_at
        await self._captured.put(entry)

    async def settled(self, key: SessionKey, *, dreams: bool = True) -> None:
        """Wait for the session's capture (and, with `dreams`, its consolidation) in flight."""
        for running in (self._observing.get(key), self._dreaming.get(key) if dreams else None):
            if running is not None:
                await asyncio.gather(running, return_exceptions=True)

    async def discard_session(self, key: SessionKey) -> int:
        """Drop a session's buffer unconsolidated (its data is being deleted); how many
        candidates it held."""
        await self.settled(key, dreams=False)
        buf, candidates = await self.short_term.peek(key)
        await self.short_term.forget(key, sys.float_info.max)  # however recently fed (a Redis script reads no inf)
        return len(candidates) if buf is not None else 0

    async def end_session(self, key: SessionKey) -> dict[str, Any] | None:
        """Trigger B: the session ended; consolidate within `end_timeout_s`, then forget the buffer."""
        await self.settled(key)
        buf, entries = await self.short_term.peek(key)
        if buf is None:
            await self.short_term.forget(key, 0.0)  # a listing left by a buffer that expired goes
            return None
        event = None
        if entries and "B" in self.config.triggers_for(buf.profile):
            event = await self._run_dream(key, "B", self.config.end_timeout_s)
        await self.short_term.forget(key, buf.last_seen_at)
        return event

    async def sweep(self) -> int:
        """End the sessions idle past `idle_timeout_s`."""
        idle = await self.short_term.idle(self._clock(), self.config.idle_timeout_s)
        for key in idle:
            await self.end_session(key)
        return len(idle)

    def _dream(self, key: SessionKey, trigger: str, timeout: float | None) -> None:
        if key in self._dreaming:
            return
        task = self._spawn(self._run_dream(key, trigger, timeout))
        self._dreaming[key] = task
        task.add_done_callback(lambda _: self._dreaming.pop(key, None))

    async def _run_dream(self, key: SessionKey, trigger: str, timeout: float | None) -> dict[str, Any] | None:
        now = self._clock()
        buf, entries = await self.short_term.drain(key, now)
        if buf is None or not entries:
            return None
        model = self._consolidator(self.config.dream_model or buf.model)
        classify: Complete | None = None
        if self.config.classifier_model:
            classifier = self.config.classifier_model
            classify = lambda msgs: self._complete(classifier, msgs)  # noqa: E731
        ttl_s = self.config.feedback_ttl_s()
        shared = self._shared(buf.tenant, buf.profile)
        event = await auto_dream(Dream(buf, key[1], model, ttl_s, shared), entries, self._captured, timeout, classify,
                                 now)
        if model.complete is not None:
            retried = await retry_quarantined(buf.tenant, self._captured, model, ttl_s, shared, now, timeout)
            if any(retried.values()):
                event["quarantine"] = retried
        event["trigger"] = trigger
        try:
            await self._on_dream(key, event)
        except Exception as e:  # the memory is written; only the log line is missing
            log.warning("AUTO_DREAM of session %s not logged: %s", key[1], e)
        return event

    def _shared(self, tenant: str, profile: str) -> frozenset[Category]:
        """The captured categories this tenant's users share."""
        own = self._sharing(tenant) if self._sharing is not None else None
        return frozenset(Category(c) for c in self.config.shared_for(profile, own))

    def _consolidator(self, model: str | None) -> Consolidator:
        """The consolidating model, and how much one call to it may hold."""
        if not model:
            return Consolidator(None)
        count: Count | None = None
        limit: int | None = None
        head: Head | None = None
        if self._measure is not None:
            try:
                count, limit, head = self._measure(model)
            except Exception as e:  # an unknown route fails at the call, with its own error
                log.warning("memory: no limit known for %s (%s): consolidation calls are not batched", model, e)
        return Consolidator(lambda msgs: self._complete(model, msgs), count, limit, head)

    def _spawn(self, work: Awaitable[Any]) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("memory background task failed: %s", task.exception())

    async def idle_tasks(self) -> None:
        """Wait for the background work in flight (tests, shutdown)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def close(self) -> None:
        """Shutdown ends the sessions whose buffers die with this process: buffered memory is
        consolidated (or written raw), not lost. Buffers in Redis stay for the replicas that
        carry the sessions on (or end them when they go idle)."""
        await self.idle_tasks()
        self._reading.shutdown(wait=False)
        for key in await self.short_term.left_at_close():
            await self.end_session(key)
        await self.short_term.close()
        await self.store.close()
