"""The Responses door's store on its own: a live chain survives the tenant's bound."""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from ctxgate.proxy.doors import response_store
from ctxgate.proxy.doors.response_store import StoredResponse, open_response_store


def _stored(i: int) -> StoredResponse:
    return StoredResponse(f"resp_{i}", f"resp_{i - 1}" if i else None, [{"role": "user", "content": f"turn {i}"}],
                          [{"type": "message", "role": "assistant", "content": "ok"}], {"id": f"resp_{i}"},
                          time.time(), "s")


async def test_a_chain_in_use_is_not_pruned_by_the_tenants_bound(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The store drops a tenant's least recently used responses beyond its bound; a walk
    refreshes every link, so a long live conversation keeps resolving while one-off
    responses of other agents go first."""
    monkeypatch.setattr(response_store, "MAX_PER_TENANT", 10)
    monkeypatch.setattr(response_store, "_PRUNE_EVERY", 1)
    store = open_response_store("memory", tmp_path)
    for i in range(8):
        await store.put("t", _stored(i))
        items, session = await store.conversation("t", f"resp_{i}")
        assert [m["content"] for m in items if m["role"] == "user"] == [f"turn {k}" for k in range(i + 1)]
        await store.put("t", StoredResponse(f"other_{i}", None, [], [], {}, time.time(), None))
    assert session == "s"
    assert await store.get("t", "other_0") is None  # the one-off responses went
    await store.close()
    restarted = open_response_store("memory", tmp_path)  # no in-process copy: every link from the files
    items, _ = await restarted.conversation("t", "resp_7")
    assert len([m for m in items if m["role"] == "user"]) == 8
    await restarted.close()
