"""The session WAL as the proxy writes and reads it (docs/wal.md).

Before forwarding: USER_INPUT and TOOL_RESULT for the client's messages the log has not
seen yet (`wal_events.py`), a COMPRESSION per compaction step, then, after a compaction, a
CHECKPOINT (fsynced) holding a full snapshot of the session state. After the reply: RESPONSE
(the upstream call completed) and a TOOL_CALL per tool call in it; once `checkpoint_every`
events are logged since the last CHECKPOINT, a periodic one, after the reply is on its way.
Recovery is the latest intact checkpoint's snapshot plus the events after it, so a restarted
gateway forwards exactly what it would have forwarded without the crash.
"""
from __future__ import annotations

import asyncio
import logging
import time
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Callable

import orjson

from ctxgate.wal.backend import Appended, Fence, WalFenced
from ctxgate.wal.open_log import open_log
from ctxgate.wal.config import WalConfig
from ctxgate.wal.events import EventType, content_hash
from ctxgate.wal.mirror import DB_NAME, SqliteMirror
from ctxgate.wal.paths import WalPaths
from ctxgate.wal.reader import Recovery, find_checkpoint, recover
from ctxgate.wal.records import REF, record_key, resolved
from .off_loop import heavy, index_inline
from .turn_budget import Turn
from ..errors import ErrorKind, GatewayError
from .redis_lock import lease_lost
from .state import SessionState
from .wal_events import compression, first_unlogged, message_events

log = logging.getLogger("ctxgate.wal")
INLINE_EVENTS = 256
"""Events an append encodes on the event loop; more are encoded and written in a thread."""
INLINE_MESSAGES = 16
"""A turn logs at most this many new messages inline (if they are small: `index_inline`)."""
APPEND_FENCE: ContextVar[Fence | None] = ContextVar("append_fence", default=None)
"""The session lock of the transaction committing now (`Sessions._commit` sets it): every
append the commit makes is fenced by it, wherever in the journal the append is made."""


class RollbackError(ValueError):
    pass


