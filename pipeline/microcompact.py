"""Level 2, Microcompact: cut the middle out of long tool outputs.

A tool result over its tool's threshold keeps its first 1,500 and last
500 tokens (cut with the tokenizer, at a line or word boundary: boundaries.py) around the separator
`... [middle N tokens truncated] ...` (with expansion on, `... [middle N tokens truncated,
ref ctx:HEX] ...`: the middle is kept under that reference). The separator itself marks the message as cut
(rather than a `microcompacted: true` field): a proxy cannot add fields to messages a provider validates,
and a message that carries the separator is never truncated again.

What counts as tool output is the conversation model's observations, in any dialect: a
`tool` message, a user turn answering a text-protocol action (SWE-agent, OpenHands,
mini-swe-agent) or carrying `tool_result` blocks, each under its action's tool's threshold.
A user-turn observation is cut as a whole, so it keeps its header (`EXECUTION RESULT of
[…]:`, `<returncode>`) in the head and stays a user turn. Nothing in the recent window is
cut, but by `RecentWindowCut` when the window alone is over the budget.
"""
from __future__ import annotations

import re

from .config import MicrocompactConfig
from .conversation import Conversation, Kind, counted_result
from .fingerprint import message_fingerprint
from .protocols.anthropic import map_result_texts
from .refs import SIZING_REF, CutLog, content_ref
from .strategy import Stopwatch, level_result
from .tail import PROTECTED_TAIL
from .tokens import TokenCounter
from .turns import newest_user_index
from .request import CompressionRequest
from .types import CompressionResult, Level, Message, RecentWindow

SEPARATOR = "\n... [middle {n} tokens truncated] ...\n"
SEPARATOR_WITH_REF = "\n... [middle {n} tokens truncated, ref {ref}] ...\n"
_SEPARATOR_RE = re.compile(r"\.\.\. \[middle \d+ tokens truncated(?:, ref ctx:[0-9a-f]+)?\] \.\.\.")


def is_microcompacted(text: str) -> bool:
    return _SEPARATOR_RE.search(text) is not None


def separator(n: int, ref: str | None) -> str:
    return SEPARATOR.format(n=n) if ref is None else SEPARATOR_WITH_REF.format(n=n, ref=ref)


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

    def truncate(self, text: str, threshold: int, counter: TokenCounter, cuts: CutLog | None = None) -> str | None:
        """`text` cut to head + separator + tail, or None when it is short or already cut;
        with `cuts`, the middle is kept there under its own reference, which the separator names."""
        if len(text.encode()) <= threshold or is_microcompacted(text):
            return None  # a token is at least one byte: this text cannot be over the threshold
        tokens = counter.count_cached(text)  # outputs are resent every turn: tokenize each once
        if tokens <= threshold:
            return None
        head, tail = self.config.head_tokens, self.config.tail_tokens
        if head + tail > threshold:
            # A budget-scaled (or last-resort) threshold: the cut text, separator included, keeps at most the
            # threshold, split 3:1 between head and tail.
            kept = threshold - counter.count(separator(tokens, SIZING_REF if cuts is not None else None))
            head, tail = kept * 3 // 4, kept // 4
        start, end = counter.head_and_tail_cached(text, head, tail)  # each at a line or word boundary
        middle = tokens - counter.count(start) - counter.count(end)  # boundaries keep less than asked
        exact = text.startswith(start) and text.endswith(end) and len(start) + len(end) <= len(text)
        hidden = text[len(start):len(text) - len(end)] if exact else text  # what is not seen
        ref = content_ref(hidden) if cuts is not None else None
        cut = start + separator(middle, ref) + end
        if counter.count_cached(cut) >= tokens:
            return None  # just over the threshold: the separator costs more
        if cuts is not None:
            cuts.keep(hidden)
        return cut

    def compact_message(self, message: Message, tool_name: str | None, counter: TokenCounter,
                        results_in_step: int = 1, threshold: int | None = None,
                        cuts: CutLog | None = None) -> Message:
        """One message with its long tool output cut, in the message's own form (a string
        content, or the `tool_result` blocks of a content list); the same object when
        nothing was cut, so an untouched message stays byte-identical."""
        limit = self.threshold_for(tool_name, results_in_step) if threshold is None else threshold
        content = message.get("content")
        if isinstance(content, str):
            cut = self.truncate(content, limit, counter, cuts)
            return message if cut is None else {**message, "content": cut}
        return map_result_texts(message, lambda text: self.truncate(text, limit, counter, cuts))

    def candidates(self, conversation: Conversation, start: int, end: int,
                   protected: frozenset[int] = frozenset()) -> list[tuple[int, str | None, int]]:
        """(index, tool name, results in its step) of every observation in [start, end)."""
        out: list[tuple[int, str | None, int]] = []
        for unit in conversation.units:
            members = [i for i in range(unit.start, unit.end) if conversation.kind(i) is Kind.OBSERVATION]
            in_step = sum(len(conversation.infos[i].observations) for i in members)
            for i in members:
                if start <= i < end and i not in protected:
                    out.append((i, conversation.infos[i].observations[0].tool, max(1, in_step)))
        return out

    def compact_range(self, request: CompressionRequest, start: int, end: int) -> tuple[list[Message], list[int]]:
        """The request's messages with every observation in [start, end) cut; and the indices cut."""
        conversation = request.conversation
        shape = request.shape(self.pin_first_user)
        out = list(request.messages)
        changed: list[int] = []
        cfg, counter = self.config, request.counter
        found = conversation.memo("microcompact-candidates")
        key = (start, end, shape.pinned)
        if key not in found:
            found[key] = self.candidates(conversation, start, end, shape.pinned)
        for i, tool_name, results_in_step in found[key]:
            # What a message is cut to depends on its content, the limit and the counter alone:
            # kept with the reading, so a history sent again is not re-scanned for its cuts.
            limit = self.threshold_for(tool_name, results_in_step)
            memo = conversation.memo(("microcompact", counter, limit, cfg.head_tokens, cfg.tail_tokens,
                                      request.cuts is not None))
            if i in memo:
                kept, originals = memo[i]
                cut = out[i] if kept is None else {**kept}
            else:
                mine = CutLog() if request.cuts is not None else None
                cut = self.compact_message(out[i], tool_name, counter, results_in_step, threshold=limit, cuts=mine)
                originals = mine.originals if mine is not None else {}
                memo[i] = (None if cut is out[i] else {**cut}, originals)
            if request.cuts is not None:
                request.cuts.originals.update(originals)
            if cut is not out[i]:
                out[i] = cut
                changed.append(i)
        return out, changed

    async def compress(self, request: CompressionRequest) -> CompressionResult | None:
        watch = Stopwatch()
        shape = request.shape(self.pin_first_user)
        messages, changed = self.compact_range(request, shape.head, shape.tail)
        if not changed:
            return None
        conversation, counter = request.conversation, request.counter
        fps, counts = list(conversation.fingerprints), conversation.counts(counter)
        after = conversation.total(counter)
        for i in changed:
            fps[i] = message_fingerprint(messages[i])
            after += counter.count_structured(messages[i], fps[i]) - counts[i]
        return counted_result(self.level, request, conversation, messages, fps, (changed[0], changed[-1] + 1),
                              watch, len(changed), [f"microcompact: truncated {len(changed)} tool outputs"],
                              after=after)


