"""What counting a new conversation costs, tiktoken against the encoder ctxgate counts with.

A conversation of `--size` tokens of real trajectory messages (common.build_conversation),
made new each iteration (common.fresh: no count cached), counted whole as a turn counts it
(`HistoryIndex.counted`, every message by `TokenCounter.count_message`) with o200k_base: once
by tiktoken itself (`TiktokenEncoder`) and once by ctxgate's own encoder for it (gigatoken's,
`tokens.tiktoken_encoder`), in a shuffled order each iteration, in one thread; p50 and p95 of
each, the ratio, and whether the two counts agree (they must: the same ids).

    .venv/bin/python bench/count_speed.py [--sizes 10K,107K,400K] [--iterations 40] [--out FILE]
"""
from __future__ import annotations

import argparse
import random
import time

import common  # sets LITELLM_LOCAL_MODEL_COST_MAP first
from overhead import parse_size

from ctxgate.pipeline.history_index import HistoryIndex
from ctxgate.pipeline.tokens import TiktokenEncoder, TokenCounter, tiktoken_encoder

ENCODING = "o200k_base"


def _counted(counter: TokenCounter, messages: list[dict]) -> tuple[float, int]:
    index = HistoryIndex([], [], [0], counter.name).extend(messages, 0, counter, count=False)
    started = time.perf_counter()
    done = index.counted(messages, counter)
    return (time.perf_counter() - started) * 1000, done.tokens()


def run(sizes: list[int], iterations: int) -> str:
    encoders = {"tiktoken": TiktokenEncoder(ENCODING), "ctxgate (gigatoken)": tiktoken_encoder(ENCODING)}
    rows = []
    for size in sizes:
        base = common.build_conversation(size, common.gpt4o_counter())
        times: dict[str, list[float]] = {name: [] for name in encoders}
        agree = True
        for i in range(iterations + 2):
            messages = common.fresh(base, f"count-{i}")
            totals = set()
            for name in random.sample(list(encoders), len(encoders)):
                # A counter of its own each time: nothing kept from the last iteration's count.
                ms, total = _counted(TokenCounter(f"tiktoken:{ENCODING}", encoders[name], byte_bounded=True), messages)
                totals.add(total)
                if i >= 2:
                    times[name].append(ms)
            agree = agree and len(totals) == 1
        p50 = {name: common.median(v) for name, v in times.items()}
        rows.append([f"{size // 1000}K", str(len(base)),
                     *(f"{p50[n]:.2f} / {common.pct(times[n], 0.95):.2f}" for n in encoders),
                     f"{p50['tiktoken'] / p50['ctxgate (gigatoken)']:.1f}×", "yes" if agree else "NO"])
        common.progress(f"count_speed: {size // 1000}K done")
    return (common.section_header("Counting a new conversation: tiktoken against ctxgate's encoder")
            + "\n" + common.about(__doc__) + "\n\n"
            + common.table(["size", "messages", *(f"{n} p50 / p95 ms" for n in encoders), "speed-up",
                            "same counts"], rows) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="10K,107K,400K")
    p.add_argument("--iterations", type=int, default=40)
    p.add_argument("--out", default=None, help="write the section to this file, not bench/RESULTS.md")
    args = p.parse_args()
    common.publish("count-speed", run([parse_size(s) for s in args.sizes.split(",")], args.iterations), args.out)


if __name__ == "__main__":
    main()
