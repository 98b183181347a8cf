"""What reading a steady turn's body costs the Messages door, before and after a change to
proxy/resent.py, side by side in one process.

A 200K-token conversation (common.build_conversation) grows by a reply and a user message a
turn, one session, its body sent as bench/doors.py writes it: `messages-cc` as Claude Code
does (the newest message's last block marked with a `cache_control` breakpoint, moved every
turn), or `messages` (no breakpoint: each body resends the last one's bytes as they were).
Each turn's bytes go through every version of `ResentBodies` as the door uses it, in an order
shuffled per turn: `parse` (None: `orjson.loads` of the whole body) then `keep`, each timed
with perf_counter. The versions: `before`, proxy/resent.py at a git commit (`--before`, loaded
from `git show`), and `after`, the working tree's. The bodies are built before the first is
timed.

    .venv/bin/python bench/resent_turns.py [--turns 300] [--size 200K] [--before 1674deb] [--shape messages-cc]
"""
from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

import common  # sets LITELLM_LOCAL_MODEL_COST_MAP first, puts tests/ on sys.path
import doors
import orjson

from ctxgate.proxy import resent as after_module

KEY = ("acme", "messages", "bench")


def bodies(size: int, turns: int, shape: str) -> list[bytes]:
    base = common.build_conversation(size, common.gpt4o_counter())
    door, messages, out = doors.DOORS[shape], list(base), []
    for i in range(turns):
        messages += [{"role": "assistant", "content": f"ok {i}"},
                     {"role": "user", "content": f"Next step {i}: continue with the task and report what changed."}]
        out.append(door.payload(messages))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--turns", type=int, default=300)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--size", default="200K")
    p.add_argument("--before", default="1674deb")
    p.add_argument("--shape", default="messages-cc", choices=["messages-cc", "messages"])
    args = p.parse_args()
    size = int(float(args.size.rstrip("Kk")) * 1000) if args.size[-1] in "Kk" else int(args.size)
    raws = bodies(size, args.warmup + args.turns, args.shape)
    before = common.module_at(args.before, "proxy/resent.py").ResentBodies()
    versions: dict[str, Any] = {"before": before, "after": after_module.ResentBodies()}
    times: dict[str, dict[str, list[float]]] = {v: {"parse": [], "keep": [], "turn": []} for v in versions}
    parsed: dict[str, list[int]] = {v: [] for v in versions}
    rng = random.Random(38)
    for i, raw in enumerate(raws):
        order = list(versions)
        rng.shuffle(order)
        for name in order:
            resent = versions[name]
            t0 = time.perf_counter()
            known = resent.parse(KEY, raw, "messages")
            body = known.body if known is not None else orjson.loads(raw)
            t1 = time.perf_counter()
            resent.keep(KEY, raw, body, "messages", known)
            t2 = time.perf_counter()
            if i >= args.warmup:
                times[name]["parse"].append((t1 - t0) * 1000)
                times[name]["keep"].append((t2 - t1) * 1000)
                times[name]["turn"].append((t2 - t0) * 1000)
                parsed[name].append(known.parsed_bytes if known is not None else len(raw))
    print(f"{args.turns} steady turns ({args.warmup} more before them untimed) of a {args.size}-token session, "
          f"shape {args.shape}, body {len(raws[0]):,}-{len(raws[-1]):,} bytes; before = proxy/resent.py at "
          f"{args.before}, after = the working tree")
    print("| version | hits | second-cut hits | bytes parsed, median | parse ms p50 / mean | keep ms p50 / mean "
          "| parse + keep ms p50 / p99 / mean |")
    print("|---|--:|--:|--:|--:|--:|--:|")
    for name, resent in versions.items():
        t = times[name]

        def p50(xs: list[float]) -> str:
            return f"{statistics.median(xs):.3f}"

        p99 = sorted(t["turn"])[int(0.99 * (len(t["turn"]) - 1))]
        print(f"| {name} | {resent.hits} | {getattr(resent, 'second_hits', '—')} | "
              f"{statistics.median(parsed[name]):,.0f} | {p50(t['parse'])} / {statistics.fmean(t['parse']):.3f} | "
              f"{p50(t['keep'])} / {statistics.fmean(t['keep']):.3f} | {p50(t['turn'])} / {p99:.3f} / "
              f"{statistics.fmean(t['turn']):.3f} |")


if __name__ == "__main__":
    main()
