"""aider rebuilding its request every turn: compaction points and prefix stability per turn.

Real aider (the suite's pin, tests/real_agents.py) through `ctxgate run --url`, a recorder in
front of the gateway (what aider sent, tests/recorder.py, with each reply's `X-Ctx-Levels`) and
the scripted upstream behind it (tests/upstream.py: o200k counts, the limit enforced), driven as
tests/test_real_agent_aider.py drives it: yes to each command and to adding its output, then
`continue`. aider appends its reminder to the newest user turn, so every turn it changes the
message it sent last. Per scenario: aider's turns (its own summary requests aside), the turns
that were compaction points (`X-Ctx-Levels` names a level), ctxgate's summary calls, and of the
consecutive forwarded pairs those that are prefix-stable (the second starts with the first) and
those stable but for what aider changed (the second starts with the first up to the first message
aider changed or left out in its next request, where the first has it). `--code DIR` runs the gateway from another
checkout (a worktree of an earlier commit: the *before* figures).

    .venv/bin/python bench/aider_turns.py [--code /work/wt-before] [--out /tmp/x.md]
"""
from __future__ import annotations

import json
import os
import re
import signal
import tempfile
from dataclasses import dataclass
from pathlib import Path

import common
import orjson
import pexpect
from pexpect.popen_spawn import PopenSpawn

from real_agents import pypi_agent
from test_real_agent_aider import AIDER_FLAGS, CALC, NOTES, PROMPT_TIMEOUT_S, TASK, _drive, _kept, recorded_gateway
from test_real_agents import _launch

SCENARIOS = (("agent-steps-14", 24_000, False), ("agent-edit-12", 6_000, True), ("agent-edit-12", 4_000, True),
             ("agent-edit-12-touch", 6_000, True))
"""(model, limit, calc.py and a read-only notes.md in the chat): 14 steps of ~6.5K tokens; 12 of
~300 and then a SEARCH/REPLACE edit of calc.py (tests/agent_edit.py; `-touch`: each step's
command also appends a line to calc.py, so aider's files-in-chat message changes every turn)."""


@dataclass
class Figures:
    turns: int
    points: list[int]
    summaries: int
    own_summaries: int
    strict: int
    allowed: int


def run(model: str, limit: int, files: bool, where: Path) -> Figures:
    upstream, gateway, recorder = recorded_gateway(where, model, limit)
    work = where / "work"
    work.mkdir()
    extra: list[str] = []
    if files:
        (work / "calc.py").write_text(CALC)
        (work / "notes.md").write_text(NOTES)
        extra = ["--no-auto-lint", "--read", "notes.md", "calc.py"]
    command, env = _launch(None, "aider", [str(pypi_agent("aider-chat") / "aider"), "--model", f"openai/{model}",
                                           *AIDER_FLAGS, *extra], work, url=recorder.url, SHELL="/bin/sh")
    child = PopenSpawn(command, cwd=str(work), env=env, encoding="utf-8", timeout=PROMPT_TIMEOUT_S,
                       preexec_fn=os.setsid)
    try:
        _drive(child, TASK, int(re.findall(r"\d+", model)[0]))
        child.sendline("/exit")
        child.expect(pexpect.EOF)
        chats = [(orjson.loads(s.raw)["messages"], levels) for s, levels in zip(recorder.log, recorder.levels)
                 if s.path.endswith("/chat/completions")]
        received = [r.body["messages"] for r in upstream.log if r.door == "chat" and isinstance(r.body, dict)]
    finally:
        if child.proc.poll() is None:
            os.killpg(child.proc.pid, signal.SIGKILL)
        recorder.stop()
        gateway.stop()
        upstream.stop()
    turns = [(m, levels) for m, levels in chats if len(m) > 2]  # aider's own summary requests have two
    forwarded = [m for m in received if len(m) > 2]
    assert len(forwarded) == len(turns), (len(forwarded), len(turns))
    strict = allowed = 0
    for (sent, _), (nxt, _), a, b in zip(turns, turns[1:], forwarded, forwarded[1:]):
        strict += b[:len(a)] == a
        allowed += _kept(sent, nxt, a, b)  # the test's own measure of it
    return Figures(len(turns), [i for i, (_, levels) in enumerate(turns) if levels not in ("", "none")],
                   len(received) - len(forwarded) - (len(chats) - len(turns)), len(chats) - len(turns), strict, allowed)


def main() -> None:
    p = common.parser(__doc__)
    p.add_argument("--code", default=None, help="a checkout whose ctxgate the gateway runs (default: this one)")
    p.add_argument("--only", default=None, help="the scenarios of this model only")
    args = p.parse_args()
    if args.code:  # the gateway is a child process: it imports ctxgate from the first PYTHONPATH entry
        shim = Path(tempfile.mkdtemp(prefix="ctxgate-code-"))
        (shim / "ctxgate").symlink_to(Path(args.code).resolve())
        os.environ["PYTHONPATH"] = os.pathsep.join([str(shim), *filter(None, [os.environ.get("PYTHONPATH")])])
    rows = []
    for model, limit, files in (s for s in SCENARIOS if args.only in (None, s[0])):
        with tempfile.TemporaryDirectory(prefix="aider-turns-") as tmp:
            f = run(model, limit, files, Path(tmp))
        common.progress(json.dumps({"model": model, "limit": limit, **f.__dict__}))
        pairs = f.turns - 1
        rows.append([f"{model} at {limit:,}" + (", calc.py in the chat" if files else ""), f.turns,
                     f"{len(f.points)} ({f.points})", f"{len(f.points) / f.turns:.2f}", f.summaries,
                     f"{f.strict}/{pairs}", f"{f.allowed}/{pairs}"])
    table = common.table(["scenario", "aider turns", "compaction points (turns)", "points / turn",
                          "ctxgate summaries", "prefix-stable pairs", "stable but for what aider changed"], rows)
    code = f"the gateway from {args.code}" if args.code else "the gateway from this checkout"
    common.publish("aider-turns" + ("-code" if args.code else ""),
                   f"{common.section_header('aider rebuilding its request every turn')}\n{code}\n\n"
                   f"{common.about(__doc__)}\n\n{table}\n", args.out)


if __name__ == "__main__":
    main()
