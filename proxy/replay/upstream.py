"""The upstream a replay answers from: it counts a request as an OpenAI-like provider does
and, when the replay enforces the limit, refuses one over it with the provider's own words.
"""
from __future__ import annotations

from typing import Any

from ctxgate.pipeline.tokens import TokenCounter

Message = dict[str, Any]
CTXGATE, UPSTREAM = "ctxgate", "upstream"
"""Who refused a turn: ctxgate before the upstream (`context_exhausted`), or the upstream."""


class ProviderCount:
    """The provider's `usage.prompt_tokens` of a request: the messages and the tools schema."""

    def __init__(self, counter: TokenCounter, tools: list[dict[str, Any]] | None) -> None:
        self.counter = counter
        self.tools_tokens = counter.count_tools(tools)

    def __call__(self, messages: list[Message]) -> int:
        return self.counter.count_messages(messages) + self.tools_tokens


def too_long_message(limit: int, tokens: int) -> str:
    """OpenAI's context-length error: the message `Compactor.reactive` reads the limit from."""
    return (f"This model's maximum context length is {limit} tokens. However, your messages resulted in "
            f"{tokens} tokens. Please reduce the length of the messages.")
