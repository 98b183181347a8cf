"""Today's per-dialect bench on an older commit's engine, and two such runs compared turn by turn.

`setup COMMIT WORKTREE`: a detached worktree of COMMIT with today's bench (bench/dialects.py,
bench/common.py, tests/trajectories.py) and today's driver, probes and scores
(proxy/replay/{driver,baselines,probes,scores,upstream}.py) copied in, and the smallest shims the
old engine needs in the driver (`SHIMS`: what a commit before the quoting of issue 34 item 5 lacks).
Nothing of it is committed; run the bench there with a folder holding `ctxgate -> WORKTREE` first
on PYTHONPATH:

    .venv/bin/python bench/replay_old_commit.py setup 367dc8f /work/wt-h34-pre
    mkdir -p /tmp/h34/pre && ln -sfn /work/wt-h34-pre /tmp/h34/pre/ctxgate
    cd /work/wt-h34-pre && CTXGATE_TRAJECTORIES=/work/shared/trajectories PYTHONPATH=/tmp/h34/pre \\
        /work/main/.venv/bin/python bench/dialects.py --out /tmp/h34/pre.md --turns /tmp/h34/pre.jsonl

`compare OLD.jsonl NEW.jsonl`: from two `--turns` files, per dialect and limit, task, files and last
error of ctxgate (stand-in summary) on all turns (the figures of the bench's tables) and on the turns
both answered, with the turns each refused; `--worse` lists the turns both answered where NEW
scores below OLD. `--cost` (files written by a bench/dialects.py with the per-turn cost pieces):
per dialect and limit, the cost (OpenAI ratios) and prefix stability on all turns and on the turns
both answered, the cost split by who refused each turn, and the turns both answered whose request
starts with the previous one in OLD and not in NEW, by cause.
"""
from __future__ import annotations

import argparse
import collections
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson

from ctxgate.proxy.replay.scores import OPENAI

ROOT = Path(__file__).resolve().parent.parent
COPIED = ("bench/dialects.py", "bench/common.py", "tests/trajectories.py",
          *(f"proxy/replay/{name}.py" for name in ("driver", "baselines", "probes", "scores", "upstream")))
SHIMS = (
    # The cost model's prices lived in the engine.
    ("from ctxgate.pipeline.depth import prices_of\n", ""),
    ("from ..engine.content_store import MemoryContentStore\n",
     "from ..engine.content_store import MemoryContentStore\nfrom ..engine.depth import prices_of\n"),
    # No fixed notice before the quoting: the request goes as the compactor left it.
    ("from ctxgate.pipeline.notes import with_notice\n", ""),
    ("done.messages = with_notice(plan.messages)", "done.messages = list(plan.messages)"),
    # No waste accounting: every summary call is still counted by the driver's counted_summary.
    ("from ..engine.summary_cost import SummaryCost\n", ""),
    ("content=content, on_waste=wasted) if speculate", "content=content) if speculate"),
    ("content=content, on_waste=wasted)\n", "content=content)\n"),
    ('        pending = SummaryCost.from_dict(out.state.speculative.get("summary"))\n'
     "        if pending.calls:\n"
     '            wasted("unneeded", pending.calls, pending.tokens)\n', ""),
)
"""(today's driver text, what the old engine takes instead): each must occur exactly once."""
PROBED = ("task", "files", "error")


def setup(commit: str, worktree: Path) -> None:
    subprocess.run(["git", "worktree", "add", "--detach", str(worktree), commit], cwd=ROOT, check=True)
    for path in COPIED:
        shutil.copyfile(ROOT / path, worktree / path)
    driver = worktree / "proxy/replay/driver.py"
    text = driver.read_text()
    for today, old in SHIMS:
        if text.count(today) != 1:
            sys.exit(f"shim not applicable (today's driver changed?): {today!r}")
        text = text.replace(today, old)
    driver.write_text(text)


Turn = dict[str, Any]
Key = tuple[str, float, int]


def read(path: str) -> dict[Key, Turn]:
    """The turns of the per-dialect runs (not the long sessions), by (run, ratio, turn)."""
    out = {}
    for line in Path(path).read_bytes().splitlines():
        t = orjson.loads(line)
        if "runs back to back" not in t["run"]:
            out[(t["run"], t["ratio"], t["turn"])] = t
    return out


