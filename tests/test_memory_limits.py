"""Memory bounded (issue 14): per-tenant caps on entries and bytes, paginated lists, the
file store's append log (written off the event loop), and the one id rule on every door
and memory endpoint that names a user or project. A real `ctxgate serve` in front of the
scripted upstream, over real sockets; the stores directly on tmp_path."""
from __future__ import annotations

import asyncio
import json
import threading
import uuid
from pathlib import Path
from typing import Any, Iterator

import httpx
import orjson
import pytest
import xxhash

from ctxgate.memory.config import MemoryConfig
from ctxgate.memory.entries import Category, MemoryEntry
from ctxgate.memory.file_store import FileMemoryStore
from ctxgate.memory.capture import project_id
from ctxgate.memory.limits import BoundedStore, MemoryFull
from ctxgate.memory.manager import MemoryManager
from ctxgate.memory.short_term import BufferScope
from ctxgate.pipeline.fingerprint import message_fingerprint
from ctxgate.pipeline.provenance import message_spans
from ctxgate.proxy.ids import derived_id, is_valid_id
from ctxgate.wal.paths import safe_name
from clients import assert_error_shape
from servers import Gateway, launch, main_config, stop_all
from upstream import ScriptedUpstream

TENANTS = ("caps", "pages", "ids", "load")
SYSTEM = {"role": "system", "content": "You are a coding agent."}
BAD_IDS = ["../../etc/passwd", "ünïcødé", "x" * 256, "has space", ""]


def key(tenant: str) -> str:
    return f"sk-{tenant}"


