"""Memory and the WAL through the two new front doors, as on the chat door (see
test_memory_proxy.py): a real `ctxgate serve` with memory on, in front of the scripted
upstream, driven by the official SDKs over real sockets.

- /v1/messages (anthropic SDK, an `anthropic/...` route): a stored entry reaches the upstream
  as quoted data in a user turn of its own ahead of the client's (never in `system`, which
  gets only ctxgate's fixed notice after the client's text); `metadata.user_id` picks user memory.
- /v1/responses (openai SDK, an `openai/...` route): the entry reaches the upstream as a user
  input item of its own, quoted, ahead of the client's input; `instructions` stay the client's.
- on both doors the session's WAL (`GET /v1/ctx/sessions/{id}`: turns, wal_seq) advances
  with every turn.

Every assertion reads the bodies the upstream received."""
from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

import anthropic
import httpx
import openai
import pytest

from ctxgate.memory.loader import HEADER
from ctxgate.pipeline.notes import NOTICE
from ctxgate.proxy.doors.messages_model import CONTEXT_ACK
from servers import KEYS, UPSTREAM_KEY, Gateway, launch, main_config, stop_all
from upstream import REPLY, ScriptedUpstream

KEY = KEYS["acme"]
CLAUDE = "claude-mem"
SYSTEM = "You are a careful coding agent."
INSTRUCTIONS = "Answer in one line."
MEMORY_OPEN = '<ctxgate-context source="memory">\n'


@pytest.fixture(scope="module")
def gw(upstream: ScriptedUpstream, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    config = main_config(upstream.url, "auto", memory={"dream_model": "summarizer"})
    config["model_list"].append({"model_name": CLAUDE, "model_info": {"max_input_tokens": 100_000}, "litellm_params": {
        "model": "anthropic/claude-x", "api_base": upstream.url, "api_key": UPSTREAM_KEY}})
    gateway = launch("doors-memory", Path(tmp_path_factory.mktemp("doors-memory")), config).wait_ready()
    yield gateway
    stop_all([gateway])


def new_session() -> str:
    return f"dm-{uuid.uuid4().hex[:12]}"


def remember(gw: Gateway, content: str, category: str = "project", **scope: str) -> None:
    """Store one entry for acme through the memory API, as on the chat door."""
    body: dict[str, Any] = {"category": category, "content": content}
    if scope:
        body["scope"] = scope
    made = httpx.post(gw.base + "/v1/ctx/memory", json=body, timeout=30, headers={"Authorization": f"Bearer {KEY}"})
    assert made.status_code == 201, made.text


def session_of(gw: Gateway, session: str) -> dict[str, Any]:
    status, summary = gw.get(f"/v1/ctx/sessions/{session}", {"Authorization": f"Bearer {KEY}"})
    assert status == 200, summary
    return summary  # type: ignore[no-any-return]


def received(up: ScriptedUpstream, door: str) -> dict[str, Any]:
    """The body of the last request the upstream received through `door`."""
    bodies = [r.body for r in up.log if r.door == door]
    assert bodies, f"nothing reached the upstream's {door} endpoint"
    return bodies[-1]  # type: ignore[no-any-return]


# -- Anthropic Messages ---------------------------------------------------------------------


def claude(gw: Gateway) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gw.base, api_key=KEY, max_retries=0)


def ask_claude(gw: Gateway, session: str, messages: list[dict[str, Any]], user: str | None = None) -> str:
    reply = claude(gw).messages.create(
        model=CLAUDE, max_tokens=32, system=SYSTEM, messages=messages,  # type: ignore[arg-type]
        metadata={"user_id": user} if user else anthropic.omit, extra_headers={"X-Ctx-Session": session})
    assert reply.content[0].type == "text"
    return reply.content[0].text


def system_texts(body: dict[str, Any]) -> list[str]:
    system = body.get("system")
    if isinstance(system, str):
        return [system]
    assert isinstance(system, list), system
    return [b["text"] for b in system if b.get("type") == "text"]


def memory_blocks(body: dict[str, Any]) -> list[str]:
    """The quoted memory blocks of the user turns."""
    return [b["text"] for m in body["messages"] if m["role"] == "user" and isinstance(m["content"], list)
            for b in m["content"] if b.get("type") == "text" and b["text"].startswith(MEMORY_OPEN + HEADER)]


