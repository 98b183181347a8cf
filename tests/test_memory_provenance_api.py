"""The memory API's provenance through a running gateway: what an API entry records, listing
by origin, source, status, session and user, bulk removal (the caller's tenant only), sharing
a captured entry with the tenant's other users, and releasing or purging a quarantined one.

Captured entries are written into the gateway's own file store by a second process (this
one), as two gateways sharing a data directory would: the store reads what another process
appended."""
from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any, Iterator

import httpx
import pytest

from ctxgate.memory.entries import Category, MemoryEntry, Provenance, Quarantine
from ctxgate.memory.file_store import FileMemoryStore
from clients import assert_error_shape, client
from servers import KEYS, Gateway, main_config, start_gateways
from upstream import ScriptedUpstream

SYSTEM = {"role": "system", "content": "You are a coding agent."}


@pytest.fixture(scope="module")
def gw(upstream: ScriptedUpstream, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    gateway = start_gateways({"prov": (tmp_path_factory.mktemp("prov"), main_config(upstream.url, "auto"))})["prov"]
    yield gateway
    gateway.stop()


def api(gw: Gateway, method: str, path: str = "", body: Any = None, key: str = KEYS["acme"]) -> httpx.Response:
    return httpx.request(method, gw.base + "/v1/ctx/memory" + path, json=body, timeout=30,
                         headers={"Authorization": f"Bearer {key}"})


def uid(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def captured(content: str, *, user: str | None, session: str, source: str = "human", tenant: str = "acme",
             category: Category = Category.PROJECT, project: str | None = "p1",
             quarantine: Quarantine | None = None) -> MemoryEntry:
    return MemoryEntry(category=category, tenant=tenant, content=content, origin="capture",
                       user=user if category == Category.USER else None,
                       project=project if category in (Category.PROJECT, Category.FEEDBACK) else None,
                       provenance=[Provenance(tenant=tenant, user=user, project=project, session=session, turn=1,
                                              door="chat", source=source, span=content)],  # type: ignore[arg-type]
                       quarantine=quarantine)


def seed(gw: Gateway, *entries: MemoryEntry) -> None:
    assert gw.data_dir is not None

    async def put() -> None:
        store = FileMemoryStore(gw.data_dir / "memory")  # type: ignore[operator]
        try:
            for entry in entries:
                await store.put(entry)
        finally:
            await store.close()
    asyncio.run(put())


def listed(gw: Gateway, query: str, key: str = KEYS["acme"]) -> set[str]:
    reply = api(gw, "GET", "?" + query, key=key)
    assert reply.status_code == 200, reply.text
    return {e["id"] for e in reply.json()["data"]}


def sent(up: ScriptedUpstream) -> str:
    """Everything the upstream was sent in the latest agent request, as text."""
    return json.dumps([c for c in up.chats() if c.body.get("model") == "gpt-4o"][-1].body["messages"])


def chat(gw: Gateway, user: str, project: str = "p1") -> None:
    """A new session's first turn: its memory block is built for it, from memory as it is now."""
    client(gw).chat.completions.create(
        model="gpt-4o", messages=[SYSTEM, {"role": "user", "content": "How do I run the tests?"}],
        extra_headers={"X-Ctx-Session": uid("s"), "X-Ctx-User": user, "X-Ctx-Project": project})


def test_an_api_entry_records_where_it_came_from(gw: Gateway) -> None:
    made = api(gw, "POST", "", {"category": "feedback", "content": "Run make test, not pytest.",
                                "scope": {"user": "u9", "project": "shop"}})
    assert made.status_code == 201, made.text
    entry = made.json()
    assert entry["status"] == "active" and entry["origin"] == "api"
    assert entry["confirmations"] == 1 and entry["shared"] is False and entry["quarantine"] is None
    [source] = entry["provenance"]
    assert source["source"] == "api" and source["door"] == "api"
    assert (source["user"], source["project"]) == ("u9", "shop")
    assert "tenant" not in source and "tenant" not in entry
    again = [e for e in api(gw, "GET", "?origin=api&user=u9").json()["data"] if e["id"] == entry["id"]]
    assert again == [entry]


def test_listing_filters_by_origin_source_status_session_and_user(gw: Gateway) -> None:
    ua, ub, sa, sb = uid("ua"), uid("ub"), uid("sa"), uid("sb")
    human = captured("The shop uses Postgres 16.", user=ua, session=sa)
    tool = captured("Fetched page says run setup.sh.", user=ub, session=sb, source="tool_output",
                    quarantine=Quarantine(reason="consolidation failed"))
    legacy = MemoryEntry(category=Category.REFERENCE, tenant="acme", content="Stored before provenance.",
                         origin="capture")
    seed(gw, human, tool, legacy)
    mine = api(gw, "POST", "", {"category": "user", "content": "Likes tabs.", "scope": {"user": ua}}).json()["id"]
    ours = {human.id, tool.id, legacy.id, mine}

    assert listed(gw, "origin=capture") & ours == {human.id, tool.id, legacy.id}
    assert listed(gw, "origin=api") & ours == {mine}
    assert listed(gw, "source=tool_output") & ours == {tool.id}
    assert listed(gw, "source=human") & ours == {human.id}
    assert listed(gw, "status=quarantined") & ours == {tool.id, legacy.id}
    assert listed(gw, "status=active") & ours == {human.id, mine}
    assert listed(gw, f"session={sa}") == {human.id}
    assert listed(gw, f"user={ua}") == {human.id, mine}  # the owner's sighting, and the user scope
    assert listed(gw, f"user={ub}&status=quarantined") == {tool.id}
    assert listed(gw, f"user={ub}&status=active") == set()
    shown = {e["id"]: e for e in api(gw, "GET", f"?session={sb}").json()["data"]}
    assert shown[tool.id]["status"] == "quarantined"
    assert shown[tool.id]["quarantine"]["reason"] == "consolidation failed"
    assert shown[tool.id]["provenance"][0]["span"] == "Fetched page says run setup.sh."
    assert listed(gw, f"session={sa}", key=KEYS["relay"]) == set()  # another tenant sees none of it


@pytest.mark.parametrize("query", ["origin=dream", "source=web", "status=gone", "session=a%20b", "session=..x",
                                   "user=%2Fetc"])
def test_a_bad_filter_is_a_400_naming_it(gw: Gateway, query: str) -> None:
    name = query.split("=")[0]
    for method in ("GET", "DELETE"):
        reply = api(gw, method, "?" + query)
        assert_error_shape(reply, 400)
        assert reply.json()["error"]["param"] == name


def test_bulk_removal_takes_a_filter_and_reaches_the_callers_tenant_only(gw: Gateway) -> None:
    session, user = uid("bulk"), uid("ub")
    acme = [captured(f"Fact {i} of the bulk session.", user=user, session=session) for i in range(3)]
    relay = captured("Relay's fact of a session with the same id.", user=user, session=session, tenant="relay")
    kept = captured("Another session's fact.", user=user, session=uid("other"))
    seed(gw, *acme, relay, kept)
    assert_error_shape(api(gw, "DELETE", ""), 400, "filter_required")
    assert_error_shape(api(gw, "DELETE", f"?sesion={session}"), 400)  # a typo never widens what goes
    assert listed(gw, f"session={session}") == {e.id for e in acme}

    gone = api(gw, "DELETE", f"?session={session}")
    assert gone.status_code == 200, gone.text
    assert gone.json()["deleted"] == 3 and set(gone.json()["ids"]) == {e.id for e in acme}
    assert listed(gw, f"session={session}") == set()
    assert listed(gw, f"session={session}", key=KEYS["relay"]) == {relay.id}
    assert listed(gw, f"user={user}") == {kept.id}
    assert api(gw, "DELETE", f"?session={session}").json()["deleted"] == 0


def test_purging_the_quarantined_entries_of_a_user(gw: Gateway) -> None:
    user = uid("uq")
    raw = [captured(f"Raw candidate {i}.", user=user, session=uid("s"), source="tool_output",
                    quarantine=Quarantine(reason="consolidation timed out")) for i in range(2)]
    vetted = captured("A vetted fact.", user=user, session=uid("s"))
    seed(gw, *raw, vetted)
    gone = api(gw, "DELETE", f"?status=quarantined&user={user}").json()
    assert gone["deleted"] == 2
    assert listed(gw, f"user={user}") == {vetted.id}


def test_sharing_a_captured_entry_with_the_tenants_other_users(gw: Gateway, up: ScriptedUpstream) -> None:
    owner, other = uid("own"), uid("oth")
    fact = captured(f"Project p1 deploys with deploy-{owner}.sh.", user=owner, session=uid("s"))
    seed(gw, fact)
    chat(gw, owner)
    assert fact.content in sent(up)
    chat(gw, other)
    assert fact.content not in sent(up)  # its owner's only

    shared = api(gw, "PATCH", f"/{fact.id}", {"shared": True})
    assert shared.status_code == 200 and shared.json()["shared"] is True
    chat(gw, other)
    assert fact.content in sent(up)

    assert api(gw, "PATCH", f"/{fact.id}", {"shared": False}).json()["shared"] is False
    chat(gw, other)
    assert fact.content not in sent(up)
    assert_error_shape(api(gw, "PATCH", f"/{fact.id}", {"shared": "yes"}), 400)
    assert_error_shape(api(gw, "PATCH", f"/{fact.id}", {"shared": True}, key=KEYS["relay"]), 404, "memory_not_found")


def test_releasing_a_quarantined_entry_lets_it_be_injected(gw: Gateway, up: ScriptedUpstream) -> None:
    user = uid("rel")
    raw = captured(f"The staging host is stage-{user}.", user=user, session=uid("s"),
                   quarantine=Quarantine(reason="consolidation failed", attempts=2))
    legacy = MemoryEntry(category=Category.PROJECT, tenant="acme", project="p1", origin="capture",
                         content=f"Legacy fact for {user}.")
    seed(gw, raw, legacy)
    chat(gw, user)
    assert raw.content not in sent(up)  # stored, never injected
    assert_error_shape(api(gw, "PATCH", f"/{raw.id}", {"status": "quarantined"}), 400)

    released = api(gw, "PATCH", f"/{raw.id}", {"status": "active"})
    assert released.status_code == 200, released.text
    assert released.json()["status"] == "active" and released.json()["quarantine"] is None
    assert released.json()["provenance"][0]["session"] == raw.provenance[0].session  # its sources are kept
    chat(gw, user)
    assert raw.content in sent(up)

    vouched = api(gw, "PATCH", f"/{legacy.id}", {"status": "active"}).json()
    assert vouched["status"] == "active" and [p["source"] for p in vouched["provenance"]] == ["api"]


def test_the_dashboard_shows_where_each_entry_came_from(gw: Gateway) -> None:
    session, user = uid("dash"), uid("ud")
    raw = captured("Raw from a tool.", user=user, session=session, source="tool_output",
                   quarantine=Quarantine(reason="consolidation failed"))
    seed(gw, raw)
    reply = httpx.get(gw.base + "/v1/ctx/dashboard/memory", headers={"Authorization": f"Bearer {KEYS['acme']}"},
                      timeout=30)
    assert reply.status_code == 200, reply.text
    [row] = [e for e in reply.json()["data"] if e["id"] == raw.id]
    assert (row["source"], row["session"], row["status"], row["owner"]) == ("tool_output", session, "quarantined", user)
    assert row["quarantine"]["reason"] == "consolidation failed" and row["provenance"][0]["span"] == raw.content
    assert "tenant" not in row["provenance"][0]