@pytest.fixture(scope="module")
def gw(upstream: ScriptedUpstream, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    config = main_config(upstream.url, "auto", memory={"max_entries": 5, "max_bytes": 4000, "max_entry_bytes": 1000},
                         tenants={t: {"api_keys": [key(t)]} for t in TENANTS})
    gateway = launch("memory-limits", Path(tmp_path_factory.mktemp("memory-limits")), config).wait_ready()
    yield gateway
    stop_all([gateway])


@pytest.fixture(scope="module")
def roomy(upstream: ScriptedUpstream, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """Default caps, for the pages and the load."""
    config = main_config(upstream.url, "auto", tenants={t: {"api_keys": [key(t)]} for t in TENANTS})
    gateway = launch("memory-roomy", Path(tmp_path_factory.mktemp("memory-roomy")), config).wait_ready()
    yield gateway
    stop_all([gateway])


def api(gw: Gateway, tenant: str, method: str, path: str = "", body: Any = None,
        params: dict[str, Any] | None = None) -> httpx.Response:
    return httpx.request(method, gw.base + "/v1/ctx/memory" + path, json=body, params=params, timeout=30,
                         headers={"Authorization": f"Bearer {key(tenant)}"})


def listing(gw: Gateway, tenant: str) -> list[dict[str, Any]]:
    """Every entry, page by page."""
    out: list[dict[str, Any]] = []
    cursor = None
    while True:
        page = api(gw, tenant, "GET", params={"limit": 1000, **({"cursor": cursor} if cursor else {})}).json()
        out += page["data"]
        if not page["has_more"]:
            return out
        cursor = page["next_cursor"]


def add(gw: Gateway, tenant: str, content: str, **extra: Any) -> httpx.Response:
    return api(gw, tenant, "POST", body={"category": "reference", "content": content, **extra})


# -- caps ---------------------------------------------------------------------------------

def test_an_entry_over_its_size_is_413_and_changes_nothing(gw: Gateway) -> None:
    before = listing(gw, "caps")
    assert_error_shape(add(gw, "caps", "x" * 1001), 413, "memory_entry_too_large")
    assert_error_shape(add(gw, "caps", "small", data={"blob": "y" * 1000}), 413, "memory_entry_too_large")
    assert listing(gw, "caps") == before


def test_the_entry_past_the_count_cap_is_refused_and_changes_nothing(gw: Gateway) -> None:
    for entry in listing(gw, "caps"):
        api(gw, "caps", "DELETE", f"/{entry['id']}")
    made = [add(gw, "caps", f"note {i}").json() for i in range(5)]
    before = listing(gw, "caps")
    assert [e["id"] for e in before] == [e["id"] for e in made]
    error = assert_error_shape(add(gw, "caps", "one too many"), 422, "memory_full")
    assert "max_entries" in error["message"]
    assert listing(gw, "caps") == before
    api(gw, "caps", "DELETE", f"/{made[0]['id']}")
    assert add(gw, "caps", "room again").status_code == 201  # a delete makes room


def test_the_write_past_the_byte_cap_is_refused_and_changes_nothing(gw: Gateway) -> None:
    for entry in listing(gw, "caps"):
        api(gw, "caps", "DELETE", f"/{entry['id']}")
    made = [add(gw, "caps", f"{i}" * 900).json() for i in range(4)]  # 4 x 904 bytes of 4000
    before = listing(gw, "caps")
    error = assert_error_shape(add(gw, "caps", "z" * 900), 422, "memory_full")
    assert "max_bytes" in error["message"]
    # A change that grows an entry past the cap is refused too, and the entry stays as it was.
    small = add(gw, "caps", "tiny").json()
    before = listing(gw, "caps")
    assert_error_shape(api(gw, "caps", "PATCH", f"/{small['id']}", {"content": "w" * 900}), 422, "memory_full")
    assert listing(gw, "caps") == before
    assert api(gw, "caps", "PATCH", f"/{made[0]['id']}", {"content": "shorter"}).status_code == 200


def test_racing_writes_stop_exactly_at_the_cap(gw: Gateway) -> None:
    for entry in listing(gw, "caps"):
        api(gw, "caps", "DELETE", f"/{entry['id']}")
    statuses: list[int] = []
    racers = [threading.Thread(target=lambda i=i: statuses.append(add(gw, "caps", f"racer {i}").status_code))
              for i in range(12)]
    for t in racers:
        t.start()
    for t in racers:
        t.join()
    assert sorted(statuses) == [201] * 5 + [422] * 7
    assert len(listing(gw, "caps")) == 5


# -- pages --------------------------------------------------------------------------------

def test_walking_every_page_misses_and_repeats_nothing(roomy: Gateway) -> None:
    made = [add(roomy, "pages", f"page note {i}").json()["id"] for i in range(23)]
    first = api(roomy, "pages", "GET").json()
    assert first["object"] == "list" and len(first["data"]) == 23 and first["has_more"] is False
    assert first["next_cursor"] is None
    seen: list[str] = []
    cursor = None
    deleted = None
    while True:
        page = api(roomy, "pages", "GET", params={"limit": 5, **({"cursor": cursor} if cursor else {})}).json()
        assert len(page["data"]) <= 5
        seen += [e["id"] for e in page["data"]]
        if not page["has_more"]:
            assert page["next_cursor"] is None
            break
        cursor = page["next_cursor"]
        if deleted is None:  # an entry removed mid-walk, right at the cursor, shifts nothing
            deleted = seen[-1]
            api(roomy, "pages", "DELETE", f"/{deleted}")
    assert seen == made and len(set(seen)) == len(seen)
    filtered = api(roomy, "pages", "GET", params={"category": "user", "limit": 2}).json()
    assert filtered["data"] == [] and filtered["has_more"] is False


@pytest.mark.parametrize("params", [{"limit": "0"}, {"limit": "1001"}, {"limit": "ten"}, {"cursor": "nope"},
                                   {"cursor": "W10"}])
def test_bad_page_parameters_are_400(roomy: Gateway, params: dict[str, str]) -> None:
    assert_error_shape(api(roomy, "pages", "GET", params=params), 400)


# -- the file store's log -------------------------------------------------------------------

def test_writes_while_healthz_answers(roomy: Gateway) -> None:
    """Writes of 10 KB entries from 4 threads while /healthz is polled: every poll answers and
    every entry is there, exactly, afterwards (also in a new store reading the same files)."""
    health: list[int] = []
    stop = threading.Event()

    def poll() -> None:
        with httpx.Client(timeout=30) as c:
            while not stop.is_set():
                health.append(c.get(roomy.base + "/healthz").status_code)

    def write(worker: int) -> list[tuple[str, str]]:
        done = []
        for i in range(15):
            content = f"{worker}-{i} " + uuid.uuid4().hex * 300
            made = add(roomy, "load", content)
            assert made.status_code == 201, made.text
            done.append((made.json()["id"], content))
        return done

    poller = threading.Thread(target=poll)
    poller.start()
    results: list[list[tuple[str, str]]] = [[] for _ in range(4)]
    writers = [threading.Thread(target=lambda w=w: results.__setitem__(w, write(w))) for w in range(4)]
    for t in writers:
        t.start()
    for t in writers:
        t.join()
    stop.set()
    poller.join()
    assert health and set(health) == {200}
    written = dict(pair for r in results for pair in r)
    assert len(written) == 60
    assert {e["id"]: e["content"] for e in listing(roomy, "load")} == written
    assert roomy.data_dir is not None
    files = list((roomy.data_dir / "memory" / "load").glob("*.json*"))
    assert [f.name for f in files] == ["reference.jsonl"]
    reread = asyncio.run(FileMemoryStore(roomy.data_dir / "memory").list("load"))
    assert {e.id: e.content for e in reread} == written


def _entry(content: str, tenant: str = "t", category: Category = Category.REFERENCE, **kw: Any) -> MemoryEntry:
    return MemoryEntry(category=category, tenant=tenant, content=content, **kw)


def test_the_log_is_appended_compacted_and_read_incrementally(tmp_path: Path) -> None:
    async def run() -> None:
        writer, reader = FileMemoryStore(tmp_path), FileMemoryStore(tmp_path)  # two processes' views
        entry = _entry("v0")
        await writer.put(entry)
        assert (await reader.get("t", entry.id)).content == "v0"  # type: ignore[union-attr]
        log = tmp_path / "t" / "reference.jsonl"
        for i in range(1, 300):  # the same entry rewritten: dead lines, compacted away
            entry.content = f"v{i}"
            await writer.put(entry)
            assert (await reader.get("t", entry.id)).content == f"v{i}"  # type: ignore[union-attr]
        assert log.read_bytes().count(b"\n") <= 66
        gone = _entry("short-lived")
        await reader.put(gone)
        assert await writer.delete("t", gone.id)
        assert [e.content for e in await FileMemoryStore(tmp_path).list("t")] == ["v299"]

    asyncio.run(run())


def test_a_torn_line_and_an_old_whole_file_are_read(tmp_path: Path) -> None:
    old = _entry("from the old format")
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "reference.json").write_bytes(orjson.dumps([old.model_dump(mode="json")]))

    async def run() -> None:
        store = FileMemoryStore(tmp_path)
        assert [e.content for e in await store.list("t")] == ["from the old format"]
        new = _entry("after the crash")
        (tmp_path / "t" / "reference.jsonl").write_bytes(b'{"put": {"id": "torn')  # a crash mid-line
        await store.put(new)
        assert {e.content for e in await FileMemoryStore(tmp_path).list("t")} == {"from the old format",
                                                                                "after the crash"}

    asyncio.run(run())


# -- capture and the caps -------------------------------------------------------------------

def test_capture_evicts_the_oldest_captured_entries_never_the_apis(tmp_path: Path) -> None:
    config = MemoryConfig(max_entries=3, max_bytes=10_000)

    async def run() -> None:
        api_view = BoundedStore(FileMemoryStore(tmp_path), config)
        captured = api_view.capturing()
        await api_view.put(_entry("the client's", updated_at=1.0))
        for i in range(2):
            await captured.put(_entry(f"captured {i}", updated_at=10.0 + i))
        with pytest.raises(MemoryFull):
            await api_view.put(_entry("refused"))
        await captured.put(_entry("captured 2", updated_at=20.0))
        assert sorted(e.content for e in await api_view.list("t")) == ["captured 1", "captured 2", "the client's"]
        assert {e.origin for e in await api_view.list("t")} == {"api", "capture"}
        full = BoundedStore(FileMemoryStore(tmp_path / "b"), MemoryConfig(max_entries=1))
        await full.put(_entry("the client's"))
        await full.capturing().put(_entry("skipped"))  # only an API entry to evict: skipped
        assert [e.content for e in await full.list("t")] == ["the client's"]

    asyncio.run(run())


def test_a_session_end_past_the_cap_evicts_the_oldest_captured_entry(tmp_path: Path) -> None:
    """Through the manager: auto-dream writes the session's correction (feedback, verbatim)
    through the capture view, which makes room by evicting the oldest captured entry."""
    async def summarize(model: str, messages: list[dict[str, Any]]) -> str:
        return "unused: feedback needs no model"

    async def dreamt(key: Any, event: dict[str, Any]) -> None:
        return None

    async def run() -> list[MemoryEntry]:
        manager = MemoryManager(FileMemoryStore(tmp_path), MemoryConfig(max_entries=3, triggers=["B"]), summarize,
                                dreamt)
        await manager.store.put(_entry("the client's", updated_at=1.0))
        for i in range(2):
            await manager.store.capturing().put(_entry(f"captured {i}", updated_at=10.0 + i))
        messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "Write the test."},
                    {"role": "assistant", "content": "I used unittest for the new test."},
                    {"role": "user", "content": "No, use pytest instead of unittest, that is our code style."}]
        manager.observe(("t", "s1"), BufferScope(None, "p1", "professional", None), messages,
                        [message_fingerprint(m) for m in messages], lambda text, tokens: text,
                        lambda unseen: message_spans(messages, unseen))
        await manager.idle_tasks()
        await manager.end_session(("t", "s1"))
        return await manager.store.list("t")

    kept = asyncio.run(run())
    assert len(kept) == 3 and [e.content for e in kept[:2]] == ["the client's", "captured 1"]
    assert kept[2].category == Category.FEEDBACK and kept[2].origin == "capture"


