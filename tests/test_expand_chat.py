"""Reversible compaction on the Chat Completions door, through a real `ctxgate serve` with
the `openai` SDK: the model asks for what was cut through the gateway's own tool, the
gateway answers it and asks again, and the agent gets only the final answer."""
from __future__ import annotations

import json
import re
import uuid
from pathlib import Path
from typing import Any, Iterator

import openai
import pytest

from ctxgate.pipeline.config import PipelineConfig
from servers import KEYS, METRICS_HEADERS, Gateway, _model, launch, main_config, run_ctxgate, stop_all
from upstream import EXPAND_TOOL, REPLY, Received, ScriptedUpstream

MARKER = "MIDDLE-MARKER-4242"
BUDGET = {"X-Ctx-Budget": "6000"}
TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}}}}]
OTHER_KEY = "sk-other"
REF = re.compile(r"ref (ctx:[0-9a-f]{12})")


def expand_config(upstream: ScriptedUpstream) -> dict[str, Any]:
    config = main_config(upstream.url, "auto")
    base = f"{upstream.url}/v1"
    config["model_list"] += [_model(name, base, max_input_tokens=128_000)
                             for name in ("gpt-4o-expand", "gpt-4o-expand-mixed", "gpt-4o-expand-greedy")]
    tenants = config["ctxgate"]["tenants"]
    tenants["acme"]["allow_overrides"] = ["profile", "budget", "expand"]
    tenants["other"] = {"api_keys": [OTHER_KEY], "allow_overrides": ["budget"]}
    return config


@pytest.fixture(scope="module")
def gw(upstream: ScriptedUpstream, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    gateway = launch("expand", Path(tmp_path_factory.mktemp("expand-door")), expand_config(upstream)).wait_ready()
    yield gateway
    stop_all([gateway])


def client(gw: Gateway, key: str = KEYS["acme"]) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url, api_key=key, max_retries=0, timeout=60)


