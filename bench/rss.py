"""ctxgate's resident memory (VmRSS of the server and its children) over long runs.

`ctxgate serve --workers 1` (`forwarding: auto`, in-memory session state, WAL on,
`max_input_tokens` 1,000,000 so nothing is compacted) in front of bench/upstream.py, a fresh
process per scenario; C clients in a closed loop, one pooled aiohttp session. *turns*: turns
over steady sessions, each from a ~2K-token history of trajectory messages growing by one pair
(the reply, ~150 tokens of trajectory text) a turn, starting over as a new session id past
~20K (turn sizes: the client's running o200k_base estimate); *mixed*: every other request a
new conversation (no `X-Ctx-Session`, a first message never seen before). RSS is VmRSS from
`/proc/<pid>/status`, peak is VmHWM; *after warm-up* is at 10% of the requests; *growth* is end
− after warm-up (issues 13 and 14 ask < 50 MB); *idle* is `--settle` s after the last reply;
*data dir*: the WAL and memory files at the end. RSS at every tenth of each run is listed.

    .venv/bin/python bench/rss.py [--scenarios turns,mixed] [--turns 10000] [--requests 100000]
        [--sessions 50] [--concurrency 20] [--door chat] [--out FILE]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import common  # sets LITELLM_LOCAL_MODEL_COST_MAP first
import doors
import processes

import aiohttp

Message = dict[str, Any]
USER_TOKENS = 150


def rss_mb(pid: int, field_name: str = "VmRSS") -> float:
    """VmRSS (or another /proc status field in kB) of `pid` and its descendants, in MB (10^6 bytes)."""
    todo, kb = [pid], 0
    while todo:
        p = todo.pop()
        try:
            kb += next((int(line.split()[1]) for line in Path(f"/proc/{p}/status").read_text().splitlines()
                        if line.startswith(field_name + ":")), 0)
            todo += [int(c) for task in Path(f"/proc/{p}/task").iterdir()
                     for c in (task / "children").read_text().split()]
        except (OSError, ValueError, IndexError):
            pass
    return kb * 1024 / 1e6


def user_texts(counter: Any, n: int = 400) -> list[str]:
    """Real user and tool texts from the trajectories, each cut to ~USER_TOKENS tokens."""
    texts = [counter.head(m["content"], USER_TOKENS) for _, _, msgs in common.named_trajectories() for m in msgs
             if m.get("role") in ("user", "tool") and isinstance(m.get("content"), str) and len(m["content"]) > 400]
    return texts[:n] or ["Continue with the task and report what changed in each file you touched."]


@dataclass
class Session:
    """A steady session: a history that grows by one pair a turn, starting over as a new
    session id past `max_tokens` (the tokens are the client's running o200k estimate)."""
    index: int
    run: str
    cycle: int = -1
    messages: list[Message] = field(default_factory=list)
    tokens: int = 0
    turns: int = 0

    @property
    def sid(self) -> str:
        return f"{self.run}-s{self.index}-c{self.cycle}"


@dataclass
class Result:
    scenario: str
    what: str
    requests: int
    samples: list[float] = field(default_factory=list)
    """RSS at the start and after every tenth of the requests."""
    warm_mb: float = 0.0
    settled_mb: float = 0.0
    peak_mb: float = 0.0
    errors: int = 0
    first_error: str = ""
    seconds: float = 0.0
    sessions_used: int = 0
    new_conversations: int = 0
    sizes: list[int] = field(default_factory=list)
    data_mb: float = 0.0


async def drive(res: Result, args: argparse.Namespace, door: doors.Door, base: str, pid: int,
                http: aiohttp.ClientSession, texts: list[tuple[str, int]], history: tuple[list[Message], int]) -> None:
    run, picked = f"rss-{os.urandom(3).hex()}", [0]
    sessions = [Session(i, run) for i in range(args.sessions)]
    idle: asyncio.Queue[Session] = asyncio.Queue()
    for s in sessions:
        idle.put_nowait(s)
    warm_at, tenth, counts = max(1, int(res.requests * 0.1)), max(1, res.requests // 10), {"next": 0, "done": 0}
    res.samples.append(rss_mb(pid))
    started = time.perf_counter()

    def text() -> tuple[str, int]:
        picked[0] += 1
        return texts[(picked[0] - 1) % len(texts)]

    async def send(messages: list[Message], sid: str | None) -> bool:
        try:
            error = (await door.post(http, base, messages, processes.UPSTREAM_KEY, sid))[0]
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError) as e:  # a reply not in its shape
            error = f"{type(e).__name__}: {e}"
        if error:
            res.errors += 1
            res.first_error = res.first_error or error[:400]
        return error is None

    async def turn(s: Session) -> None:
        if s.cycle < 0 or s.tokens > args.max_tokens:
            s.cycle += 1
            s.messages, s.tokens = common.fresh(history[0], f"s{s.index}.{s.cycle}"), history[1]
        words, tokens = text()
        s.messages.append({"role": "user", "content": f"[{s.sid} turn {s.turns}] {words}"})
        s.tokens += tokens + 12
        res.sizes.append(s.tokens)
        if await send(s.messages, s.sid):
            s.messages.append({"role": "assistant", "content": "ok"})
            s.tokens, s.turns = s.tokens + 5, s.turns + 1
        else:  # a failed turn: its user message goes, to be sent again next time
            s.messages.pop()

    async def worker() -> None:
        while counts["next"] < res.requests:
            i = counts["next"]
            counts["next"] += 1
            if res.scenario == "mixed" and i % 2 == 0:
                res.new_conversations += 1
                await send([{"role": "system", "content": "You are a careful software engineer working in a "
                             "repository."}, {"role": "user", "content": f"[{run} new conversation {i}] {text()[0]}"}],
                           None)
            else:
                s = await idle.get()
                try:
                    await turn(s)
                finally:
                    idle.put_nowait(s)
            counts["done"] += 1
            if counts["done"] == warm_at:
                res.warm_mb = rss_mb(pid)
            if counts["done"] % tenth == 0:
                res.samples.append(rss_mb(pid))
                common.progress(f"  {res.scenario}: {counts['done']:,}/{res.requests:,} requests, RSS "
                                f"{res.samples[-1]:.1f} MB, {time.perf_counter() - started:.0f}s, errors {res.errors}")

    await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    res.seconds = time.perf_counter() - started
    res.samples.append(rss_mb(pid))
    await asyncio.sleep(args.settle)
    res.settled_mb, res.peak_mb = rss_mb(pid), rss_mb(pid, "VmHWM")
    res.sessions_used = sum(s.cycle + 1 for s in sessions)


async def main_async(args: argparse.Namespace, door: doors.Door) -> list[Result]:
    counter = common.gpt4o_counter()
    base = common.build_conversation(args.start_tokens, counter)
    texts = [(t, counter.count_structured({"role": "user", "content": t})) for t in user_texts(counter)]
    results = []
    for scenario in args.scenarios:
        total = args.turns if scenario == "turns" else args.requests
        res = Result(scenario, f"{total:,} turns over {args.sessions} steady sessions" if scenario == "turns" else
                     f"{total:,} requests: every other one a new conversation, the rest turns of {args.sessions} "
                     "sessions", total)
        with processes.Servers("ctxgate-rss-") as servers:  # a fresh ctxgate per scenario: an empty process
            upstream = servers.upstream()
            gw = servers.ctxgate(processes.ctxgate_config(upstream.url, servers.workdir), workers=1)
            common.progress(f"rss: {scenario}: ctxgate pid {gw.popen.pid} at {gw.url}, {total:,} requests, "
                            f"concurrency {args.concurrency}, door {door.name}")
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
            async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=300)) as http:
                await drive(res, args, door, gw.url, gw.popen.pid, http, texts, (base, counter.count_messages(base)))
            data = servers.workdir / "data-auto"
            res.data_mb = sum(f.stat().st_size for f in data.rglob("*") if f.is_file()) / 1e6
            if gw.popen.poll() is not None:
                res.first_error = res.first_error or f"ctxgate exited with {gw.popen.returncode}"
            errors = [line for line in gw.log.read_text(errors="replace").splitlines() if "error" in line.lower()]
            if errors:
                common.progress(f"rss: {scenario}: ctxgate logged errors:\n" + "\n".join(errors)[-1500:])
        results.append(res)
        common.progress(f"rss: {scenario}: start {res.samples[0]:.1f} MB, after warm-up {res.warm_mb:.1f} MB, end "
                        f"{res.samples[-1]:.1f} MB, peak {res.peak_mb:.1f} MB; {res.seconds:.0f}s, errors {res.errors}"
                        + (f" ({res.first_error})" if res.first_error else ""))
    return results


