"""The planner of a large conversation runs in a thread on a loop of its own, and the
summary it asks for is asked on the serving loop (whose HTTP client and stores it needs);
a small one is planned inline (proxy/engine/off_loop.py)."""
from __future__ import annotations

import asyncio
import threading
from dataclasses import replace
from typing import Any

from ctxgate.pipeline.config import PipelineConfig
from ctxgate.proxy.engine.off_loop import HEAVY_MESSAGES, run_planner
from ctxgate.proxy.engine.turn_budget import Turn
from pipeline_builders import counter, user


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
