"""Level 2, Microcompact: cut the middle out of long tool outputs.

As the spec says: a tool result over its tool's threshold keeps its first 1,500 and last
500 tokens (cut with the tokenizer, not by characters) around the separator
`... [middle N tokens truncated] ...`. The separator itself is the spec's
`microcompacted: true` mark: a proxy cannot add fields to messages a provider validates,
and a message that carries the separator is never truncated again.

SWE-agent style agents return observations in `user` messages; those are treated as
tool output too, except the task statement and the newest user message.
"""
from __future__ import annotations

import re

from .config import MicrocompactConfig
from .strategy import Stopwatch, level_result
from .tokens import TokenCounter
from .turns import newest_user_index, split_units, task_index
from .types import CompressionRequest, CompressionResult, Level, Message

SEPARATOR = "\n... [middle {n} tokens truncated] ...\n"
_SEPARATOR_RE = re.compile(r"\.\.\. \[middle \d+ tokens truncated\] \.\.\.")


def is_microcompacted(text: str) -> bool:
    return _SEPARATOR_RE.search(text) is not None


def tool_names_by_call_id(messages: list[Message]) -> dict[str, str]:
    names: dict[str, str] = {}
    for m in messages:
        for tc in m.get("tool_calls") or []:
            if isinstance(tc, dict):
                names[tc.get("id")] = (tc.get("function") or {}).get("name") or ""
    return names


class MicrocompactStrategy:
    level = Level.MICROCOMPACT

    def __init__(self, config: MicrocompactConfig, pin_first_user: bool = True,
                 effective_budget: int | None = None) -> None:
        self.config = config
        self.pin_first_user = pin_first_user
        self.effective_budget = effective_budget

    def threshold_for(self, tool_name: str | None, results_in_step: int = 1) -> int:
        """The tool's threshold, capped by the budget share that one step's results share:
        four parallel reads must not keep four times what one read may."""
        cfg = self.config
        threshold = cfg.default_threshold
        if tool_name:
            if tool_name in cfg.thresholds:
                threshold = cfg.thresholds[tool_name]
            else:
                lowered = tool_name.lower()
                for key, value in cfg.thresholds.items():
                    if key.lower() in lowered:
                        threshold = value
                        break
        if self.effective_budget:
            share = int(self.effective_budget * cfg.budget_share) // max(1, results_in_step)
            threshold = min(threshold, max(cfg.min_threshold, share))
        return threshold

    def truncate(self, text: str, threshold: int, counter: TokenCounter) -> str | None:
        """`text` cut to head + separator + tail, or None when it is short or already cut."""
        if len(text.encode()) <= threshold or is_microcompacted(text):
            return None  # a token is at least one byte: this text cannot be over the threshold
        tokens = counter.count_cached(text)  # outputs are resent every turn: tokenize each once
        if tokens <= threshold:
            return None
        head, tail = self.config.head_tokens, self.config.tail_tokens
        if head + tail > threshold:
            # A budget-scaled (or last-resort) threshold: the cut text, separator included, keeps at most the
            # threshold, in the spec's 3:1 split.
            kept = threshold - counter.count(SEPARATOR.format(n=tokens))
            head, tail = kept * 3 // 4, kept // 4
        middle = tokens - head - tail
        start, end = counter.head_and_tail_cached(text, head, tail)
        cut = start + SEPARATOR.format(n=middle) + end
        return cut if counter.count_cached(cut) < tokens else None  # just over the threshold: the separator costs more

    def compact_message(self, message: Message, tool_name: str | None, counter: TokenCounter,
                        results_in_step: int = 1) -> Message:
        """One message with its long text content cut; the same message when nothing to cut."""
        content = message.get("content")
        if not isinstance(content, str):
            return message
        cut = self.truncate(content, self.threshold_for(tool_name, results_in_step), counter)
        return message if cut is None else {**message, "content": cut}

    def candidates(self, messages: list[Message]) -> list[tuple[int, str | None, int]]:
        """(index, tool name, results in its step) of every message that holds tool output."""
        names = tool_names_by_call_id(messages)
        protected = {newest_user_index(messages)}
        if self.pin_first_user:
            protected.add(task_index(messages))
        step_size = {i: u.end - u.start - 1 for u in split_units(messages) for i in range(u.start + 1, u.end)}
        out: list[tuple[int, str | None, int]] = []
        for i, m in enumerate(messages):
            if m.get("role") == "tool":
                out.append((i, names.get(m.get("tool_call_id")), step_size.get(i, 1)))
            elif m.get("role") == "user" and i not in protected:
                out.append((i, None, 1))
        return out

    def compact_from(self, messages: list[Message], start: int, counter: TokenCounter,
                     observations: bool = True) -> tuple[list[Message], list[int]]:
        """Messages with every tool output from index `start` on cut; and the indices cut.
        `observations=False` leaves tool output in user messages alone (see `_arrival_compact`)."""
        out = list(messages)
        changed: list[int] = []
        for i, tool_name, results_in_step in self.candidates(messages):
            if i < start or (not observations and messages[i].get("role") == "user"):
                continue
            cut = self.compact_message(out[i], tool_name, counter, results_in_step)
            if cut is not out[i]:
                out[i] = cut
                changed.append(i)
        return out, changed

    async def compress(self, request: CompressionRequest) -> CompressionResult | None:
        watch = Stopwatch()
        messages, changed = self.compact_from(request.messages, 0, request.counter)
        if not changed:
            return None
        return level_result(self.level, request, messages, (changed[0], changed[-1] + 1), watch, len(changed),
                            [f"microcompact: truncated {len(changed)} tool outputs"])


class NewestObservationCut:
    """The chain's last resort, run when every level has and the request still does not fit:
    cut the newest user message, if it is an observation (SWE-agent style, tool output in a
    user message) rather than the task statement, to the room the rest leaves, head and tail
    around Microcompact's separator. Every level protects that message, but a turn whose
    newest observation alone is over the budget fails otherwise."""
    level = Level.MICROCOMPACT

    def __init__(self, microcompact: MicrocompactStrategy) -> None:
        self.microcompact = microcompact

    async def compress(self, request: CompressionRequest) -> CompressionResult | None:
        watch = Stopwatch()
        messages, counter = request.messages, request.counter
        newest = newest_user_index(messages)
        if newest is None or newest == task_index(messages):
            return None  # the task statement is not an observation
        content = messages[newest].get("content")
        if not isinstance(content, str):
            return None
        others = counter.count_messages(messages) - counter.count_structured(messages[newest])
        bare = counter.count_structured({**messages[newest], "content": ""})
        room = max(self.microcompact.config.min_threshold, request.token_budget - others - bare)
        cut = self.microcompact.truncate(content, room, counter)
        if cut is None:
            return None
        out = [*messages[:newest], {**messages[newest], "content": cut}, *messages[newest + 1:]]
        return level_result(self.level, request, out, (newest, newest + 1), watch, 1,
                            ["microcompact: cut the newest observation, alone over the budget"])