def pooled(turns: list[Turn], probe: str) -> float | None:
    """The bench's pooling: the mean over turns of a run, then over the runs where it applies."""
    by_run: dict[str, list[float]] = collections.defaultdict(list)
    for t in turns:
        if t[probe] is not None:
            by_run[t["run"]].append(t[probe])
    means = [sum(v) / len(v) for v in by_run.values() if v]
    return sum(means) / len(means) if means else None


def fmt(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.3f}"


def compare(old_path: str, new_path: str, worse: bool) -> None:
    old, new = read(old_path), read(new_path)
    if old.keys() != new.keys():
        sys.exit(f"the two runs replayed other turns ({len(old.keys() ^ new.keys())} differ)")
    cells: dict[tuple[str, float], list[Key]] = collections.defaultdict(list)
    for key in old:
        cells[(old[key]["dialect"], key[1])].append(key)
    print("| dialect at limit | turns | refused old / new | both answered | "
          + " | ".join(f"{p} old → new (all) | {p} old → new (both answered)" for p in PROBED) + " |")
    print("|:---|---:|---:|---:|" + "---:|---:|" * len(PROBED))
    for (dialect, ratio), keys in sorted(cells.items(), key=lambda c: (-c[0][1], c[0][0])):
        both = [k for k in keys if not old[k]["refused_by"] and not new[k]["refused_by"]]
        figures = []
        for p in PROBED:
            figures.append(f"{fmt(pooled([old[k] for k in keys], p))} → {fmt(pooled([new[k] for k in keys], p))}")
            figures.append(f"{fmt(pooled([old[k] for k in both], p))} → {fmt(pooled([new[k] for k in both], p))}")
        refused = f"{sum(bool(old[k]['refused_by']) for k in keys)} / {sum(bool(new[k]['refused_by']) for k in keys)}"
        print(f"| {dialect} at {ratio:.0%} | {len(keys)} | {refused} | {len(both)} | " + " | ".join(figures) + " |")
    if worse:
        print()
        for key in sorted(old):
            o, n = old[key], new[key]
            if o["refused_by"] or n["refused_by"]:
                continue
            low = [p for p in PROBED if o[p] is not None and n[p] is not None and n[p] < o[p]]
            if low:
                print(f"{o['dialect']} {key[1]:.0%} {key[0]} turn {key[2]}: "
                      + ", ".join(f"{p} {o[p]:.3f} → {n[p]:.3f}" for p in low)
                      + f" (tokens {o['tokens']} → {n['tokens']}, levels {o['levels']} → {n['levels']})")


def turn_cost(t: Turn) -> float:
    """A turn's request and its summary calls, priced as score_run prices them (OpenAI ratios)."""
    return OPENAI.request(t["sent"], t["cached"]) + OPENAI.summary(*t["summary"])


def whole_cost(t: Turn) -> float:
    return OPENAI.request(t["whole_sent"], t["whole_cached"])


def mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def by_run(keys: list[Key]) -> dict[str, list[Key]]:
    runs: dict[str, list[Key]] = collections.defaultdict(list)
    for k in sorted(keys, key=lambda k: k[2]):
        runs[k[0]].append(k)
    return runs


def cost_of(side: dict[Key, Turn], runs: dict[str, list[Key]], only: set[Key] | None = None) -> float | None:
    """The bench's cost: per run, its turns' (or those in `only`) cost over the whole history's on
    the same turns; the mean over runs."""
    ratios = []
    for keys in runs.values():
        chosen = [k for k in keys if only is None or k in only]
        whole = sum(whole_cost(side[k]) for k in chosen)
        if whole:
            ratios.append(sum(turn_cost(side[k]) for k in chosen) / whole)
    return mean(ratios)


def stable_of(side: dict[Key, Turn], runs: dict[str, list[Key]], pairs: set[Key] | None = None) -> float | None:
    """Prefix-stable: per run, the share of answered turns (or of `pairs`) starting with the
    previous answered request; the mean over runs."""
    shares = []
    for keys in runs.values():
        flags = [side[k]["stable"] for k in keys if side[k]["stable"] is not None and (pairs is None or k in pairs)]
        if flags:
            shares.append(sum(flags) / len(flags))
    return mean(shares)


