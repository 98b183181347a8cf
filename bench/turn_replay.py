"""A recorded run replayed turn by turn through the compactor, with the gpt-4o tokenizer and
a scripted summary: `ctxgate replay`'s driver (proxy/replay/driver.py) as the benchmarks
use it. Used by bench/prefix_stability.py.
"""
from __future__ import annotations

import asyncio
from typing import Any, Callable

import common  # noqa: F401  (sets up the tokenizer files and the import path)

from ctxgate.proxy.replay.driver import Forwarded, Message, Replay, agent_turns, replay as replay_session

__all__ = ["Forwarded", "Message", "Replay", "SUMMARY", "agent_turns", "replay"]

SUMMARY = """1. User goal: fix the failing behaviour described in the task.
2. Completed steps: explored the repository; reproduced the problem.
3. Key decisions: edited the module that raised the error.
4. Open issues: run the test suite again.
5. Current files: see the restored file list.
6. Skill/tool context: str_replace_editor, execute_bash."""


async def replay(messages: list[Message], tools: list[dict[str, Any]] | None, budget: int, *,
                 provider_count: Callable[[list[Message]], int] | None = None, speculate: bool = True,
                 summary_s: float = 0.0, upstream_s: float = 0.0) -> Replay:
    """`summary_s`: how long a summary takes; the rest as `proxy.replay.driver.replay`."""
    async def summarize(_: list[Message]) -> str:
        if summary_s:
            await asyncio.sleep(summary_s)
        return SUMMARY

    return await replay_session(messages, tools, budget, counter=common.gpt4o_counter(), summarize=summarize,
                                provider_count=provider_count, speculate=speculate, upstream_s=upstream_s)
