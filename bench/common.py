"""Shared helpers of the benchmarks: trajectories as requests, conversations of a given
size, machine info, and the RESULTS.md section writer.

Nothing here downloads anything: tiktoken's BPE files come from the litellm wheel (set up
by ctxgate.pipeline.tokens on import) and the trajectories are the files in
../shared/trajectories, loaded by tests/trajectories.py.
"""
from __future__ import annotations

import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # before anything imports litellm

import argparse
import asyncio
import copy
import datetime as _dt
import platform
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterable

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
from servers import free_port  # noqa: E402  (tests/servers.py)
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


def fresh(messages: list[Message], i: int | str) -> list[Message]:
    """The conversation with `<i> ` in front of every message's text: nothing cached."""
    out = []
    for m in messages:
        m = dict(m)
        m["content"] = f"<{i}> " + (m.get("content") or "")
        out.append(m)
    return out


TURNS_PER_SESSION = 10
"""A session runs this many turns, then the next one starts (same history): the request
size stays within ~20 short messages of the nominal size however many iterations run."""


def turn(base: list[Message], i: int) -> list[Message]:
    """Iteration i: turn k = i % 10 of session i // 10 — the history, then k+1 pairs of
    (the upstream's reply, a new user message). Each turn resends the previous turn's
    messages unchanged and adds two, the second never seen before."""
    session, k = divmod(i, TURNS_PER_SESSION)
    extra: list[Message] = []
    for j in range(k + 1):
        extra.append({"role": "assistant", "content": "ok"})
        extra.append({"role": "user", "content": f"Next step {session * TURNS_PER_SESSION + j}: continue with the "
                                                 f"task and report what changed."})
    return base + extra



SUMMARY = ("1. Goal: finish the task the user gave.\n2. Completed steps: explored the repository, reproduced the "
           "bug, edited the code.\n3. Key decisions: used str_replace_editor and execute_bash.\n4. Open issues: "
           "the tests still need to run.\n5. Files: see the restored state.\n6. Skill/tool context: none active.")


async def instant_summary(_prompt: list[Message]) -> str:
    """A fixed six-field summary at once: ctxgate's own work without the LLM call."""
    return SUMMARY


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


_PUBLISHED: set[str] = set()


def publish(key: str, markdown: str, out: str | None) -> None:
    """Print a benchmark's markdown and write it to its section of RESULTS.md or, with `out`,
    to that file (every section of the run, one after the other)."""
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
    align = align or "l" + "r" * (len(headers) - 1)
    marks = {"l": ":---", "r": "---:", "c": ":---:"}
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(marks[a] for a in align) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(str(c) for c in r) + " |")
    return "\n".join(lines)


def parser(doc: str | None, *, out: bool = True, wait: float | None = None,
           proxy: bool = False) -> argparse.ArgumentParser:
    """A bench's argument parser, its description the docstring's first paragraph: `--out`
    (the markdown to a file, RESULTS.md and the bench's other files left alone), `--max-wait`
    (a quiet machine, `wait` seconds by default) and `--litellm-proxy`, as asked."""
    p = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])
    if out:
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


# ---------------------------------------------------------------------------------------
# Servers: the scripted upstream, `ctxgate serve`, the LiteLLM proxy, as real processes

VENV_BIN = Path(sys.executable).parent
UPSTREAM_KEY = "sk-bench-upstream"
SERVER_ENV = {"LITELLM_LOCAL_MODEL_COST_MAP": "True"}


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    url: str

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)


