"""Shared helpers of the benchmarks: trajectories as requests, conversations of a given
size, machine info, and the RESULTS.md section writer.

Nothing here downloads anything: tiktoken's BPE files come from the litellm wheel (set up
by ctxgate.pipeline.tokens on import) and the trajectories are the files in
../shared/trajectories, loaded by tests/trajectories.py.
"""
from __future__ import annotations

import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # before anything imports litellm

import copy
import datetime as _dt
import platform
import re
import shlex
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterable

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
RESULTS = BENCH / "RESULTS.md"
sys.path.insert(0, str(ROOT / "tests"))

from ctxgate.pipeline.tokens import TokenCounter, TokenizerRegistry  # noqa: E402
try:
    from ctxgate.pipeline.conversation import split_units  # noqa: E402
except ImportError:  # the package as it was before pipeline/conversation.py (a "before" run of a benchmark)
    from ctxgate.pipeline.turns import split_units  # type: ignore[attr-defined,no-redef]  # noqa: E402
from ctxgate.pipeline.turns import is_valid_sequence  # noqa: E402
from trajectories import Trajectory, all_trajectories, every_dialect  # noqa: E402

Message = dict[str, Any]
CLIENT_KEEPALIVE_S = 2.0
"""How long the benches' HTTP clients keep an idle connection: below the LiteLLM proxy's
(uvicorn closes idle keep-alive connections after 5 s), so no request goes out on a
connection the server is closing (a ServerDisconnectedError mid-run)."""


def gpt4o_counter() -> TokenCounter:
    return TokenizerRegistry().for_model("gpt-4o")


# ---------------------------------------------------------------------------------------
# Trajectories as requests


def request_ready(messages: list[Message]) -> list[Message]:
    """A recorded run as the request its agent would send for its next step.

    Two repairs, both in a copy (the loader's output is shared):
    - a `tool` message without `tool_call_id` gets the id of the call it answers (the
      SWE-agent .traj files keep it in `tool_call_ids`, which tests/trajectories.py drops);
    - trailing assistant messages are dropped: the recorded last answer is what the model
      produced, not part of its input, and an unanswered tool call is not a valid request.
    """
    out = copy.deepcopy(messages)
    pending: list[str] = []
    for m in out:
        if m.get("role") == "assistant" and m.get("tool_calls"):
            pending = [tc.get("id") for tc in m["tool_calls"]]
        elif m.get("role") == "tool":
            if not m.get("tool_call_id") and pending:
                m["tool_call_id"] = pending[0]
            if m.get("tool_call_id") in pending:
                pending.remove(m["tool_call_id"])
    while out and out[-1].get("role") == "assistant":
        out.pop()
    return out


def named_trajectories(every: bool = False) -> list[tuple[str, Trajectory, list[Message]]]:
    """(unique name, trajectory, request-ready messages) for every valid one; `every`:
    every recorded run (every_dialect: with the text-protocol runs), else all_trajectories.

    tau-bench's task ids repeat over its trials, so names get a `#k` index there."""
    out, seen = [], {}
    for t in (every_dialect() if every else all_trajectories()):
        k = seen.get(t.name, 0)
        seen[t.name] = k + 1
        name = t.name if k == 0 and not t.name.startswith("tau-bench") else f"{t.name}#{k}"
        msgs = request_ready(t.messages)
        if len(msgs) >= 3 and is_valid_sequence(msgs):
            out.append((name, t, msgs))
    return out


def short_name(name: str, width: int = 60) -> str:
    if name.startswith("swe-agent/"):
        parts = name.split("/")
        name = "swe-agent/" + "/".join(p[:24] for p in parts[1:-1][-1:]) + "/" + parts[-1]
    return name if len(name) <= width else name[: width - 1] + "…"


# ---------------------------------------------------------------------------------------
# Conversations of a given size


def _body_units(messages: list[Message]) -> list[list[Message]]:
    """The non-system messages of a request, as units (a tool call with its results)."""
    body = [m for m in messages if m.get("role") not in ("system", "developer")]
    return [body[u.start:u.end] for u in split_units(body)]


def _interleaved_sources() -> list[list[Message]]:
    """Trajectories round-robin over their sources (openhands, swe-agent, tau-bench), so a
    long history mixes tool-call coding runs, text-mode SWE-agent runs and chat."""
    by_source: dict[str, list[list[Message]]] = {}
    for _, t, msgs in named_trajectories():
        by_source.setdefault(t.source, []).append(msgs)
    order = ["swe-gym-openhands", "swe-agent", "tau-bench"]
    out = []
    longest = max(len(v) for v in by_source.values())
    for i in range(longest):
        for src in order:
            runs = by_source.get(src, [])
            if runs:
                out.append(runs[i % len(runs)])
    return out


def build_conversation(target_tokens: int, counter: TokenCounter) -> list[Message]:
    """A request of about `target_tokens` (OpenAI's message formula, o200k_base) made of
    real trajectory messages: the system prompt of the first OpenHands run, then whole
    runs (their own system prompts left out, so each later run reads as a new task in the
    same session) until the size is reached. The last text message is cut with the
    tokenizer so the total lands on the target; the request ends on a user/tool message."""
    runs = _interleaved_sources()
    system = next(m for m in runs[0] if m.get("role") == "system")
    out: list[Message] = [copy.deepcopy(system)]
    total = counter.count_messages(out)
    i = 0
    while target_tokens - total > 16 and i < 10 * len(runs):
        for unit in _body_units(runs[i % len(runs)]):
            room = target_tokens - total
            if room <= 16:
                break
            cost = sum(counter.count_structured(m) for m in unit)
            if cost <= room:
                out.extend(copy.deepcopy(unit))
                total += cost
            elif len(unit) == 1 and unit[0].get("role") in ("user", "tool") and isinstance(unit[0].get("content"), str):
                # The unit would overshoot: a single text message is cut to fit exactly.
                m = copy.deepcopy(unit[0])
                m["content"] = counter.head(m["content"], max(1, room - 6))
                out.append(m)
                total = counter.count_messages(out)
                break
            # else: skip a tool-call unit that does not fit, and try the next one
        i += 1
    while out and out[-1].get("role") == "assistant":
        out.pop()
    assert is_valid_sequence(out), "built conversation is not a valid request"
    return out


