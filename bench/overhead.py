"""The latency ctxgate adds over calling the same scripted upstream directly, per door.

`ctxgate serve` twice (`forwarding: auto` and `forwarding: litellm`), the bare relay
(bench/relay.py: an aiohttp server that forwards the bytes and nothing else, the floor of any
proxy on aiohttp) and, when an environment with `litellm[proxy]` is given, the LiteLLM proxy
(same `model_list`, plus the master key it refuses to start without; `make bench` makes
`.bench-litellm-proxy/`) in front of `bench/upstream.py` (a fixed "ok" in each API's shape, no
input `usage`; with `stream: true`, that API's SSE events; `--delay-ms 0,200`: the whole run
once per delay, the upstream answering that late), all on 127.0.0.1. Each iteration this process (one pooled aiohttp
session) builds one conversation of real trajectory messages (common.build_conversation),
writes it in each door's wire format (bench/doors.py: the same content in each, the chat,
Messages and Gemini bodies declaring the same tools, those the conversation calls; a `-stream`
door's whole stream is read, to its terminator) and sends it through every (door, target) lane
in a shuffled order; `direct` is a POST to the upstream's own endpoint for that door.
*Added*: target − direct on the same door, paired per iteration (p50 / p95 / p99 of the differences).
`X-Ctx-Overhead-Ms`: ctxgate's own report of its time, upstream excluded. conv-<size>: a conversation never seen
(every message prefixed anew); turn-<size>: the next turn of a session (ten turns each; a session's
first turn is a new conversation, conv-<size>'s case, and is not measured there). Routes: `gpt-4o` →
`openai/gpt-4o` (chat, Responses, and Gemini's generateContent, which ctxgate sends on as a chat
completion and renders back; its `direct` is the upstream's own generateContent; the LiteLLM
proxy is not sent it), `claude-sonnet-4-5` → `anthropic/claude-sonnet-4-5` (Messages),
`max_input_tokens` 1,000,000: nothing compacted (X-Ctx-Levels). `X-Ctx-Tokenizer`:
how ctxgate counted (no local Claude tokenizer: the Messages door counts an estimate, UTF-8
bytes / 3, where chat and Responses run tiktoken).

    .venv/bin/python bench/overhead.py [--sizes 1K,10K,50K,100K,200K,400K] [--kinds conv,turn]
        [--small 40] [--mid 20] [--large 10] [--doors chat,messages,...] [--litellm-proxy PATH]
        [--forwarding auto,litellm] [--delay-ms 0,200] [--gc python,server]
"""
from __future__ import annotations

import argparse
import asyncio
import random
import re
import time
from dataclasses import dataclass, field
from typing import Any

import common  # sets LITELLM_LOCAL_MODEL_COST_MAP first
import doors
import processes
from ctxgate.pipeline.tokens import TokenCounter

import aiohttp

DIRECT = "direct"
RELAY = "bare relay"
UPSTREAM_KEY = processes.UPSTREAM_KEY


@dataclass
class Scenario:
    name: str
    what: str
    kind: str  # "fresh" | "turn"
    base: list[dict[str, Any]]
    iterations: int
    warmup: int
    size: int = 0
    tokens: list[int] = field(default_factory=list)
    body_bytes: dict[str, int] = field(default_factory=dict)

    def messages(self, i: int, door: str) -> list[dict[str, Any]]:
        """Iteration i's conversation for a door (a new one is new to each door: else the second
        door would find it counted and known)."""
        return common.fresh(self.base, f"{i}:{door}") if self.kind == "fresh" else common.turn(self.base, i)


def size_label(size: int) -> str:
    return f"{size // 1000}K" if size % 1000 == 0 else str(size)


def parse_size(text: str) -> int:
    text = text.strip().upper()
    return int(float(text[:-1]) * 1000) if text.endswith("K") else int(text)


def iterations_for(size: int, args: argparse.Namespace) -> tuple[int, int]:
    """(measured iterations, warm-up) for a conversation of `size` tokens."""
    if size <= 10_000:
        return args.small, 3
    if size <= 100_000:
        return args.mid, 2
    return args.large, 2


