"""`ctxgate replay` end to end: real files on disk, the real command (`ctxgate.proxy.cli.main`
in process, and once as a subprocess), its table checked against its report's figures and
against the session counted independently.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from ctxgate.pipeline.config import PipelineConfig
from ctxgate.pipeline.tokens import TokenizerRegistry
from ctxgate.proxy.cli import main
from ctxgate.proxy.replay.driver import agent_turns, replay
from ctxgate.proxy.replay.formats import read_recordings
from ctxgate.proxy.replay.summaries import Summarizer
from ctxgate.proxy.replay.table import COLUMNS
from servers import model_list
from upstream import ScriptedUpstream

WORDS = ("def class return import self value index result error config path token budget session "
         "request message handler parser buffer stream module assert raise yield lambda").split()
BUDGET = 6000


def _text(rng: random.Random, lines: int) -> str:
    return "\n".join(f"{n:4d}  " + " ".join(rng.choice(WORDS) for _ in range(12)) for n in range(1, lines + 1))


def openai_messages(steps: int = 24, seed: int = 1) -> list[dict[str, Any]]:
    """An agent's chat history: system, task, then `steps` tool calls each with a ~700-token result."""
    rng = random.Random(seed)
    out: list[dict[str, Any]] = [{"role": "system", "content": "You are a coding agent. Use the tools."},
                                 {"role": "user", "content": "Fix the failing test in src/app/module_3.py."}]
    for k in range(steps):
        tool = "read_file" if k % 2 == 0 else "bash"
        args = {"path": f"src/app/module_{k}.py"} if tool == "read_file" else {"command": f"pytest -k case_{k}"}
        out.append({"role": "assistant", "content": f"Step {k}: looking further.",
                    "tool_calls": [{"id": f"call_{k}", "type": "function",
                                    "function": {"name": tool, "arguments": json.dumps(args)}}]})
        out.append({"role": "tool", "tool_call_id": f"call_{k}", "content": _text(rng, 40)})
    out.append({"role": "assistant", "content": "The test passes now."})
    return out


def write_openai_jsonl(path: Path) -> Path:
    path.write_text("".join(json.dumps(m) + "\n" for m in openai_messages()))
    return path


