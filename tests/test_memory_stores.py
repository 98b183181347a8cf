"""The LongTermStore contract, the same tests over the three backends: JSON files on
tmp_path, Redis on a real redis-server, Qdrant in local mode on tmp_path with embeddings
from the scripted upstream's /v1/embeddings through litellm.aembedding.

The upstream's embeddings are hashes of the text (tests/upstream.py `_vector`): they carry
no meaning, so the vector store's "relevant" entry is the one whose text is the query.
"""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import redis.exceptions

from ctxgate.memory.entries import Category, MemoryEntry
from ctxgate.memory.file_store import FileMemoryStore
from ctxgate.memory.redis_store import RedisMemoryStore
from ctxgate.memory.store import LongTermStore
from ctxgate.memory.vector_store import QdrantMemoryStore
from upstream import ScriptedUpstream

NOW = 1_800_000_000.0
BACKENDS = ("file", "redis", "qdrant")


@dataclass
class Backend:
    name: str
    open: Callable[[], LongTermStore]
    """A new store object over the same files, Redis keys or Qdrant path."""

    @property
    def vector(self) -> bool:
        return self.name == "qdrant"


def litellm_embed(upstream: ScriptedUpstream):  # type: ignore[no-untyped-def]
    import litellm

    async def embed(texts: list[str]) -> list[list[float]]:
        reply = await litellm.aembedding(model="openai/embed-test", input=texts, api_base=upstream.url + "/v1",
                                         api_key="x")
        return [d["embedding"] for d in reply.data]

    return embed


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    if request.param == "file":
        return Backend("file", lambda: FileMemoryStore(tmp_path / "memory"))
    if request.param == "redis":
        url = request.getfixturevalue("redis_server").url
        prefix = f"test-{uuid.uuid4().hex}:mem"  # one server for the session, fresh keys per test
        return Backend("redis", lambda: RedisMemoryStore(url, prefix=prefix))
    embed = litellm_embed(request.getfixturevalue("upstream"))
    return Backend("qdrant", lambda: QdrantMemoryStore(embed, path=tmp_path / "qdrant"))


def entry(content: str, category: Category = Category.USER, tenant: str = "acme", **kw: object) -> MemoryEntry:
    kw.setdefault("created_at", NOW)
    kw.setdefault("updated_at", NOW)
    return MemoryEntry(category=category, tenant=tenant, content=content, **kw)  # type: ignore[arg-type]


async def test_put_get_replace_delete(backend: Backend) -> None:
    store = backend.open()
    try:
        e = entry("prefers tabs over spaces", data={"preferences": {"indent": "tabs"}})
        await store.put(e)
        assert await store.get("acme", e.id) == e
        changed = e.model_copy(update={"content": "prefers four spaces", "updated_at": NOW + 1})
        await store.put(changed)
        assert await store.get("acme", e.id) == changed
        assert [x.content for x in await store.list("acme")] == ["prefers four spaces"]
        assert await store.delete("acme", e.id) is True
        assert await store.get("acme", e.id) is None
        assert await store.delete("acme", e.id) is False
        assert await store.list("acme") == []
    finally:
        await store.close()


async def test_list_by_category_and_moving_an_entry(backend: Backend) -> None:
    store = backend.open()
    try:
        made = {c: [entry(f"{c.value} note {i}", c, created_at=NOW + i) for i in range(3)] for c in Category}
        for entries in made.values():
            for e in entries:
                await store.put(e)
        for c in Category:
            assert await store.list("acme", c) == made[c]
        assert len(await store.list("acme")) == 12
        moved = made[Category.USER][0].model_copy(update={"category": Category.REFERENCE})
        await store.put(moved)  # same id, another category: it leaves the first one
        assert moved not in await store.list("acme", Category.USER)
        assert moved in await store.list("acme", Category.REFERENCE)
        assert await store.get("acme", moved.id) == moved
        assert len(await store.list("acme")) == 12
    finally:
        await store.close()


async def test_tenants_never_mix(backend: Backend) -> None:
    store = backend.open()
    try:
        mine = entry("deploys with helm to the staging cluster", Category.REFERENCE, id="mem_shared")
        theirs = entry("deploys with helm to the staging cluster", Category.REFERENCE, tenant="../globex",
                       id="mem_shared")
        await store.put(mine)
        before = await store.version("../globex")
        assert await store.get("../globex", "mem_shared") is None
        assert await store.list("../globex") == []
        assert await store.search("../globex", mine.content, tuple(Category), None, None, 10, NOW) == []
        assert await store.delete("../globex", "mem_shared") is False
        assert await store.version("../globex") == before
        await store.put(theirs)
        assert await store.get("acme", "mem_shared") == mine
        assert await store.get("../globex", "mem_shared") == theirs
        assert await store.delete("../globex", "mem_shared") is True
        assert await store.get("acme", "mem_shared") == mine
        assert [e for e, _ in await store.search("acme", mine.content, tuple(Category), None, None, 10, NOW)] == [mine]
        assert await store.purge_expired("../globex", NOW + 10**9) == 0
    finally:
        await store.close()