class Servers:
    """The processes of one bench run, in a temporary folder: each started and healthy, all
    stopped (last started first) and the folder removed on leaving the `with`."""

    def __init__(self, prefix: str) -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix=prefix))
        self.procs: list[Proc] = []

    def __enter__(self) -> "Servers":
        return self

    def __exit__(self, *exc: object) -> None:
        for p in reversed(self.procs):
            p.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def start(self, name: str, argv: list[str], port: int, health: str = "/healthz",
              env: dict[str, str] | None = None, timeout: float = 120.0) -> Proc:
        """Start `argv` (listening on `port`), wait until `health` answers 200 (the LiteLLM
        proxy's is /health/liveliness)."""
        base, log = f"http://127.0.0.1:{port}", self.workdir / f"{name}.log"
        popen = subprocess.Popen(argv, stdout=open(log, "wb"), stderr=subprocess.STDOUT, cwd=self.workdir,
                                 env={**os.environ, **(env or {})})
        self.procs.append(Proc(name, popen, log, base))
        deadline = time.monotonic() + timeout
        while True:
            if popen.poll() is not None:
                raise RuntimeError(f"{name} exited with {popen.returncode}:\n{log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(base + health, timeout=1) as r:
                    if r.status == 200:
                        return self.procs[-1]
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not become healthy in {timeout}s:\n{log.read_text()[-3000:]}")
            time.sleep(0.1)

    def upstream(self) -> Proc:
        """bench/upstream.py, the scripted "ok" upstream."""
        port = free_port()
        return self.start("upstream", [sys.executable, str(BENCH / "upstream.py"), "--port", str(port)], port)

    def ctxgate(self, config: dict[str, Any], name: str = "ctxgate", workers: int | None = None,
                env: dict[str, str] | None = None) -> Proc:
        """`ctxgate serve` with this config (written as YAML beside its log)."""
        import yaml

        port, path = free_port(), self.workdir / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config))
        argv = [str(VENV_BIN / "ctxgate"), "serve", "--config", str(path), "--port", str(port),
                "--log-level", "WARNING"] + (["--workers", str(workers)] if workers else [])
        return self.start(name, argv, port, env={**SERVER_ENV, **(env or {})})

    def litellm_proxy(self, argv: list[str], upstream: str, version: str, workers: int | None = None
                      ) -> tuple[Proc, str]:
        """The LiteLLM proxy on the bench's routes; (the process, its master key: it refuses to start without)."""
        import doors
        import yaml

        port, path, master = free_port(), self.workdir / "litellm-proxy.yaml", f"sk-bench-{os.urandom(16).hex()}"
        path.write_text(yaml.safe_dump({"model_list": doors.model_list(upstream, UPSTREAM_KEY),
                                        "general_settings": {"master_key": master}}))
        extra = ["--num_workers", str(workers)] if workers else []
        proc = self.start("litellm-proxy", [*argv, "--config", str(path), "--port", str(port), *extra], port,
                          "/health/liveliness", SERVER_ENV, timeout=180)
        proc.name = f"LiteLLM proxy {version}"
        return proc, master


def ctxgate_config(upstream: str, workdir: Path, forwarding: str = "auto", state: str | None = None,
                   max_input_tokens: int = 1_000_000, **settings: Any) -> dict[str, Any]:
    """The benches' gateway: the bench's routes on `upstream` (`max_input_tokens` 1,000,000:
    nothing compacted), its own data folder; `state`: ctxgate.state (a redis:// URL, which
    `serve --workers N` with N > 1 needs); `settings`: more of the `ctxgate` section."""
    import doors

    ctx: dict[str, Any] = {"forwarding": forwarding, "data_dir": str(workdir / f"data-{forwarding}"), **settings}
    if state:
        ctx["state"] = state
    return {"model_list": doors.model_list(upstream, UPSTREAM_KEY, max_input_tokens=max_input_tokens),
            "ctxgate": ctx}


async def closed_loop(send: Callable[[int, int], Awaitable[str | None]], concurrency: int, seconds: float
                      ) -> tuple[list[float], int, list[str]]:
    """`concurrency` clients, each sending its next request (`send(client, i)`: None when
    answered, else the error) as soon as the previous one is answered, for one second of
    warm-up and `seconds` more: (latencies in ms of the replies in the measured window,
    replies in all, errors)."""
    in_window: list[float] = []
    answered, errors = [0], []
    t0 = time.perf_counter()
    window = (t0 + 1.0, t0 + 1.0 + seconds)

    async def client(w: int) -> None:
        i = 0
        while time.perf_counter() < window[1]:
            started = time.perf_counter()
            error = await send(w, i)
            end = time.perf_counter()
            if error is None:
                answered[0] += 1
                if window[0] <= end <= window[1]:
                    in_window.append((end - started) * 1000)
            else:
                errors.append(error)
            i += 1

    await asyncio.gather(*(client(w) for w in range(concurrency)))
    return in_window, answered[0], errors
