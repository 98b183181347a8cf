"""The cost of each compression level on a 200K-token history, called directly.

The history is built from the recorded trajectories (bench/common.py:
build_conversation: OpenHands, SWE-agent and tau-bench runs interleaved, 200,000 tokens by
o200k_base). Every strategy gets the whole history and the budget a 200K-token window
compacts to: 200,000 × safety 0.95 × target 0.50 = 95,000 tokens (effective budget
190,000). Autocompact's summarize is a scripted coroutine that returns a fixed six-field
summary at once, so its figure is ctxgate's own work without the LLM call. The chain is
build_pipeline(PipelineConfig(), ...).compact(), as proxy/compaction.py runs it.

Each level is timed cold (first call: nothing read, counted or cut before in the process) and
warm (re-applied to the same history: its reading and the records memoised with it reused).

    .venv/bin/python bench/levels.py [--runs 20]
"""
from __future__ import annotations

import asyncio
import os
import sys
import time
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from pipeline_builders import CountingEncoder  # noqa: E402

from ctxgate.pipeline.autocompact import AutocompactBreaker, AutocompactStrategy  # noqa: E402
from ctxgate.pipeline.chain import build_pipeline  # noqa: E402
from ctxgate.pipeline.collapse import CollapseStore, CollapseStrategy  # noqa: E402
from ctxgate.pipeline.config import PipelineConfig  # noqa: E402
from ctxgate.pipeline.conversation import _memo as conversation_memo  # noqa: E402
from ctxgate.pipeline.microcompact import MicrocompactStrategy  # noqa: E402
from ctxgate.pipeline.restore import extract_working_state  # noqa: E402
from ctxgate.pipeline.snip import SnipStrategy  # noqa: E402
from ctxgate.pipeline.tokens import TokenCounter  # noqa: E402
from ctxgate.pipeline.request import CompressionRequest  # noqa: E402

WINDOW = 200_000


