"""Budget decisions in the provider's own count: the `usage.prompt_tokens` of a session's
last reply anchors the next turn's count, so a provider that counts less than ctxgate
(here: the tools schema left out) is not compacted early, and one that counts more (its
own framing) is compacted before it refuses the request."""
from __future__ import annotations

import uuid
from typing import Any

import openai

from clients import client
from ctxgate.pipeline.config import PipelineConfig
from ctxgate.pipeline.tokens import TokenizerRegistry
from ctxgate.proxy.engine.compaction import fingerprints_of
from ctxgate.proxy.engine.turn_budget import Turn, limit_of, measured_calibration, provider_offset
from ctxgate.proxy.engine.state import SessionState
from pipeline_builders import Message, counter, filler, system, tool_turn, user
from servers import KEYS, Gateway
from upstream import ScriptedUpstream

BUDGET = 4000
TRIGGER = 0.85 * PipelineConfig().effective_budget(BUDGET)
WIDE_TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": f"tool_{i}", "description": filler(120, 500 + i),
                                      "parameters": {"type": "object", "properties": {}}}} for i in range(12)]


def _send(gw: Gateway, session: str, messages: list[Message], tools: list[dict[str, Any]] | None = None) -> Any:
    params: dict[str, Any] = {"tools": tools} if tools else {}
    raw = client(gw).chat.completions.with_raw_response.create(
        model="gpt-4o", messages=messages, extra_headers={"X-Ctx-Budget": str(BUDGET), "X-Ctx-Session": session},
        **params)
    raw.parse()
    return raw.headers


def _session(gw: Gateway, session: str) -> dict[str, Any]:
    status, summary = gw.get(f"/v1/ctx/sessions/{session}", {"Authorization": f"Bearer {KEYS['acme']}"})
    assert status == 200, summary
    return summary


def _forwarded(up: ScriptedUpstream) -> list[Any]:
    """The requests the agent's turns made upstream (not the summaries)."""
    return [r for r in up.chats() if r.body.get("model") == "gpt-4o"]


def _history(tokens: int) -> list[Message]:
    """system, task and tool turns of 150 tokens up to about `tokens` (ctxgate's count)."""
    out = [system(), user("TASK: fix the failing test in src/app.py")]
    i = 0
    while counter().count_messages(out + tool_turn(i, size=150)) < tokens:
        out += tool_turn(i, size=150)
        i += 1
    return out + [user("go on")]


async def _no_summary(_: list[Message]) -> str:
    raise AssertionError("no summary here")


# -- units ------------------------------------------------------------------------------

def test_the_offset_is_bounded() -> None:
    assert provider_offset(900, 1000, 200) == -100
    assert provider_offset(900, 1000, 0) == -50  # no tools to leave out: 5% at most
    assert provider_offset(1200, 1000, 0) == 200
    # At most the tools schema and 5% fewer: a provider reporting 1 token is not believed.
    assert provider_offset(1, 1000, 300) == -(300 + 50)
    # At most 50% more.
    assert provider_offset(10_000, 1000, 0) == 500



def test_a_small_change_keeps_the_offset_in_use() -> None:
    msgs = _history(500)
    turn = Turn(messages=msgs, fingerprints=fingerprints_of(msgs), tools=None, counter=counter(),
                config=PipelineConfig(), max_input_tokens=BUDGET, summarize=_no_summary, count_offset=-40)
    assert measured_calibration(turn, 2000, 1962) is None  # -38: the same, give or take
    assert measured_calibration(turn, 2000, 1900) == (-100, 1.0)
    assert measured_calibration(turn, 2000, 0) is None  # no usage figure


