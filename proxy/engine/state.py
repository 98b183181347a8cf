"""Session state: what ctxgate remembers about a conversation between two requests.

One interface, two backends: in-process (the embedded default) and Redis (shared by
replicas, saved as a delta: `redis_state`). Both hold the state behind a per-session
lock, so two requests of one session never interleave their read-modify-write.
"""
from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from contextlib import asynccontextmanager, contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, AsyncContextManager, AsyncIterator, Callable, Iterator, Protocol

import orjson

from ctxgate.pipeline.records import CompactionRecord
from ctxgate.wal.backend import Fence
from ..errors import ErrorKind, GatewayError

MAX_RECORDS = 8
MAX_COMPACTION_LOG = 200
MAX_USERS = 16
MAX_EXPANDED = 32
"""Expansion exchanges kept for later turns (each is also bounded by the budget it was made in)."""


@dataclass
class SessionState:
    tenant: str
    session_id: str
    created_at: float = field(default_factory=time.time)
    updated_at: float = field(default_factory=time.time)
    turns: int = 0
    """Requests the session planned and forwarded (attempts, the failed and the in-flight ones included)."""
    answered_turns: int = 0
    """Of those, the ones answered by the upstream and settled (a RESPONSE in the WAL)."""
    profile: str = ""
    """The profile of the latest turn (it decides whether the WAL is written)."""
    records: list[CompactionRecord] = field(default_factory=list)
    collapse: dict[str, Any] = field(default_factory=dict)
    breaker: dict[str, Any] = field(default_factory=dict)
    working: dict[str, Any] = field(default_factory=dict)
    has_attempted_reactive_compact: bool = False
    guard_request: str = ""
    """The prefix hash of the request that set the loop guard (see `compaction._set_guard`)."""
    dialect: str = ""
    """The protocol the agent speaks (`pipeline.protocols.detect_dialect`), once detected."""
    learned_max_input_tokens: int | None = None
    """A smaller limit the upstream itself reported in a context-length error."""
    count_offset: int = 0
    """The provider's count of the last forwarded request minus ctxgate's (`provider_offset`),
    valid for requests with the same model and tools schema (`count_offset_key`)."""
    count_offset_key: str = ""
    count_scale: float = 1.0
    """The provider's count over ctxgate's estimate (`calibration_of`), under the same key."""
    speculative: dict[str, Any] = field(default_factory=dict)
    """A compaction made ahead of time (speculative Autocompact), applied once the trigger is
    reached: {"record": CompactionRecord as a dict, "collapse", "breaker", "working"}."""
    speculation: dict[str, Any] = field(default_factory=dict)
    """A background compaction started and not finished: {prefix_len, prefix_hash, target,
    records, logged}. Kept in the WAL so a restart can run it again."""
    speculation_wasted: int = 0
    """Background compactions that did not fit when the trigger came: after one, this
    session grows too fast per turn for speculation to pay, so it stops."""
    expanded: list[dict[str, Any]] = field(default_factory=list)
    """What the gateway's expansion tool added after a client's message in an answered turn:
    {"prefix_len", "prefix_hash" (the client's messages it follows), "messages" (the model's
    calls and their results, neutral)}. Put back in place on later turns (`compaction`), so the
    next request starts with what the provider cached, and the model keeps what it asked for;
    gone once a compaction covers it."""
    compaction_log: list[dict[str, Any]] = field(default_factory=list)
    wal_seq: int = 0
    """The last seq written to this session's WAL."""
    wal_logged: int = 0
    """How many of the client's messages the WAL has seen, and the prefix hash naming them."""
    wal_logged_hash: str = ""
    wal_since_checkpoint: int = 0
    wal_full_records: list[str] = field(default_factory=list)
    """The records (by `wal.records.record_key`) a checkpoint of the live WAL file holds in
    full: the next checkpoint names them rather than writing them again."""
    memory_block: str = ""
    """The memory block injected into this session's requests, kept byte-identical until the
    tenant's memory (`memory_version`) or the session's scope (`memory_scope`) changes."""
    memory_version: int | None = None
    memory_scope: str = ""
    users: list[str] = field(default_factory=list)
    """The users its turns named (their memory scope's), the latest last: how deleting a
    user's data finds their sessions."""
    wal_pending: list[dict[str, Any]] = field(default_factory=list)
    """Compaction steps not yet written to the WAL; drained in the same locked section."""

    @property
    def key(self) -> tuple[str, str]:
        return (self.tenant, self.session_id)

    def add_record(self, record: CompactionRecord) -> None:
        self.records = [r for r in self.records if r.prefix_len < record.prefix_len][-(MAX_RECORDS - 1):] + [record]
        self.expanded = [e for e in self.expanded if e["prefix_len"] >= record.prefix_len]  # the rest are in it

    def add_expanded(self, prefix_len: int, prefix_hash: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
        """One answered turn's expansion exchange, after the client's first `prefix_len` messages."""
        entry = {"prefix_len": prefix_len, "prefix_hash": prefix_hash, "messages": messages}
        self.expanded = [*(e for e in self.expanded if e["prefix_len"] < prefix_len), entry][-MAX_EXPANDED:]
        return entry

    def note_user(self, user: str | None) -> None:
        if user is not None and (not self.users or self.users[-1] != user):
            self.users = [*(u for u in self.users if u != user), user][-MAX_USERS:]

    def log_compaction(self, entry: dict[str, Any]) -> None:
        self.compaction_log = (self.compaction_log + [entry])[-MAX_COMPACTION_LOG:]
        self.wal_pending.append(entry)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "SessionState":
        data = dict(data)
        data["records"] = [CompactionRecord.from_dict(r) for r in data.get("records", [])]
        known = cls.__dataclass_fields__
        return cls(**{k: v for k, v in data.items() if k in known})

    def to_bytes(self) -> bytes:
        return orjson.dumps(asdict(self))

    @classmethod
    def from_bytes(cls, raw: bytes | str) -> "SessionState":
        return cls.from_dict(orjson.loads(raw))


class SessionStore(Protocol):
    def lock(self, tenant: str, session_id: str) -> Any: ...
    async def load(self, tenant: str, session_id: str) -> SessionState | None: ...
    async def save(self, state: SessionState) -> None: ...
    async def forget(self, tenant: str, session_id: str) -> None:
        """Drop an in-process copy a failed change may have touched (a no-op where `load`
        returns a fresh copy each time)."""
    async def erase(self, tenant: str, session_id: str) -> bool:
        """Delete the session's state wherever it is kept (deleting a session's data; call with
        the session locked); whether there was any."""
    def fence(self, state: SessionState) -> Fence | None:
        """The session's lock as this process holds it, for a write to check (the state's save
        and a log append in the same Redis check it in their own scripts); None: one process,
        nothing to fence."""
    async def confirm(self, state: SessionState) -> None:
        """Raise (503 session_lease_lost) when this process no longer holds the session's lock:
        another replica carried the session on while this one was cut off. For a write that
        cannot check the fence itself (a log in files or in another Redis)."""
    def speculating(self, tenant: str, session_id: str) -> AsyncContextManager[bool]:
        """Claim the session's background compaction across replicas: True while this process
        holds the claim (renewed, released at the end), False when another one does."""
    async def publish_speculation(self, tenant: str, session_id: str, result: dict[str, Any]) -> None:
        """Hand a finished background compaction to the replica whose turn needs it now."""
    async def speculation_result(self, tenant: str, session_id: str, prefix_hash: str,
                                 wait_s: float) -> dict[str, Any] | None:
        """The result another replica's background compaction over the prefix `prefix_hash`
        published, waiting for it while a replica holds the claim (at most `wait_s`); None when
        there is none."""
    async def list(self, tenant: str | None = None, limit: int | None = None) -> list[SessionState]:
        """The sessions the store holds, of `tenant` or of every tenant, the most recently saved
        first (at most `limit`), for reading only: listing neither renews their place in memory
        nor their lifetime in Redis."""
    async def ping(self) -> bool: ...
    async def close(self) -> None: ...


class MemorySessionStore:
    """In-process state, a cache of what the WAL holds: the least recently used sessions are
    forgotten past `max_sessions`, and any idle past `idle_ttl_s`, so memory does not grow
    with every conversation ever seen. A forgotten session that returns is rebuilt from its
    WAL (`Sessions.transaction`)."""

    def __init__(self, max_sessions: int = 10_000, idle_ttl_s: float = 3600.0,
                 clock: Callable[[], float] = time.time) -> None:
        self._states: OrderedDict[tuple[str, str], SessionState] = OrderedDict()
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}
        self._max = max_sessions
        self._ttl = idle_ttl_s
        self._clock = clock

    @asynccontextmanager
    async def lock(self, tenant: str, session_id: str) -> AsyncIterator[None]:
        key = (tenant, session_id)
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:
            yield
        if not lock.locked() and key not in self._states:
            self._locks.pop(key, None)

    async def load(self, tenant: str, session_id: str) -> SessionState | None:
        state = self._states.get((tenant, session_id))
        if state is not None:
            self._states.move_to_end(state.key)
        return state

    async def save(self, state: SessionState) -> None:
        now = self._clock()
        state.updated_at = now
        self._states[state.key] = state
        self._states.move_to_end(state.key)
        # Least recently used first: the oldest go while there are too many or they are idle.
        while self._states:
            key, oldest = next(iter(self._states.items()))
            if len(self._states) <= self._max and now - oldest.updated_at <= self._ttl:
                break
            del self._states[key]
            lock = self._locks.get(key)
            if lock is not None and not lock.locked():
                del self._locks[key]

    async def forget(self, tenant: str, session_id: str) -> None:
        # `load` hands out the stored object itself: after a failed change, only the WAL
        # still has the state as it was before.
        self._states.pop((tenant, session_id), None)

    async def erase(self, tenant: str, session_id: str) -> bool:
        return self._states.pop((tenant, session_id), None) is not None

    async def list(self, tenant: str | None = None, limit: int | None = None) -> list[SessionState]:
        found = [state for (t, _), state in reversed(self._states.items()) if tenant is None or t == tenant]
        return found[:limit]

    def fence(self, state: SessionState) -> Fence | None:
        """One process: its lock cannot lapse."""
        return None

    async def confirm(self, state: SessionState) -> None:
        """One process: its lock cannot lapse."""

    @asynccontextmanager
    async def speculating(self, tenant: str, session_id: str) -> AsyncIterator[bool]:
        yield True  # one process: the speculator's own bookkeeping runs one per session

    async def publish_speculation(self, tenant: str, session_id: str, result: dict[str, Any]) -> None:
        return None

    async def speculation_result(self, tenant: str, session_id: str, prefix_hash: str,
                                 wait_s: float) -> dict[str, Any] | None:
        return None

    def __len__(self) -> int:
        return len(self._states)

    async def ping(self) -> bool:
        return True

    async def close(self) -> None:
        return None


@contextmanager
def reachable() -> Iterator[None]:
    """Redis down or partitioned, a cluster failing over, or something else answering at its
    address: a 503 the client may retry, not an internal error."""
    from redis.exceptions import InvalidResponse

    from ctxgate.redis_backend import UNAVAILABLE

    try:
        yield
    except InvalidResponse as e:
        raise GatewayError(ErrorKind.UNAVAILABLE, f"the session state backend did not answer as Redis: {e}",
                           code="state_unavailable") from None
    except UNAVAILABLE as e:
        raise GatewayError(ErrorKind.UNAVAILABLE,
                           f"the session state backend is unreachable: {e}", code="state_unavailable") from None