Lane = tuple[doors.Door, doors.Target]


def measured(sc: Scenario, i: int) -> bool:
    """Iteration `i` is measured: past the warm-up, and not a session's first turn (a new
    conversation, which conv-<size> measures) when the scenario is steady turns."""
    return i >= sc.warmup and (sc.kind != "turn" or i % common.TURNS_PER_SESSION != 0)


def key(door: doors.Door, t: doors.Target) -> str:
    return f"{door.name}|{t.name}"


async def run_scenario(sc: Scenario, lanes: list[Lane], http: aiohttp.ClientSession, counter: TokenCounter,
                       rng: random.Random) -> dict[str, list[doors.Sample]]:
    """Every iteration: one conversation, in each door's format, through every lane, shuffled."""
    samples: dict[str, list[doors.Sample]] = {key(d, t): [] for d, t in lanes}
    cold: dict[str, doors.Sample] = {}
    run_id = f"{sc.name}-{rng.randrange(1 << 30):x}"
    total, counted = sc.warmup, 0
    while counted < sc.iterations:
        counted += measured(sc, total)
        total += 1
    used = list(dict.fromkeys(d for d, _ in lanes))
    door_of = {d.name: d for d in used}
    started = time.perf_counter()
    for i in range(total):
        conversations = {d.name: sc.messages(i, d.name) for d in used}
        bodies = {name: door_of[name].payload(msgs) for name, msgs in conversations.items()}
        if i in (0, common.TURNS_PER_SESSION - 1, total - 1):
            sc.tokens.append(counter.count_messages(next(iter(conversations.values()))))
            sc.body_bytes = {name: len(b) for name, b in bodies.items()}
        order = list(lanes)
        rng.shuffle(order)
        for door, t in order:
            sid = re.sub(r"[^A-Za-z0-9_.:@-]+", "-", f"{run_id}-{i // common.TURNS_PER_SESSION}-{door.name}-{t.name}")
            s = await t.sample(http, door, conversations[door.name], sid if sc.kind == "turn" else None,
                               bodies[door.name])
            if measured(sc, i):
                samples[key(door, t)].append(s)
            elif i == 0:
                cold[key(door, t)] = s
        if (i + 1) % max(1, total // 10) == 0 or i + 1 == total:
            common.progress(f"  {sc.name}: {i + 1}/{total} iterations ({time.perf_counter() - started:.1f}s)")
    for k, s in cold.items():
        samples[f"_cold|{k}"] = [s]
    return samples


def fmt(x: float, digits: int = 2) -> str:
    return "n/a" if x != x else f"{x:.{digits}f}"


def ratio(a: float, b: float, digits: int) -> str:
    return f"{a / b:.{digits}f}×" if b > 0 else "n/a"


Stats = dict[str, float]
"""A lane's figures in one scenario: p50, p95, added_p50, added_p95, added_p99, hdr_p50, hdr_p95, cold (ms)."""
Result = tuple[Scenario, str, dict[str, Stats]]
"""A scenario, its section and each lane's figures (by `key`)."""


@dataclass
class Run:
    """Every scenario through every lane with the upstream answering `delay` ms late."""
    delay: float
    scenarios: list[Scenario]
    lanes: list[Lane]
    results: list[Result]
    proxy: doors.Target | str


def summarise(sc: Scenario, lanes: list[Lane], samples: dict[str, list[doors.Sample]]) -> tuple[str, dict[str, Stats]]:
    rows, stats = [], {}
    for door, t in lanes:
        k, direct = key(door, t), samples[f"{door.name}|{DIRECT}"]
        ms = [s.ms for s in samples[k]]
        paired = [a.ms - b.ms for a, b in zip(samples[k], direct)]
        over = [s.overhead_ms for s in samples[k] if s.overhead_ms is not None]
        levels = {s.levels for s in samples[k] if s.levels}
        tokenizers = {s.tokenizer for s in samples[k] if s.tokenizer}
        st = stats[k] = {"p50": common.pct(ms, 0.5), "p95": common.pct(ms, 0.95),
                         "added_p50": common.pct(paired, 0.5), "added_p95": common.pct(paired, 0.95),
                         "added_p99": common.pct(paired, 0.99),
                         "hdr_p50": common.pct(over, 0.5), "hdr_p95": common.pct(over, 0.95),
                         "cold": samples.get(f"_cold|{k}", [doors.Sample(float("nan"))])[0].ms}
        added = "—" if t.name == DIRECT else f"{fmt(st['added_p50'])} / {fmt(st['added_p95'])} / {fmt(st['added_p99'])}"
        hdr = f"{fmt(st['hdr_p50'])} / {fmt(st['hdr_p95'])}" if over else "—"
        rows.append([door.name, t.name, fmt(st["p50"]), fmt(st["p95"]), added,
                     ratio(st["p50"], common.pct([s.ms for s in direct], 0.5), 2), hdr, fmt(st["cold"], 1),
                     ",".join(sorted(levels)) if levels else "—", ",".join(sorted(tokenizers)) or "—"])
    lo, hi = min(sc.tokens), max(sc.tokens)
    toks = f"{lo:,}" if lo == hi else f"{lo:,}–{hi:,}"
    sizes = ", ".join(f"{name} {n:,}" for name, n in sc.body_bytes.items())
    text = (f"### {sc.name}: {sc.what}\n\n{sc.iterations} measured iterations after {sc.warmup} warm-up; "
            f"request size {toks} tokens (o200k_base, OpenAI's message formula), {len(sc.base)} base messages; "
            f"body bytes of the last iteration per door: {sizes}.\n\n"
            + common.table(["door", "target", "p50 ms", "p95 ms", "added vs direct p50 / p95 / p99 ms (paired)",
                            "p50 ratio", "X-Ctx-Overhead-Ms p50 / p95", "first (warm-up) request ms", "X-Ctx-Levels",
                            "X-Ctx-Tokenizer"], rows, "llrrrrrrll") + "\n")
    return text, stats


async def main_async(args: argparse.Namespace) -> list[Run]:
    common.wait_for_quiet(max_wait_s=args.max_wait)
    counter = common.gpt4o_counter()
    common.progress("overhead: building conversations from trajectories")
    scenarios = []
    for size in args.sizes:
        base = common.build_conversation(size, counter)
        n, warm = iterations_for(size, args)
        label = size_label(size)
        if "conv" in args.kinds:
            scenarios.append(Scenario(f"conv-{label}", f"a new {label}-token conversation", "fresh", base, n, warm,
                                      size=size))
        if "turn" in args.kinds:
            scenarios.append(Scenario(f"turn-{label}", f"steady-state next turn of a {label}-token session", "turn",
                                      base, n, warm, size=size))
    return [await run_delay(args, scenarios, counter, delay) for delay in args.delay_ms]


async def run_delay(args: argparse.Namespace, scenarios: list[Scenario], counter: TokenCounter, delay: float) -> Run:
    """Every scenario through every lane, the upstream answering `delay` ms late."""
    active = [doors.DOORS[n] for n in args.doors.split(",")]
    with processes.Servers("ctxgate-bench-") as servers:
        upstream = servers.upstream(delay)
        # The serving policy's lane keeps its plain name; another CTXGATE_GC policy's is named by it.
        gws = {fwd + ("" if gc == "server" else f" gc={gc}"):
               servers.ctxgate(processes.ctxgate_config(upstream.url, servers.workdir, fwd,
                                                        data_dir=str(servers.workdir / f"data-{fwd}-{gc}")),
                               f"ctxgate-{fwd}-{gc}", env={"CTXGATE_GC": gc})
               for fwd in args.forwarding.split(",") for gc in args.gc.split(",")}
        relay = servers.relay(upstream.url)
        common.progress(f"overhead: upstream {upstream.url} (answers {delay:g} ms late), relay {relay.url}, "
                        + ", ".join(f"ctxgate {fwd} {gw.url}" for fwd, gw in gws.items()))
        targets = [doors.Target(DIRECT, upstream.url, UPSTREAM_KEY), doors.Target(RELAY, relay.url, UPSTREAM_KEY)]
        targets += [doors.Target(f"ctxgate forwarding={fwd}", gw.url, UPSTREAM_KEY, session_header=True)
                    for fwd, gw in gws.items()]
        proxy = servers.litellm_proxy(args.litellm_proxy, upstream.url)
        common.progress(f"overhead: LiteLLM proxy: {processes.proxy_note(proxy)}")
        targets += [] if isinstance(proxy, str) else [proxy]
        lanes: list[Lane] = [(d, t) for d in active for t in targets if not (d.google and t is proxy)]
        rng = random.Random(20240601)
        connector = aiohttp.TCPConnector(limit=32, keepalive_timeout=processes.CLIENT_KEEPALIVE_S)
        timeout = aiohttp.ClientTimeout(total=600)
        results: list[Result] = []
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
            for sc in scenarios:
                sc.tokens = []
                common.progress(f"overhead: {sc.name} ({sc.what}), {sc.warmup}+{sc.iterations} iterations × "
                                f"{len(lanes)} (door, target) lanes")
                samples = await run_scenario(sc, lanes, http, counter, rng)
                text, stats = summarise(sc, lanes, samples)
                results.append((sc, text, stats))
                for door, t in lanes:
                    if t.name != DIRECT:
                        st, d = stats[key(door, t)], stats[f"{door.name}|{DIRECT}"]["p50"]
                        common.progress(f"    {door.name:9s} {t.name:34s} p50 {st['p50']:8.2f} ms  (direct "
                                        f"{d:7.2f} ms, added p50 {st['added_p50']:7.2f} ms)")
    return Run(delay, scenarios, lanes, results, proxy)


def write_results(args: argparse.Namespace, runs: list[Run]) -> None:
    every = args.doors == ",".join(doors.DOORS)  # a run of some doors has its own section: the full one stays
    late = [r.delay for r in runs if r.delay]
    what = ("" if every else args.doors.replace(",", ", ")) + \
        (f"; upstream answering {' and '.join(f'{r.delay:g}' for r in runs)} ms late" if late else "")
    lines = [common.section_header("Overhead: latency added over a direct call, per door"
                                   + (f" ({what.strip('; ')})" if what else "")), ""]
    lines.append(common.about(__doc__) + f"\n\nLiteLLM proxy: {processes.proxy_note(runs[0].proxy)}\n")
    lines += against_relay(runs)
    for run in runs:
        if len(runs) > 1:
            lines.append(f"### The upstream answering {run.delay:g} ms late\n")
        lines += run_lines(run)
    name = "overhead" if every else f"overhead-{args.doors.replace(',', '-')}"
    delays = "-".join(f"{r.delay:g}" for r in runs)
    common.publish(name + (f"-delay-{delays}ms" if late else ""), "\n".join(lines), args.out)


def against_relay(runs: list[Run]) -> list[str]:
    """Issue 38's aim, side by side: a new conversation through ctxgate adds no more than the
    LiteLLM proxy with an upstream that answers at once, and at most 2 ms more than the bare
    relay with one that takes 200 ms."""
    rows = []
    for run in runs:
        proxy = run.proxy.name if isinstance(run.proxy, doors.Target) else None
        for sc, _, stats in run.results:
            for door in dict.fromkeys(d for d, _ in run.lanes):
                ctx, relay = stats.get(f"{door.name}|ctxgate forwarding=auto"), stats.get(f"{door.name}|{RELAY}")
                if ctx is None or relay is None:
                    continue
                px = stats.get(f"{door.name}|{proxy}") if proxy else None
                rows.append([f"{run.delay:g}", sc.name, door.name, fmt(ctx["added_p50"]), fmt(relay["added_p50"]),
                             fmt(px["added_p50"]) if px else "—", fmt(ctx["added_p50"] - relay["added_p50"]),
                             ratio(ctx["added_p50"], px["added_p50"], 2) if px else "—", fmt(ctx["hdr_p50"])])
    if not rows:
        return []
    return ["**ctxgate (forwarding=auto) beside the bare relay and the LiteLLM proxy: added latency over a direct "
            "call, p50 ms** (issue 38's aims for a new conversation: ctxgate ÷ proxy ≤ 1× with an upstream that "
            "answers at once; ctxgate − relay ≤ 2 ms with one that answers 200 ms late):\n",
            common.table(["upstream delay ms", "scenario", "door", "ctxgate", "bare relay", "LiteLLM proxy",
                          "ctxgate − relay", "ctxgate ÷ proxy", "X-Ctx-Overhead-Ms p50"], rows, "lll" + "r" * 6)
            + "\n"]


def run_lines(run: Run) -> list[str]:
    """The tables of one run: added latency per lane, ctxgate against the proxy, Gemini against
    Chat, the steady turn's growth with size, then each scenario's own table."""
    scenarios, lanes, results = run.scenarios, run.lanes, run.results
    by = {sc.name: stats for sc, _, stats in results}
    lines: list[str] = []
    names = [t.name for t in dict.fromkeys(t for _, t in lanes) if t.name != DIRECT]
    proxy_name = next((n for n in names if n.startswith("LiteLLM proxy")), None)
    kinds = [("fresh", "a new conversation (conv-*)"), ("turn", "the steady-state next turn of a session (turn-*)")]
    for kind, what in kinds:
        scs = [sc for sc in scenarios if sc.kind == kind]
        if not scs:
            continue
        head_rows = []
        for door in dict.fromkeys(d for d, _ in lanes):
            for name in names:
                k = f"{door.name}|{name}"
                if k in by[scs[0].name]:
                    head_rows.append([door.name, name, *(f"{fmt(by[sc.name][k]['added_p50'])} / "
                                                         f"{fmt(by[sc.name][k]['added_p95'])}" for sc in scs)])
        lines.append(f"**Added latency over a direct call through the same door, p50 / p95 ms — {what}:**\n")
        lines.append(common.table(["door", "target", *[sc.name for sc in scs]], head_rows,
                                  "ll" + "r" * len(scs)) + "\n")
        if proxy_name:
            rows = []
            for door in dict.fromkeys(d for d, _ in lanes):
                pk = f"{door.name}|{proxy_name}"
                if pk not in by[scs[0].name]:
                    continue
                rows.append([door.name, *(ratio(by[sc.name][f"{door.name}|ctxgate forwarding=auto"]["added_p50"],
                                                by[sc.name][pk]["added_p50"], 2) for sc in scs)])
            lines.append(f"**ctxgate (forwarding=auto) added p50 ÷ LiteLLM proxy added p50 — {what}** "
                         "(issue 13's aim: ≤ 0.5×):\n")
            lines.append(common.table(["door", *[sc.name for sc in scs]], rows) + "\n")
    lines += gemini_vs_chat(scenarios, lanes, by)
    turns = sorted((sc for sc in scenarios if sc.kind == "turn"), key=lambda sc: sc.size)
    big = next((sc for sc in turns if sc.size == 200_000), turns[-1] if turns else None)
    if big is not None and turns and big is not turns[0]:
        small = turns[0]
        ratio_rows = []
        for door in dict.fromkeys(d for d, _ in lanes):
            for name in ("ctxgate forwarding=auto", "ctxgate forwarding=litellm"):
                k = f"{door.name}|{name}"
                if k in by[big.name] and k in by[small.name]:
                    a, b = by[big.name][k], by[small.name][k]
                    ratio_rows.append([door.name, name, fmt(a["added_p50"]), fmt(b["added_p50"]),
                                       ratio(a["added_p50"], b["added_p50"], 1), fmt(a["hdr_p50"]), fmt(b["hdr_p50"]),
                                       ratio(a["hdr_p50"], b["hdr_p50"], 1)])
        lines.append(f"**Steady-state turn, {big.name} vs {small.name}** (aim for 200K vs 2K: ≤ 1.5×):\n")
        lines.append(common.table(["door", "", f"added p50, {big.name}", f"added p50, {small.name}", "ratio",
                                   f"X-Ctx-Overhead-Ms p50, {big.name}", f"… {small.name}", "ratio"], ratio_rows,
                                  "ll" + "r" * 6) + "\n")
    for _, text, _ in results:
        lines.append(text)
    return lines


def gemini_vs_chat(scenarios: list[Scenario], lanes: list[Lane], by: dict[str, dict[str, Stats]]) -> list[str]:
    """Issue 39's aim, side by side: each Gemini lane adds no more than the Chat door (streamed:
    than chat-stream) at the same size."""
    name = "ctxgate forwarding=auto"
    used = {d.name for d, _ in lanes}
    pairs = [(c, g) for c, g in ((doors.CHAT, doors.GEMINI), (doors.CHAT_STREAM, doors.GEMINI_STREAM),
                                 (doors.CHAT, doors.GEMINI_NATIVE), (doors.CHAT_STREAM, doors.GEMINI_NATIVE_STREAM))
             if c.name in used and g.name in used]
    rows = []
    for c, g in pairs:
        chat, gemini = f"{c.name}|{name}", f"{g.name}|{name}"
        rows += [[sc.name, f"{g.name} vs {c.name}",
                  f"{fmt(by[sc.name][chat]['added_p50'])} / {fmt(by[sc.name][chat]['added_p99'])}",
                  f"{fmt(by[sc.name][gemini]['added_p50'])} / {fmt(by[sc.name][gemini]['added_p99'])}",
                  ratio(by[sc.name][gemini]["added_p50"], by[sc.name][chat]["added_p50"], 2),
                  f"{fmt(by[sc.name][chat]['hdr_p50'])} / {fmt(by[sc.name][gemini]['hdr_p50'])}"] for sc in scenarios]
    if not rows:
        return []
    return [f"**Gemini door vs Chat door, {name}: added latency over a direct call, p50 / p99 ms** (issue 39's aim: "
            "Gemini ÷ Chat ≤ 1×; with few iterations p99 is about the slowest one):\n",
            common.table(["scenario", "lanes", "chat added p50 / p99", "gemini added p50 / p99", "gemini ÷ chat, p50",
                          "X-Ctx-Overhead-Ms p50, chat / gemini"], rows, "llrrrr") + "\n"]


def main() -> None:
    p = common.parser(__doc__, wait=600.0, proxy=True)
    p.add_argument("--sizes", type=lambda v: [parse_size(x) for x in v.split(",")],
                   default=[1_000, 10_000, 50_000, 100_000, 200_000, 400_000],
                   help="comma-separated conversation sizes in tokens (1K = 1,000)")
    p.add_argument("--kinds", type=lambda v: v.split(","), default=["conv", "turn"],
                   help="conv (new conversations), turn (steady-state turns), or both")
    p.add_argument("--small", type=int, default=40, help="measured iterations for sizes up to 10K")
    p.add_argument("--mid", type=int, default=20, help="measured iterations for sizes above 10K up to 100K")
    p.add_argument("--large", type=int, default=10, help="measured iterations for sizes above 100K")
    p.add_argument("--doors", default=",".join(doors.DOORS),
                   help="comma-separated doors to measure")
    p.add_argument("--forwarding", default="auto,litellm", help="ctxgate's forwarding modes, one lane each")
    p.add_argument("--gc", default="server",
                   help="comma-separated CTXGATE_GC policies (proxy/gc_policy.py): server (what serve does; the lane "
                        "`ctxgate forwarding=<mode>`) or python (Python's own: `... gc=python`), one lane each "
                        "per forwarding mode")
    p.add_argument("--delay-ms", type=lambda v: [float(x) for x in v.split(",")], default=[0.0],
                   help="comma-separated upstream answer delays (ms): a run of every lane for each")
    args = p.parse_args()
    write_results(args, asyncio.run(main_async(args)))


if __name__ == "__main__":
    main()