def client_turns(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The turns without the memory block's user turn and the assistant turn ctxgate puts after it."""
    turns = body["messages"]
    if turns and isinstance(turns[0]["content"], list) and memory_blocks({"messages": turns[:1]}):
        assert turns[1] == {"role": "assistant", "content": CONTEXT_ACK}
        return turns[2:]  # type: ignore[no-any-return]
    return turns  # type: ignore[no-any-return]


def test_messages_door_carries_the_memory_block_as_quoted_data_in_a_user_turn_of_its_own(
        gw: Gateway, up: ScriptedUpstream) -> None:
    fact = f"The build runs with `make ci-{uuid.uuid4().hex[:6]}`."
    remember(gw, fact)
    assert ask_claude(gw, new_session(), [{"role": "user", "content": "How do I build this?"}]) == REPLY
    body = received(up, "messages")
    texts = system_texts(body)
    assert texts == [SYSTEM, NOTICE]  # the client's own system text, then ctxgate's fixed notice: no entry
    [block] = memory_blocks(body)
    assert fact in block
    memory, ack, question = body["messages"]
    assert memory["role"] == "user" and memory["content"][0]["text"] == block
    assert ack == {"role": "assistant", "content": CONTEXT_ACK}  # the roles alternate, nothing merged into the turn
    assert question == {"role": "user", "content": "How do I build this?"}  # the newest turn as sent


def test_messages_door_metadata_user_id_selects_user_memory(gw: Gateway, up: ScriptedUpstream) -> None:
    user, other = f"u-{uuid.uuid4().hex[:6]}", f"u-{uuid.uuid4().hex[:6]}"
    preference = f"{user} wants answers in haiku form."
    remember(gw, preference, category="user", user=user)

    ask_claude(gw, new_session(), [{"role": "user", "content": "Explain the build."}], user=user)
    assert any(preference in b for b in memory_blocks(received(up, "messages")))

    ask_claude(gw, new_session(), [{"role": "user", "content": "Explain the build."}], user=other)
    assert preference not in str(received(up, "messages"))  # another user's: not his


# -- OpenAI Responses -----------------------------------------------------------------------


def gpt(gw: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url, api_key=KEY, max_retries=0)


def ask_gpt(gw: Gateway, session: str, items: list[dict[str, Any]], user: str | None = None) -> str:
    reply = gpt(gw).responses.create(model="gpt-4o", instructions=INSTRUCTIONS, input=items,  # type: ignore[arg-type]
                                     store=False, user=user or openai.omit,
                                     extra_headers={"X-Ctx-Session": session})
    return reply.output_text


def memory_items(body: dict[str, Any]) -> list[dict[str, Any]]:
    def text(item: dict[str, Any]) -> str:
        content = item.get("content")
        if isinstance(content, str):
            return content
        return "".join(p.get("text", "") for p in content or [] if isinstance(p, dict))
    return [i for i in body["input"] if isinstance(i, dict) and text(i).startswith(MEMORY_OPEN + HEADER)]


def test_responses_door_carries_the_memory_block_as_an_input_item(gw: Gateway, up: ScriptedUpstream) -> None:
    fact = f"Deploys go through the `ship-{uuid.uuid4().hex[:6]}` pipeline."
    remember(gw, fact)
    question = {"role": "user", "content": "How do we deploy?"}
    assert ask_gpt(gw, new_session(), [question]) == REPLY
    body = received(up, "responses")
    assert body["instructions"] == INSTRUCTIONS  # still the client's, memory is not folded into them
    [item] = memory_items(body)
    assert item["role"] == "user" and fact in item["content"]  # quoted data, never a developer message
    # ctxgate's fixed notice, the memory, then the client's input, which is kept.
    assert body["input"] == [{"role": "developer", "content": NOTICE}, item, question]


def test_responses_door_user_selects_user_memory(gw: Gateway, up: ScriptedUpstream) -> None:
    user = f"u-{uuid.uuid4().hex[:6]}"
    preference = f"{user} reads diffs, not prose."
    remember(gw, preference, category="user", user=user)
    ask_gpt(gw, new_session(), [{"role": "user", "content": "What changed?"}], user=user)
    assert any(preference in i["content"] for i in memory_items(received(up, "responses")))
    ask_gpt(gw, new_session(), [{"role": "user", "content": "What changed?"}], user=f"x-{user}")
    assert not any(preference in i["content"] for i in memory_items(received(up, "responses")))


# -- the WAL on both doors ------------------------------------------------------------------


def _wal_advances(gw: Gateway, session: str, turn: Callable[[int], None]) -> None:
    seqs = []
    for n in range(1, 4):
        turn(n)
        summary = session_of(gw, session)
        assert summary["turns"] == n
        seqs.append(summary["wal_seq"])
    assert 0 < seqs[0] < seqs[1] < seqs[2], seqs  # every turn appended to the session's log


def test_messages_door_wal_advances_per_turn(gw: Gateway, up: ScriptedUpstream) -> None:
    session = new_session()
    history: list[dict[str, Any]] = []

    def turn(n: int) -> None:
        history.append({"role": "user", "content": f"step {n}"})
        history.append({"role": "assistant", "content": ask_claude(gw, session, list(history))})
        assert client_turns(received(up, "messages")) == history[:-1]

    _wal_advances(gw, session, turn)


def test_responses_door_wal_advances_per_turn(gw: Gateway, up: ScriptedUpstream) -> None:
    session = new_session()
    items: list[dict[str, Any]] = []

    def turn(n: int) -> None:
        items.append({"role": "user", "content": f"step {n}"})
        items.append({"role": "assistant", "content": ask_gpt(gw, session, list(items))})
        body = received(up, "responses")
        notice = {"role": "developer", "content": NOTICE}
        sent = [i for i in body["input"] if i not in memory_items(body) and i != notice]
        assert sent == items[:-1]

    _wal_advances(gw, session, turn)
