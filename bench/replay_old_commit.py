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
scores below OLD.
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
    args = p.parse_args()
    if args.command == "setup":
        setup(args.commit, args.worktree)
    else:
        compare(args.old, args.new, args.worse)


if __name__ == "__main__":
    main()