def test_an_estimate_is_calibrated_by_a_scale_not_an_offset() -> None:
    """The bytes / 3 estimate's error grows with the text: measured on a whole history, an
    offset would over-correct the much smaller view a compaction leaves."""
    msgs = _history(500)
    estimate = TokenizerRegistry().counter("estimate")
    turn = Turn(messages=msgs, fingerprints=fingerprints_of(msgs), tools=None, counter=estimate,
                config=PipelineConfig(), max_input_tokens=BUDGET, summarize=_no_summary)
    assert measured_calibration(turn, 20_000, 11_000) == (0, 0.55)
    assert measured_calibration(turn, 20_000, 1_000) == (0, 0.5)  # bounded
    turn.count_scale = 0.55
    assert measured_calibration(turn, 10_000, 5_540) is None  # the scale in use, give or take
    assert limit_of(SessionState("t", "s"), turn) == int(BUDGET / 0.55)  # budgets in ctxgate's own units


# -- through the gateway ------------------------------------------------------------------

def test_a_provider_that_leaves_the_tools_out_is_not_compacted_early(gateway: Gateway, up: ScriptedUpstream) -> None:
    tools_tokens = counter().count_tools(WIDE_TOOLS)
    history = _history(int(TRIGGER) - 400)
    ours = counter().count_messages(history) + tools_tokens
    assert ours > TRIGGER > counter().count_messages(history) + 100  # over the trigger only with the schema

    fresh = f"usage-fresh-{uuid.uuid4().hex[:8]}"
    assert _send(gateway, fresh, history, WIDE_TOOLS)["x-ctx-levels"] != "none"  # nothing measured yet

    measured = f"usage-measured-{uuid.uuid4().hex[:8]}"
    _send(gateway, measured, history[:2] + [user("start")], WIDE_TOOLS)
    offset = _session(gateway, measured)["count_offset"]
    assert -tools_tokens - 50 <= offset <= -tools_tokens + 50  # the upstream counts the messages only
    up.reset()
    headers = _send(gateway, measured, history, WIDE_TOOLS)
    assert headers["x-ctx-levels"] == "none"
    assert int(headers["x-ctx-tokens-out"]) == ours  # ctxgate's own count, as before
    forwarded = _forwarded(up)[-1]
    assert forwarded.body["messages"] == history  # forwarded as sent
    assert forwarded.prompt_tokens < ours  # the provider counts less than ctxgate: the decision was its


def test_other_tools_are_not_judged_by_an_offset_measured_without_them(gateway: Gateway, up: ScriptedUpstream) -> None:
    session = f"usage-tools-{uuid.uuid4().hex[:8]}"
    _send(gateway, session, [system(), user("TASK: fix it"), user("start")], WIDE_TOOLS)
    assert _session(gateway, session)["count_offset"] < 0
    history = _history(int(TRIGGER) + 200)
    assert _send(gateway, session, history)["x-ctx-levels"] != "none"  # no tools now: ctxgate's count decides


def test_a_provider_that_counts_more_is_compacted_before_it_refuses(gateway: Gateway, up: ScriptedUpstream) -> None:
    up.limit = BUDGET
    up.framing_tokens = 12  # per message, beyond OpenAI's formula
    session = f"usage-framing-{uuid.uuid4().hex[:8]}"
    messages = [system(), user("TASK: fix the failing test in src/app.py")]
    first_compaction = None
    for i in range(40):
        messages += tool_turn(i, size=150)
        try:
            headers = _send(gateway, session, messages)
        except openai.APIStatusError as e:  # pragma: no cover - the assertion below says what happened
            raise AssertionError(f"turn {i}: {e.status_code} {e.message}") from None
        if first_compaction is None and headers["x-ctx-levels"] != "none":
            first_compaction = int(headers["x-ctx-tokens-in"])
    refused = [r for r in _forwarded(up) if r.prompt_tokens > BUDGET]
    assert not refused, "the upstream never had to refuse a request"
    assert _session(gateway, session)["count_offset"] > 0
    # The first compaction came while ctxgate's own count was still below the trigger:
    # only the provider's count had crossed it.
    assert first_compaction is not None and first_compaction <= TRIGGER
