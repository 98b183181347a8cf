"""What the benchmarks share: recorded runs as requests, conversations of a given size, the
RESULTS.md section (its header says the command, machine, code and load) and the command
line; the servers of a run are processes.py.

Nothing is downloaded: the trajectories are ../shared/trajectories (tests/trajectories.py).
"""
from __future__ import annotations

import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # before anything imports litellm
if os.environ.get("TIKTOKEN_CACHE_DIR"):  # the servers run in a temporary folder: a relative path breaks there
    os.environ["TIKTOKEN_CACHE_DIR"] = os.path.abspath(os.environ["TIKTOKEN_CACHE_DIR"])

import argparse  # noqa: E402
import copy  # noqa: E402
import datetime as _dt  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402
import shlex  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import types  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Iterable  # noqa: E402

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
RESULTS = BENCH / "RESULTS.md"
sys.path.insert(0, str(ROOT / "tests"))

from ctxgate.pipeline.conversation import split_units  # noqa: E402
from ctxgate.pipeline.tokens import TokenCounter, TokenizerRegistry  # noqa: E402
from ctxgate.pipeline.turns import is_valid_sequence  # noqa: E402
from trajectories import Trajectory, all_trajectories, every_dialect  # noqa: E402

Message = dict[str, Any]


def gpt4o_counter() -> TokenCounter:
    return TokenizerRegistry().for_model("gpt-4o")


def request_ready(messages: list[Message]) -> list[Message]:
    """A recorded run as the request its agent would send next (a copy): a `tool` message
    without `tool_call_id` gets the id of the call it answers (SWE-agent's files keep it
    elsewhere), and trailing assistant messages go (the model's output, not its input)."""
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
    """(unique name, trajectory, request-ready messages) of every valid run: the tool-call and
    SWE-agent ones, or with `every` every dialect's (tau-bench's ids repeat over trials: `#k`)."""
    out: list[tuple[str, Trajectory, list[Message]]] = []
    seen: dict[str, int] = {}
    for t in (every_dialect() if every else all_trajectories()):
        k = seen.get(t.name, 0)
        seen[t.name] = k + 1
        name = t.name if k == 0 and not t.name.startswith("tau-bench") else f"{t.name}#{k}"
        msgs = request_ready(t.messages)
        if len(msgs) >= 3 and is_valid_sequence(msgs):
            out.append((name, t, msgs))
    return out


def build_conversation(target_tokens: int, counter: TokenCounter) -> list[Message]:
    """A request of about `target_tokens` (o200k) of real messages: the first OpenHands run's
    system prompt, then whole runs round-robin over the sources (their system prompts left
    out: each reads as the next task), the last text message cut to land on the size; it
    ends on a user or tool message."""
    by_source: dict[str, list[list[Message]]] = {}
    for _, t, msgs in named_trajectories():
        by_source.setdefault(t.source, []).append(msgs)
    sources = [by_source[s] for s in ("swe-gym-openhands", "swe-agent", "tau-bench") if by_source.get(s)]
    runs = [src[i % len(src)] for i in range(max(map(len, sources))) for src in sources]
    out: list[Message] = [copy.deepcopy(next(m for m in runs[0] if m.get("role") == "system"))]
    total = counter.count_messages(out)
    i = 0
    while target_tokens - total > 16 and i < 10 * len(runs):
        body = [m for m in runs[i % len(runs)] if m.get("role") not in ("system", "developer")]
        for unit in (body[u.start:u.end] for u in split_units(body)):
            room = target_tokens - total
            if room <= 16:
                break
            cost = sum(counter.count_structured(m) for m in unit)
            if cost <= room:
                out.extend(copy.deepcopy(unit))
                total += cost
            elif len(unit) == 1 and unit[0].get("role") in ("user", "tool") and isinstance(unit[0].get("content"), str):
                m = copy.deepcopy(unit[0])  # a single text message is cut to fit exactly
                m["content"] = counter.head(m["content"], max(1, room - 6))
                out.append(m)
                total = counter.count_messages(out)
                break
        i += 1
    while out and out[-1].get("role") == "assistant":
        out.pop()
    assert is_valid_sequence(out), "built conversation is not a valid request"
    return out