class RecentWindowCut:
    """The chain's last resort, run when every level has and the request still does not fit:
    the recent window alone is over the budget. Its observations are cut oldest first, each
    to its tool's threshold or, when that is not enough, to what the budget leaves it,
    before anything newer is touched; the last message and the newest user message are
    never changed, nor anything in `protect` (the protected tail, `tail.py`: in the chain,
    the window's older observations give room, the tail only in the fallbacks, once the
    notes and the restored state have given theirs)."""
    level = Level.MICROCOMPACT

    def __init__(self, microcompact: MicrocompactStrategy, protect: RecentWindow | None = PROTECTED_TAIL) -> None:
        self.microcompact = microcompact
        self.protect = protect

    async def compress(self, request: CompressionRequest) -> CompressionResult | None:
        watch = Stopwatch()
        counter, conversation = request.counter, request.conversation
        shape = request.shape(self.microcompact.pin_first_user)
        out = list(request.messages)
        # Only what the window makes the request go over by, with nothing before it but what
        # every level keeps: older history still over the target is not the window's to pay for.
        alone = (counter.count_messages(out[:shape.head]) + counter.count_messages(out[shape.tail:])
                 + sum(counter.count_structured(out[i]) for i in shape.pinned))
        total = counter.count_messages(out)
        goal = total - max(0, alone - request.token_budget)
        changed: list[int] = []
        last = len(out) - 1
        floor = self.microcompact.config.min_threshold
        newest = newest_user_index(out)  # the newest user message is never compressed
        protected = shape.pinned | ({newest} if newest is not None else set())
        end = last if self.protect is None else min(last, conversation.recent_start(self.protect))
        for i, tool_name, in_step in self.microcompact.candidates(conversation, shape.tail, end, protected):
            if total <= goal:
                break
            before = counter.count_structured(out[i])
            content = before - counter.count_structured({**out[i], "content": ""})  # thresholds are on the text
            threshold = self.microcompact.threshold_for(tool_name, in_step)
            threshold = min(threshold, max(floor, content - (total - goal)))
            cut = self.microcompact.compact_message(out[i], tool_name, counter, in_step, threshold, request.cuts)
            if cut is not out[i]:
                out[i] = cut
                changed.append(i)
                total += counter.count_structured(cut) - before
        if not changed:
            return None
        return level_result(self.level, request, out, (changed[0], changed[-1] + 1), watch, len(changed),
                            [f"microcompact: the recent window alone was over the budget; cut {len(changed)} "
                             "of its oldest tool outputs"])


class LastObservationCut:
    """What is left when even a request cut down to the turn in progress is over the budget:
    its last message, if it is an observation (a tool's output, in any dialect), cut head and
    tail to the room the rest leaves. The one exception to "the last message is never
    changed": without it the provider refuses the turn, and the agent loses the whole output
    rather than its middle. A last message that is not an observation is never cut."""
    level = Level.MICROCOMPACT

    def __init__(self, microcompact: MicrocompactStrategy) -> None:
        self.microcompact = microcompact

    async def compress(self, request: CompressionRequest) -> CompressionResult | None:
        watch = Stopwatch()
        messages, counter = request.messages, request.counter
        last = len(messages) - 1
        if last < 0 or request.conversation.kind(last) is not Kind.OBSERVATION:
            return None
        others = counter.count_messages(messages) - counter.count_structured(messages[last])
        bare = counter.count_structured({**messages[last], "content": ""})
        room = max(self.microcompact.config.min_threshold, request.token_budget - others - bare)
        cut = self.microcompact.compact_message(messages[last], None, counter, threshold=room, cuts=request.cuts)
        if cut is messages[last]:
            return None
        return level_result(self.level, request, [*messages[:last], cut], (last, last + 1), watch, 1,
                            ["microcompact: the last observation alone did not fit; its middle was cut"])
