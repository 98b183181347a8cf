"""What memory's capture of a new conversation costs, before and after a change to
memory/capture.py, side by side in one process.

A gateway captures every new conversation's messages once, after its reply, in a thread
(a long history) or on the loop: CPU the next requests share. Here each size's conversation
(common.build_conversation, recorded agent runs) is split into spans as the proxy splits it
(`message_spans`) and captured by each version, in an order shuffled per round: `before`,
memory/capture.py at a git commit (`--before`, loaded from `git show`), and `after`, the
working tree's. The table gives the p50 ms of `capture` alone and whether both versions found
the same candidates (category, content and data).

    .venv/bin/python bench/capture_cost.py [--sizes 100K,200K] [--rounds 30] [--before e136c02] [--out FILE]
"""
from __future__ import annotations

import random
import statistics
import time
from typing import Any

import common  # sets LITELLM_LOCAL_MODEL_COST_MAP first
from overhead import parse_size

from ctxgate.memory import capture as after_module
from ctxgate.pipeline.provenance import message_spans


def found(candidates: list[tuple[int, Any]]) -> list[tuple[int, str, str, Any]]:
    return [(i, c.category.value, c.content, c.data) for i, c in candidates]


def main() -> None:
    p = common.parser(__doc__, wait=120)
    p.add_argument("--sizes", type=lambda v: [parse_size(s) for s in v.split(",")], default=[100_000, 200_000])
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--before", default="e136c02")
    args = p.parse_args()
    common.wait_for_quiet(max_wait_s=args.max_wait)
    versions = {"before": common.module_at(args.before, "memory/capture.py").capture, "after": after_module.capture}
    rows = []
    rng = random.Random(38)
    for size in args.sizes:
        messages = common.build_conversation(size, common.gpt4o_counter())
        spans = message_spans(messages, set(range(len(messages))))
        results = {name: found(capture(messages, spans, lambda s, n: s[:n], 1.0)) for name, capture in versions.items()}
        times: dict[str, list[float]] = {name: [] for name in versions}
        for _ in range(args.rounds):
            order = list(versions)
            rng.shuffle(order)
            for name in order:
                started = time.perf_counter()
                versions[name](messages, spans, lambda s, n: s[:n], 1.0)
                times[name].append((time.perf_counter() - started) * 1000)
        before, after = statistics.median(times["before"]), statistics.median(times["after"])
        rows.append([f"{size // 1000}K", len(messages), f"{before:.1f}", f"{after:.1f}", f"{after / before:.2f}×",
                     len(results["after"]), "yes" if results["before"] == results["after"] else "**no**"])
        common.progress(f"  {size // 1000}K: {before:.1f} -> {after:.1f} ms")
    text = "\n".join([
        common.section_header("Memory's capture of a new conversation, before and after"), "", common.about(__doc__),
        "", f"`before`: memory/capture.py at {args.before}; {args.rounds} rounds.", "",
        common.table(["size", "messages", "before p50 ms", "after p50 ms", "after ÷ before", "candidates",
                      "same candidates"], rows),
    ])
    common.publish("capture-cost", text, args.out)


if __name__ == "__main__":
    main()
