"""Session states and checkpoint events for the WAL tests of both backends."""
from __future__ import annotations

from typing import Any

from ctxgate.proxy.engine.state import CompactionRecord, SessionState


def wal_state(tenant: str = "t1", session: str = "s1", turns: int = 0, tokens_after: int = 100) -> SessionState:
    """A professional-profile session (its WAL is written) with one compaction record."""
    state = SessionState(tenant, session, turns=turns, profile="professional")
    state.records = [CompactionRecord(prefix_len=4, prefix_hash="ab" * 16,
                                      messages=[{"role": "system", "content": "x"}], levels=["snip"],
                                      tokens_before=500, tokens_after=tokens_after, created_at=1.0)]
    return state


def checkpoint_of(state: SessionState) -> dict[str, Any]:
    return {"type": "CHECKPOINT", "reason": "compaction", "state": state.to_dict()}