# -- the one id rule ------------------------------------------------------------------------

def _headers(headers: dict[str, str]) -> dict[str, bytes]:
    return {k: v.encode() for k, v in headers.items()}  # unicode goes out as UTF-8 bytes


def _chat(gw: Gateway, headers: dict[str, str] | None = None, user: Any = None) -> httpx.Response:
    body: dict[str, Any] = {"model": "gpt-4o", "messages": [SYSTEM, {"role": "user", "content": "Hi"}]}
    if user is not None:
        body["user"] = user
    return httpx.post(gw.base + "/v1/chat/completions", json=body, timeout=30,
                      headers={"Authorization": f"Bearer {key('ids')}", **_headers(headers or {})})


def _door(gw: Gateway, door: str, headers: dict[str, str]) -> httpx.Response:
    if door == "messages":
        return httpx.post(gw.base + "/v1/messages", timeout=30, headers={"x-api-key": key("ids"), **_headers(headers)},
                          json={"model": "gpt-4o", "max_tokens": 10, "messages": [{"role": "user", "content": "Hi"}]})
    return httpx.post(gw.base + "/v1/responses", json={"model": "gpt-4o", "input": "Hi"}, timeout=30,
                      headers={"Authorization": f"Bearer {key('ids')}", **_headers(headers)})


