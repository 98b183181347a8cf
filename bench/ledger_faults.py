"""Forwarded requests whose step ledger is wrong, over the recorded runs (issue 36 item 1).

Every run of bench/dialects.py is replayed as that bench replays it (the stand-in summary, the
upstream enforcing the limit, at 50% and 25% of the run's final size), and each request ctxgate
forwarded is checked against the client's own steps, numbered 1, 2, … in the order the agent
took them (tests/ledger_checks.py, `ledger_faults`): a ledger line naming other steps than the
client's at its numbers, a range naming more or fewer calls than numbers, a number named twice
or out of order, a step named and still there verbatim.

    .venv/bin/python bench/ledger_faults.py                          # every dialect
    .venv/bin/python bench/ledger_faults.py --only "SWE-agent text"
"""
from __future__ import annotations

import argparse
import asyncio
import collections

import common
import dialects
from ctxgate.proxy.replay.driver import replay
from ctxgate.proxy.replay.probes import floor_of
from ctxgate.proxy.replay.upstream import ProviderCount
from ledger_checks import ledger_faults

Cell = tuple[str, float]


async def count(only: str | None) -> tuple[collections.Counter[Cell], collections.Counter[Cell]]:
    """Per (dialect, limit ratio): requests forwarded, and those with a ledger fault."""
    counter = common.gpt4o_counter()
    forwarded: collections.Counter[Cell] = collections.Counter()
    faulty: collections.Counter[Cell] = collections.Counter()
    for _, t, dialect, messages in dialects.runs(only, None):
        provider = ProviderCount(counter, t.tools)
        final, floor = provider(messages), floor_of(messages, provider)
        for ratio in dialects.RATIOS:
            limit = int(ratio * final)
            if floor > limit:
                continue  # the system prompt and the task alone are over it: no compactor serves it
            run = await replay(messages, t.tools, limit, counter=counter, provider_count=provider,
                               summarize=dialects.stand_in_summary, wait_background=True, enforce_limit=True)
            for sent in run.forwarded:
                forwarded[dialect, ratio] += 1
                faulty[dialect, ratio] += bool(ledger_faults(messages[:sent.turn], sent.messages)[0])
    return forwarded, faulty


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default=None, help="one dialect, as bench/dialects.py --only takes it")
    forwarded, faulty = asyncio.run(count(p.parse_args().only))
    print("| dialect | limit | forwarded with a ledger fault |\n|:---|---:|---:|")
    for dialect, ratio in sorted(forwarded):
        print(f"| {dialect} | {ratio:.0%} | {faulty[dialect, ratio]} of {forwarded[dialect, ratio]} |")


if __name__ == "__main__":
    main()
