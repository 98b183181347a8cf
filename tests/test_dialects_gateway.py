"""Issue 11 end to end: an agent in each dialect (tool calls, OpenHands text, SWE-agent
text, mini-swe-agent) replayed turn by turn through a real `ctxgate serve` with the
official openai SDK, at `X-Ctx-Budget` about half the history's final size; what the
scripted upstream received for the agent's model (not the summary calls) is checked:

- no turn refused, one upstream call per turn, every call within the limit (the
  upstream's own count, `usage.prompt_tokens`);
- the recent window (the last 10 messages, widened to the last two complete steps) ends
  every forwarded request in order, byte for byte but where the issue allows a cut (at a
  compaction point where the window exceeds the compaction target, observations cut oldest
  first, head and tail kept, never the last message; a cut stays on later turns); what
  arrived after the last compaction point is forwarded verbatim (`WindowWatch`);
- actions and observations kept or removed together; what ctxgate adds is marked;
- outside compaction points each turn's forwarded messages start with the previous turn's
  (>= 95% of those turns), and compaction points are few (a compaction lands at a target
  share of the budget, leaving headroom for many turns);
- the session summary names the dialect.

The upstream enforces no limit here (`up.limit` stays 0): the summary calls go to the
same upstream, and their prompts may be larger than the agent's budget. Whether a
request would have been refused is read from the upstream's own count of every call.

Also: a request whose system prompt, task and last message (not an observation) alone are
over the budget is refused with `context_exhausted` before any upstream call; one whose
last message is a huge observation is forwarded within the limit, that observation cut
head and tail; odd texts (an unterminated `<function=` block, a user message that mentions
`<returncode>`) pass through.
"""
from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, replace
from itertools import pairwise
from typing import Any, Iterator, cast

import openai
import pytest

from ctxgate.memory.loader import HEADER as MEMORY_HEADER
from ctxgate.pipeline.config import PipelineConfig
from ctxgate.pipeline.notes import NOTICE, OPEN, is_ctxgate_message

from clients import assert_error_shape, client
from dialect_builders import (
    DIALECTS,
    ERROR_LINE,
    INSTRUCTIONS,
    MINI_SWE_AGENT,
    OBSERVATION,
    OPENHANDS_TEXT,
    REPLY,
    ROOTS,
    SWE_AGENT_TEXT,
    TALK,
    TASK,
    TOOL_CALLS,
    History,
    Request,
    WindowWatch,
    build,
    core,
    feasible,
    is_cut_of,
    pair_problems,
    same,
    tokens_of,
    unmarked_additions,
)
from pipeline_builders import Message, counter, filler
from servers import KEYS, Gateway, main_config, start_gateways, stop_all
from upstream import Received, ScriptedUpstream

MODEL = "gpt-4o"
SEED, STEPS = 12, 40
STABLE_SHARE = 0.95
MAX_POINT_SHARE = 0.25
"""At most this share of the turns may be compaction points: at budget = half the final
size, target 50% and trigger 85%, a compaction leaves room for several turns."""


