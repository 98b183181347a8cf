"""The latency ctxgate adds over calling the same scripted upstream directly.

Real processes: bench/upstream.py, and `ctxgate serve` twice in front of it (one with
`forwarding: auto`, ctxgate's own pooled aiohttp client; one with `forwarding: litellm`,
litellm.acompletion), plus the LiteLLM proxy when `litellm[proxy]` is installed. This
process is the client: one pooled aiohttp session sends the same payloads, interleaved
in a shuffled order each iteration, to every target; `litellm.acompletion` is also called
in this process against the same upstream, so litellm's own cost is seen next to a plain
aiohttp POST.

Scenarios (conversations made of real trajectory messages, sizes by o200k_base):
- conv-1K, conv-100K: a conversation ctxgate has not seen: every message of every
  request carries a fresh `<i>` prefix, so nothing is in the fingerprint cache.
- turn-2K, turn-200K: the steady-state next turn of a session (`X-Ctx-Session`), each
  turn resending the history plus the previous replies and one new user message (a new
  session, with the same history, every 10 turns, so the size stays put); the
  model's `max_input_tokens` is 1,000,000, so nothing is compacted: this is counting with
  the fingerprint cache, plus everything else a turn does.

    .venv/bin/python bench/overhead.py [--small 200] [--large 40]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  (sets LITELLM_LOCAL_MODEL_COST_MAP first)

import aiohttp  # noqa: E402
import orjson  # noqa: E402
import yaml  # noqa: E402

VENV_BIN = Path(sys.executable).parent
UPSTREAM_KEY = "sk-bench-upstream"
MODEL = "gpt-4o"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
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


def start(name: str, argv: list[str], health: str, workdir: Path, env: dict[str, str] | None = None,
          timeout: float = 120.0) -> Proc:
    log = workdir / f"{name}.log"
    fh = open(log, "wb")
    popen = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, cwd=workdir,
                             env={**os.environ, **(env or {})})
    deadline = time.monotonic() + timeout
    while True:
        if popen.poll() is not None:
            raise RuntimeError(f"{name} exited with {popen.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(health, timeout=1) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        if time.monotonic() > deadline:
            popen.kill()
            raise RuntimeError(f"{name} did not become healthy in {timeout}s:\n{log.read_text()[-3000:]}")
        time.sleep(0.1)
    return Proc(name, popen, log, health.rsplit("/", 1)[0])


def ctxgate_config(upstream: str, forwarding: str, workdir: Path) -> Path:
    cfg = {
        "model_list": [{"model_name": MODEL,
                        "litellm_params": {"model": f"openai/{MODEL}", "api_base": f"{upstream}/v1",
                                           "api_key": UPSTREAM_KEY},
                        "model_info": {"max_input_tokens": 1_000_000}}],
        "ctxgate": {"forwarding": forwarding, "data_dir": str(workdir / f"data-{forwarding}")},
    }
    path = workdir / f"ctxgate-{forwarding}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def litellm_proxy_available() -> tuple[bool, str]:
    r = subprocess.run([sys.executable, "-c", "import litellm.proxy.proxy_server"], capture_output=True, text=True,
                       env={**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}, timeout=300)
    if r.returncode == 0:
        return True, ""
    last = (r.stderr.strip().splitlines() or ["?"])[-1]
    return False, last


# ---------------------------------------------------------------------------------------
# Payloads


def fresh(messages: list[dict[str, Any]], i: int) -> list[dict[str, Any]]:
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


def turn(base: list[dict[str, Any]], i: int) -> list[dict[str, Any]]:
    """Iteration i: turn k = i % 10 of session i // 10 — the history, then k+1 pairs of
    (the upstream's reply, a new user message). Each turn resends the previous turn's
    messages unchanged and adds two, the second never seen before."""
    session, k = divmod(i, TURNS_PER_SESSION)
    extra: list[dict[str, Any]] = []
    for j in range(k + 1):
        extra.append({"role": "assistant", "content": "ok"})
        extra.append({"role": "user", "content": f"Next step {session * TURNS_PER_SESSION + j}: continue with the "
                                                 f"task and report what changed."})
    return base + extra


@dataclass
class Scenario:
    name: str
    what: str
    kind: str  # "fresh" | "turn"
    base: list[dict[str, Any]]
    iterations: int
    warmup: int
    tokens: list[int] = field(default_factory=list)

    def messages(self, i: int) -> list[dict[str, Any]]:
        return fresh(self.base, i) if self.kind == "fresh" else turn(self.base, i)


# ---------------------------------------------------------------------------------------
# Targets


@dataclass
class Sample:
    ms: float
    overhead_ms: float | None = None
    levels: str | None = None


class Target:
    def __init__(self, name: str, url: str | None = None, session_header: bool = False,
                 via_litellm_sdk: str | None = None, api_key: str = UPSTREAM_KEY) -> None:
        self.name = name
        self.url = url
        self.session_header = session_header
        self.litellm_base = via_litellm_sdk
        self.api_key = api_key

    async def send(self, http: aiohttp.ClientSession, messages: list[dict[str, Any]], body: bytes,
                   session: str | None) -> Sample:
        if self.litellm_base is not None:
            import litellm

            started = time.perf_counter()
            reply = await litellm.acompletion(model=f"openai/{MODEL}", messages=messages, api_base=self.litellm_base,
                                              api_key=self.api_key)
            ms = (time.perf_counter() - started) * 1000
            if reply.choices[0].message.content != "ok":
                raise RuntimeError(f"{self.name}: unexpected reply {reply}")
            return Sample(ms)
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {self.api_key}"}
        if self.session_header and session:
            headers["X-Ctx-Session"] = session  # else (a new conversation) ctxgate derives one
        started = time.perf_counter()
        async with http.post(self.url, data=body, headers=headers) as r:
            raw = await r.read()
            ms = (time.perf_counter() - started) * 1000
            if r.status != 200:
                raise RuntimeError(f"{self.name}: HTTP {r.status}: {raw[:500]!r}")
            over = r.headers.get("X-Ctx-Overhead-Ms")
            return Sample(ms, float(over) if over else None, r.headers.get("X-Ctx-Levels"))


async def run_scenario(sc: Scenario, targets: list[Target], http: aiohttp.ClientSession, counter,
                       rng: random.Random) -> dict[str, list[Sample]]:
    samples: dict[str, list[Sample]] = {t.name: [] for t in targets}
    cold: dict[str, Sample] = {}
    run_id = f"{sc.name}-{rng.randrange(1 << 30):x}"
    total = sc.warmup + sc.iterations
    started = time.perf_counter()
    for i in range(total):
        msgs = sc.messages(i)
        if i in (0, TURNS_PER_SESSION - 1, total - 1):
            sc.tokens.append(counter.count_messages(msgs))
        body = orjson.dumps({"model": MODEL, "messages": msgs})
        order = list(targets)
        rng.shuffle(order)
        for t in order:
            sid = f"{run_id}-{i // TURNS_PER_SESSION}-{t.name}"
            s = await t.send(http, msgs, body,
                             re.sub(r"[^A-Za-z0-9_.:@-]+", "-", sid) if sc.kind == "turn" else None)
            if i >= sc.warmup:
                samples[t.name].append(s)
            elif i == 0:
                cold[t.name] = s
        if (i + 1) % max(1, total // 10) == 0 or i + 1 == total:
            common.progress(f"  {sc.name}: {i + 1}/{total} iterations ({time.perf_counter() - started:.1f}s)")
    samples["_cold"] = [cold.get(t.name, Sample(float("nan"))) for t in targets]  # type: ignore[assignment]
    return samples


# ---------------------------------------------------------------------------------------


def fmt(x: float, digits: int = 2) -> str:
    return "n/a" if x != x else f"{x:.{digits}f}"


def summarise(sc: Scenario, targets: list[Target], samples: dict[str, list[Sample]]) -> tuple[str, dict[str, dict]]:
    direct = [s.ms for s in samples["direct"]]
    d50 = common.pct(direct, 0.5)
    rows, stats = [], {}
    cold = dict(zip([t.name for t in targets], samples["_cold"]))
    for t in targets:
        ms = [s.ms for s in samples[t.name]]
        p50, p95 = common.pct(ms, 0.5), common.pct(ms, 0.95)
        paired = [a.ms - b.ms for a, b in zip(samples[t.name], samples["direct"])]
        over = [s.overhead_ms for s in samples[t.name] if s.overhead_ms is not None]
        levels = {s.levels for s in samples[t.name] if s.levels}
        st = {"p50": p50, "p95": p95, "added_p50": common.pct(paired, 0.5), "added_p95": common.pct(paired, 0.95),
              "hdr_p50": common.pct(over, 0.5) if over else float("nan"),
              "hdr_p95": common.pct(over, 0.95) if over else float("nan"), "levels": levels,
              "cold": cold[t.name].ms}
        stats[t.name] = st
        added = "—" if t.name == "direct" else f"{fmt(st['added_p50'])} / {fmt(st['added_p95'])}"
        ratio = "1.00×" if t.name == "direct" else f"{p50 / d50:.2f}×"
        hdr = f"{fmt(st['hdr_p50'])} / {fmt(st['hdr_p95'])}" if over else "—"
        rows.append([t.name, fmt(p50), fmt(p95), added, ratio, hdr, fmt(st["cold"], 1),
                     ",".join(sorted(levels)) if levels else "—"])
    lo, hi = min(sc.tokens), max(sc.tokens)
    toks = f"{lo:,}" if lo == hi else f"{lo:,}–{hi:,}"
    text = (f"### {sc.name}: {sc.what}\n\n{sc.iterations} measured iterations after {sc.warmup} warm-up; "
            f"request size {toks} tokens (o200k_base, OpenAI's message formula), {len(sc.base)} base messages.\n\n"
            + common.table(["target", "p50 ms", "p95 ms", "added vs direct p50 / p95 ms (paired)",
                            "p50 ratio", "X-Ctx-Overhead-Ms p50 / p95", "first (warm-up) request ms", "X-Ctx-Levels"],
                           rows, "lrrrrrrl") + "\n")
    return text, stats


def breakdown(scenarios: list[Scenario], runs: int = 20) -> str:
    """Where a steady-state turn's time goes inside ctxgate: the same calls chat.py makes,
    timed in this process (no HTTP), median of `runs`, on turn 5 of each session."""
    from ctxgate.pipeline.config import PipelineConfig
    from ctxgate.proxy.engine.compaction import Compactor, Turn, fingerprints_of
    from ctxgate.proxy.engine.state import SessionState
    from ctxgate.proxy.doors.validation import validate_chat_request

    async def no_summary(_msgs):  # never called: nothing is over the trigger
        raise RuntimeError("unexpected compaction")

    rows = []
    for sc in scenarios:
        if sc.kind != "turn":
            continue
        counter = common.TokenizerRegistry().for_model(MODEL)
        msgs = sc.messages(5)
        body = orjson.dumps({"model": MODEL, "messages": msgs})
        parsed = orjson.loads(body)
        fps = fingerprints_of(msgs)
        counter.count_request(msgs, None, fps)  # the session's earlier turns filled the cache
        config = PipelineConfig()
        turn_ = Turn(messages=msgs, fingerprints=fps, tools=None, counter=counter, config=config,
                     max_input_tokens=1_000_000, summarize=no_summary)
        compactor = Compactor()
        loop = asyncio.new_event_loop()
        payload = {"model": MODEL, **parsed}

        def timed(fn) -> float:
            out = []
            for _ in range(runs):
                t0 = time.perf_counter()
                fn()
                out.append((time.perf_counter() - t0) * 1000)
            return common.median(out)

        steps = [
            ("orjson.loads(body)", lambda: orjson.loads(body)),
            ("validation.validate_chat_request(body)", lambda: validate_chat_request(parsed)),
            ("compaction.fingerprints_of(messages)", lambda: fingerprints_of(msgs)),
            ("counter.count_request(messages, tools, fps) — cached, as chat.py calls it",
             lambda: counter.count_request(msgs, None, fps)),
            ("counter.count_messages(messages) — no fingerprints: one full tokenizer pass",
             lambda: counter.count_messages(msgs)),
            ("counter.count_messages(messages, fps) — by fingerprint (cached)",
             lambda: counter.count_messages(msgs, fps)),
            ("Compactor.prepare(state, turn) — whole, below trigger",
             lambda: loop.run_until_complete(compactor.prepare(SessionState("t", "s"), turn_))),
            ("orjson.dumps(payload) — forwarded body", lambda: orjson.dumps(payload)),
        ]
        for label, fn in steps:
            rows.append([sc.name, label, fmt(timed(fn), 3)])
        loop.close()
        common.progress(f"  breakdown {sc.name}: done")
    return ("### Where a steady-state turn goes (in-process, no HTTP)\n\n"
            f"The calls `proxy/chat.py` makes on a turn below the trigger, on turn 5 of each session, timed one by "
            f"one in the client process, median of {runs} runs (`Compactor.prepare` on one event loop, "
            "`run_until_complete` each time).\n\n" + common.table(["session", "call", "ms"], rows, "llr") + "\n")


async def main_async(args: argparse.Namespace):
    common.wait_for_quiet()
    counter = common.gpt4o_counter()
    common.progress("overhead: building conversations from trajectories")
    scenarios = [
        Scenario("conv-1K", "a new 1K-token conversation", "fresh", common.build_conversation(1_000, counter),
                 args.small, 5),
        Scenario("conv-100K", "a new 100K-token conversation", "fresh", common.build_conversation(100_000, counter),
                 args.large, 2),
        Scenario("turn-2K", "steady-state next turn of a 2K-token session", "turn",
                 common.build_conversation(2_000, counter), args.small, 5),
        Scenario("turn-200K", "steady-state next turn of a 200K-token session", "turn",
                 common.build_conversation(200_000, counter), args.large, 3),
    ]
    workdir = Path(tempfile.mkdtemp(prefix="ctxgate-bench-"))
    procs: list[Proc] = []
    proxy_ok, proxy_why = litellm_proxy_available()
    common.progress(f"overhead: litellm[proxy] importable: {proxy_ok}" + ("" if proxy_ok else f" ({proxy_why})"))
    try:
        up_port = free_port()
        upstream = start("upstream", [sys.executable, str(common.BENCH / "upstream.py"), "--port", str(up_port)],
                         f"http://127.0.0.1:{up_port}/healthz", workdir)
        procs.append(upstream)
        gws = {}
        for fwd in ("auto", "litellm"):
            port = free_port()
            cfg = ctxgate_config(upstream.url, fwd, workdir)
            gws[fwd] = start(f"ctxgate-{fwd}", [str(VENV_BIN / "ctxgate"), "serve", "--config", str(cfg), "--port",
                                                str(port), "--log-level", "WARNING"],
                             f"http://127.0.0.1:{port}/healthz", workdir, {"LITELLM_LOCAL_MODEL_COST_MAP": "True"})
            procs.append(gws[fwd])
        common.progress(f"overhead: upstream {upstream.url}, ctxgate auto {gws['auto'].url}, "
                        f"ctxgate litellm {gws['litellm'].url}")
        targets = [
            Target("direct", f"{upstream.url}/v1/chat/completions"),
            Target("ctxgate forwarding=auto", f"{gws['auto'].url}/v1/chat/completions", session_header=True),
            Target("ctxgate forwarding=litellm", f"{gws['litellm'].url}/v1/chat/completions", session_header=True),
            Target("litellm.acompletion (in-process)", via_litellm_sdk=f"{upstream.url}/v1"),
        ]
        if proxy_ok:
            port = free_port()
            lcfg = workdir / "litellm-proxy.yaml"
            lcfg.write_text(yaml.safe_dump({"model_list": [{"model_name": MODEL, "litellm_params": {
                "model": f"openai/{MODEL}", "api_base": f"{upstream.url}/v1", "api_key": UPSTREAM_KEY}}]}))
            proxy = start("litellm-proxy", [str(VENV_BIN / "litellm"), "--config", str(lcfg), "--port", str(port)],
                          f"http://127.0.0.1:{port}/health/liveliness", workdir,
                          {"LITELLM_LOCAL_MODEL_COST_MAP": "True"}, timeout=180)
            procs.append(proxy)
            targets.append(Target("LiteLLM proxy", f"{proxy.url}/v1/chat/completions"))
        import litellm

        litellm.suppress_debug_info = True
        rng = random.Random(20240601)
        connector = aiohttp.TCPConnector(limit=32, keepalive_timeout=60)
        timeout = aiohttp.ClientTimeout(total=600)
        results: list[tuple[Scenario, str, dict[str, dict]]] = []
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
            for sc in scenarios:
                common.progress(f"overhead: {sc.name} ({sc.what}), {sc.warmup}+{sc.iterations} iterations × "
                                f"{len(targets)} targets")
                samples = await run_scenario(sc, targets, http, counter, rng)
                text, stats = summarise(sc, targets, samples)
                results.append((sc, text, stats))
                d = stats["direct"]["p50"]
                for t in targets[1:]:
                    st = stats[t.name]
                    common.progress(f"    {t.name:34s} p50 {st['p50']:8.2f} ms  (direct {d:7.2f} ms, "
                                    f"added p50 {st['added_p50']:7.2f} ms)")
    finally:
        for p in reversed(procs):
            p.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return scenarios, targets, results, proxy_ok, proxy_why


def write_results(args, scenarios, targets, results, proxy_ok: bool, proxy_why: str, extra: str = "") -> None:
    by = {sc.name: stats for sc, _, stats in results}
    lines = [common.section_header("Overhead: latency added over a direct call"), ""]
    lines.append(
        "ctxgate (`.venv/bin/ctxgate serve`, one process each for `forwarding: auto` and `forwarding: litellm`) in "
        "front of `bench/upstream.py` (a fixed 'ok' completion, no `usage`), all on "
        "127.0.0.1. The client is this script: one pooled aiohttp session, the same bytes sent to every target, "
        "targets in a shuffled order each iteration. `direct` is a plain aiohttp POST to the upstream; "
        "`litellm.acompletion (in-process)` is the litellm SDK called in the client process against the same "
        "upstream. *Added* is the per-iteration difference target − direct (p50 / p95 of those differences). "
        "`X-Ctx-Overhead-Ms` is ctxgate's own report of its time, upstream excluded. The model's "
        "`max_input_tokens` is 1,000,000, so no request was compacted (X-Ctx-Levels column).\n")
    if not proxy_ok:
        lines.append(f"LiteLLM proxy: **not run** — `litellm[proxy]` is not installed in .venv "
                     f"(`import litellm.proxy.proxy_server` fails: `{proxy_why}`).\n")
    # Headline table
    head_rows = []
    for name in ("ctxgate forwarding=auto", "ctxgate forwarding=litellm"):
        row = [name]
        for sc in scenarios:
            st = by[sc.name][name]
            row.append(f"{fmt(st['added_p50'])} / {fmt(st['added_p95'])}")
        head_rows.append(row)
    lit = ["litellm.acompletion vs aiohttp"]
    for sc in scenarios:
        st = by[sc.name]["litellm.acompletion (in-process)"]
        lit.append(f"{fmt(st['added_p50'])} / {fmt(st['added_p95'])}")
    head_rows.append(lit)
    if proxy_ok:
        row = ["LiteLLM proxy"]
        for sc in scenarios:
            st = by[sc.name]["LiteLLM proxy"]
            row.append(f"{fmt(st['added_p50'])} / {fmt(st['added_p95'])}")
        head_rows.append(row)
    lines.append("**Added latency over direct, p50 / p95 ms:**\n")
    lines.append(common.table(["", *[sc.name for sc in scenarios]], head_rows) + "\n")
    ratio_rows = []
    for name in ("ctxgate forwarding=auto", "ctxgate forwarding=litellm"):
        a, b = by["turn-200K"][name], by["turn-2K"][name]
        ratio_rows.append([name, fmt(a["added_p50"]), fmt(b["added_p50"]),
                           f"{a['added_p50'] / b['added_p50']:.1f}×" if b["added_p50"] > 0 else "n/a",
                           fmt(a["hdr_p50"]), fmt(b["hdr_p50"]),
                           f"{a['hdr_p50'] / b['hdr_p50']:.1f}×" if b["hdr_p50"] > 0 else "n/a"])
    lines.append("**Steady-state turn, 200K-token session vs 2K-token session** (aim: ≤ 1.5×):\n")
    lines.append(common.table(["", "added p50, 200K turn", "added p50, 2K turn", "ratio",
                               "X-Ctx-Overhead-Ms p50, 200K", "… 2K", "ratio"], ratio_rows) + "\n")
    for _, text, _ in results:
        lines.append(text)
    if extra:
        lines.append(extra)
    common.write_section("overhead", "\n".join(lines))
    common.progress(f"overhead: wrote {common.RESULTS.relative_to(common.ROOT)}")


def main() -> None:
    p = argparse.ArgumentParser(description="ctxgate's added latency over a direct upstream call")
    p.add_argument("--small", type=int, default=200, help="iterations for the 1K and 2K scenarios")
    p.add_argument("--large", type=int, default=40, help="iterations for the 100K and 200K scenarios")
    args = p.parse_args()
    scenarios, targets, results, proxy_ok, proxy_why = asyncio.run(main_async(args))
    common.progress("overhead: in-process breakdown of a steady-state turn")
    extra = breakdown(scenarios)
    write_results(args, scenarios, targets, results, proxy_ok, proxy_why, extra)


if __name__ == "__main__":
    main()