async def test_scope_visibility(backend: Backend) -> None:
    store = backend.open()
    try:
        entries = [entry("user wide", Category.USER), entry("alice only", Category.USER, user="alice"),
                   entry("bob only", Category.USER, user="bob"),
                   entry("every project", Category.PROJECT), entry("p1 layout", Category.PROJECT, project="p1"),
                   entry("p2 layout", Category.PROJECT, project="p2"),
                   entry("p1 correction", Category.FEEDBACK, project="p1"),
                   entry("p2 correction", Category.FEEDBACK, project="p2"),
                   entry("any correction", Category.FEEDBACK),
                   entry("reference doc", Category.REFERENCE, user="bob", project="p2")]
        for e in entries:
            await store.put(e)
        everyone = {"user wide", "every project", "any correction", "reference doc"}
        expected = {("alice", "p1"): everyone | {"alice only", "p1 layout", "p1 correction"},
                    ("bob", "p2"): everyone | {"bob only", "p2 layout", "p2 correction"},
                    (None, None): everyone, ("carol", "p3"): everyone}
        for (user, project), contents in expected.items():
            found = await store.search("acme", "layout correction", tuple(Category), user, project, 100, NOW)
            assert {e.content for e, _ in found} == contents, (user, project)
        only_user = await store.search("acme", "alice", (Category.USER,), "alice", "p1", 100, NOW)
        assert {e.content for e, _ in only_user} == {"user wide", "alice only"}
    finally:
        await store.close()


async def test_expiry(backend: Backend) -> None:
    store = backend.open()
    try:
        gone = entry("used grep instead of ripgrep", Category.FEEDBACK, expires_at=NOW - 1)
        due = entry("ran tests before the build", Category.FEEDBACK, expires_at=NOW)
        lasting = entry("keep commits small", Category.FEEDBACK, expires_at=NOW + 3600)
        forever = entry("speaks French", Category.USER)
        for e in (gone, due, lasting, forever):
            await store.put(e)
        assert len(await store.list("acme")) == 4
        assert {e.id for e in await store.list("acme", now=NOW)} == {lasting.id, forever.id}
        found = await store.search("acme", "grep tests build commits", tuple(Category), None, None, 10, NOW)
        assert {e.id for e, _ in found} == {lasting.id, forever.id}
        version = await store.version("acme")
        assert await store.purge_expired("acme", NOW) == 2
        assert await store.version("acme") != version
        assert {e.id for e in await store.list("acme")} == {lasting.id, forever.id}
        version = await store.version("acme")
        assert await store.purge_expired("acme", NOW) == 0
        assert await store.version("acme") == version
        assert await store.purge_expired("acme", NOW + 3600) == 1
        assert [e.id for e in await store.list("acme")] == [forever.id]
    finally:
        await store.close()


async def test_version_changes_on_writes_only(backend: Backend) -> None:
    store = backend.open()
    try:
        seen = [await store.version("acme")]
        e = entry("likes short answers")
        await store.put(e)
        seen.append(await store.version("acme"))
        await store.get("acme", e.id)
        await store.list("acme")
        await store.search("acme", "short answers", tuple(Category), None, None, 5, NOW)
        await store.delete("acme", "mem_missing")
        assert await store.version("acme") == seen[-1]
        await store.put(e.model_copy(update={"content": "likes long answers"}))
        seen.append(await store.version("acme"))
        await store.delete("acme", e.id)
        seen.append(await store.version("acme"))
        assert len(set(seen)) == len(seen), seen
        assert await store.version("acme") == seen[-1]
    finally:
        await store.close()


async def test_search_ranks_the_relevant_entry_first(backend: Backend) -> None:
    store = backend.open()
    try:
        texts = ["The project uses pytest with asyncio_mode auto for its tests",
                 "Deployments go through the helm chart in deploy/k8s",
                 "The user prefers answers in French and short code blocks",
                 "Database migrations are written with alembic and run in CI",
                 "Avoid sudo: the container runs as an unprivileged user"]
        entries = [entry(t, Category.REFERENCE, updated_at=NOW + i) for i, t in enumerate(texts)]
        for e in entries:
            await store.put(e)
        # Lexical stores match words; the vector store's hash embeddings match only the text itself.
        query = texts[3] if backend.vector else "how are alembic migrations run"
        found = await store.search("acme", query, (Category.REFERENCE,), None, None, 3, NOW)
        assert found[0][0] == entries[3]
        assert len(found) == 3
        assert found[0][1] > found[1][1]
    finally:
        await store.close()