class Journal:
    def __init__(self, data_dir: str | Path, config: WalConfig, clock: Callable[[], float] = time.time,
                 watch_external: bool = False, on_damage: Callable[[str], None] | None = None,
                 state: str = "memory") -> None:
        """`state` is `ctxgate.state`: with the config, it says where the log lives
        (`WalConfig.backend_for`)."""
        self.config = config
        self.paths = WalPaths(data_dir)
        self._on_damage = on_damage
        self.writer = open_log(config, self.paths, state, clock, on_torn=lambda path, _: self._damaged("torn"))
        """The backend (`wal/backend.py`): files or Redis."""
        self.mirror = SqliteMirror(self.paths.data_dir / DB_NAME)
        self._watch_external = watch_external
        """In-process state only: notice a rollback made from the CLI on the session's next turn."""
        self._remote = config.backend_for(state) == "redis"
        """Every append is a network round trip: made in a thread, never on the event loop."""
        self._failing: set[str] = set()
        """Tenants whose last append failed (`failing`)."""

    def enabled(self, profile: str) -> bool:
        return self.config.enabled_for(profile or "professional")

    def failing(self, tenant: str) -> bool:
        """The tenant's last append failed (its log unwritable or unreachable): until one is
        written, its new conversations are logged before they are forwarded, as its other
        turns are, so each is refused with nothing forwarded (`count_beside.py`)."""
        return tenant in self._failing

    # -- reading ---------------------------------------------------------------------------

    async def recover(self, tenant: str, session: str) -> SessionState | None:
        """The session as the WAL has it, or None when there is no log of it."""
        if not self._remote and not self.writer.exists(tenant, session):
            return None  # a new session: one stat answers, a thread hop would cost more
        return await asyncio.to_thread(self._recover, tenant, session)

    def _recover(self, tenant: str, session: str) -> SessionState | None:
        if not self.writer.exists(tenant, session):
            return None  # archives alone are history, not a session to resume
        read = self.writer.open(tenant, session)
        found = recover(read.scans)
        if not found.last_seq:
            return None
        if found.checkpoint is not None:
            found.checkpoint = {**found.checkpoint,
                                "state": _resolved_state(found.checkpoint, read.records, tenant, session)}
        for damage in found.damaged:
            log.warning("WAL %s line %d is damaged (%s): skipped, recovery goes on from checkpoint %s",
                        damage.file, damage.line, damage.reason, found.checkpoint and found.checkpoint["seq"])
            self._damaged("damaged")
        state = _rebuild(tenant, session, found)
        held = read.held  # what the next checkpoint may name
        state.wal_full_records = [k for k in map(record_key, found.checkpoint["state"]["records"]) if k in held
                                  ] if found.checkpoint else []
        log.info("session %s/%s recovered from the WAL: checkpoint %s, %d events after it, seq %d",
                 tenant, session, found.checkpoint and found.checkpoint["seq"], len(found.events), state.wal_seq)
        return state

    def stale(self, state: SessionState) -> bool:
        return self._watch_external and self.writer.changed_externally(state.tenant, state.session_id)

    # -- writing ---------------------------------------------------------------------------

    def checks(self, fence: Fence) -> bool:
        """Whether the log's appends check `fence` themselves (it is in the lock's Redis)."""
        return self.writer.checks(fence)

    async def log_request(self, state: SessionState, turn: Turn, tokens_out: int | None, budget: int,
                          number: int | None = None) -> None:
        """What this turn brought and what compaction did, before anything is forwarded (a new
        conversation far below the trigger: beside its upstream call, `count_beside.py`, as turn
        `number`); a CHECKPOINT with them only after a compaction (a periodic one waits for the
        reply: `due`)."""
        steps, state.wal_pending = state.wal_pending, []
        if not self.enabled(state.profile):
            return
        before = (state.wal_logged, state.wal_logged_hash)
        start = first_unlogged(state, turn)
        new = turn.messages[start:]
        # A steady turn logs its one or two new messages on the loop, as its index is extended;
        # a heavy turn's many are made into events and written in one thread hop (a hop costs
        # a long session's turn more than the work; the size of the whole conversation does not decide it).
        inline = len(new) <= INLINE_MESSAGES and \
            index_inline(len(new), sum(len(orjson.dumps(m, default=str)) for m in new))
        rest = [compression(step) for step in steps if step["level"] != "chain"]
        logged_speculation = bool(state.speculation.get("logged"))
        if state.speculation and not logged_speculation:
            state.speculation["logged"] = True
            rest.append({"type": EventType.SPECULATION.value,
                         **{k: v for k, v in state.speculation.items() if k != "logged"}})
        store = self.config.store_content
        try:
            await self._write(state, lambda: message_events(state, turn, start, store, number) + rest, "compaction",
                              tokens_out, budget, checkpoint=bool(steps), off_loop=not inline and heavy(turn))
        except GatewayError:  # nothing was written: the next write carries it all
            state.wal_logged, state.wal_logged_hash = before
            state.wal_pending = steps + state.wal_pending
            if state.speculation:
                state.speculation["logged"] = logged_speculation
            raise

    async def log_reply(self, state: SessionState, status: int, prompt_tokens: int | None,
                        tool_calls: list[dict[str, Any]], tokens_in: int | None, tokens_out: int | None,
                        model: str, expansions: dict[str, int] | None = None,
                        exchange: dict[str, Any] | None = None) -> None:
        """The answered turn: the model group that answered it (a fallback's, when one did),
        the provider's count beside ctxgate's of what the client sent (`tokens_in`) and of
        what was forwarded (`tokens_out`); before it, an EXPANSION per original the gateway gave
        back to the model in this turn (`expansions`: ref -> tokens). `exchange`: what the
        expansions appended (`SessionState.add_expanded`), so a recovered session puts it back
        in place as the live one does."""
        if not self.enabled(state.profile):
            return
        events: list[dict[str, Any]] = [{"type": EventType.EXPANSION.value, "turn": state.turns, "ref": ref,
                                         "tokens": tokens} for ref, tokens in (expansions or {}).items()]
        events += [{"type": EventType.RESPONSE.value, "turn": state.turns, "status": status,
                    "model": model, "prompt_tokens": prompt_tokens, "tokens_in": tokens_in,
                    "tokens_out": tokens_out, "tool_calls": len(tool_calls),
                    "count_offset": state.count_offset, "count_offset_key": state.count_offset_key,
                    "count_scale": state.count_scale,
                    "dialect": state.dialect, **({"expanded": exchange} if exchange else {})}]
        for call in tool_calls:
            fn = call.get("function") or {}
            events.append({"type": EventType.TOOL_CALL.value, "tool": fn.get("name"), "call_id": call.get("id"),
                           "params_hash": content_hash(str(fn.get("arguments", "")))})
        await self._write(state, events, "periodic", None, None, checkpoint=False)

    async def log_dream(self, state: SessionState, event: dict[str, Any]) -> None:
        """Auto-dream consolidated the session's short-term memory (the memory system's event):
        written after the turn, so with the periodic checkpoint when it is due."""
        if self.enabled(state.profile):
            due = state.wal_since_checkpoint + 1 >= self.config.checkpoint_every
            await self._write(state, [{"type": EventType.AUTO_DREAM.value, **event}], "periodic", None, None,
                              checkpoint=due)

    def due(self, state: SessionState) -> bool:
        """`checkpoint_every` events are logged since the session's last CHECKPOINT: a periodic
        one is owed. It only shortens replay (recovery is the last checkpoint plus the events
        after it), so no reply waits for it: `Sessions.checkpoint_later` writes it after."""
        return self.enabled(state.profile) and state.wal_since_checkpoint >= self.config.checkpoint_every

    async def checkpoint(self, state: SessionState, reason: str) -> None:
        if self.enabled(state.profile):
            await self._write(state, [], reason, None, None, checkpoint=True)

    async def _write(self, state: SessionState, events: list[dict[str, Any]] | Callable[[], list[dict[str, Any]]],
                     reason: str, tokens_out: int | None, budget: int | None, checkpoint: bool,
                     off_loop: bool = False) -> None:
        """Append `events` (or those `events()` makes), and a CHECKPOINT after them when
        `checkpoint`. In one thread hop when there is a checkpoint (a copy of the whole state
        and an fsync), a round trip (a remote log), many events to encode, or, `off_loop`,
        events to make; on the event loop otherwise."""
        if callable(events) and not off_loop:
            events = events()
        fence = APPEND_FENCE.get()
        made: list[dict[str, Any]] = []
        full: list[str] = []

        def append() -> Appended | None:
            nonlocal made, full
            made = events() if callable(events) else events
            written = made
            if checkpoint:
                event, full = self._checkpoint_event(state, reason, tokens_out, budget)
                written = made + [event]
            if not written:
                return None
            return self.writer.append(state.tenant, state.session_id, written, state.wal_seq, checkpoint, fence)

        hop = off_loop or checkpoint or self._remote or (isinstance(events, list) and len(events) > INLINE_EVENTS)
        try:
            appended = await asyncio.to_thread(append) if hop else append()
        except WalFenced:
            raise lease_lost(*state.key) from None
        except OSError as e:
            log.error("WAL of session %s/%s not written: %s", state.tenant, state.session_id, e)
            self._failing.add(state.tenant)
            raise GatewayError(ErrorKind.UNAVAILABLE,
                               f"the session log could not be written ({e.strerror or e}); nothing was forwarded",
                               code="wal_unavailable") from None
        if appended is None:
            return
        self._failing.discard(state.tenant)
        state.wal_seq = appended.last_seq
        state.wal_since_checkpoint = 0 if checkpoint else state.wal_since_checkpoint + len(made)
        if checkpoint:
            state.wal_full_records = full
        if appended.archived is not None:
            log.info("WAL %s/%s: events before seq %d archived to %s", state.tenant, state.session_id,
                     appended.events[-1]["seq"], appended.archived)
        if self.config.sqlite_for(state.profile):
            self.mirror.put(state.tenant, state.session_id, appended.events)

    def _checkpoint_event(self, state: SessionState, reason: str, tokens_out: int | None,
                          budget: int | None) -> tuple[dict[str, Any], list[str]]:
        """The checkpoint, with the records the live file holds already named rather than
        written (`wal/records.py`), and the keys of every record the file holds once it is written."""
        last = state.compaction_log[-1] if state.compaction_log else {}
        snapshot = state.to_dict()
        snapshot["wal_pending"] = []
        in_file = set(state.wal_full_records)
        keys = [record_key(r) for r in snapshot["records"]]
        snapshot["records"] = [{REF: k} if k in in_file else r for k, r in zip(keys, snapshot["records"])]
        event = {"type": EventType.CHECKPOINT.value, "reason": reason, "level": last.get("level"),
                 "messages_tokens": tokens_out, "tokens_left": None if tokens_out is None or budget is None
                 else budget - tokens_out, "memory_size": 0,
                 "pending_tasks": list(state.working.get("pending_tasks", [])), "state": snapshot}
        return event, keys

    # -- rollback --------------------------------------------------------------------------

    def checkpoints(self, tenant: str, session: str) -> list[dict[str, Any]]:
        scans = self.writer.history(tenant, session).scans
        return [{k: v for k, v in c.items() if k != "state"} for scan in scans for c in scan.checkpoints]

    async def rollback(self, tenant: str, session: str, to_seq: int) -> SessionState:
        """The session as it was at checkpoint `to_seq`, written as a new checkpoint."""
        read = await asyncio.to_thread(self.writer.history, tenant, session)
        target = find_checkpoint(read.scans, to_seq)
        if target is None:
            seqs = [c["seq"] for scan in read.scans for c in scan.checkpoints]
            raise RollbackError(f"session {session} has no checkpoint at seq {to_seq} "
                                f"(checkpoints: {', '.join(map(str, seqs)) or 'none'})")
        state = SessionState.from_dict(_resolved_state(target, read.records, tenant, session))
        state.log_compaction({"level": "rollback", "to_seq": to_seq, "at": time.time()})
        state.wal_seq, state.wal_pending, state.wal_since_checkpoint = read.scans[-1].last_seq, [], 0
        state.wal_full_records = []  # written in full: what the old checkpoint named may be archived since
        event, full = self._checkpoint_event(state, "rollback", None, None)
        event["rolled_back_to"] = to_seq
        appended = await asyncio.to_thread(self.writer.append, tenant, session, [event], state.wal_seq, True)
        state.wal_seq, state.wal_full_records = appended.last_seq, full
        return state

    def users(self, tenant: str, session: str) -> set[str]:
        """The users the session's live log names (its turns' and its checkpoints'), read
        without changing anything."""
        found: set[str] = set()
        for event in self.writer.live(tenant, session).events:
            if isinstance(user := event.get("user"), str):
                found.add(user)
            if isinstance(state := event.get("state"), dict):
                found.update(u for u in state.get("users") or [] if isinstance(u, str))
        return found

    async def erase(self, tenant: str, session: str) -> dict[str, int]:
        """The session's log gone: live log, archives, and its rows in this gateway's SQLite mirror."""
        erased = await asyncio.to_thread(self.writer.erase, tenant, session)
        rows = await asyncio.to_thread(self.mirror.erase, tenant, session)
        return {"wal_logs": erased.live, "wal_archives": erased.archives, "wal_mirror_rows": rows}

    def prune_archives(self) -> list[str]:
        return self.writer.prune(self.config.archive_retention_days * 86400.0, time.time())

    def _damaged(self, kind: str) -> None:
        if self._on_damage is not None:
            self._on_damage(kind)

    def close(self) -> None:
        self.mirror.close()
        self.writer.close()