def cause(o: Turn, n: Turn) -> str:
    """Why NEW's request lost the previous one's prefix where OLD's kept it."""
    if n["compacted"] and not o["compacted"]:
        return "b: a compaction point in NEW only"
    if n["compacted"]:
        return "c: both compact, NEW's point rewrites further back" if n["prefix"] < o["prefix"] else "c?: both compact"
    return "d: no compaction point in NEW"


def cost_compare(old_path: str, new_path: str) -> None:
    old, new = read(old_path), read(new_path)
    cells: dict[tuple[str, float], list[Key]] = collections.defaultdict(list)
    for key in old:
        cells[(old[key]["dialect"], key[1])].append(key)
    print("| dialect at limit | cost old → new (all) | cost old → new (both answered) | prefix-stable old → new (all) "
          "| prefix-stable old → new (both answered, after a turn both answered) | lost prefix in new only |")
    print("|:---|---:|---:|---:|---:|---:|")
    split_rows, lost_rows = [], []
    for (dialect, ratio), keys in sorted(cells.items(), key=lambda c: (-c[0][1], c[0][0])):
        runs = by_run(keys)
        both = {k for k in keys if not old[k]["refused_by"] and not new[k]["refused_by"]}
        pairs = {k for ks in runs.values() for a, k in zip(ks, ks[1:]) if a in both and k in both}
        lost = sorted(k for k in pairs if old[k]["stable"] and not new[k]["stable"])
        print(f"| {dialect} at {ratio:.0%} | {fmt(cost_of(old, runs))} → {fmt(cost_of(new, runs))} "
              f"| {fmt(cost_of(old, runs, both))} → {fmt(cost_of(new, runs, both))} "
              f"| {pct(stable_of(old, runs))} → {pct(stable_of(new, runs))} "
              f"| {pct(stable_of(old, runs, pairs))} → {pct(stable_of(new, runs, pairs))} "
              f"| {len(lost)} of {len(pairs)} |")
        groups = {"both answered": both,
                  "refused by NEW only": {k for k in keys if new[k]["refused_by"] and not old[k]["refused_by"]},
                  "refused by OLD only": {k for k in keys if old[k]["refused_by"] and not new[k]["refused_by"]},
                  "refused by both": {k for k in keys if old[k]["refused_by"] and new[k]["refused_by"]}}
        parts = []
        for label, group in groups.items():
            shares = [[sum(turn_cost(side[k]) for k in ks if k in group) / whole for side in (old, new)]
                      for ks in runs.values() if (whole := sum(whole_cost(old[k]) for k in ks))]
            parts.append(f"{label} ({len(group)}) {sum(s[0] for s in shares) / len(shares):.3f} → "
                         f"{sum(s[1] for s in shares) / len(shares):.3f}")
        split_rows.append(f"{dialect} at {ratio:.0%}: " + "; ".join(parts))
        for k in lost:
            o, n = old[k], new[k]
            lost_rows.append(f"{dialect} {ratio:.0%} {k[0]} turn {k[2]}: {cause(o, n)} (prefix {o['prefix']} → "
                             f"{n['prefix']} messages, cached {o['cached']} → {n['cached']} of {o['sent']} → "
                             f"{n['sent']}; levels {o['levels']} → {n['levels']})")
    print("\nThe cost (all turns) split by who refused the turn, each part over the run's whole history, "
          "mean over runs (the parts add up to the cost):\n")
    print("\n".join(f"- {row}" for row in split_rows))
    print("\nTurns both answered, after a turn both answered, that start with the previous request in OLD "
          "and not in NEW:\n")
    print("\n".join(lost_rows) or "none")


def pct(v: float | None) -> str:
    return "n/a" if v is None else f"{100 * v:.1f}%"


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("setup", help="a worktree of COMMIT with today's bench and driver, shimmed")
    s.add_argument("commit")
    s.add_argument("worktree", type=Path)
    c = sub.add_parser("compare", help="two --turns files, all turns and turns both answered")
    c.add_argument("old")
    c.add_argument("new")
    c.add_argument("--worse", action="store_true", help="list the turns both answered where NEW is lower")
    c.add_argument("--cost", action="store_true", help="cost and prefix stability instead of the probes")
    args = p.parse_args()
    if args.command == "setup":
        setup(args.commit, args.worktree)
    elif args.cost:
        cost_compare(args.old, args.new)
    else:
        compare(args.old, args.new, args.worse)


if __name__ == "__main__":
    main()
