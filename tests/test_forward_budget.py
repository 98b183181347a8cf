"""What ctxgate forwards, on each door, through a real `ctxgate serve` over the scripted upstream:

- never what the provider will refuse: a request still over the effective budget after
  compaction is answered `context_exhausted` in the door's own error shape, and the upstream
  gets no call for it (issue 36, item 8);
- the expansion tool only to a request that carries tools of its own: one sent without tools
  (Qwen Code's own summarisation request) reaches the upstream without tools, even in a
  session compacted with references, and without the expansion exchanges of earlier turns
  (item 10);
- what is forwarded is counted as the provider counts it, the expansion tool included, within
  the safety margin the budget keeps (item 8).
"""
from __future__ import annotations

import json
import re
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import pytest

from ctxgate.pipeline.config import PipelineConfig
from ctxgate.pipeline.refs import REF_RE
from pipeline_builders import bash_step, counter, filler, tool_use_step
from servers import KEYS, UPSTREAM_KEY, Gateway, launch, main_config, stop_all
from upstream import EXPAND_TOOL, Received, ScriptedUpstream

LIMIT = 2400
BUDGET = PipelineConfig().effective_budget(LIMIT)
SYSTEM = "You are a careful coding agent."
TASK = "TASK: fix the failing test in src/app.py"
KEY = KEYS["acme"]
Body = dict[str, Any]


@pytest.fixture(scope="module")
def gw(upstream: ScriptedUpstream, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    config = main_config(upstream.url, "auto")
    config["model_list"] += [{"model_name": name, "model_info": {"max_input_tokens": 100_000}, "litellm_params": {
        "model": f"anthropic/{name}", "api_base": upstream.url, "api_key": UPSTREAM_KEY}}
        for name in ("claude-x", "claude-expand")]
    # The scripted upstream counts with o200k on every door: so does ctxgate, for a count to compare.
    config["ctxgate"]["tokenizers"] = [{"pattern": "claude-*", "tokenizer": "tiktoken:o200k_base"}]
    gateway = launch("forward-budget", Path(tmp_path_factory.mktemp("forward-budget")), config).wait_ready()
    yield gateway
    stop_all([gateway])


def output(i: int, tokens: int) -> str:
    return f"step {i} output\n" + filler(tokens, 100 + i)


# -- each door's request: system prompt, task, tool steps, and a last user message ----------------
def chat_body(steps: int, size: int, last: str, tools: bool = True, model: str = "gpt-4o") -> Body:
    messages: list[Body] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}]
    for i in range(steps):
        messages += bash_step(i, output(i, size))
    messages += [{"role": "assistant", "content": "Done with the checks."}, {"role": "user", "content": last}]
    body: Body = {"model": model, "messages": messages}
    if tools:
        body["tools"] = [{"type": "function", "function": {"name": "bash", "parameters": {
            "type": "object", "properties": {"command": {"type": "string"}}}}}]
    return body


def messages_body(steps: int, size: int, last: str, tools: bool = True, model: str = "claude-x") -> Body:
    messages: list[Body] = [{"role": "user", "content": TASK}]
    for i in range(steps):
        messages += tool_use_step(i, output(i, size))
    messages += [{"role": "assistant", "content": "Done with the checks."}, {"role": "user", "content": last}]
    body: Body = {"model": model, "max_tokens": 64, "system": SYSTEM, "messages": messages}
    if tools:
        body["tools"] = [{"name": "bash", "input_schema": {"type": "object", "properties": {
            "command": {"type": "string"}}}}]
    return body


def responses_body(steps: int, size: int, last: str, tools: bool = True, model: str = "gpt-4o") -> Body:
    items: list[Body] = [{"role": "user", "content": TASK}]
    for i in range(steps):
        items += [{"type": "function_call", "call_id": f"call_{i}", "name": "bash",
                   "arguments": json.dumps({"command": f"check {i}"})},
                  {"type": "function_call_output", "call_id": f"call_{i}", "output": output(i, size)}]
    items += [{"type": "message", "role": "assistant", "content": [{"type": "output_text",
                                                                     "text": "Done with the checks."}]},
              {"role": "user", "content": last}]
    body: Body = {"model": model, "instructions": SYSTEM, "input": items}
    if tools:
        body["tools"] = [{"type": "function", "name": "bash", "parameters": {
            "type": "object", "properties": {"command": {"type": "string"}}}}]
    return body


DOORS: dict[str, tuple[str, Callable[..., Body]]] = {
    "chat": ("/v1/chat/completions", chat_body),
    "messages": ("/v1/messages", messages_body),
    "responses": ("/v1/responses", responses_body),
}


