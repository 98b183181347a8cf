"""How deep a compaction point should go: the frontier of depth against what the agent keeps
against what it costs, over every recorded run (bench/dialects.py's replay: the upstream
enforcing the limit, the stand-in summary), at limits of 50% and 25% of each run's size.

Each row is one compaction policy (a PipelineConfig), all in the same run of this script:
- *fixed target*: `cost.depth: target`, every point lands at `target_ratio` (the policy before the cost model);
- *cost model*: the default (`cost.depth: cost`, `min_turns` 8), with `min_turns` 4 and 16 beside it;
- *cost model, not incremental*: every point may rewrite the earlier notes (`incremental: false`);
- *shallow*: the fixed target at 0.65 of the budget; *deep*: the fixed target at 0.30.

Figures pooled over every feasible run of every dialect (tau-bench's 130-odd customer-service
runs outnumber the coding runs, so the coding runs alone are shown too): compaction points and
summary calls per 100 turns, prefix-stable share of turns, cache-aware cost relative to no
compaction at OpenAI's and Anthropic's price ratios (summary calls included), the probes (task,
touched files, last error line, last 6 messages verbatim) and the refused share. Definitions:
bench/dialects.py.

    .venv/bin/python bench/compaction_frontier.py                  # writes its section of RESULTS.md
    .venv/bin/python bench/compaction_frontier.py --tau-every 10 --out /tmp/frontier.md
"""
from __future__ import annotations

import asyncio
import sys
import time
from typing import Any

import common
from ctxgate.pipeline.config import PipelineConfig
from ctxgate.proxy.replay.scores import PRICES, RunScore, mean
from dialects import RATIOS, STAND_IN, evaluate, feasible, runs
from trajectories import DIALECTS

VARIANTS: dict[str, dict[str, Any]] = {
    "fixed target (0.50)": {"cost": {"depth": "target"}},
    "cost model (default, min_turns 8)": {},
    "cost model, min_turns 4": {"cost": {"min_turns": 4}},
    "cost model, min_turns 16": {"cost": {"min_turns": 16}},
    "cost model, not incremental": {"incremental": False},
    "shallow: fixed target 0.65": {"cost": {"depth": "target"}, "target_ratio": 0.65},
    "deep: fixed target 0.30": {"cost": {"depth": "target"}, "target_ratio": 0.30},
}


def row(label: str, scores: list[RunScore]) -> list[str]:
    turns = max(1, sum(r.turns for r in scores))

    def f(values: list[float | None], digits: int = 3) -> str:
        v = mean(values)
        return "n/a" if v is None else f"{v:.{digits}f}"

    return [label, f"{100 * sum(r.points for r in scores) / turns:.1f}",
            f"{100 * sum(r.summaries for r in scores) / turns:.1f}",
            f"{100 * (mean([r.stable for r in scores]) or 0):.1f}%",
            *(f([r.cost[name] for r in scores]) for name in PRICES),
            *(f([r.probes[k] for r in scores]) for k in ("task", "files", "error", "latest")),
            f"{100 * (mean([r.refused_ctxgate + r.refused_upstream for r in scores]) or 0):.1f}%"]


HEADERS = ["policy", "points / 100 turns", "summaries / 100 turns", "prefix-stable", "cost (OpenAI)",
           "cost (Anthropic)", "task", "files", "last error", "last 6", "refused"]


def main() -> None:
    p = common.parser(__doc__)
    p.add_argument("--tau-every", type=int, default=1, help="every Nth tau-bench run (1: all 200)")
    args = p.parse_args()
    counter = common.gpt4o_counter()
    chosen = runs(None, None, max(1, args.tau_every))
    loop = asyncio.new_event_loop()
    started = time.perf_counter()
    results = {}
    for label, overrides in VARIANTS.items():
        config = PipelineConfig(**overrides)
        t0 = time.perf_counter()
        results[label] = [evaluate(name, t, dialect, msgs, counter, loop, config, (STAND_IN,))
                          for name, t, dialect, msgs in chosen]
        print(f"{label}: {len(chosen)} runs in {time.perf_counter() - t0:.0f}s", file=sys.stderr, flush=True)
    out = [common.section_header("Compaction frontier: depth against recoverability against cost")
           + f"\n- wall time {time.perf_counter() - started:.0f}s\n", __doc__.split("\n\n    .venv")[0].strip() + "\n"]
    coding = list(DIALECTS)
    for ratio in RATIOS:
        for title, keep in (("every run", lambda r: True), ("coding runs only (no tau-bench)",
                                                              lambda r: r.source != "tau-bench")):
            rows = []
            for label, rs in results.items():
                scored = [s[STAND_IN] for d in coding for r, s in feasible(rs, d, ratio) if keep(r)]
                rows.append(row(label, scored))
            n = sum(1 for d in coding for r, _ in feasible(next(iter(results.values())), d, ratio) if keep(r))
            out.append(f"### Limit {ratio:.0%}, {title} ({n} runs)\n")
            out.append(common.table(HEADERS, rows) + "\n")
    markdown = "\n".join(out)
    common.publish("compaction-frontier", markdown, args.out)


if __name__ == "__main__":
    main()