def write_results(args: argparse.Namespace, results: list[Result], door: str) -> None:
    lines = [common.section_header("RSS: ctxgate's memory over long runs"), "", common.about(__doc__)
             + f"\n\n{args.concurrency} clients, {door} door, idle after {args.settle:g} s.\n"]
    rows = [[r.scenario, f"{r.requests:,}", f"{r.samples[0]:.1f}", f"{r.warm_mb:.1f}", f"{r.samples[-1]:.1f}",
             f"{r.samples[-1] - r.warm_mb:+.1f}", f"{r.settled_mb:.1f}", f"{r.peak_mb:.1f}", f"{r.sessions_used:,}",
             f"{r.new_conversations:,}", f"{min(r.sizes, default=0):,}–{max(r.sizes, default=0):,}",
             f"{r.data_mb:.1f}", f"{r.seconds:.0f}", r.errors] for r in results]
    lines.append(common.table(["scenario", "requests", "start MB", "after warm-up MB", "end MB", "growth MB",
                               "idle MB", "peak MB", "session ids", "new conversations", "turn size, tokens (est.)",
                               "data dir MB", "seconds", "errors"], rows, "lrrrrrrrrrrrrr") + "\n")
    lines += [f"- {r.scenario}: {r.what}; RSS MB at the start and every tenth: "
              + ", ".join(f"{mb:.0f}" for mb in r.samples) + (f"; first error: `{r.first_error}`" if r.first_error
                                                              else "") for r in results]
    common.publish("rss", "\n".join(lines) + "\n", args.out)


def main() -> None:
    p = common.parser(__doc__)
    p.add_argument("--scenarios", type=lambda v: v.split(","), default=["turns", "mixed"], help="turns, mixed")
    p.add_argument("--turns", type=int, default=10_000, help="requests of the turns scenario (issue 13: 10,000)")
    p.add_argument("--requests", type=int, default=100_000, help="requests of the mixed scenario (issue 14: 100,000)")
    p.add_argument("--sessions", type=int, default=50, help="steady sessions")
    p.add_argument("--concurrency", type=int, default=20)
    p.add_argument("--start-tokens", type=int, default=2_000, help="a session's first history, tokens")
    p.add_argument("--max-tokens", type=int, default=20_000, help="past this, a session starts over as a new one")
    p.add_argument("--settle", type=float, default=5.0, help="idle seconds before the last RSS reading")
    p.add_argument("--door", default="chat", choices=list(doors.DOORS))
    args = p.parse_args()
    unknown = [s for s in args.scenarios if s not in ("turns", "mixed")]
    if unknown:
        p.error(f"unknown scenario(s) {unknown}: turns, mixed")
    common.use_uvloop()
    write_results(args, asyncio.run(main_async(args, doors.DOORS[args.door])), args.door)


if __name__ == "__main__":
    main()