def write_claude_code(path: Path, steps: int = 24, seed: int = 2) -> Path:
    """A Claude Code transcript as the client writes it: a summary line, a meta line, each
    assistant message split over several lines of one message id, tool results as user lines."""
    rng = random.Random(seed)
    model = "claude-sonnet-4-5-20250929"
    lines: list[dict[str, Any]] = [
        {"type": "summary", "summary": "An earlier session", "leafUuid": "u0"},
        {"type": "user", "message": {"role": "user", "content": "Fix the flaky test in tests/test_io.py"}},
        {"type": "user", "isMeta": True, "message": {"role": "user", "content": "<command-name>/x"}},
    ]
    for k in range(steps):
        msg = {"id": f"msg_{k}", "role": "assistant", "model": model}
        if k == 0:
            lines.append({"type": "assistant", "message": {**msg, "content": [
                {"type": "thinking", "thinking": "Read the test first.", "signature": "c2ln"}]}})
        lines.append({"type": "assistant", "message": {**msg, "content": [{"type": "text", "text": f"Step {k}."}]}})
        lines.append({"type": "assistant", "message": {**msg, "content": [
            {"type": "tool_use", "id": f"toolu_{k}", "name": "Read", "input": {"file_path": f"/repo/src/io_{k}.py"}}]}})
        lines.append({"type": "user", "message": {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": f"toolu_{k}", "content": _text(rng, 40)}]}})
    lines.append({"type": "assistant", "message": {"id": "msg_end", "role": "assistant", "model": model,
                                                   "content": [{"type": "text", "text": "Fixed."}]}})
    lines.append({"type": "file-history-snapshot", "snapshot": {}})
    parent = None
    for n, line in enumerate(lines):  # linked as Claude Code links them: each line to the one before
        if line["type"] in ("user", "assistant"):
            line.update(uuid=f"u{n}", parentUuid=parent)
            parent = line["uuid"]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


SUMMARISING_LEVELS = ["microcompact", "collapse", "autocompact"]
"""The chain without Snip: the cost model's deep compaction points let Snip free these short
sessions' spans alone, with no summary (docs/compaction.md)."""


def run_replay(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["replay", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def table_row(out: str, name: str) -> dict[str, str]:
    """The table's row of session `name` (its first line: the numbers), by column."""
    line = next(line for line in out.splitlines() if line.startswith("│") and line.split("│")[1].strip() == name)
    return dict(zip(COLUMNS, (cell.strip() for cell in line.split("│")[1:-1])))


def money(value: float | None) -> str:
    return "n/a" if value is None else f"${value:,.4f}"


def check_row(row: dict[str, str], r: dict[str, Any]) -> None:
    """The table's figures are the report's."""
    assert row["turns"] == str(len(r["turns"]))
    assert row["limit"] == str(r["limit"])
    assert row["tokens sent"] == str(r["sent_total"]) == str(sum(t["sent"] for t in r["turns"]))
    assert row["tokens forwarded"] == str(r["forwarded_total"]) == str(sum(t["forwarded"] or 0 for t in r["turns"]))
    assert row["summaries"] == str(r["summaries"])
    assert row["prefix-stable"] == f"{r['stable_turns']}/{len(r['turns']) - 1}"
    assert row["refused"] == str(r["refused_turns"]) == str(sum(bool(t["refused"]) for t in r["turns"]))
    assert row["over limit"] == str(len(r["over_limit_turns"]))
    assert r["over_limit_turns"] == [t["turn"] for t in r["turns"] if (t["forwarded"] or 0) > r["limit"]]
    assert row["cost without"] == money(r["cost_without"])
    assert row["cost with"] == money(r["cost_with"])
    assert row["points / 100 turns"] == f"{r['points_per_100_turns']:.1f}" == \
        f"{100 * len(r['compactions']) / len(r['turns']):.1f}"
    assert row["summaries / point"] == f"{r['summaries'] / max(1, len(r['compactions'])):.2f}"
    answered = [t for t in r["turns"] if t["forwarded"] is not None]
    hits = [t["cached_forwarded"] if t["cached_forwarded"] >= 1024 else 0 for t in answered]
    assert row["cache read"] == str(r["cache_read_tokens"]) == str(sum(hits))
    written = sum(t["forwarded"] for t in answered) - sum(hits)
    assert row["cache written"] == str(r["cache_write_tokens"]) == str(written)
    first_level = next(iter(r["levels_fired"]))
    assert row["levels fired @ turns"].startswith(f"{first_level}@")


def check_costs(r: dict[str, Any], model: str) -> None:
    """The costs follow from the turns at litellm's list prices: the agent's history is
    append-only, so each request's cached prefix is the whole previous request; a forwarded
    request's is the previous forwarded request when it was stable."""
    import litellm

    entry = litellm.model_cost[model.removesuffix("-20250929")]
    read = entry["cache_read_input_token_cost"]
    write = entry.get("cache_creation_input_token_cost") or entry["input_cost_per_token"]
    turns = r["turns"]
    assert [t["cached_sent"] for t in turns[1:]] == [t["sent"] for t in turns[:-1]]
    for a, b in zip(turns, turns[1:]):
        assert not b["stable"] or b["cached_forwarded"] == a["forwarded"]

    def cost(tokens: int, cached: int) -> float:
        hit = cached if cached >= 1024 else 0
        return hit * read + (tokens - hit) * write

    answered = [t for t in turns if t["forwarded"] is not None]
    assert r["cost_without"] == pytest.approx(sum(cost(t["sent"], t["cached_sent"]) for t in answered))
    summaries = r["cost_summaries"]
    assert summaries > 0
    assert r["cost_with"] == pytest.approx(sum(cost(t["forwarded"], t["cached_forwarded"]) for t in answered)
                                           + summaries)


def independent_counts(path: Path, model: str) -> tuple[list[int], list[int]]:
    """Each turn's request as the agent sent it, and as forwarded, counted here from the file
    and from a second run of the driver (the offline summariser is deterministic)."""
    _, (recording,) = read_recordings(str(path))
    counter = TokenizerRegistry().for_model(model)
    tools = counter.count_tools(recording.tools)
    sent = [counter.count_messages(recording.messages[:i]) + tools for i in agent_turns(recording.messages)]
    run = asyncio.run(replay(recording.messages, recording.tools, BUDGET, counter=counter,
                             summarize=Summarizer(counter), config=PipelineConfig(levels=SUMMARISING_LEVELS),
                             wait_background=True))
    forwarded = [counter.count_messages(f.messages) + tools for f in run.turns]
    return sent, forwarded


@pytest.mark.parametrize("writer, model", [(write_openai_jsonl, "gpt-4o"),
                                           (write_claude_code, "claude-sonnet-4-5-20250929")],
                         ids=["openai-jsonl", "claude-code"])
def test_replay_compacts_and_reports_the_same_figures(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                      writer: Any, model: str) -> None:
    session = writer(tmp_path / "session.jsonl")
    out = tmp_path / "report"
    config = tmp_path / "ctxgate.yaml"  # Snip alone would free these spans: the summaries are what is tested
    config.write_text(yaml.safe_dump({"ctxgate": {"pipeline": {"levels": SUMMARISING_LEVELS}}}))
    code, stdout, err = run_replay(capsys, str(session), "--budget", str(BUDGET), "--out", str(out),
                                   "--config", str(config))
    assert code == 0, err
    (r,) = json.loads((out / "report.json").read_text())
    assert r["format"] == ("openai" if model == "gpt-4o" else "claude-code")
    assert r["model"] == model and r["limit"] == BUDGET
    check_row(table_row(stdout, "session"), r)
    sent, forwarded = independent_counts(session, model)
    assert [t["sent"] for t in r["turns"]] == sent
    assert [t["forwarded"] for t in r["turns"]] == forwarded
    assert r["compactions"] and r["summaries"] >= 1 and r["refused_turns"] == 0
    assert max(forwarded) <= BUDGET < max(sent)
    assert r["forwarded_total"] < r["sent_total"]
    check_costs(r, model)
    assert "offline summariser" in r["summarizer"]
    assert any(p["summary"].startswith("1. User goal: ") for p in r["compactions"])
    assert (out / "report.html").stat().st_size > 1_000_000  # plotly inlined
    assert (out / "session.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_claude_code_transcript_reads_as_the_messages_door_does(tmp_path: Path) -> None:
    fmt, (recording,) = read_recordings(str(write_claude_code(tmp_path / "t.jsonl", steps=3)))
    assert fmt == "claude-code" and recording.model == "claude-sonnet-4-5-20250929"
    roles = [m["role"] for m in recording.messages]
    assert roles == ["user", "assistant", "user", "assistant", "user", "assistant", "user", "assistant"]
    first = recording.messages[1]["content"]
    assert [b["type"] for b in first] == ["thinking", "text", "tool_use"]  # one message id, three lines
    assert recording.messages[0]["content"] == [{"type": "text", "text": "Fix the flaky test in tests/test_io.py"}]


@pytest.mark.parametrize("linked", [True, False], ids=["linked", "file-order"])
def test_after_claude_codes_own_compaction_the_history_starts_from_its_summary(tmp_path: Path, linked: bool) -> None:
    path = write_claude_code(tmp_path / "t.jsonl", steps=3)
    boundary = {"type": "system", "subtype": "compact_boundary", "uuid": "b", "parentUuid": None}
    summary = {"type": "user", "isCompactSummary": True, "uuid": "s", "parentUuid": "b",
               "message": {"role": "user", "content": "This session is being continued. Summary: read io_0..2."}}
    after = {"type": "assistant", "uuid": "a", "parentUuid": "s", "message": {
        "id": "msg_after", "role": "assistant", "content": [{"type": "text", "text": "Continuing."}]}}
    added = [boundary, summary, after]
    if not linked:
        lines = [json.loads(line) for line in path.read_text().splitlines()] + added
        for line in lines:
            line.pop("uuid", None)
            line.pop("parentUuid", None)
        path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    else:
        path.write_text(path.read_text() + "".join(json.dumps(line) + "\n" for line in added))
    _, (recording,) = read_recordings(str(path))
    assert [m["role"] for m in recording.messages] == ["user", "assistant"]
    assert recording.messages[0]["content"][0]["text"].startswith("This session is being continued")


def test_a_rewound_branch_of_a_claude_code_transcript_is_not_replayed(tmp_path: Path) -> None:
    path = write_claude_code(tmp_path / "t.jsonl", steps=2)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    talk = [line for line in lines if line.get("uuid")]
    fork = talk[-2]  # the user rewinds to the last tool result and the agent answers differently
    abandoned = talk[-1]
    retry = {"type": "assistant", "uuid": "retry", "parentUuid": fork["uuid"],
             "message": {"id": "msg_retry", "role": "assistant", "content": [{"type": "text", "text": "Again."}]}}
    path.write_text(path.read_text() + json.dumps(retry) + "\n")
    _, (recording,) = read_recordings(str(path))
    texts = [b.get("text") for m in recording.messages for b in m["content"] if isinstance(b, dict)]
    assert "Again." in texts and abandoned["message"]["content"][0]["text"] not in texts


def _config(tmp_path: Path, upstream_url: str, summarizer_base: str | None = None, summarizer: str = "summarizer",
            timeout_s: float = 60.0) -> Path:
    models = [m for m in model_list(upstream_url) if m["model_name"] in ("gpt-4o", summarizer)]
    if summarizer_base is not None:
        models[1]["litellm_params"]["api_base"] = summarizer_base
    path = tmp_path / "ctxgate.yaml"
    autocompact = {"model": summarizer, "timeout_s": timeout_s}
    path.write_text(yaml.safe_dump({"model_list": models, "ctxgate": {"pipeline": {
        "autocompact": autocompact, "levels": SUMMARISING_LEVELS}}}))
    return path


def test_summaries_come_from_the_configured_model(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                  upstream: ScriptedUpstream) -> None:
    upstream.reset()
    config = _config(tmp_path, upstream.url)
    code, _, err = run_replay(capsys, str(write_openai_jsonl(tmp_path / "s.jsonl")), "--budget", str(BUDGET),
                              "--config", str(config), "--out", str(tmp_path / "out"))
    assert code == 0, err
    (r,) = json.loads((tmp_path / "out" / "report.json").read_text())
    asked = [c for c in upstream.chats() if c.body.get("model") == "summarizer"]
    assert r["summarizer"] == "model summarizer" and len(asked) == r["summaries"] >= 1
    assert any("1. " in p["summary"] and "Skill" not in p["summary"][:2] for p in r["compactions"] if p["summary"])


def test_an_unreachable_model_falls_back_to_the_offline_summariser(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str],
                                                                  upstream: ScriptedUpstream) -> None:
    config = _config(tmp_path, upstream.url, summarizer_base="http://127.0.0.1:9/v1")
    code, _, err = run_replay(capsys, str(write_openai_jsonl(tmp_path / "s.jsonl")), "--budget", str(BUDGET),
                              "--config", str(config), "--out", str(tmp_path / "out"))
    assert code == 0, err
    (r,) = json.loads((tmp_path / "out" / "report.json").read_text())
    assert r["summarizer"].startswith("offline summariser: model summarizer failed")
    assert r["summaries"] >= 1 and any(p["summary"].startswith("1. User goal") for p in r["compactions"])


def test_a_model_that_hangs_is_given_up_for_the_offline_summariser(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str],
                                                                   upstream: ScriptedUpstream) -> None:
    upstream.slow_s = 30.0  # far past the summary's deadline (half of autocompact.timeout_s)
    try:
        config = _config(tmp_path, upstream.url, summarizer="slow", timeout_s=2.0)
        code, _, err = run_replay(capsys, str(write_openai_jsonl(tmp_path / "s.jsonl")), "--budget", str(BUDGET),
                                  "--config", str(config), "--out", str(tmp_path / "out"))
    finally:
        upstream.slow_s = 3.0
    assert code == 0, err
    (r,) = json.loads((tmp_path / "out" / "report.json").read_text())
    assert r["summarizer"] == "offline summariser: model slow failed (timed out)"
    assert r["summaries"] >= 1 and any(p["summary"].startswith("1. User goal") for p in r["compactions"])


@pytest.mark.parametrize("content, says", [
    ("", "not a recorded session"),
    ("just some text\nand more", "neither JSON nor JSONL"),
    ('{"foo": 1}', "not a recorded session"),
    ('[{"role": "user", "content": "hi"}]', "no session with an assistant turn"),
    ('{"history": 3}', "not a recorded session"),
], ids=["empty", "text", "unknown-object", "no-assistant", "bad-traj"])
def test_a_bad_file_is_one_clear_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                 content: str, says: str) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    code, out, err = run_replay(capsys, str(bad), "--out", str(tmp_path / "out"))
    assert code == 2
    assert err.startswith("ctxgate replay: ") and says in err and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


def test_a_wrong_format_and_a_missing_file_exit_2_without_a_traceback(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    session = write_openai_jsonl(tmp_path / "s.jsonl")
    code, _, err = run_replay(capsys, str(session), "--format", "tau-bench")
    assert code == 2 and "cannot be read as tau-bench" in err and err.count("\n") == 1
    done = subprocess.run([sys.executable, "-m", "ctxgate.proxy.cli", "replay", str(tmp_path / "missing.json")],
                          capture_output=True, text=True, env={**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"},
                          timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.startswith("ctxgate replay: ") and "cannot read" in done.stderr


def test_an_upstream_that_enforces_the_limit_is_answered_by_reactive_compactions(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An upstream that counts twice what ctxgate counts refuses requests ctxgate thought fit:
    without --enforce-limit they go out over the limit; with it each refusal is followed by a
    reactive compaction and the request sent again fits."""
    session = write_openai_jsonl(tmp_path / "session.jsonl")
    reports = {}
    for flags in ([], ["--enforce-limit"]):
        out = tmp_path / f"report{len(flags)}"
        code, stdout, err = run_replay(capsys, str(session), "--budget", str(BUDGET), "--upstream-scale", "2",
                                       "--out", str(out), *flags)
        assert code == 0, err
        (r,) = json.loads((out / "report.json").read_text())
        check_row(table_row(stdout, "session"), r)
        assert table_row(stdout, "session")["reactive"] == str(r["reactive"])
        reports[bool(flags)] = r
    unenforced, enforced = reports[False], reports[True]
    assert unenforced["over_limit_turns"] and unenforced["reactive"] == 0
    refused = [t for t in enforced["turns"] if t["reactive"]]
    assert refused and enforced["reactive"] == sum(t["reactive"] for t in refused)
    reactive_points = {p["turn"] for p in enforced["compactions"] if any(s["reason"] == "reactive" for s in p["steps"])}
    assert reactive_points and reactive_points <= {t["turn"] for t in refused}
    assert enforced["over_limit_turns"] == []
    assert all(t["forwarded"] <= BUDGET for t in enforced["turns"] if t["forwarded"] is not None)