def main() -> None:
    p = common.parser(__doc__, wait=600.0)
    p.add_argument("--runs", type=int, default=20)
    args = p.parse_args()
    runs = args.runs

    common.wait_for_quiet(max_wait_s=args.max_wait)
    counter = common.gpt4o_counter()
    common.progress("levels: building a 200K-token history from trajectories")
    history = common.build_conversation(WINDOW, counter)
    cfg = PipelineConfig()
    effective = cfg.effective_budget(WINDOW)
    budget = int(effective * cfg.target_ratio)
    size = counter.count_messages(history)
    common.progress(f"levels: {len(history)} messages, {size:,} tokens, budget {budget:,}, {runs} runs each")
    loop = asyncio.new_event_loop()

    def request(c: TokenCounter = counter) -> CompressionRequest:
        return CompressionRequest(history, budget, c)

    primed_store = CollapseStore(cfg.collapse)
    loop.run_until_complete(CollapseStrategy(cfg.collapse, primed_store, cfg.pin_first_user)
                            .compress(request()))

    def chain(c: TokenCounter):
        pipe = build_pipeline(cfg, summarize=common.instant_summary, effective_budget=effective,
                              working_state=extract_working_state(history, cfg.restore))
        return pipe.compact(CompressionRequest(history, budget, c))

    # name, spec figure, factory of the coroutine to time (given a counter), setup note
    cases: list[tuple[str, str, Callable[[TokenCounter], Any]]] = [
        ("Snip", "~0 ms",
         lambda c: SnipStrategy(cfg.snip, cfg.pin_first_user).compress(request(c))),
        ("Microcompact", "~1 ms",
         lambda c: MicrocompactStrategy(cfg.microcompact, cfg.pin_first_user, effective).compress(request(c))),
        ("Collapse (first fold, empty store)", "~5 ms",
         lambda c: CollapseStrategy(cfg.collapse, CollapseStore(cfg.collapse),
                                    cfg.pin_first_user).compress(request(c))),
        ("Collapse (re-projection, store holds the folds)", "~5 ms",
         lambda c: CollapseStrategy(cfg.collapse, primed_store, cfg.pin_first_user).compress(request(c))),
        ("Autocompact (instant scripted summary)", "LLM call",
         lambda c: AutocompactStrategy(cfg.autocompact, common.instant_summary, AutocompactBreaker(),
                                       cfg.pin_first_user).compress(request(c))),
        ("Whole chain: extract_working_state + build_pipeline + compact()", "—",
         chain),
    ]

    rows = []
    for name, spec, make in cases:
        # One untimed run with a counting tokenizer: what it did, and how much it encoded.
        conversation_memo.clear()
        probe = CountingEncoder()
        probe_counter = TokenCounter("tiktoken:o200k_base(counting)", probe)
        result = loop.run_until_complete(make(probe_counter))
        # Cold: the first call on a history this process has not read, with a fresh counter (no
        # memoised reading, no cached counts or cuts); the store a re-projection case holds stays.
        colds = []
        for _ in range(max(1, min(runs, 5))):
            conversation_memo.clear()
            fresh = common.gpt4o_counter()
            coro = make(fresh)
            t0 = time.perf_counter()
            loop.run_until_complete(coro)
            colds.append((time.perf_counter() - t0) * 1000)
        cold = common.median(colds)
        # First read of this history, but counted before (as the proxy's gate counts a request before it
        # compacts it): the reading and the level's records are made, the counter's cache is warm.
        firsts = []
        for _ in range(max(1, min(runs, 5))):
            loop.run_until_complete(make(counter))
            conversation_memo.clear()
            coro = make(counter)
            t0 = time.perf_counter()
            loop.run_until_complete(coro)
            firsts.append((time.perf_counter() - t0) * 1000)
        first = common.median(firsts)
        loop.run_until_complete(make(counter))  # warm: the timed runs below re-apply what this one memoised
        times, cpu = [], []
        for _ in range(runs):
            coro = make(counter)
            t0, c0 = time.perf_counter(), time.process_time()
            loop.run_until_complete(coro)
            times.append((time.perf_counter() - t0) * 1000)
            cpu.append((time.process_time() - c0) * 1000)
        med, p95, lo = common.median(times), common.pct(times, 0.95), min(times)
        if result is None:
            did = "nothing to do (returned None)"
        else:
            lv = ",".join(s.level.value for s in result.steps) or "none"
            affected = sum(s.messages_affected for s in result.steps)
            did = (f"{lv}: {affected} messages affected, {size:,} → {result.tokens_after:,} tokens, "
                   f"fits={result.fits}")
        rows.append([name, f"{cold:.1f}", f"{first:.1f}", f"{med:.2f}", f"{p95:.2f}", f"{lo:.2f}",
                     f"{common.median(cpu):.2f}", spec, f"{probe.tokens / size:.1f}×", did])
        common.progress(f"  {name}: cold {cold:.1f} ms; first read, counted {first:.1f} ms; "
                        f"warm median {med:.2f} ms (p95 {p95:.1f}, min {lo:.1f}); "
                        f"encoded {probe.tokens / size:.1f}× the history; {did}")
    loop.close()

    # The unit costs these figures are made of.
    unit = []
    for label, fn in [
        ("counter.count_messages(history) — one tokenizer pass, no cache", lambda: counter.count_messages(history)),
        ("extract_working_state(history, RestoreConfig())", lambda: extract_working_state(history, cfg.restore)),
    ]:
        ts, cs = [], []
        for _ in range(runs):
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            ts.append((time.perf_counter() - t0) * 1000)
            cs.append((time.process_time() - c0) * 1000)
        unit.append([label, f"{common.median(ts):.1f}", f"{min(ts):.1f}", f"{common.median(cs):.1f}"])

    text = [common.section_header("Levels: cost of each compression level on a 200K-token history"), ""]
    text.append(
        f"History: {len(history)} messages, {size:,} tokens (o200k_base), built from the trajectories "
        f"(OpenHands, SWE-agent and tau-bench runs interleaved; `bench/common.py: build_conversation`). Every "
        f"strategy is called directly on the whole history, e.g. `SnipStrategy(config.snip).compress("
        f"CompressionRequest(messages, {budget:,}, counter))`, with the budget a 200K window compacts to "
        f"(200,000 × 0.95 × 0.50; effective budget {effective:,} for Microcompact's thresholds and the restore "
        f"budget). Autocompact's summarize returns a fixed six-field summary at once (no LLM). Median, p95 and "
        f"min of {runs} runs, in ms (wall clock), on one event loop, and the median CPU time of the process (less "
        f"sensitive to other load on the machine). *Encoded* is how many tokens the tokenizer encoded in "
        f"one run, as a multiple of the history's size (from an untimed run with a fresh counting tokenizer, "
        f"so nothing is cached yet). The timed (warm) runs share one counter, as the proxy's turns do: message "
        f"counts (by fingerprint) and text counts (by text hash) come from its cache after the first run. "
        f"*Cold* is the median of up to 5 first calls, "
        f"each after clearing `read_conversation`'s memo and with a fresh counter (nothing read, counted or cut "
        f"before; the re-projection case keeps its primed store). *First read, counted* is the median of up to 5 "
        f"first reads of the history by a counter that has counted it before (the proxy's gate counts a request "
        f"before it compacts it): `read_conversation`'s memo cleared, the counter's cache warm. *Warm* is the "
        f"same call re-applied: the history is read again by fingerprint, and the reading's memoised records "
        f"(shape, counts, Snip's cut, Microcompact's cuts, Collapse's runs) "
        f"are reused.\n")
    text.append(common.table(["level", "cold ms", "first read, counted ms", "warm median ms", "warm p95 ms",
                              "warm min ms", "warm CPU median ms", "spec", "encoded", "what it did"],
                             rows, "lrrrrrrrrl") + "\n")
    text.append("Unit costs on the same history (median of the same number of runs):\n")
    text.append(common.table(["call", "median ms", "min ms", "CPU median ms"], unit) + "\n")
    common.publish("levels", "\n".join(text), args.out)


if __name__ == "__main__":
    main()