def post(gw: Gateway, door: str, body: Body, session: str, budget: int) -> httpx.Response:
    path = DOORS[door][0]
    headers = {"X-Ctx-Session": session, "X-Ctx-Budget": str(budget)}
    if door == "messages":
        headers |= {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
    else:
        headers["Authorization"] = f"Bearer {KEY}"
    return httpx.post(gw.base + path, json=body, headers=headers, timeout=60)


def forwarded(up: ScriptedUpstream, since: int, door: str, model: str) -> list[Received]:
    """The calls the upstream got for the client's model (not the summariser's) since `since`."""
    return [r for r in up.log[since:] if r.door == door and isinstance(r.body, dict) and r.body.get("model") == model]


def error_of(door: str, resp: httpx.Response) -> tuple[str, str]:
    """(code or type, message) of an error in the door's own shape."""
    assert resp.status_code == 400, (resp.status_code, resp.text[:500])
    body = resp.json()
    if door == "messages":
        assert body["type"] == "error" and set(body["error"]) >= {"type", "message"}, body
        return body["error"]["type"], body["error"]["message"]
    assert set(body["error"]) >= {"message", "type", "param", "code"}, body
    return body["error"]["code"], body["error"]["message"]


# -- item 8: over the budget after compaction, refused before any upstream call -------------------
@pytest.mark.parametrize("door", DOORS)
def test_a_request_over_the_budget_after_compaction_is_refused_up_front(gw: Gateway, up: ScriptedUpstream,
                                                                        door: str) -> None:
    """The last message (the user's, which no level cuts) leaves the request over the effective
    budget however the older steps are compacted, though under the context limit (so not
    refused as infeasible from the start): ctxgate compacts, sees the result still over the
    budget, and answers context_exhausted rather than pay for a call the provider refuses."""
    marker = f"LAST-{uuid.uuid4().hex}"
    make = DOORS[door][1]
    fixed = counter().count_messages([{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}])
    last = f"{marker}\n" + filler(BUDGET + 40 - fixed - 60, 7)  # the instructions, task and last: ~ BUDGET + 40
    body = make(4, 150, last)
    up.limit = LIMIT
    since = len(up.log)
    resp = post(gw, door, body, f"over-{door}-{uuid.uuid4().hex[:8]}", LIMIT)
    code, message = error_of(door, resp)
    assert code == ("invalid_request_error" if door == "messages" else "context_exhausted")
    assert message.startswith("CONTEXT_EXHAUSTED") and "after compaction" in message, message
    numbers = [int(n) for n in re.findall(r"\d+", message)]
    assert BUDGET in numbers and any(n > BUDGET for n in numbers), message
    # (Anthropic's free count_tokens may be asked, for the calibration: that is no call paid for.)
    leaked = [r for r in up.log[since:] if marker.encode() in r.raw and r.door != "count_tokens"]
    assert leaked == [], f"the upstream got {len(leaked)} call(s) for a request ctxgate refused"
    assert forwarded(up, since, door, body["model"]) == []


@pytest.mark.parametrize("door", DOORS)
def test_a_request_that_fits_after_compaction_is_forwarded_within_the_budget(gw: Gateway, up: ScriptedUpstream,
                                                                            door: str) -> None:
    """The same history with a short last message: compacted, forwarded, answered, and what the
    upstream counted is within the limit (the refusal above is not a refusal of everything)."""
    body = DOORS[door][1](8, 300, "What failed?")
    up.limit = LIMIT
    since = len(up.log)
    resp = post(gw, door, body, f"fits-{door}-{uuid.uuid4().hex[:8]}", LIMIT)
    assert resp.status_code == 200, resp.text[:500]
    assert resp.headers["x-ctx-levels"] != "none"
    [sent] = forwarded(up, since, door, body["model"])
    assert sent.prompt_tokens is not None and sent.prompt_tokens <= LIMIT
    assert int(resp.headers["x-ctx-tokens-out"]) <= BUDGET


# -- item 10: no tools in, no tools out -----------------------------------------------------------
def _compacted_session(gw: Gateway, up: ScriptedUpstream, door: str,
                       model: str) -> tuple[str, Body, httpx.Response]:
    """A session compacted with references, its last request (with tools) forwarded with the
    expansion tool: the setting in which a request without tools must stay without."""
    session = f"tools-{door}-{uuid.uuid4().hex[:8]}"
    make = DOORS[door][1]
    for steps in range(2, 30):
        body = make(steps, 400, "Go on.", model=model)
        since = len(up.log)
        resp = post(gw, door, body, session, 6000)
        assert resp.status_code == 200, resp.text[:500]
        if resp.headers["x-ctx-levels"] != "none":
            [sent] = forwarded(up, since, door, model)[-1:]
            assert EXPAND_TOOL in json.dumps(sent.body.get("tools")), "a request with tools is offered the tool"
            return session, body, resp
    raise AssertionError("the session never compacted")


@pytest.mark.parametrize("door", DOORS)
def test_a_request_without_tools_reaches_the_upstream_without_tools(gw: Gateway, up: ScriptedUpstream,
                                                                    door: str) -> None:
    model = "claude-x" if door == "messages" else "gpt-4o"
    session, body, _ = _compacted_session(gw, up, door, model)
    summarise = DOORS[door][1](0, 0, "", tools=False, model=model)
    key = {"chat": "messages", "messages": "messages", "responses": "input"}[door]
    # The agent's own summarisation request: its history and an instruction, no tools.
    request = {**{k: v for k, v in body.items() if k != "tools"},
               key: [*body[key], *summarise[key][-2:-1],
                     {"role": "user", "content": "Summarise the conversation so far."}]}
    since = len(up.log)
    resp = post(gw, door, request, session, 6000)
    assert resp.status_code == 200, resp.text[:500]
    [sent] = forwarded(up, since, door, model)
    assert "tools" not in sent.body, f"the upstream got tools the client never sent: {sent.body.get('tools')}"
    assert REF_RE.search(sent.raw.decode()), "the session's notes (with references) are in the request"


def test_the_expansion_exchanges_stay_out_of_a_request_without_tools(gw: Gateway, up: ScriptedUpstream) -> None:
    """Messages: the model expanded a reference (ctxgate answered its tool_use); the agent's
    next request, sent without tools, must not carry that tool_use, which Anthropic refuses in a
    request that defines no tools."""
    session, body, resp = _compacted_session(gw, up, "messages", "claude-expand")
    assert int(resp.headers.get("x-ctx-expansions", "0")) >= 1, "the model expanded a reference"
    answered = {**body, "messages": [*body["messages"], {"role": "assistant", "content": "ok"},
                                     {"role": "user", "content": "Summarise the conversation so far."}]}
    answered.pop("tools")
    since = len(up.log)
    resp = post(gw, "messages", answered, session, 6000)
    assert resp.status_code == 200, resp.text[:500]
    [sent] = forwarded(up, since, "messages", "claude-expand")
    assert "tools" not in sent.body and EXPAND_TOOL not in sent.raw.decode()


# -- item 8: counted as the provider counts -------------------------------------------------------
@pytest.mark.parametrize("door", ["messages", "responses"])
def test_what_is_forwarded_is_counted_as_the_provider_counts_it(gw: Gateway, up: ScriptedUpstream, door: str) -> None:
    """After compaction the request carries the expansion tool: ctxgate's count of what it
    forwards (X-Ctx-Tokens-Out) is within the budget's safety margin of what the provider
    counts, and never under it by more (the scripted upstream counts every door's body)."""
    model = "claude-x" if door == "messages" else "gpt-4o"
    session = f"count-{door}-{uuid.uuid4().hex[:8]}"
    margin = 1 - PipelineConfig().safety_ratio
    checked = 0
    for steps in range(2, 14):
        body = DOORS[door][1](steps, 150, "Go on.", model=model)
        since = len(up.log)
        resp = post(gw, door, body, session, LIMIT)
        assert resp.status_code == 200, resp.text[:500]
        [sent] = forwarded(up, since, door, model)
        if EXPAND_TOOL not in json.dumps(sent.body.get("tools")):
            continue
        ours, theirs = int(resp.headers["x-ctx-tokens-out"]), sent.prompt_tokens
        assert theirs is not None and ours >= theirs * (1 - margin / 2), (steps, ours, theirs)
        checked += 1
    assert checked >= 3, "the session was compacted on too few turns to compare"


def test_a_responses_turn_is_counted_with_its_reasoning(gw: Gateway, up: ScriptedUpstream) -> None:
    """Codex sends its reasoning items back (their summaries are input the provider counts):
    ctxgate's count of the request is not below the provider's by more than the margin allows."""
    items: list[Body] = [{"role": "user", "content": TASK}]
    for i in range(6):
        items += [{"type": "reasoning", "id": f"rs_{i}", "encrypted_content": "gAAAA" + "x" * 40,
                   "summary": [{"type": "summary_text", "text": filler(150, 300 + i)}]},
                  {"type": "function_call", "call_id": f"call_{i}", "name": "bash",
                   "arguments": json.dumps({"command": f"check {i}"})},
                  {"type": "function_call_output", "call_id": f"call_{i}", "output": output(i, 40)}]
    body = {"model": "gpt-4o", "instructions": SYSTEM, "input": items}
    since = len(up.log)
    resp = post(gw, "responses", body, f"reasoning-{uuid.uuid4().hex[:8]}", 100_000)
    assert resp.status_code == 200, resp.text[:500]
    [sent] = forwarded(up, since, "responses", "gpt-4o")
    ours, theirs = int(resp.headers["x-ctx-tokens-out"]), sent.prompt_tokens
    margin = 1 - PipelineConfig().safety_ratio
    assert theirs is not None and ours >= theirs * (1 - margin / 2), (ours, theirs)


def test_a_legacy_function_call_is_counted() -> None:
    """Chat's older single `function_call` (its name and arguments are read by the model)."""
    arguments = json.dumps({"command": filler(80, 9)})
    call = {"role": "assistant", "content": None, "function_call": {"name": "bash", "arguments": arguments}}
    bare = {"role": "assistant", "content": None}
    assert counter().count_structured(call) - counter().count_structured(bare) >= counter().count(arguments)
