"""The planner of a large conversation runs in a thread on a loop of its own, and the
summary it asks for is asked on the serving loop (whose HTTP client and stores it needs);
a small one is planned inline (proxy/engine/off_loop.py)."""
from __future__ import annotations

import asyncio
import threading
from dataclasses import replace
from typing import Any

from ctxgate.pipeline.config import PipelineConfig
from ctxgate.pipeline.history_index import HistoryIndex
from ctxgate.pipeline.tokens import TokenCounter
from ctxgate.proxy.engine.off_loop import HEAVY_MESSAGES, count_off_loop, run_planner
from ctxgate.proxy.engine.turn_budget import Turn
from pipeline_builders import CountingEncoder, counter, user


def test_a_heavy_plan_runs_off_the_loop_and_asks_its_summary_on_it() -> None:
    async def run() -> None:
        serving, me = asyncio.get_running_loop(), threading.get_ident()
        asked: list[tuple[bool, int]] = []

        async def summarize(prompt: list[dict[str, Any]]) -> str:
            asked.append((asyncio.get_running_loop() is serving, threading.get_ident()))
            return f"summary of {len(prompt)}"

        async def plan(turn: Turn) -> tuple[int, bool, str]:
            return threading.get_ident(), asyncio.get_running_loop() is serving, await turn.summarize([user("a")])

        messages = [user(f"m{i}") for i in range(HEAVY_MESSAGES)]
        turn = Turn(messages=messages, fingerprints=[], tools=None, counter=counter(), config=PipelineConfig(),
                    max_input_tokens=1000, summarize=summarize)
        planner_thread, on_serving_loop, text = await run_planner(turn, plan)
        assert planner_thread != me and not on_serving_loop and text == "summary of 1"
        assert asked == [(True, me)]
        planner_thread, on_serving_loop, _ = await run_planner(replace(turn, messages=messages[:3]), plan)
        assert planner_thread == me and on_serving_loop

    asyncio.run(run())


class _ThreadNoting(CountingEncoder):
    """Notes the thread each count runs in."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: set[int] = set()

    def count(self, text: str) -> int:
        self.threads.add(threading.get_ident())
        return super().count(text)


def test_a_count_runs_on_the_loop_up_to_the_tokenizers_inline_bytes_and_in_a_thread_above() -> None:
    async def run() -> None:
        me = threading.get_ident()
        messages = [user(f"message {i}") for i in range(5)]
        for body_bytes, on_loop in [(CountingEncoder.inline_count_bytes, True),
                                    (CountingEncoder.inline_count_bytes + 1, False)]:
            encoder = _ThreadNoting()
            counter = TokenCounter("noting", encoder)
            index = HistoryIndex.build([], counter).extend(messages, 0, counter, count=False)
            counted = await count_off_loop(index, messages, counter, body_bytes)
            assert counted.tokens() == counter.count_messages(messages) and encoder.tokens > 0
            assert (encoder.threads == {me}) is on_loop and len(encoder.threads) == 1

    asyncio.run(run())