def fresh(messages: list[Message], i: int | str) -> list[Message]:
    """The conversation with `<i> ` in front of every message's text: nothing cached."""
    return [{**m, "content": f"<{i}> " + (m.get("content") or "")} for m in messages]


TURNS_PER_SESSION = 10


def turn(base: list[Message], i: int) -> list[Message]:
    """Iteration i: turn i % 10 of session i // 10, the history and k+1 pairs of (the reply,
    a new user message); each turn resends the previous one and adds two messages."""
    session, k = divmod(i, TURNS_PER_SESSION)
    extra: list[Message] = []
    for j in range(k + 1):
        extra.append({"role": "assistant", "content": "ok"})
        extra.append({"role": "user", "content": f"Next step {session * TURNS_PER_SESSION + j}: continue with the "
                                                 f"task and report what changed."})
    return base + extra


def pct(values: Iterable[float], q: float) -> float:
    """The q-quantile (q in hundredths), linear between the closest ranks."""
    vals = list(values)
    if len(vals) < 2:
        return vals[0] if vals else float("nan")
    return statistics.quantiles(vals, n=100, method="inclusive")[round(q * 100) - 1]


def median(values: Iterable[float]) -> float:
    vals = list(values)
    return statistics.median(vals) if vals else float("nan")


def _first(path: str, prefix: str) -> str:
    try:
        return next((line.split(":", 1)[1].strip() for line in Path(path).read_text().splitlines()
                     if line.startswith(prefix)), "")
    except OSError:
        return ""


def machine_info() -> str:
    mem = _first("/proc/meminfo", "MemTotal")
    bits = [f"nproc={os.cpu_count()}", _first("/proc/cpuinfo", "model name"),
            f"{int(mem.split()[0]) / 1024 / 1024:.0f} GiB RAM" if mem else "", f"Python {platform.python_version()}",
            platform.platform()]
    return ", ".join(b for b in bits if b)


def load_avg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def git_state() -> str:
    """The commit of the ctxgate package imported (a worktree on PYTHONPATH for a 'before'
    run), with its uncommitted changes."""
    import ctxgate.pipeline

    where = Path(os.path.realpath(ctxgate.pipeline.__file__)).parent.parent

    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=where, capture_output=True, text=True, check=False).stdout

    dirty = [line[3:] for line in git("status", "--porcelain", "--untracked-files=all", "--", "proxy", "pipeline",
                                      "memory", "wal").splitlines() if line.strip()]
    return (f"{git('rev-parse', '--short', 'HEAD').strip() or '?'}" + ("" if where == ROOT else f" (`{where}`)")
            + (f" + uncommitted changes in {', '.join(dirty)}" if dirty else ""))


START_LOAD, CODE_AT_START = load_avg(), git_state()


def wait_for_quiet(threshold: float = 0.7, max_wait_s: float = 600.0) -> None:
    """Other work on the machine skews every figure: wait, up to `max_wait_s`, for the 1-minute
    load average to fall below `threshold`."""
    global START_LOAD, CODE_AT_START
    deadline, last = time.monotonic() + max_wait_s, 0.0
    while (one := float(load_avg().split()[0] if load_avg() != "?" else 0)) >= threshold:
        if time.monotonic() > deadline:
            progress(f"machine still busy (load {one:.2f}) after {max_wait_s:.0f}s; measuring anyway")
            break
        if time.monotonic() - last > 30:
            progress(f"waiting for the machine to be quiet (1-min load {one:.2f} >= {threshold})")
            last = time.monotonic()
        time.sleep(5)
    START_LOAD, CODE_AT_START = load_avg(), git_state()  # the code the servers start with


