"""A bug in the middle of a turn changes nothing: the session transaction keeps no part of a
change that failed on an unexpected exception (the compaction it had planned, the turn it
had counted, the WAL lines it would have written), while a refusal (a domain error) still
keeps what ran before it.

The gateway runs in this process on a real socket, against the scripted upstream, driven by
the official `openai` SDK. The bug is injected by wrapping the real compactor: it plans the
turn (and so changes the session's state) and then raises, as a defect in later code would.
"""
from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml
from aiohttp import web

from ctxgate.proxy.app import create_app
from ctxgate.proxy.config import load_config
from ctxgate.proxy.gateway import Gateway
from servers import KEYS, free_port, main_config
from upstream import ScriptedUpstream

SESSION = "rollback-1"
HEADERS = {"X-Ctx-Session": SESSION}


def _conversation(turns: int) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a careful engineer."},
                                      {"role": "user", "content": "Fix the failing test in the parser."}]
    for i in range(turns):
        messages.append({"role": "assistant", "content": f"Reading part {i} of the log."})
        messages.append({"role": "user", "content": f"log part {i}: " + f"line {i} of the build output. " * 120})
    return messages


class _Bug(RuntimeError):
    pass


async def _serve(gw: Gateway) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(create_app(gw), access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}/v1"


_PER_PROCESS = ("created_at", "updated_at", "profile", "memory_scope", "memory_version")
"""Not in the WAL: set again by the next turn (a restart forgets them the same way)."""


def _lasting(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in state.items() if k not in _PER_PROCESS}


def _agent_calls(up: ScriptedUpstream) -> list[Any]:
    """The upstream calls made for the agent's turns (not the summariser's)."""
    return [c for c in up.chats() if c.body.get("model") == "gpt-4o"]


def _wal_lines(data_dir: Path) -> int:
    return sum(len(p.read_bytes().splitlines()) for p in data_dir.rglob("*.jsonl") if "wal" in p.parts)


def test_a_bug_after_planning_a_compaction_keeps_nothing_of_the_turn(up: ScriptedUpstream, tmp_path: Path) -> None:
    config_path = tmp_path / "ctxgate.yaml"
    config_path.write_text(yaml.safe_dump(main_config(up.url, "auto")))
    gw = Gateway.build(load_config(config_path), str(tmp_path / "data"))
    small, large = _conversation(2), _conversation(12)

    async def run() -> None:
        runner, url = await _serve(gw)
        client = openai.AsyncOpenAI(base_url=url, api_key=KEYS["acme"], max_retries=0, timeout=30)
        try:
            first = await client.chat.completions.with_raw_response.create(
                model="gpt-4o", messages=small, extra_headers=HEADERS)  # type: ignore[arg-type]
            assert first.headers["x-ctx-levels"] == "none"
            before = (await gw.sessions.read("acme", SESSION))
            assert before is not None
            before_state, before_wal = _lasting(before.to_dict()), _wal_lines(gw.data_dir)

            real_prepare = gw.compactor.prepare

            async def prepare_then_fail(state: Any, turn: Any) -> Any:
                plan = await real_prepare(state, turn)
                assert plan.levels, "the injected bug must come after a compaction changed the state"
                raise _Bug("a defect after planning")

            gw.compactor.prepare = prepare_then_fail  # type: ignore[method-assign]
            answered = len(_agent_calls(up))
            with pytest.raises(openai.InternalServerError) as caught:
                await client.chat.completions.create(model="gpt-4o", messages=large,  # type: ignore[arg-type]
                                                     extra_headers={**HEADERS, "X-Ctx-Budget": "3000"})
            body: Any = caught.value.body
            assert body["code"] == "internal_error" and caught.value.response.headers["x-request-id"] in \
                body["message"]
            assert len(_agent_calls(up)) == answered, "nothing may be forwarded for a failed turn"
            after = await gw.sessions.read("acme", SESSION)
            assert after is not None
            assert _lasting(after.to_dict()) == before_state, "the failed turn changed the session"
            assert _wal_lines(gw.data_dir) == before_wal, "the failed turn wrote to the WAL"

            gw.compactor.prepare = real_prepare  # type: ignore[method-assign]
            again = await client.chat.completions.with_raw_response.create(
                model="gpt-4o", messages=large, extra_headers={**HEADERS, "X-Ctx-Budget": "3000"})  # type: ignore
            assert again.headers["x-ctx-levels"] != "none"
            state = await gw.sessions.read("acme", SESSION)
            assert state is not None and state.turns == before_state["turns"] + 1 and state.records
        finally:
            await client.close()
            await runner.cleanup()
            await gw.close()

    asyncio.run(run())