def build_log() -> list[dict[str, Any]]:
    lines = [f"build step {i}: compiling module_{i}.c ok" for i in range(1500)]
    lines[750] = f"error: {MARKER} undefined reference to frobnicate"
    return [{"role": "system", "content": "You are a build agent."},
            {"role": "user", "content": "Build the project and fix errors."},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
             "function": {"name": "bash", "arguments": "{\"command\": \"make\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "\n".join(lines)},
            {"role": "user", "content": "What failed?"}]


def headers(**extra: str) -> dict[str, str]:
    return {**BUDGET, "X-Ctx-Session": f"exp-{uuid.uuid4().hex[:12]}", **extra}


def ask(gw: Gateway, model: str, stream: bool, messages: list[dict[str, Any]] | None = None,
        key: str = KEYS["acme"], **hdrs: str) -> dict[str, Any]:
    """One turn through the SDK: what the agent saw, and the response headers."""
    kw: dict[str, Any] = dict(model=model, messages=messages or build_log(), tools=TOOLS,
                              extra_headers=hdrs or headers())
    if not stream:
        raw = client(gw, key).chat.completions.with_raw_response.create(**kw)
        r = raw.parse()
        msg = r.choices[0].message
        return {"text": msg.content, "calls": [c.function.name for c in msg.tool_calls or []],
                "finish": r.choices[0].finish_reason, "headers": raw.headers}
    text, calls, finish = "", [], None
    with client(gw, key).chat.completions.with_streaming_response.create(stream=True, **kw) as raw:
        for chunk in raw.parse():
            if chunk.choices:
                delta = chunk.choices[0].delta
                text += delta.content or ""
                calls += [c.function.name for c in delta.tool_calls or [] if c.function and c.function.name]
                finish = chunk.choices[0].finish_reason or finish
        return {"text": text, "calls": calls, "finish": finish, "headers": raw.headers}


def chats(up: ScriptedUpstream) -> list[Received]:
    return [r for r in up.chats() if r.body and r.body.get("model") != "summarizer"]


def offered(entry: Received) -> list[str]:
    return [(t.get("function") or {}).get("name") for t in entry.body.get("tools") or []]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_the_agent_gets_the_final_answer_and_the_upstream_the_original(gw: Gateway, up: ScriptedUpstream,
                                                                       stream: bool) -> None:
    seen = ask(gw, "gpt-4o-expand", stream)
    assert seen["text"] == REPLY and seen["calls"] == [] and seen["finish"] == "stop"
    first, second, *rest = chats(up)
    cut = json.dumps(first.body["messages"])
    assert "ref ctx:" in cut and MARKER not in cut
    assert offered(first) == ["bash", EXPAND_TOOL]
    assert offered(second) == offered(first)  # the same tool bytes: the prompt cache holds
    # The follow-up appends the call and its result after the first request's messages, unchanged.
    n = len(first.body["messages"])
    assert second.body["messages"][:n] == first.body["messages"]
    end = first.raw.index(b'],"tools"')
    assert second.raw[:end] == first.raw[:end]
    call, result = second.body["messages"][n:]
    assert call["tool_calls"][0]["function"]["name"] == EXPAND_TOOL
    assert MARKER in result["content"] and result["tool_call_id"] == call["tool_calls"][0]["id"]
    # The log does not fit the budget's room whole: its failure line comes with its head and tail,
    # and every part left out is named by a reference of its own, which the model asks for next.
    assert REF.search(result["content"]) and " lines, " in result["content"]
    results = [m["content"] for m in (rest or [second])[-1].body["messages"][n + 1::2]]
    served = [r for r in results if "cannot be expanded in this turn" not in r]
    assert seen["headers"]["x-ctx-expansions"] == str(len(served))
    budget = int(BUDGET["X-Ctx-Budget"])
    assert all(entry.prompt_tokens is not None and entry.prompt_tokens <= budget for entry in [first, second, *rest])


def test_the_next_turn_starts_with_what_the_model_asked_for(gw: Gateway, up: ScriptedUpstream) -> None:
    """The expansion stays in the conversation: the next turn's request starts with the last
    follow-up of this one (what the provider cached), and no reference is asked for twice."""
    hdrs = headers()
    ask(gw, "gpt-4o-expand", False, **hdrs)
    before = chats(up)
    up.reset()
    messages = [*build_log(), {"role": "assistant", "content": REPLY}, {"role": "user", "content": "Fix it."}]
    ask(gw, "gpt-4o-expand", False, messages, **hdrs)
    after = chats(up)
    last = before[-1].body["messages"]
    assert after[0].body["messages"][:len(last)] == last
    assert after[0].body["messages"][len(last):] == messages[-2:]
    ids = [[m["tool_call_id"] for m in r.body["messages"] if m["role"] == "tool" and
            m["tool_call_id"].startswith("call_expand_")] for r in (before[-1], after[-1])]
    assert ids[0] and len(set(ids[1])) == len(ids[1])  # answered once, across both turns


def _expanded_ids(entry: Received) -> list[str]:
    return [m["tool_call_id"] for m in entry.body["messages"]
            if m["role"] == "tool" and m["tool_call_id"].startswith("call_expand_")]


def test_a_compaction_point_leaves_the_earlier_expansions_out(gw: Gateway, up: ScriptedUpstream) -> None:
    """The next compaction point compacts the client's history, not the expansions of earlier
    turns: each result is a copy of an original still stored under its reference, so no note
    stores a copy of it again or names the calls that asked for it."""
    hdrs = headers()
    ask(gw, "gpt-4o-expand", False, **hdrs)
    assert _expanded_ids(chats(up)[-1])
    up.reset()
    rebuilt = build_log()[3]["content"].replace("module_", "unit_")
    messages = [*build_log(), {"role": "assistant", "content": REPLY},
                {"role": "user", "content": "Rebuild it."},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "call_2", "type": "function",
                 "function": {"name": "bash", "arguments": "{\"command\": \"make\"}"}}]},
                {"role": "tool", "tool_call_id": "call_2", "content": rebuilt}]
    seen = ask(gw, "gpt-4o-expand", False, messages, **hdrs)
    assert "autocompact" in seen["headers"]["x-ctx-levels"] or "snip" in seen["headers"]["x-ctx-levels"] \
        or "microcompact" in seen["headers"]["x-ctx-levels"], "the second turn is a compaction point"
    first = chats(up)[0]
    assert _expanded_ids(first) == []
    assert EXPAND_TOOL not in json.dumps(first.body["messages"])


