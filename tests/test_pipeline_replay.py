"""End to end: recorded agent runs replayed turn by turn through a running ctxgate, in
front of an upstream that enforces a context limit as a real provider does.

Without ctxgate the replay fails with `context_length_exceeded`; through ctxgate it
completes, the upstream never receives more than its limit, every request is one a
provider accepts, the task statement survives, and the summarising model is called at
most once per compaction point.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import openai
import pytest

from ctxgate.pipeline.turns import is_valid_sequence
from clients import agent_turns, feasible_turns
from servers import KEYS, Gateway, main_config, start_gateways
from trajectories import Trajectory, openhands, swe_agent, tau_bench
from upstream import ScriptedUpstream, prompt_tokens

LIMIT_SHARE = 0.4
"""The upstream's limit, as a share of the whole trajectory: compaction must happen."""


def _pick() -> list[Trajectory]:
    """Two runs of each agent that are valid OpenAI requests, long enough that their system
    prompt and task fit the limit."""
    chosen: list[Trajectory] = []
    for runs in (openhands(), swe_agent(), tau_bench()):
        fitting = [t for t in runs if len(t.messages) >= 16 and _head_tokens(t) < prompt_tokens(t.messages) * 0.2
                   and all(is_valid_sequence(turn) for turn in _turns(t))]
        fitting.sort(key=lambda t: (-len(t.messages), t.name))
        chosen += fitting[:2]
    return chosen


def _head_tokens(t: Trajectory) -> int:
    first_user = next(i for i, m in enumerate(t.messages) if m["role"] == "user")
    return prompt_tokens(t.messages[:first_user + 1])


def _turns(t: Trajectory) -> list[list[dict[str, Any]]]:
    """The requests the agent sent before its replies, those the replay's limit can serve."""
    return feasible_turns(agent_turns(t.messages), int(prompt_tokens(t.messages) * LIMIT_SHARE))


TRAJECTORIES = _pick()


@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ScriptedUpstream, Gateway]]:
    upstream = ScriptedUpstream().start()
    base = tmp_path_factory.mktemp("replay")
    gw = start_gateways({"replay": (base, main_config(upstream.url, "auto"))})["replay"]
    yield upstream, gw
    gw.stop()
    upstream.stop()


def test_the_selection_covers_every_agent() -> None:
    sources = {t.source for t in TRAJECTORIES}
    assert sources == {"swe-gym-openhands", "swe-agent", "tau-bench"}, sources


@pytest.mark.parametrize("trajectory", TRAJECTORIES, ids=[t.name[-40:] for t in TRAJECTORIES])
def test_replay_fails_without_ctxgate_and_completes_through_it(
        limited: tuple[ScriptedUpstream, Gateway], trajectory: Trajectory) -> None:
    upstream, gw = limited
    limit = int(prompt_tokens(trajectory.messages) * LIMIT_SHARE)
    upstream.limit = limit
    upstream.reset()
    turns = _turns(trajectory)

    direct = openai.OpenAI(base_url=f"{upstream.url}/v1", api_key="sk-up", max_retries=0, timeout=30)
    refused = 0
    for messages in turns:
        try:
            direct.chat.completions.create(model="gpt-4o", messages=messages, tools=trajectory.tools)
        except openai.BadRequestError as e:
            assert e.code == "context_length_exceeded"
            refused += 1
    assert refused > 0, "the limit is too generous: the replay never overflows without ctxgate"

    upstream.reset()
    through = openai.OpenAI(base_url=gw.url, api_key=KEYS["acme"], max_retries=0, timeout=60)
    session = f"replay-{abs(hash(trajectory.name))}"
    compaction_turns = 0
    for messages in turns:
        raw = through.chat.completions.with_raw_response.create(
            model="gpt-4o", messages=messages, tools=trajectory.tools,
            extra_headers={"X-Ctx-Budget": str(limit), "X-Ctx-Session": session})
        assert raw.parse().choices, "every turn gets an answer"
        if raw.headers["x-ctx-levels"] != "none":
            compaction_turns += 1

    forwarded = [r for r in upstream.chats() if r.body and r.body.get("model") == "gpt-4o"]
    summaries = [r for r in upstream.chats() if r.body and r.body.get("model") == "summarizer"]
    assert compaction_turns > 0
    refused_through = [r for r in forwarded if r.prompt_tokens > limit]
    assert len(refused_through) <= compaction_turns, "at most one reactive retry per compaction"
    accepted = [r for r in forwarded if r.prompt_tokens <= limit]
    assert len(accepted) == len(turns)
    task = next(m for m in trajectory.messages if m["role"] == "user")
    for r in accepted:
        sent = r.body["messages"]
        assert is_valid_sequence(sent), "tool calls and results stay paired"
        assert sent[0] == trajectory.messages[0], "the system prompt is kept as sent"
        assert task in sent, "the task statement survives every compaction"
    assert len(summaries) <= compaction_turns + 1, "one summary per compaction point (plus one speculative)"


def test_overflowing_model_gets_context_exhausted_after_one_retry(limited: tuple[ScriptedUpstream, Gateway]) -> None:
    upstream, gw = limited
    upstream.limit = 0
    upstream.reset()
    cli = openai.OpenAI(base_url=gw.url, api_key=KEYS["acme"], max_retries=0, timeout=60)
    messages = TRAJECTORIES[0].messages[:6]
    with pytest.raises(openai.BadRequestError) as caught:
        cli.chat.completions.create(model="overflow", messages=messages,
                                    extra_headers={"X-Ctx-Session": "replay-overflow"})
    body = caught.value.response.json()["error"]
    assert body["code"] == "context_exhausted"
    assert body["message"].startswith("CONTEXT_EXHAUSTED")
    calls = [r for r in upstream.chats() if r.body and r.body.get("model") == "overflow"]
    assert len(calls) <= 2, "one try and one reactive retry, never a loop"


def test_compacted_prefix_is_reapplied_byte_identically(limited: tuple[ScriptedUpstream, Gateway],
                                                        tmp_path: Path) -> None:
    """Resending the same history gives the same upstream payload, with no new summary."""
    upstream, gw = limited
    trajectory = TRAJECTORIES[0]
    limit = int(prompt_tokens(trajectory.messages) * LIMIT_SHARE)
    upstream.limit = limit
    upstream.reset()
    cli = openai.OpenAI(base_url=gw.url, api_key=KEYS["acme"], max_retries=0, timeout=60)
    headers = {"X-Ctx-Budget": str(limit), "X-Ctx-Session": "replay-twice"}
    messages = _turns(trajectory)[-1]
    cli.chat.completions.create(model="gpt-4o", messages=messages, tools=trajectory.tools, extra_headers=headers)
    first = [r for r in upstream.chats() if r.body.get("model") == "gpt-4o"][-1].raw
    summaries = sum(1 for r in upstream.chats() if r.body.get("model") == "summarizer")
    cli.chat.completions.create(model="gpt-4o", messages=messages, tools=trajectory.tools, extra_headers=headers)
    second = [r for r in upstream.chats() if r.body.get("model") == "gpt-4o"][-1].raw
    assert second == first
    assert sum(1 for r in upstream.chats() if r.body.get("model") == "summarizer") == summaries