def module_at(commit: str, path: str) -> types.ModuleType:
    """The module at `path` (from the repository root) as it was at `commit`, to run beside
    today's: its package-relative imports (`from .x`) read from today's package."""
    source = subprocess.run(["git", "show", f"{commit}:{path}"], check=True, capture_output=True, text=True,
                            cwd=ROOT).stdout
    package = "ctxgate." + ".".join(Path(path).parent.parts)
    module = types.ModuleType(f"{Path(path).stem}_{commit}")
    sys.modules[module.__name__] = module  # dataclasses look their module up
    exec(compile(source.replace("\nfrom .", f"\nfrom {package}."), f"{path}@{commit}", "exec"), module.__dict__)
    return module


def command_line() -> str:
    return " ".join([".venv/bin/python", shlex.quote(os.path.relpath(sys.argv[0], ROOT)),
                     *map(shlex.quote, sys.argv[1:])])


def about(doc: str | None) -> str:
    """A script's docstring without its first line and usage: what it measures and how, for its section."""
    return (doc or "").split("\n\n    .venv")[0].split("\n\n", 1)[-1].strip()


def section_header(title: str) -> str:
    now = _dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    end = git_state()
    return (f"## {title}\n\n- command: `{command_line()}` (from the repository root)\n- date: {now}\n"
            f"- machine: {machine_info()}\n- code: ctxgate at git {CODE_AT_START}"
            + ("" if end == CODE_AT_START else f" (at the end of the run: {end})") + "\n"
            f"- load average (1/5/15 min) at start: {START_LOAD}; at end: {load_avg()} (other processes on the "
            f"machine inflate wall-clock figures)\n")


def write_section(key: str, markdown: str) -> None:
    """Replace (or append) this benchmark's section of bench/RESULTS.md."""
    start, end = f"<!-- bench:{key}:start -->", f"<!-- bench:{key}:end -->"
    block = f"{start}\n{markdown.rstrip()}\n{end}\n"
    text = RESULTS.read_text()
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end) + r"\n?", re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block
    RESULTS.write_text(text)


_PUBLISHED: set[str] = set()


def publish(key: str, markdown: str, out: str | None) -> None:
    """Print the markdown and write it to its section of RESULTS.md or, with `out`, to that
    file (every section of the run, one after the other)."""
    print(markdown)
    if out:
        with open(out, "a" if out in _PUBLISHED else "w") as f:
            f.write(markdown + "\n")
        _PUBLISHED.add(out)
    else:
        write_section(key, markdown)
    print(f"{key}: wrote {out or RESULTS.relative_to(ROOT)}", file=sys.stderr)


def progress(msg: str) -> None:
    print(msg, flush=True)


def table(headers: list[str], rows: list[list[Any]], align: str | None = None) -> str:
    marks = {"l": ":---", "r": "---:", "c": ":---:"}
    lines = ["| " + " | ".join(headers) + " |",
             "|" + "|".join(marks[a] for a in align or "l" + "r" * (len(headers) - 1)) + "|"]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows])


def parser(doc: str | None, *, wait: float | None = None, proxy: bool = False) -> argparse.ArgumentParser:
    """`--out` (the markdown to a file, bench/ left alone), `--max-wait` (for a quiet machine,
    `wait` s by default) and `--litellm-proxy`, as asked."""
    p = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])
    p.add_argument("--out", default=None, help="write the markdown here, not to bench/RESULTS.md")
    if wait is not None:
        p.add_argument("--max-wait", type=float, default=wait,
                       help="seconds to wait for a quiet machine (1-min load < 0.7) before measuring")
    if proxy:
        p.add_argument("--litellm-proxy", metavar="PATH",
                       help="the `litellm` CLI (or python) of an environment with litellm[proxy]; "
                            "default $CTXGATE_BENCH_LITELLM_PROXY, else .venv's if it has the proxy")
    return p


def use_uvloop() -> None:
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