def _step(i: int, output: str) -> list[dict[str, Any]]:
    call = {"id": f"call_s{i}", "type": "function",
            "function": {"name": "bash", "arguments": f'{{"command": "step {i}"}}'}}
    return [{"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"call_s{i}", "content": output}]


def test_an_expansion_leaves_the_next_turn_room_to_grow(gw: Gateway, up: ScriptedUpstream) -> None:
    """Results take the room up to the compaction trigger less a turn of the session's growth:
    the next turn, one ordinary step, is forwarded on top of the expansion rather than made a
    compaction point (a cache break) by it."""
    hdrs = headers()
    system, task, call, log, question = build_log()
    earlier = [m for i in range(6) for m in _step(i, "\n".join(f"line {i}.{k} of the output" for k in range(40)))]
    history = [system, task, *earlier, call, log, question]
    ask(gw, "gpt-4o-expand", False, history, **hdrs)
    turn_one = chats(up)
    assert _expanded_ids(turn_one[-1]), "the model expanded what the point cut"
    up.reset()
    listing = "\n".join(f"src/unit_{i}.c" for i in range(120))
    seen = ask(gw, "gpt-4o-expand", False, [*history, *_step(7, listing)], **hdrs)
    assert seen["headers"]["x-ctx-levels"] == "none"
    last, first = turn_one[-1].body["messages"], chats(up)[0]
    assert first.body["messages"][:len(last)] == last
    config = PipelineConfig()
    trigger = config.trigger_ratio * config.effective_budget(int(BUDGET["X-Ctx-Budget"]))
    assert first.prompt_tokens is not None and first.prompt_tokens < trigger


def test_a_gateway_killed_and_restarted_puts_the_expansion_back(up: ScriptedUpstream, tmp_path: Path) -> None:
    """The exchange is in the WAL's RESPONSE: the session rebuilt from the log after kill -9
    forwards what a gateway that never stopped would."""
    config, hdrs = expand_config(up), headers()
    first = launch("expand-killed", tmp_path, config).wait_ready()
    try:
        ask(first, "gpt-4o-expand", False, **hdrs)
    finally:
        first.proc.kill()
        first.proc.wait(10)
        stop_all([first])
    last = chats(up)[-1].body["messages"]
    up.reset()
    again = launch("expand-restarted", tmp_path, config).wait_ready()
    try:
        messages = [*build_log(), {"role": "assistant", "content": REPLY}, {"role": "user", "content": "Fix it."}]
        ask(again, "gpt-4o-expand", False, messages, **hdrs)
    finally:
        stop_all([again])
    assert chats(up)[0].body["messages"][:len(last)] == last


def test_a_ref_of_another_session_or_tenant_is_refused(gw: Gateway, up: ScriptedUpstream) -> None:
    mine = headers()
    ask(gw, "gpt-4o", False, **mine)  # compacted, no expansion asked: the refs are this session's
    [entry] = chats(up)
    theirs = REF.findall(json.dumps(entry.body["messages"]))[0]
    # The same tenant's other session, then another tenant's session of the same name.
    for key, hdrs in ((KEYS["acme"], headers()), (OTHER_KEY, mine)):
        up.reset()
        messages = build_log()
        messages[3] = {**messages[3], "content": messages[3]["content"].replace("compiling", "linking")}
        messages[-1] = {"role": "user", "content": f"What failed? See ref {theirs} from the other run."}
        seen = ask(gw, "gpt-4o-expand", False, messages, key, **hdrs)
        assert seen["calls"] == []  # the model also asks for the parts of its own result (the rounds' limit)
        answers = {m["tool_call_id"]: m["content"] for r in chats(up) for m in r.body["messages"]
                   if m["role"] == "tool" and m["tool_call_id"].startswith("call_expand_")}
        refused = answers[f"call_expand_{theirs[4:]}"]
        assert refused.startswith(f"Nothing is stored under ref {theirs}") and MARKER not in refused


def test_at_most_three_expansions_a_turn_and_a_ref_once(gw: Gateway, up: ScriptedUpstream) -> None:
    seen = ask(gw, "gpt-4o-expand-greedy", False)
    assert seen["calls"] == [] and seen["finish"] == "stop" and seen["text"] == ""
    sent = chats(up)
    # The first call, three follow-ups, and one whose result says the limit is reached; the
    # model still asking then, that ask is taken out.
    assert len(sent) == 5
    results = [m["content"] for m in sent[-1].body["messages"] if m["role"] == "tool"
               and m["tool_call_id"].startswith("call_expand_")]
    assert MARKER in results[0] and all("already expanded in this turn" in r for r in results[1:3])
    assert results[3].startswith("No more expansions in this turn (at most 3)")
    assert seen["headers"]["x-ctx-expansions"] == "1"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_reply_mixing_our_call_with_the_agents_returns_only_the_agents(gw: Gateway, up: ScriptedUpstream,
                                                                          stream: bool) -> None:
    seen = ask(gw, "gpt-4o-expand-mixed", stream)
    assert seen["calls"] == ["bash"] and seen["finish"] == "tool_calls"
    assert len(chats(up)) == 1


def test_not_offered_before_compaction_nor_when_off(gw: Gateway, up: ScriptedUpstream) -> None:
    short = [{"role": "user", "content": "hi"}]
    assert ask(gw, "gpt-4o-expand", False, short)["text"] == REPLY
    assert offered(chats(up)[0]) == ["bash"]
    for hdrs in ({"X-Ctx-Profile": "minimal"}, {"X-Ctx-Expand": "off"}):
        up.reset()
        seen = ask(gw, "gpt-4o-expand", False, **headers(**hdrs))
        assert seen["text"] == REPLY and "x-ctx-expansions" not in seen["headers"]
        [entry] = chats(up)
        assert "ref ctx:" not in json.dumps(entry.body["messages"]) and offered(entry) == ["bash"]


def test_the_expand_header_is_the_tenants_to_allow(gw: Gateway, up: ScriptedUpstream) -> None:
    with pytest.raises(openai.PermissionDeniedError, match="may not override its expand"):
        ask(gw, "gpt-4o", False, key=OTHER_KEY, **headers(**{"X-Ctx-Expand": "on"}))
    with pytest.raises(openai.BadRequestError, match="X-Ctx-Expand must be on or off"):
        ask(gw, "gpt-4o", False, **headers(**{"X-Ctx-Expand": "maybe"}))


def test_expansions_are_counted_in_metrics(gw: Gateway, up: ScriptedUpstream) -> None:
    ask(gw, "gpt-4o-expand", False)
    status, text = gw.get("/metrics", METRICS_HEADERS)
    assert status == 200
    served = re.search(r'ctxgate_expansions_total\{outcome="served"\} (\d+)', str(text))
    tokens = re.search(r"^ctxgate_expansion_tokens_total (\S+)$", str(text), re.M)
    assert served and int(served.group(1)) >= 1 and tokens and float(tokens.group(1)) > 1000


def test_a_follow_up_too_long_is_told_to_the_model_never_the_loop_guard(gw: Gateway, up: ScriptedUpstream) -> None:
    up.limit = 2000  # the compacted request fits; with the original expanded in it, it does not
    hdrs = headers()
    seen = ask(gw, "gpt-4o-expand", False, **hdrs)
    assert seen["text"] == REPLY and seen["calls"] == [] and seen["finish"] == "stop"
    first, refused, told, *_ = chats(up)
    assert MARKER in json.dumps(refused.body["messages"][-1])
    assert "too long for the model's context window" in told.body["messages"][-1]["content"]
    assert told.body["messages"][:len(first.body["messages"])] == first.body["messages"]
    status, summary = gw.get(f"/v1/ctx/sessions/{hdrs['X-Ctx-Session']}", {"Authorization": f"Bearer {KEYS['acme']}"})
    assert status == 200 and summary["has_attempted_reactive_compact"] is False
    assert [e["level"] for e in summary["compactions"] if e.get("reason") == "reactive"] == []


def test_each_expansion_is_logged_in_the_wal(gw: Gateway, up: ScriptedUpstream) -> None:
    hdrs = headers()
    seen = ask(gw, "gpt-4o-expand", False, **hdrs)
    assert gw.data_dir is not None
    done = run_ctxgate(["wal", "show", hdrs["X-Ctx-Session"], "--tenant", "acme", "--json", "--limit", "0",
                        "--config", str(gw.output.parent / "ctxgate.yaml"), "--data-dir", str(gw.data_dir)],
                       cwd=gw.output.parent)
    assert done.returncode == 0, done.stderr
    events = json.loads(done.stdout)
    expansions = [e for e in events if e["type"] == "EXPANSION"]
    assert len(expansions) == int(seen["headers"]["x-ctx-expansions"]) >= 1
    assert all(REF.fullmatch(f"ref {e['ref']}") and e["tokens"] > 0 for e in expansions)
    response = next(e for e in events if e["type"] == "RESPONSE")
    assert {e["turn"] for e in expansions} == {response["turn"]}
    assert events.index(expansions[-1]) < events.index(response)