def _rebuild(tenant: str, session: str, found: Recovery) -> SessionState:
    state = (SessionState.from_dict(found.checkpoint["state"]) if found.checkpoint
             else SessionState(tenant, session))
    state.tenant, state.session_id = tenant, session
    for event in found.events:
        kind = event["type"]
        if kind in (EventType.USER_INPUT.value, EventType.TOOL_RESULT.value) and "index" in event:
            state.wal_logged, state.wal_logged_hash = event["index"] + 1, event.get("prefix_hash", "")
            state.note_user(event.get("user"))
        elif kind == EventType.SPECULATION.value:
            state.speculation = {k: event[k] for k in ("prefix_len", "prefix_hash", "target", "records")}
            state.speculation["logged"] = True
        elif kind == EventType.RESPONSE.value:
            state.answered_turns += 1
            state.has_attempted_reactive_compact = False  # a reply arrived: the loop guard was reset
            state.count_offset = int(event.get("count_offset") or 0)
            state.count_offset_key = str(event.get("count_offset_key") or "")
            state.count_scale = float(event.get("count_scale") or 1.0)
            state.dialect = str(event.get("dialect") or state.dialect)
            if exchange := event.get("expanded"):
                state.add_expanded(exchange["prefix_len"], exchange["prefix_hash"], exchange["messages"])
        state.turns = max(state.turns, int(event.get("turn") or 0))
    state.wal_seq, state.wal_pending = found.last_seq, []
    state.wal_since_checkpoint = len(found.events)
    return state


def _resolved_state(checkpoint: dict[str, Any], known: dict[str, dict[str, Any]], tenant: str,
                    session: str) -> dict[str, Any]:
    """A checkpoint's state with the records it names taken from those the log holds. One it
    does not hold (only if the log was damaged) is left out: the session compacts that span again."""
    state, missing = resolved(checkpoint["state"], known)
    if missing:
        log.warning("WAL %s/%s: checkpoint %s names %d compaction records no checkpoint holds; recovered "
                    "without them", tenant, session, checkpoint.get("seq"), len(missing))
    return state