def _refused(resp: httpx.Response, code: str, value: str) -> None:
    assert resp.status_code == 400, resp.text[:300]
    error = resp.json()["error"]
    assert error["code" if "code" in error else "type"] in (code, "invalid_request_error")
    assert len(error["message"]) < 400  # the value is quoted at most 200 characters long
    if value.isascii():
        assert repr(value[:197] + "..." if len(value) > 200 else value) in error["message"]


@pytest.mark.parametrize("value", BAD_IDS[:4])
@pytest.mark.parametrize("header,code", [("X-Ctx-User", "invalid_user"), ("X-Ctx-Project", "invalid_project"),
                                         ("X-Ctx-Session", "invalid_session")])
def test_a_bad_id_header_is_400_on_every_door(gw: Gateway, header: str, code: str, value: str) -> None:
    _refused(_chat(gw, {header: value}), code, value)
    for door in ("messages", "responses"):
        _refused(_door(gw, door, {header: value}), code, value)


@pytest.mark.parametrize("value", BAD_IDS)
def test_a_bad_scope_or_filter_id_is_400_and_changes_nothing(gw: Gateway, value: str) -> None:
    before = listing(gw, "ids")
    for what in ("user", "project"):
        category = "user" if what == "user" else "project"
        resp = api(gw, "ids", "POST", body={"category": category, "content": "x", "scope": {what: value}})
        _refused(resp, f"invalid_{what}", value)
        if value:
            _refused(api(gw, "ids", "GET", params={what: value}), f"invalid_{what}", value)
    made = api(gw, "ids", "POST", body={"category": "user", "content": "kept", "scope": {"user": "u1"}}).json()
    _refused(api(gw, "ids", "PATCH", f"/{made['id']}", {"scope": {"user": value}}), "invalid_user", value)
    assert api(gw, "ids", "DELETE", f"/{made['id']}").status_code == 200
    assert listing(gw, "ids") == before


