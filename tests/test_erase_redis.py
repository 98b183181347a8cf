"""Deleting a session's data from the stores that keep it in Redis (a real redis-server):
the stored Responses replies and the idempotent replies of that session go, another
session's stay, and a tenant's index keeps only what is left."""
from __future__ import annotations

import time
import uuid
from pathlib import Path

from ctxgate.proxy.doors.response_store import StoredResponse, open_response_store
from ctxgate.proxy.engine.idempotency import StoredReply, open_idempotency_store
from servers import RedisServer


async def test_a_sessions_stored_responses_go_from_redis_and_the_others_stay(redis_server: RedisServer,
                                                                            tmp_path: Path) -> None:
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    store = open_response_store(redis_server.url, tmp_path)
    for i in range(1200):  # more than one MGET batch
        await store.put(tenant, StoredResponse(f"resp_{i}", None, [], [], {"id": f"resp_{i}"}, time.time(),
                                               "gone" if i % 3 == 0 else "kept"))
    assert await store.erase_sessions(tenant, {"gone"}) == 400
    assert await store.get(tenant, "resp_0") is None and await store.get(tenant, "resp_1") is not None
    assert await store.erase_sessions(tenant, {"gone"}) == 0
    await store.close()


async def test_a_sessions_idempotent_replies_go_from_redis_and_the_others_stay(redis_server: RedisServer,
                                                                              tmp_path: Path) -> None:
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    store = open_idempotency_store(redis_server.url, tmp_path, 3600.0, 1000)

    def reply(session: str) -> StoredReply:
        return StoredReply("h", 200, "application/json", b"{}", {"X-Ctx-Session": session}, time.time())

    for i in range(10):
        await store.put(tenant, f"key-{i}", reply("gone" if i < 4 else "kept"))
    assert await store.erase_sessions(tenant, {"gone"}) == 4
    assert await store.get(tenant, "key-0") is None and await store.get(tenant, "key-9") is not None
    await store.close()