@pytest.fixture(scope="module")
def gw(upstream: ScriptedUpstream, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """One gateway (ctxgate's own forwarder: compaction does not depend on the forwarding
    path), with no speculative compaction: a speculation aims at a lower target and may cut
    window messages the normal target would not (a known limit, not tested here)."""
    config = main_config(upstream.url, "auto",
                         pipeline={"autocompact": {"model": "summarizer", "speculative_ratio": None}})
    gateways = start_gateways({"dialects": (tmp_path_factory.mktemp("dialects"), config)})
    yield gateways["dialects"]
    stop_all(gateways.values())


MEMORY_OPEN = f'<ctxgate-context source="memory">\n{MEMORY_HEADER}'


def _is_note(m: Message) -> bool:
    """A message ctxgate adds, as the upstream gets it: a quoted note (a compaction note, a
    restore block, the memory block) in a user turn, or ctxgate's fixed notice."""
    content = m.get("content")
    return is_ctxgate_message(m) or isinstance(content, str) and (
        (m.get("role") == "user" and content.startswith(OPEN)) or (m.get("role") == "system" and content == NOTICE))


def _without_memory(messages: list[Message]) -> list[Message]:
    """Without the memory block and the notice it brings."""
    return [m for m in messages if not ((m.get("role") == "user" and str(m.get("content")).startswith(MEMORY_OPEN))
                                        or (m.get("role") == "system" and m.get("content") == NOTICE))]


@dataclass
class Sent:
    request: Request
    status: int
    levels: str
    records: list[Any]
    calls: list[Received]
    """What the upstream received for the agent's model during this turn."""
    error: str = ""
    count_offset: int = 0
    """The session's measured count offset after this turn (the next turn's compaction uses it)."""
    chain: dict[str, Any] | None = None
    """The session's last compaction (its `chain` log entry): the window and target it chose."""

    @property
    def forwarded(self) -> list[Message]:
        return cast(list[Message], self.calls[-1].body["messages"]) if self.calls else []


def _session(gw: Gateway, session: str) -> dict[str, Any]:
    """`GET /v1/ctx/sessions/{id}`; empty when the session does not exist (yet)."""
    status, summary = gw.get(f"/v1/ctx/sessions/{session}", {"Authorization": f"Bearer {KEYS['acme']}"})
    assert status in (200, 404), summary
    return cast(dict[str, Any], summary) if status == 200 else {}


def _agent_calls(up: ScriptedUpstream, since: int) -> list[Received]:
    return [r for r in up.log[since:] if r.path.endswith("/chat/completions") and isinstance(r.body, dict)
            and r.body.get("model") == MODEL]


def _send(gw: Gateway, up: ScriptedUpstream, session: str, budget: int, request: Request,
          tools: list[dict[str, Any]] | None) -> Sent:
    since = len(up.log)
    params: dict[str, Any] = {"tools": tools} if tools else {}
    try:
        raw = client(gw).chat.completions.with_raw_response.create(
            model=MODEL, messages=cast(Any, request.messages),
            extra_headers={"X-Ctx-Budget": str(budget), "X-Ctx-Session": session}, **params)
        raw.parse()
        status, levels, error = raw.http_response.status_code, raw.headers.get("x-ctx-levels", ""), ""
    except openai.APIStatusError as e:
        status, levels, error = e.status_code, "", f"{e.status_code} {e.message}"
    summary = _session(gw, session)
    chains = [e for e in summary.get("compactions") or [] if e.get("level") in ("chain", "speculative")]
    return Sent(request, status, levels, summary.get("records", []), _agent_calls(up, since), error,
                int(summary.get("count_offset") or 0), chains[-1] if chains else None)


def _replay(gw: Gateway, up: ScriptedUpstream, history: History, budget: int) -> tuple[str, list[Sent]]:
    session = f"dialect-{history.dialect}-{uuid.uuid4().hex[:8]}"
    return session, [_send(gw, up, session, budget, r, history.tools) for r in history.requests()]


def _half(history: History) -> int:
    return tokens_of(history.messages, history.tools) // 2


def _turn_problems(history: History, budget: int, sent: list[Sent]) -> dict[str, list[str]]:
    """Every turn: answered, one upstream call within the limit, the recent-window rules
    (`WindowWatch`: verbatim, or cut oldest first where it is over the compaction target; the
    last message unchanged), pairs intact. Problems by requirement, turn by turn."""
    effective = PipelineConfig().effective_budget(budget)
    found: dict[str, list[str]] = {}
    watch = WindowWatch(history.tools, budget, _is_note)
    previous: Sent | None = None
    for s in sent:
        r = s.request
        point = s.levels not in ("", "none") or s.records != (previous.records if previous else [])
        offset = previous.count_offset if previous else 0
        previous = s
        where = f"turn {r.turn} of {len(history.messages)} (levels {s.levels or '-'})"
        # The test's own premise: the instructions, the task and the whole recent window fit
        # the effective budget, so every turn can be forwarded with its window.
        assert feasible(r.messages, r.kinds, history.tools, effective), f"{where}: bad test data"
        if s.status != 200 or s.error:
            found.setdefault("refused", []).append(f"{where}: {s.error}")
            continue
        if len(s.calls) != 1:
            found.setdefault("one upstream call per turn", []).append(f"{where}: {len(s.calls)} calls")
        used = max((c.prompt_tokens or 0) for c in s.calls) if s.calls else 0
        if used > budget:
            found.setdefault("within the limit", []).append(f"{where}: the upstream counted {used} > {budget}")
        if not s.calls:
            continue
        memory = [m for m in s.forwarded if m not in _without_memory(s.forwarded)]
        window = watch.check(r, _without_memory(s.forwarded), point, counter().count_messages(memory), offset,
                             s.chain if point else None)
        if window:
            found.setdefault("recent window verbatim or cut oldest first", []).append(
                f"{where}: " + "; ".join(window[:2]))
        problems = pair_problems(history.dialect, r.messages, r.kinds, s.forwarded, _is_note)
        if problems:
            found.setdefault("pairs intact", []).append(f"{where}: " + "; ".join(problems[:2]))
        unmarked = unmarked_additions(r.messages, s.forwarded, _is_note)
        if unmarked:
            found.setdefault("what ctxgate adds is marked", []).append(f"{where}: " + "; ".join(unmarked[:2]))
    return found


def _stability_problems(sent: list[Sent]) -> dict[str, list[str]]:
    """Outside compaction points, each turn's forwarded messages start with the previous
    turn's (>= 95% of them), and compaction points are few."""
    points, outside, breaks = 0, 0, []
    for a, b in pairwise(sent):
        if b.levels != "none" or b.records != a.records:
            points += 1
            continue
        outside += 1
        n = len(a.forwarded)
        if len(b.forwarded) < n or not all(same(x, y) for x, y in zip(a.forwarded, b.forwarded[:n])):
            breaks.append(b.request.turn)
    pairs = len(sent) - 1
    found: dict[str, list[str]] = {}
    if not points:
        found["compacted"] = ["no compaction at half the final size: the test tests nothing"]
    if points > MAX_POINT_SHARE * pairs:
        found["few compaction points"] = [f"{points} compaction points in {pairs} turns"]
    if not outside or (outside - len(breaks)) / outside < STABLE_SHARE:
        found["prefix stable outside compaction points"] = [
            (f"{outside - len(breaks)} of {outside} turns outside compaction points start with the previous turn's "
             f"forwarded messages (at least {STABLE_SHARE:.0%} must); breaks at turns {breaks}")]
    return found


def _report(dialect: str, found: dict[str, list[str]]) -> str:
    lines = [f"{dialect}: {len(found)} requirement(s) not met"]
    for name, problems in found.items():
        lines.append(f"- {name} ({len(problems)}): " + " | ".join(p[:400] for p in problems[:2]))
    return "\n".join(lines)


@pytest.mark.parametrize("dialect", DIALECTS)
def test_a_session_in_each_dialect_is_compacted_as_the_issue_requires(gw: Gateway, up: ScriptedUpstream,
                                                                       dialect: str) -> None:
    history = build(dialect, SEED, STEPS)
    budget = _half(history)
    session, sent = _replay(gw, up, history, budget)
    found = {**_turn_problems(history, budget, sent), **_stability_problems(sent)}
    reported = _session(gw, session).get("dialect")
    if reported != dialect:
        found["the session names its dialect"] = [f"GET /v1/ctx/sessions/{{id}} says {reported!r}"]
    assert not found, _report(dialect, found)


def _huge(message: Message, marker: str, tokens: int) -> Message:
    return {**message, "content": f"{message['content']}\n{marker}\n{filler(tokens, 4242)}"}


@pytest.mark.parametrize("dialect", DIALECTS)
def test_a_request_that_cannot_fit_is_refused_before_any_upstream_call(gw: Gateway, up: ScriptedUpstream,
                                                                        dialect: str) -> None:
    """The system prompt, the task and the last message (a human's reply, not an
    observation) alone are over the budget: no compaction can help, so ctxgate says so
    (400 `context_exhausted`, with the counts) and the upstream receives nothing for the
    request, not even a summary call."""
    history = build(dialect, SEED, 6)
    marker = f"marker-{uuid.uuid4().hex}"
    messages = [{**m, "content": f"{m['content']} {marker}"} if isinstance(m.get("content"), str) else m
                for m in history.messages]
    requests = History(dialect, SEED, messages, history.kinds, history.tools).requests()
    budget = 4000
    session = f"infeasible-{dialect}-{uuid.uuid4().hex[:8]}"
    first = requests[0]
    assert tokens_of(first.messages, history.tools) < 0.5 * budget
    assert _send(gw, up, session, budget, first, history.tools).status == 200  # a normal first turn

    last = requests[-1]
    assert last.kinds[-1] != OBSERVATION, "the test data: the last message must not be an observation"
    big = replace(last, messages=[*last.messages[:-1], _huge(last.messages[-1], marker, 2 * budget)])
    needed = tokens_of(core(big.messages, big.kinds), history.tools)
    assert needed > budget
    since = len(up.log)
    with pytest.raises(openai.BadRequestError) as caught:
        cast(Any, client(gw).chat.completions).create(
            model=MODEL, messages=cast(Any, big.messages), extra_headers={"X-Ctx-Budget": str(budget),
                                                                          "X-Ctx-Session": session},
            **({"tools": history.tools} if history.tools else {}))
    err = assert_error_shape(cast(Any, caught.value.response), 400, "context_exhausted")
    assert err["message"].startswith("CONTEXT_EXHAUSTED"), err
    counts = [int(n) for n in re.findall(r"\d+", err["message"])]
    assert any(n > budget for n in counts), f"the message does not say how many tokens are needed: {err['message']}"
    assert budget in counts or PipelineConfig().effective_budget(budget) in counts, \
        f"the message does not say what the budget is: {err['message']}"
    leaked = [r for r in up.log[since:] if marker.encode() in r.raw]
    assert not leaked, f"the upstream received {len(leaked)} call(s) for a request refused as infeasible: " + \
        ", ".join(str((r.body or {}).get("model")) for r in leaked)


@pytest.mark.parametrize("dialect", DIALECTS)
def test_a_huge_last_observation_is_cut_to_fit_not_refused(gw: Gateway, up: ScriptedUpstream, dialect: str) -> None:
    """The last message is an observation too large for the budget: the request is not
    refused; it is forwarded within the limit, the instructions and the task verbatim, the
    observation cut head and tail (the one change the last message may get)."""
    history = build(dialect, SEED, 6)
    requests = [r for r in history.requests() if r.kinds[-1] == OBSERVATION]
    assert requests, "the test data: no request ending in an observation"
    last = requests[-1]
    budget = 4000
    big = replace(last, messages=[*last.messages[:-1], _huge(last.messages[-1], "huge output", 2 * budget)])
    assert tokens_of(big.messages[-1:], history.tools) > budget
    assert tokens_of(core(big.messages, big.kinds), history.tools) < budget
    s = _send(gw, up, f"huge-last-{dialect}-{uuid.uuid4().hex[:8]}", budget, big, history.tools)
    assert s.status == 200 and len(s.calls) == 1, s.error or f"{len(s.calls)} upstream calls"
    used = s.calls[0].prompt_tokens or 0
    assert 0 < used <= budget, f"the upstream counted {used} tokens, over the limit of {budget}"
    forwarded = _without_memory(s.forwarded)
    assert is_cut_of(forwarded[-1], big.messages[-1]), \
        f"the last observation is not a head+tail cut of itself: {str(forwarded[-1].get('content'))[:200]!r}"
    for i, kind in enumerate(big.kinds):
        if kind in (INSTRUCTIONS, TASK):
            assert any(same(m, big.messages[i]) for m in forwarded), f"the {kind} was not forwarded verbatim"


UNTERMINATED = ("Let me view the loader once more.\n\n<function=str_replace_editor>\n<parameter=command>\nview\n"
                "</parameter>\n<parameter=path>\n/workspace/repo/src/config.py")
MENTIONS_RETURNCODE = ("Side note from me: our CI wraps exit codes as <returncode>1</returncode> in its logs, so do "
                       "not be confused by that when you read them. Please go on with the fix.")


def _with_odd_messages(history: History) -> History:
    """An unterminated `<function=` block (answered by the human), after the third step and
    again at the end, where the message mentioning `<returncode>` is the last one."""
    cut = [i for i, m in enumerate(history.messages) if m["role"] == "assistant"][3]
    odd = [{"role": "assistant", "content": UNTERMINATED}, {"role": "user", "content": MENTIONS_RETURNCODE}]
    messages = history.messages[:cut] + odd + history.messages[cut:] + odd
    kinds = history.kinds[:cut] + (TALK, REPLY) + history.kinds[cut:] + (TALK, REPLY)
    return History(history.dialect, history.seed, messages, kinds, history.tools)


def test_odd_texts_pass_through(gw: Gateway, up: ScriptedUpstream) -> None:
    """What merely looks like a protocol (an unclosed `<function=` block, a user message that
    mentions `<returncode>`) breaks nothing: below the trigger it is forwarded exactly as
    sent, and a session holding it is compacted like any other."""
    history = _with_odd_messages(build(OPENHANDS_TEXT, SEED + 1, 30))
    short = Request(0, history.messages[:2] + [{"role": "assistant", "content": UNTERMINATED},
                                               {"role": "user", "content": MENTIONS_RETURNCODE}], ())
    session = f"odd-{uuid.uuid4().hex[:8]}"
    s = _send(gw, up, session, 100_000, short, None)
    assert s.status == 200 and len(s.calls) == 1, s.error
    assert same(_without_memory(s.forwarded), short.messages), "below the trigger the request is forwarded as sent"

    budget = _half(history)
    session, sent = _replay(gw, up, history, budget)
    found = _turn_problems(history, budget, sent)
    reported = _session(gw, session).get("dialect")
    if reported != OPENHANDS_TEXT:
        found["the session names its dialect"] = [f"GET /v1/ctx/sessions/{{id}} says {reported!r}"]
    assert not found, _report(OPENHANDS_TEXT, found)
    assert same(sent[-1].forwarded[-1], {"role": "user", "content": MENTIONS_RETURNCODE})


def test_the_replayed_histories_are_what_the_tests_claim() -> None:
    """The test data (no servers): at half its final size every dialect's history must be
    compacted (it ends over the trigger) and every turn is feasible (what no level may
    remove fits); it holds what the issue names: long outputs, file views with paths, a
    failing command's traceback, plain talk, and each dialect's own shapes."""
    config = PipelineConfig()
    for dialect in DIALECTS:
        history = build(dialect, SEED, STEPS)
        budget = _half(history)
        effective = config.effective_budget(budget)
        assert tokens_of(history.messages, history.tools) > config.trigger_ratio * effective, dialect
        assert all(feasible(r.messages, r.kinds, history.tools, effective) for r in history.requests()), dialect
        texts = [str(m.get("content")) for m in history.messages]
        observations = [t for t, k in zip(texts, history.kinds, strict=True) if k == "observation"]
        assert max(counter().count(t) for t in observations) > 2000, f"{dialect}: no long output"
        assert any(t.rstrip().endswith(ERROR_LINE) or f"{ERROR_LINE}\n" in t for t in observations), dialect
        assert any(f"{ROOTS[dialect]}/src/" in t for t in observations), f"{dialect}: no file view with its path"
        assert TALK in history.kinds and REPLY in history.kinds, f"{dialect}: no plain talk"
    assert any(len(m.get("tool_calls") or []) > 1 for m in build(TOOL_CALLS, SEED, STEPS).messages)
    swe = build(SWE_AGENT_TEXT, SEED, STEPS)
    swe_texts = [(str(m["content"]), k) for m, k in zip(swe.messages, swe.kinds, strict=True)]
    assert any(k == "action" and "\n```\nopen " in t for t, k in swe_texts), "no fenced SWE-agent command"
    assert any(k == "action" and t.endswith("\n</command>") and "```" not in t for t, k in swe_texts), \
        "no SWE-agent command in <command> tags"
    assert any(t.startswith("OBSERVATION:") for t, _ in swe_texts)
    assert any(t.startswith("[File: /repo/src/") for t, _ in swe_texts)
    assert any(t.startswith("Your command ran successfully and did not produce any output.") for t, _ in swe_texts)
    assert all(t.endswith("(Current directory: /repo)\nbash-$") for t, k in swe_texts if k == "observation")
    mini = build(MINI_SWE_AGENT, SEED, STEPS)
    for m, k in zip(mini.messages, mini.kinds, strict=True):
        if k == "action":
            assert str(m["content"]).startswith("THOUGHT: ") and str(m["content"]).count("```bash\n") == 1
        if k == "observation":
            assert re.match(r"<returncode>\d+</returncode>\n", str(m["content"]))
    openhands = build(OPENHANDS_TEXT, SEED, STEPS)
    for m, k in zip(openhands.messages, openhands.kinds, strict=True):
        if k == "action":
            assert re.search(r"\n\n<function=(execute_bash|str_replace_editor)>\n"
                             r"(<parameter=\w+>\n.*?\n</parameter>\n)+</function>$", str(m["content"]), re.DOTALL)
        if k == "observation":
            assert re.match(r"EXECUTION RESULT of \[(execute_bash|str_replace_editor)\]:\n", str(m["content"]))