@pytest.mark.parametrize("value", [*BAD_IDS, "ok", "a.b@c:d-e_f", "x" * 128, "x" * 129, "-lead", "a..b", "ü"])
def test_the_rule_is_one_rule_in_every_layer(value: str) -> None:
    """The proxy's rule, the storage layers' backstop and the derived ids agree."""
    assert is_valid_id(value) == (safe_name(value) == value) == (derived_id(value) == value)
    assert is_valid_id(derived_id(value)) and is_valid_id(project_id("/" + value))
    assert project_id("/workspace/shop") == "workspace:shop"


def test_the_body_user_is_free_form_and_hashed_into_an_id(gw: Gateway, up: ScriptedUpstream) -> None:
    """OpenAI's `user` is whatever the client's end-user id is: never refused; one that breaks
    the rule is the memory user `h-<xxh3_128 of it>`, one that follows it is itself."""
    odd = "Ada Lovelace ../ ü"
    hashed = "h-" + xxhash.xxh3_128_hexdigest(odd.encode())
    for user, fact in ((hashed, "Ada writes in Esperanto."), ("ada@example.com", "Ada signs as A.L.")):
        made = api(gw, "ids", "POST", body={"category": "user", "content": fact, "scope": {"user": user}})
        assert made.status_code == 201, made.text
    for user, fact, other in ((odd, "Esperanto", "A.L."), ("ada@example.com", "A.L.", "Esperanto"),
                              ("x" * 300, None, None)):
        up.reset()
        resp = _chat(gw, {"X-Ctx-Session": "ids-" + uuid.uuid4().hex[:8]}, user=user)
        assert resp.status_code == 200, resp.text[:300]
        sent = json.dumps(up.chats()[-1].body["messages"])
        if fact is not None:
            assert fact in sent and other not in sent
        else:
            assert "Esperanto" not in sent and "A.L." not in sent
    up.reset()
    resp = httpx.post(gw.base + "/v1/responses", json={"model": "gpt-4o", "input": "Hi", "user": odd}, timeout=30,
                      headers={"Authorization": f"Bearer {key('ids')}"})
    assert resp.status_code == 200, resp.text[:300]
    assert "Esperanto" in json.dumps([r.body for r in up.log][-1])