# ---------------------------------------------------------------------------------------
# Statistics and reporting


def pct(values: Iterable[float], q: float) -> float:
    vals = sorted(values)
    if not vals:
        return float("nan")
    if len(vals) == 1:
        return vals[0]
    pos = (len(vals) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(vals) - 1)
    return vals[lo] + (vals[hi] - vals[lo]) * (pos - lo)


def median(values: Iterable[float]) -> float:
    vals = list(values)
    return statistics.median(vals) if vals else float("nan")


def machine_info() -> str:
    try:
        cpus = subprocess.run(["nproc"], capture_output=True, text=True, check=False).stdout.strip()
    except OSError:
        cpus = str(os.cpu_count())
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = ""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem = f"{int(line.split()[1]) / 1024 / 1024:.0f} GiB RAM"
                break
    except OSError:
        pass
    bits = [f"nproc={cpus}", model, mem, f"Python {platform.python_version()}", platform.platform()]
    return ", ".join(b for b in bits if b)


def command_line() -> str:
    script = os.path.relpath(sys.argv[0], ROOT)
    return " ".join([".venv/bin/python", shlex.quote(script), *map(shlex.quote, sys.argv[1:])])


def load_avg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


START_LOAD = load_avg()


def wait_for_quiet(threshold: float = 0.7, max_wait_s: float = 600.0) -> None:
    """Other work on the machine (a test suite, say) skews every figure: wait, up to
    `max_wait_s`, for the 1-minute load average to fall below `threshold`."""
    global START_LOAD
    import time

    deadline = time.monotonic() + max_wait_s
    last = 0.0
    while True:
        try:
            one = float(Path("/proc/loadavg").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return
        if one < threshold:
            break
        if time.monotonic() > deadline:
            progress(f"machine still busy (load {one:.2f}) after {max_wait_s:.0f}s; measuring anyway")
            break
        if time.monotonic() - last > 30:
            progress(f"waiting for the machine to be quiet (1-min load {one:.2f} >= {threshold})")
            last = time.monotonic()
        time.sleep(5)
    START_LOAD = load_avg()


def git_state() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=False).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "proxy", "pipeline"],
                               cwd=ROOT, capture_output=True, text=True, check=False).stdout.split("\n")
    except OSError:
        return "unknown"
    changed = [line[3:] for line in dirty if line.strip()]
    return f"{head or '?'}" + (f" + uncommitted changes in {', '.join(changed)}" if changed else "")


CODE_AT_START = git_state()


def section_header(title: str) -> str:
    now = _dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    return (f"## {title}\n\n"
            f"- command: `{command_line()}` (from the repository root)\n"
            f"- date: {now}\n"
            f"- machine: {machine_info()}\n"
            f"- code: ctxgate at git {CODE_AT_START}"
            + ("" if git_state() == CODE_AT_START else f" (at the end of the run: {git_state()})") + "\n"
            f"- load average (1/5/15 min) at start: {START_LOAD}; at end: {load_avg()} (other processes on the "
            f"machine inflate wall-clock figures)\n")


def write_section(key: str, markdown: str) -> None:
    """Replace (or append) this benchmark's section of bench/RESULTS.md."""
    start, end = f"<!-- bench:{key}:start -->", f"<!-- bench:{key}:end -->"
    block = f"{start}\n{markdown.rstrip()}\n{end}\n"
    text = RESULTS.read_text() if RESULTS.exists() else (
        "# Benchmark results\n\nEach section below is written by the script it names (`bench/run_all.py` "
        "runs them all). The figures are measurements of one run on the machine stated; nothing here is "
        "asserted.\n\n")
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end) + r"\n?", re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block
    RESULTS.write_text(text)


def publish(key: str, markdown: str, out: str | None) -> None:
    """Print a benchmark's markdown and write it to `out`, or to its section of RESULTS.md."""
    print(markdown)
    if out:
        Path(out).write_text(markdown + "\n")
    else:
        write_section(key, markdown)
    print(f"{key}: wrote {out or RESULTS.relative_to(ROOT)}", file=sys.stderr)


def progress(msg: str) -> None:
    print(msg, flush=True)


def table(headers: list[str], rows: list[list[Any]], align: str | None = None) -> str:
    align = align or "l" + "r" * (len(headers) - 1)
    marks = {"l": ":---", "r": "---:", "c": ":---:"}
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(marks[a] for a in align) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(str(c) for c in r) + " |")
    return "\n".join(lines)


def add_proxy_and_wait_args(parser: Any) -> None:
    """The flags every side-by-side bench takes: where the LiteLLM proxy lives, and how long to
    wait for a quiet machine."""
    parser.add_argument("--litellm-proxy", metavar="PATH",
                        help="the `litellm` CLI (or python) of an environment with litellm[proxy]; "
                             "default $CTXGATE_BENCH_LITELLM_PROXY, else .venv's if it has the proxy")
    parser.add_argument("--max-wait", type=float, default=600.0,
                        help="seconds to wait for a quiet machine (1-min load < 0.7) before measuring")
