"""What the benchmarks share: recorded runs as requests, conversations of a given size, the
servers of a run (`ctxgate serve`, the scripted upstream, the LiteLLM proxy) and the
RESULTS.md section (its header says the command, machine, code and load).

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
import shutil  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import urllib.request  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Iterable  # noqa: E402

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
RESULTS = BENCH / "RESULTS.md"
sys.path.insert(0, str(ROOT / "tests"))

import doors  # noqa: E402
import yaml  # noqa: E402
from ctxgate.pipeline.conversation import split_units  # noqa: E402
from ctxgate.pipeline.tokens import TokenCounter, TokenizerRegistry  # noqa: E402
from ctxgate.pipeline.turns import is_valid_sequence  # noqa: E402
from servers import free_port  # noqa: E402  (tests/servers.py)
from trajectories import Trajectory, all_trajectories, every_dialect  # noqa: E402

Message = dict[str, Any]
CLIENT_KEEPALIVE_S = 2.0
"""Below the LiteLLM proxy's idle keep-alive (uvicorn: 5 s), so no request goes out on a
connection the server is closing."""


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
    """A run's processes, in a temporary folder: each started and healthy, all stopped (last
    first) and the folder removed on leaving the `with`."""

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
        port = free_port()
        return self.start("upstream", [sys.executable, str(BENCH / "upstream.py"), "--port", str(port)], port)

    def ctxgate(self, config: dict[str, Any], name: str = "ctxgate", workers: int | None = None,
                env: dict[str, str] | None = None) -> Proc:
        port, path = free_port(), self.workdir / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config))
        argv = [str(VENV_BIN / "ctxgate"), "serve", "--config", str(path), "--port", str(port),
                "--log-level", "WARNING"] + (["--workers", str(workers)] if workers else [])
        return self.start(name, argv, port, env={**SERVER_ENV, **(env or {})})

    def litellm_proxy(self, path: str | None, upstream: str, workers: int | None = None) -> doors.Target | str:
        """The LiteLLM proxy on the bench's routes, as a target with its master key, or why it
        did not start (see `litellm_proxy_command`)."""
        argv, version = litellm_proxy_command(path)
        if argv is None:
            return version
        port, path, master = free_port(), str(self.workdir / "litellm-proxy.yaml"), f"sk-bench-{os.urandom(16).hex()}"
        Path(path).write_text(yaml.safe_dump({"model_list": doors.model_list(upstream, UPSTREAM_KEY),
                                              "general_settings": {"master_key": master}}))
        extra = ["--num_workers", str(workers)] if workers else []
        proc = self.start("litellm-proxy", [*argv, "--config", path, "--port", str(port), *extra], port,
                          "/health/liveliness", SERVER_ENV, timeout=180)
        return doors.Target(f"LiteLLM proxy {version}", proc.url, master)


def proxy_note(proxy: doors.Target | str) -> str:
    """A section's word on the LiteLLM proxy: its version, or why it did not run."""
    return f"litellm {proxy.name.split()[-1]}." if isinstance(proxy, doors.Target) else f"**not run** ({proxy})."


def litellm_proxy_command(path: str | None) -> tuple[list[str] | None, str]:
    """How to start the LiteLLM proxy and its litellm version, or (None, why not).

    `path` (--litellm-proxy, else $CTXGATE_BENCH_LITELLM_PROXY) is the `litellm` script of an
    environment with `litellm[proxy]`, or that environment's python; without it, .venv's own
    `litellm` if `litellm.proxy.proxy_server` imports there."""
    path = path or os.environ.get("CTXGATE_BENCH_LITELLM_PROXY")
    if path:
        exe = Path(path).absolute()  # the servers start in a temporary folder
        if not exe.exists():
            return None, f"{path} does not exist"
        is_python = exe.name.startswith("python")
        python = exe if is_python else exe.parent / "python"
        argv = [str(exe), "-m", "litellm.proxy.proxy_cli"] if is_python else [str(exe)]
    else:
        python, argv = VENV_BIN / "python", [str(VENV_BIN / "litellm")]
    r = subprocess.run([str(python), "-c", "import importlib.metadata as m, litellm.proxy.proxy_server; "
                        "print(m.version('litellm'))"], capture_output=True, text=True, timeout=300,
                       env={**os.environ, **SERVER_ENV})
    if r.returncode != 0:
        return None, f"`import litellm.proxy.proxy_server` fails with {python}: " \
                     f"{(r.stderr.strip().splitlines() or ['?'])[-1]}"
    return argv, r.stdout.strip().splitlines()[-1]


def ctxgate_config(upstream: str, workdir: Path, forwarding: str = "auto", state: str | None = None,
                   max_input_tokens: int = 1_000_000, **settings: Any) -> dict[str, Any]:
    """The bench's routes on `upstream` (nothing compacted at 1,000,000), its own data folder;
    `state`: a redis:// URL; `settings`: more of the `ctxgate` section."""
    ctx: dict[str, Any] = {"forwarding": forwarding, "data_dir": str(workdir / f"data-{forwarding}"), **settings}
    if state:
        ctx["state"] = state
    return {"model_list": doors.model_list(upstream, UPSTREAM_KEY, max_input_tokens=max_input_tokens),
            "ctxgate": ctx}
