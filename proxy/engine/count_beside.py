"""A new conversation counted beside its upstream call.

A count decides nothing for a new conversation far below the trigger, and neither does its
log: with the session's transaction that writes it (a new WAL file: a folder made, a file
opened and locked), they are most of what such a turn costs before it is forwarded, 1-2 ms of
a new 1K-token conversation on a machine woken from idleness. So such a turn, of any size, is
forwarded uncounted, and counted (in a thread when large) and logged once its bytes are on
their way; its WAL lines, `X-Ctx-Tokens-In`/`-Out` and calibration wait for the count, and its
reply (or its error) waits for them. A log that cannot be written then fails after the forward:
the reply is answered and the failure logged; from then on, until an append of the tenant's
succeeds, its new conversations are logged before they are forwarded (`Journal.failing`), so
they are refused with nothing forwarded, as its other turns are. Kept apart from `turn.py`
because it is its own rule with its own waits: which turn goes uncounted, when the session
takes that back, the count and the turn's logging once it is in, and a stream's headers
held for it. `TurnEngine` calls these at its points.
"""
from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Awaitable, Callable

from ctxgate.pipeline.history_index import HistoryIndex
from ctxgate.pipeline.tokens import TokenCounter
from ..errors import GatewayError
from ..upstream.forwarders import Reply
from .off_loop import count_off_loop
from .quiet import QUIET
from .state import SessionState
from .turn_budget import Plan, Turn, budget_of, watermark

if TYPE_CHECKING:
    from ..gateway import Gateway

log = logging.getLogger("ctxgate.turn")


def beside_upstream(counted: int, bound: int | None, counter: TokenCounter) -> bool:
    """A new conversation (none of its messages counted, not even by another replica) with a
    bytes bound, for a tokenizer the bound holds for: counted once forwarded, unless its
    session may compact (`may_compact`)."""
    return counted == 0 and bound is not None and counter.byte_bounded


def may_compact(state: SessionState, turn: Turn, bound: int | None) -> bool:
    """The session has state, or the bound with the memory block reaches the watermark: the
    turn is counted before it is planned after all."""
    return not (_fresh(state) and bound is not None and bound + turn.reserved_tokens <= watermark(turn, state))


def count_beside(gw: "Gateway", tenant: str, session_id: str, turn: Turn, number: int, plan: Plan,
                 body_bytes: int, index: HistoryIndex, fingerprinted: Callable[[], Awaitable[HistoryIndex]],
                 headers: dict[str, str], counted: Callable[[], None]) -> "asyncio.Task[None]":
    """Start the count of a turn forwarded uncounted (`ctxgate_counts_beside_upstream_total`).
    `number`: the turn's in its session (it is logged as that turn, whatever turns of the
    session were planned meanwhile). `index`: what is known of its messages; when it does not
    hold them all, `fingerprinted()` takes their fingerprints once the turn is forwarded (they
    decide nothing it sends).
    `counted` reports the count and keeps the index, as for a counted turn. Awaited by
    `settle`, so an answered turn is in the WAL before its reply is, and calibrated with its count."""
    gw.metrics.counts_beside_upstream.inc()
    return asyncio.ensure_future(_count(gw, tenant, session_id, turn, number, plan, body_bytes, index,
                                        fingerprinted, headers, counted))


async def before_headers(counting: "asyncio.Task[None]", reply: Reply) -> None:
    """A stream's headers leave with its first bytes and carry the exact count, which the
    upstream's time to answer has hidden; a whole reply's wait for it is `settle`'s. The
    upstream's reply is closed if the wait is cancelled or the count fails."""
    try:
        await asyncio.shield(counting)
    except BaseException:
        if reply.close is not None:
            reply.close()
        raise


async def _count(gw: "Gateway", tenant: str, session_id: str, turn: Turn, number: int, plan: Plan,
                 body_bytes: int, index: HistoryIndex, fingerprinted: Callable[[], Awaitable[HistoryIndex]],
                 headers: dict[str, str], counted: Callable[[], None]) -> None:
    """Fingerprint and count the turn (in a thread when large, beside the upstream call), then log its
    messages as `prepare` logs a counted turn's. The reply waits for all of it; a large turn's
    background work in threads waits meanwhile (`QUIET`)."""
    messages = turn.messages

    async def count_and_log() -> None:
        nonlocal index
        if len(index) != len(messages):
            index = await fingerprinted()
            turn.fingerprints = index.fingerprints
        turn.index = await count_off_loop(index, messages, turn.counter, body_bytes)
        tokens_out = plan.tokens_out = turn.message_tokens() + turn.fixed_tokens()
        counted()
        headers["X-Ctx-Tokens-Out"] = str(tokens_out)
        async with gw.sessions.transaction(tenant, session_id) as tx:
            # The log takes what it has not seen of these messages (all of them after another
            # request of the session logged other ones, none after this one's retry or its
            # fallback model's attempt); unless it holds a longer history of the session already.
            if tx.state.wal_logged <= len(messages):
                tx.write_log = lambda s: gw.journal.log_request(s, turn, tokens_out, budget_of(s, turn), number)

    try:
        # One turn of the event loop first: `forward` writes the request (aiohttp's task for
        # its body runs) before the count takes a core, so it adds nothing to the time the
        # upstream starts at. A large turn's whole count and log hold background threads back
        # (a capture's regular expressions would take the GIL from them); a small one's take
        # less than the hold would cost.
        await asyncio.sleep(0)
        large = body_bytes > turn.counter.inline_count_bytes
        await (QUIET.around(count_and_log()) if large else count_and_log())
    except Exception as e:  # forwarded already: the reply is answered rather than lost
        log.error("session %s: the turn was forwarded, and could not be logged: %s", session_id,
                  e.message if isinstance(e, GatewayError) else repr(e))


def _fresh(state: SessionState) -> bool:
    """A session with nothing in it yet: no turn, no log, no compaction to re-apply."""
    return state.turns == 0 and state.wal_seq == 0 and not state.records and not state.speculation
