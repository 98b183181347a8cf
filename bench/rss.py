"""ctxgate's resident memory (VmRSS of the server and its children) over long runs.

One `ctxgate serve --workers 1` (the overhead bench's config, WAL on) per scenario in front of
bench/upstream.py; C closed-loop clients. *turns*: `--turns` turns over `--sessions` steady
sessions, each from a ~2K-token history growing by a reply and ~150 tokens of trajectory text
a turn, starting over as a new session id past ~20K; *mixed*: `--requests` requests, every
other one a new conversation. Issues 13 and 14 ask growth < 50 MB from the warm-up mark (10%
of the requests) to the end. Writes bench/rss.png and bench/rss.json too, unless `--out`.

    .venv/bin/python bench/rss.py [--scenarios turns,mixed] [--turns 10000] [--requests 100000]
        [--sessions 50] [--concurrency 20] [--door chat] [--out FILE]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import common  # sets LITELLM_LOCAL_MODEL_COST_MAP first
import doors

import aiohttp
import orjson

Message = dict[str, Any]
WARMUP_FRACTION = 0.10
USER_TOKENS = 150


def _children(pid: int) -> list[int]:
    out = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            text = (task / "children").read_text().split()
            out.extend(int(c) for c in text)
    except OSError:
        pass
    return out


def _status_kb(pid: int, field_name: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def rss_mb(pid: int, field_name: str = "VmRSS") -> float:
    """VmRSS (or another /proc status field in kB) of `pid` and its descendants, in MB (10^6 bytes)."""
    todo, total = [pid], 0
    while todo:
        p = todo.pop()
        total += _status_kb(p, field_name)
        todo.extend(_children(p))
    return total * 1024 / 1e6


def dir_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 1e6 if path.exists() else 0.0


def user_texts(counter: Any, n: int = 400) -> list[str]:
    """Real user and tool texts from the trajectories, each cut to ~USER_TOKENS tokens."""
    out: list[str] = []
    for _, _, msgs in common.named_trajectories():
        for m in msgs:
            if m.get("role") in ("user", "tool") and isinstance(m.get("content"), str) and len(m["content"]) > 400:
                out.append(counter.head(m["content"], USER_TOKENS))
                if len(out) >= n:
                    return out
    return out or ["Continue with the task and report what changed in each file you touched."]


@dataclass
class Session:
    index: int
    run: str
    cycle: int = 0
    messages: list[Message] = field(default_factory=list)
    tokens: int = 0
    turns: int = 0

    @property
    def sid(self) -> str:
        return f"{self.run}-s{self.index}-c{self.cycle}"


class Conversations:
    """The steady sessions (each a history that grows by one pair a turn, restarting as a new
    session past `max_tokens`) and the new conversations of the mixed scenario."""

    def __init__(self, base: list[Message], base_tokens: int, texts: list[str], text_tokens: list[int],
                 max_tokens: int, run: str) -> None:
        self.base, self.base_tokens, self.texts, self.text_tokens = base, base_tokens, texts, text_tokens
        self.max_tokens, self.run = max_tokens, run
        self.sizes: list[int] = []
        self._n = 0

    def start(self, s: Session) -> None:
        s.messages = common.fresh(self.base, f"s{s.index}.{s.cycle}")
        s.tokens = self.base_tokens

    def next_turn(self, s: Session) -> list[Message]:
        """The request of this session's next turn: its history plus one new user message (the
        previous reply was appended when it came)."""
        if s.tokens > self.max_tokens:
            s.cycle += 1
            self.start(s)
        k = self._n % len(self.texts)
        self._n += 1
        s.messages.append({"role": "user", "content": f"[{s.sid} turn {s.turns}] {self.texts[k]}"})
        s.tokens += self.text_tokens[k] + 12
        self.sizes.append(s.tokens)
        return s.messages

    @staticmethod
    def answered(s: Session, reply: str) -> None:
        s.messages.append({"role": "assistant", "content": reply})
        s.tokens += 5
        s.turns += 1

    def new_conversation(self, i: int) -> list[Message]:
        k = self._n % len(self.texts)
        self._n += 1
        return [{"role": "system", "content": "You are a careful software engineer working in a repository."},
                {"role": "user", "content": f"[{self.run} new conversation {i}] {self.texts[k]}"}]


@dataclass
class Result:
    scenario: str
    what: str
    requests: int
    samples: list[tuple[int, float]] = field(default_factory=list)
    start_mb: float = 0.0
    warm_mb: float = 0.0
    end_mb: float = 0.0
    settled_mb: float = 0.0
    peak_mb: float = 0.0
    errors: int = 0
    first_error: str = ""
    seconds: float = 0.0
    sessions_used: int = 0
    new_conversations: int = 0
    tokens_lo: int = 0
    tokens_hi: int = 0
    data_mb: float = 0.0


async def drive(scenario: str, total: int, args: argparse.Namespace, convs: Conversations, door: doors.Door,
                base: str, pid: int, http: aiohttp.ClientSession) -> Result:
    what = (f"{total:,} turns over {args.sessions} steady sessions" if scenario == "turns" else
            f"{total:,} requests: every other one a new conversation, the rest turns of {args.sessions} sessions")
    res = Result(scenario, what, total)
    sessions = [Session(i, convs.run) for i in range(args.sessions)]
    for s in sessions:
        convs.start(s)
    idle: asyncio.Queue[Session] = asyncio.Queue()
    for s in sessions:
        idle.put_nowait(s)
    every = args.sample_every or max(1, total // 200)
    warm_at = max(1, int(total * WARMUP_FRACTION))
    counter = {"next": 0, "done": 0}
    res.start_mb = rss_mb(pid)
    res.samples.append((0, res.start_mb))
    started = time.perf_counter()

    async def send(messages: list[Message], sid: str | None) -> str | None:
        try:
            error = (await door.post(http, base, messages, common.UPSTREAM_KEY, sid))[0]
            if error:
                raise RuntimeError(error)
            return "ok"
        except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError, orjson.JSONDecodeError, KeyError) as e:
            res.errors += 1
            if not res.first_error:
                res.first_error = f"{type(e).__name__}: {e}"[:400]
            return None

    async def worker() -> None:
        while counter["next"] < total:
            i = counter["next"]
            counter["next"] += 1
            if scenario == "mixed" and i % 2 == 0:
                res.new_conversations += 1
                await send(convs.new_conversation(i), None)
            else:
                s = await idle.get()
                try:
                    reply = await send(convs.next_turn(s), s.sid)
                    if reply is not None:
                        convs.answered(s, reply)
                    else:  # a failed turn: drop the unanswered user message, retry it next time
                        s.messages.pop()
                finally:
                    idle.put_nowait(s)
            counter["done"] += 1
            done = counter["done"]
            if done % every == 0 or done == warm_at or done == total:
                mb = rss_mb(pid)
                res.samples.append((done, mb))
                if done == warm_at:
                    res.warm_mb = mb
            if done % max(1, total // 10) == 0:
                common.progress(f"  {scenario}: {done:,}/{total:,} requests, RSS {rss_mb(pid):.1f} MB, "
                                f"{time.perf_counter() - started:.0f}s, errors {res.errors}")

    await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    res.seconds = time.perf_counter() - started
    res.end_mb = rss_mb(pid)
    await asyncio.sleep(args.settle)
    res.settled_mb = rss_mb(pid)
    res.peak_mb = rss_mb(pid, "VmHWM")
    res.sessions_used = sum(s.cycle + 1 for s in sessions)
    res.tokens_lo, res.tokens_hi = (min(convs.sizes), max(convs.sizes)) if convs.sizes else (0, 0)
    return res


async def main_async(args: argparse.Namespace) -> tuple[list[Result], str]:
    counter = common.gpt4o_counter()
    base = common.build_conversation(args.start_tokens, counter)
    base_tokens = counter.count_messages(base)
    texts = user_texts(counter)
    text_tokens = [counter.count_structured({"role": "user", "content": t}) for t in texts]
    door = doors.DOORS[args.door]
    results: list[Result] = []
    for scenario in args.scenarios:
        total = args.turns if scenario == "turns" else args.requests
        with common.Servers("ctxgate-rss-") as servers:  # a fresh ctxgate per scenario: an empty process
            upstream = servers.upstream()
            gw = servers.ctxgate(common.ctxgate_config(upstream.url, servers.workdir), workers=1)
            common.progress(f"rss: {scenario}: ctxgate pid {gw.popen.pid} at {gw.url}, {total:,} requests, "
                            f"concurrency {args.concurrency}, door {door.name}")
            convs = Conversations(base, base_tokens, texts, text_tokens, args.max_tokens,
                                  f"rss-{os.urandom(3).hex()}")
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
            async with aiohttp.ClientSession(connector=connector,
                                             timeout=aiohttp.ClientTimeout(total=300)) as http:
                res = await drive(scenario, total, args, convs, door, gw.url, gw.popen.pid, http)
            res.data_mb = dir_mb(servers.workdir / "data-auto")
            if gw.popen.poll() is not None:
                res.first_error = res.first_error or f"ctxgate exited with {gw.popen.returncode}"
            log = gw.log.read_text(errors="replace")
            if "Traceback" in log or " ERROR " in log:
                tail = "\n".join(line for line in log.splitlines() if "ERROR" in line or "Error" in line)[-1500:]
                common.progress(f"rss: {scenario}: ctxgate logged errors:\n{tail}")
            results.append(res)
            common.progress(f"rss: {scenario}: start {res.start_mb:.1f} MB, after warm-up {res.warm_mb:.1f} MB, "
                            f"end {res.end_mb:.1f} MB (growth {res.end_mb - res.warm_mb:+.1f} MB), after "
                            f"{args.settle:g}s idle {res.settled_mb:.1f} MB, peak {res.peak_mb:.1f} MB; "
                            f"{res.seconds:.0f}s, turn sizes {res.tokens_lo:,}–{res.tokens_hi:,} tokens, "
                            f"{res.sessions_used} session ids, {res.new_conversations:,} new conversations, data dir "
                            f"{res.data_mb:.1f} MB, errors {res.errors}"
                            + (f" ({res.first_error})" if res.first_error else ""))
    return results, door.name


def draw(results: list[Result], out: Path) -> None:
    common.draw(out, "ctxgate RSS (VmRSS) over requests", "requests answered", "ctxgate RSS, MB",
                {f"{r.scenario}: {r.requests:,} requests": {"RSS": ([s[0] for s in r.samples],
                                                                   [s[1] for s in r.samples])} for r in results})


def write_results(args: argparse.Namespace, results: list[Result], door: str, chart: bool) -> None:
    lines = [common.section_header("RSS: ctxgate's memory over long runs"), ""]
    lines.append(
        "`bench/rss.py`: `ctxgate serve --workers 1` (`forwarding: auto`, in-memory session state, WAL on, "
        "`max_input_tokens` 1,000,000 so nothing is compacted) in front of `bench/upstream.py`, a fresh process "
        f"per scenario; {args.concurrency} clients in a closed loop, {door} door, one pooled aiohttp session. "
        "RSS is VmRSS from `/proc/<pid>/status`; *after warm-up* is at 10% of the requests; *growth* is end − "
        f"after warm-up (issues 13 and 14 ask < 50 MB); *idle* is {args.settle:g} s after the last reply; peak "
        "is VmHWM. Sessions start from a ~2K-token history of trajectory messages and grow by one pair (the "
        "reply, ~150 tokens of user text) a turn; past ~20K tokens a session ends and a new session id starts "
        "over from a fresh history (turn sizes: the client's running o200k_base estimate). Mixed: every other "
        "request a new conversation (no `X-Ctx-Session`, a first message never seen before). *data dir*: the WAL "
        "and memory files at the end.\n")
    rows = []
    for r in results:
        rows.append([r.scenario, f"{r.requests:,}", f"{r.start_mb:.1f}", f"{r.warm_mb:.1f}", f"{r.end_mb:.1f}",
                     f"{r.end_mb - r.warm_mb:+.1f}", f"{r.settled_mb:.1f}", f"{r.peak_mb:.1f}",
                     f"{r.sessions_used:,}", f"{r.new_conversations:,}", f"{r.tokens_lo:,}–{r.tokens_hi:,}",
                     f"{r.data_mb:.1f}", f"{r.seconds:.0f}", r.errors])
    lines.append(common.table(["scenario", "requests", "start MB", "after warm-up MB", "end MB",
                               "growth MB", "idle MB", "peak MB", "session ids", "new conversations",
                               "turn size, tokens (est.)", "data dir MB", "seconds", "errors"], rows,
                              "lrrrrrrrrrrrrr") + "\n")
    for r in results:
        lines.append(f"- {r.scenario}: {r.what}" + (f"; first error: `{r.first_error}`" if r.first_error else ""))
    lines.append("")
    if chart:
        lines.append("![ctxgate RSS over requests](rss.png)\n\n[rss.png](rss.png): RSS against requests answered, "
                     "per scenario; the samples are in `bench/rss.json`.\n")
    common.publish("rss", "\n".join(lines), args.out)


def main() -> None:
    p = common.parser(__doc__)
    p.add_argument("--scenarios", type=lambda v: v.split(","), default=["turns", "mixed"], help="turns, mixed")
    p.add_argument("--turns", type=int, default=10_000, help="requests of the turns scenario (issue 13: 10,000)")
    p.add_argument("--requests", type=int, default=100_000, help="requests of the mixed scenario (issue 14: 100,000)")
    p.add_argument("--sessions", type=int, default=50, help="steady sessions")
    p.add_argument("--concurrency", type=int, default=20)
    p.add_argument("--start-tokens", type=int, default=2_000, help="a session's first history, tokens")
    p.add_argument("--max-tokens", type=int, default=20_000, help="past this, a session starts over as a new one")
    p.add_argument("--sample-every", type=int, default=0, help="read RSS every N replies (default: 200 samples)")
    p.add_argument("--settle", type=float, default=5.0, help="idle seconds before the last RSS reading")
    p.add_argument("--door", default="chat", choices=list(doors.DOORS))
    args = p.parse_args()
    unknown = [s for s in args.scenarios if s not in ("turns", "mixed")]
    if unknown:
        p.error(f"unknown scenario(s) {unknown}: turns, mixed")
    common.use_uvloop()
    results, door = asyncio.run(main_async(args))
    png = Path(tempfile.gettempdir()) / "ctxgate-rss-smoke.png" if args.out else common.BENCH / "rss.png"
    chart = False
    try:
        draw(results, png)
        chart = True
        common.progress(f"rss: drew {png}")
    except ImportError as e:
        common.progress(f"rss: no chart ({e}; `pip install -e '.[bench]'`)")
    if not args.out:
        (common.BENCH / "rss.json").write_bytes(orjson.dumps(
            {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": common.command_line(),
             "results": [{**{k: v for k, v in vars(r).items() if k != "samples"}, "samples": r.samples}
                         for r in results]}, option=orjson.OPT_INDENT_2))
    write_results(args, results, door, chart)


if __name__ == "__main__":
    main()