async def test_persists_across_store_objects(backend: Backend) -> None:
    store = backend.open()
    made = [entry(f"the build needs {tool}", Category.PROJECT, project="p1", created_at=NOW + i)
            for i, tool in enumerate(["cmake", "bazel", "gradle", "maven", "meson"])]
    try:
        for e in made:
            await store.put(e)
        version = await store.version("acme")
    finally:
        await store.close()
    again = backend.open()
    try:
        assert await again.list("acme") == made
        assert await again.get("acme", made[2].id) == made[2]
        assert await again.version("acme") == version
        found = await again.search("acme", made[4].content, (Category.PROJECT,), None, "p1", 1, NOW)
        assert found[0][0] == made[4]
    finally:
        await again.close()


async def test_fifty_concurrent_puts_lose_nothing(backend: Backend) -> None:
    store = backend.open()
    try:
        made = [entry(f"concurrent fact {i}", list(Category)[i % 4], created_at=NOW + i) for i in range(50)]
        await asyncio.gather(*(store.put(e) for e in made))
        assert await store.list("acme") == made
    finally:
        await store.close()


async def test_file_store_two_processes_lose_nothing(tmp_path: Path) -> None:
    script = textwrap.dedent("""
        import asyncio, sys
        from ctxgate.memory.entries import Category, MemoryEntry
        from ctxgate.memory.file_store import FileMemoryStore

        async def main(root, tag):
            store = FileMemoryStore(root)
            for i in range(60):
                await store.put(MemoryEntry(id=f"mem_{tag}_{i}", category=list(Category)[i % 4], tenant="acme",
                                            content=f"{tag} wrote fact {i}"))
        asyncio.run(main(__import__("pathlib").Path(sys.argv[1]), sys.argv[2]))
    """)
    root = tmp_path / "memory"
    procs = [subprocess.Popen([sys.executable, "-c", script, str(root), tag], env={**os.environ})
             for tag in ("one", "two")]
    assert [p.wait(120) for p in procs] == [0, 0]
    store = FileMemoryStore(root)
    ids = {e.id for e in await store.list("acme")}
    assert ids == {f"mem_{tag}_{i}" for tag in ("one", "two") for i in range(60)}


async def test_redis_replicas_see_each_others_writes(redis_server) -> None:  # type: ignore[no-untyped-def]
    prefix = f"test-{uuid.uuid4().hex}:mem"
    a, b = RedisMemoryStore(redis_server.url, prefix=prefix), RedisMemoryStore(redis_server.url, prefix=prefix)
    try:
        first = entry("runs on python 3.11")
        await a.put(first)
        assert await b.list("acme") == [first]  # b builds its cached view
        second = entry("uses uv for environments", created_at=NOW + 1)
        await a.put(second)
        assert await b.list("acme") == [first, second]  # the shared version moved: b rebuilt
        assert await b.version("acme") == await a.version("acme")
        await asyncio.gather(*(s.put(entry(f"replica {i}", created_at=NOW + 2 + i))
                               for i, s in enumerate([a, b] * 10)))
        assert len(await a.list("acme")) == len(await b.list("acme")) == 22
    finally:
        await a.close()
        await b.close()


async def test_redis_calls_beyond_the_pool_wait_for_a_connection(redis_server) -> None:  # type: ignore[no-untyped-def]
    store = RedisMemoryStore(redis_server.url, prefix=f"test-{uuid.uuid4().hex}:mem", max_connections=3)
    try:
        made = [entry(f"pooled fact {i}", created_at=NOW + i) for i in range(100)]
        await asyncio.gather(*(store.put(e) for e in made))
        lists = await asyncio.gather(*(store.list("acme") for _ in range(20)))
        assert all(found == made for found in lists)
    finally:
        await store.close()


async def test_redis_unreachable_raises_connection_error() -> None:
    from servers import free_port

    store = RedisMemoryStore(f"redis://127.0.0.1:{free_port()}/0", timeout_s=1.0)
    try:
        with pytest.raises(redis.exceptions.ConnectionError):
            await store.list("acme")
        with pytest.raises(redis.exceptions.ConnectionError):
            await store.put(entry("never stored"))
    finally:
        await store.close()


async def test_qdrant_collections_and_point_ids(tmp_path: Path, upstream: ScriptedUpstream) -> None:
    from qdrant_client import AsyncQdrantClient

    store = QdrantMemoryStore(litellm_embed(upstream), path=tmp_path / "q")
    try:
        for c in (Category.USER, Category.FEEDBACK):
            await store.put(entry(f"{c.value} entry", c, id="mem_same"))
            await store.put(entry(f"{c.value} entry", c, id="mem_same", tenant="globex"))
    finally:
        await store.close()
    client = AsyncQdrantClient(path=str(tmp_path / "q"))
    try:
        names = {c.name for c in (await client.get_collections()).collections}
        assert names == {"ctxgate_user", "ctxgate_feedback", "ctxgate_meta"}
        points, _ = await client.scroll("ctxgate_feedback", limit=10, with_payload=True)
        assert len({p.id for p in points}) == 2 and all(uuid.UUID(str(p.id)) for p in points)
        assert {p.payload["tenant"] for p in points} == {"acme", "globex"}
        assert (await client.count("ctxgate_user")).count == 0  # moved to feedback by the second put
    finally:
        await client.close()
