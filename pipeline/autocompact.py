"""Level 4, Autocompact: an LLM summary of the old history, with a recovery message.

Scan from the tail towards the head to find the smallest span to
compress, keep at least the last 10 messages (the recent window, which also keeps the
last two complete steps), ask for the six-field structured summary,
and put a recovery message in the span's place. A proxy adds: the call has a timeout;
three failures in a row open a circuit breaker for the session; a summary computed in
the background (speculative Autocompact) is used when it covers the span, so the turn
pays no LLM latency.
"""
from __future__ import annotations

import asyncio
import re
from dataclasses import asdict, dataclass, replace
from typing import Any, Awaitable, Callable

from .config import AutocompactConfig
from .fingerprint import message_fingerprint, span_hash
from .ledger import ledger_room, ledger_text
from .notes import AUTOCOMPACT_MARKER, SUMMARY, context_note, is_ctxgate_message
from .refs import render_span
from .protocols.base import readable_text
from .strategy import Stopwatch, level_result
from .tokens import TokenCounter
from .request import CompressionRequest
from .types import CompressionResult, Level, Message, RecentWindow

Summarize = Callable[[list[Message]], Awaitable[str]]

SUMMARY_PROMPT = """Summarise the conversation history below as a structured summary that keeps:
1. The user's core goal (what the current task is)
2. The steps completed so far, in order
3. Key decision points (which tools were called, and why)
4. Unresolved problems and pending tasks
5. The list of files currently being worked on
6. The skill or tool context in use

Format: concise bullet points under those six headings. Leave out small talk."""

RECOVERY = ("{marker}\nThe history before this point was compressed into a summary{kept}; key state is kept:\n\n"
            "{summary}")
"""The quoted part of the recovery message: the summary is written from tool output and turns."""
RECOVERY_INSTRUCTIONS = ("-- Recovery instructions --\n1. Continue the unfinished task.\n"
                         "2. Re-read the current working files when you need them.\n"
                         "3. The tool context in use is restored in the messages above.")
"""ctxgate's own fixed wording, after the quoted summary."""
DEGRADE_KEEP = 3
"""The degraded mode (docs/compaction.md): only the last 3 messages and the system prompt."""
MIN_SUMMARY_TOKENS = 64
"""The least a summary keeps however tight the budget: about a line for each of the six fields."""
MESSAGE_TOKENS_FOR_SUMMARY = 800
"""Each message is cut to this many tokens in what the summariser reads."""


@dataclass
class AutocompactBreaker:
    """Three failures in a row stop Autocompact for the session (until a success)."""
    failures: int = 0
    max_failures: int = 3
    last_error: str = ""

    @property
    def open(self) -> bool:
        return self.failures >= self.max_failures

    def failed(self, error: str) -> None:
        self.failures += 1
        self.last_error = error

    def succeeded(self) -> None:
        self.failures = 0
        self.last_error = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "AutocompactBreaker":
        return cls(**data)


@dataclass(frozen=True)
class SummaryPlan:
    """What one Autocompact would summarise: messages[start:end] of its input."""
    start: int
    end: int
    key: str
    prompt: list[Message]
    length: int
    """How many messages the summary covers (the span minus pinned messages)."""
    history: tuple[Message, ...] = ()
    """Those messages, whole: what a reference in the recovery message gives back."""


def serialise(messages: list[Message], counter: TokenCounter) -> str:
    lines: list[str] = []
    for m in messages:
        text = readable_text(m)
        if counter.count(text) > MESSAGE_TOKENS_FOR_SUMMARY:
            text = counter.head(text, MESSAGE_TOKENS_FOR_SUMMARY) + " [...]"
        lines.append(f"[{'ctxgate' if is_ctxgate_message(m) else m.get('role')}] {text}")
    return "\n\n".join(lines)


_FIELD_HEADING = re.compile(r"^\W*([1-6])\b")
KEPT_LONGEST = ("4", "5")
"""Fields shortened last: the open problems (the last error) and the working files are what
the agent cannot get back from anywhere else; the goal is the pinned task statement again."""


def shorten(summary: str, tokens: int, counter: TokenCounter) -> str:
    """`summary` in at most about `tokens` tokens, every line keeping its start. Cutting only
    the end would drop whole fields (the open problems and the file list come late): instead
    the lines of the other fields share the room first, and those of fields 4 and 5 are cut
    only when the rest cannot make room."""
    lines = [line for line in summary.strip().splitlines() if line.strip()]
    costs = [counter.count(line) for line in lines]
    room = tokens - (len(lines) - 1)  # a token for each line break
    if sum(costs) <= room:
        return "\n".join(lines)
    field, late = "", []
    for line in lines:
        heading = _FIELD_HEADING.match(line)
        field = heading.group(1) if heading else field
        late.append(field in KEPT_LONGEST)
    caps = [0] * len(lines)
    for group in (True, False):  # fields 4 and 5 take what they need first, within the room
        members = [i for i in range(len(lines)) if late[i] == group]
        others = 0 if not group else sum(min(costs[i], 8) for i in range(len(lines)) if not late[i])
        for i, cap in zip(members, _share([costs[i] for i in members], room - others)):
            caps[i] = cap
        room -= sum(min(costs[i], caps[i]) for i in members)
    kept = [line if cost <= cap else _cut_line(line, cap, counter) for line, cost, cap in zip(lines, costs, caps)]
    return "\n".join(line for line in kept if line.strip())


_FIELD_BODY = re.compile(r"^\W*(?:[1-6]\b[^:\n]{0,60}:\s*)?")
"""A line's heading and bullet (`2. Completed steps: `, `- `): what its items come after."""


def _cut_line(line: str, cap: int, counter: TokenCounter) -> str:
    """A summary line in at most `cap` tokens, cut at a word boundary; a list (items after its
    heading separated by `;` or `,`, whichever it uses) keeps whole items only, so the steps
    completed never end in a fragment of one, nor a sentence in half a clause."""
    head = counter.head(line, cap)
    sep = "; " if "; " in line else ", "
    body = _FIELD_BODY.match(line)
    start = body.end() if body else 0
    at = line.rfind(sep, start, len(head) + len(sep))  # the last item's end the head reaches
    return line[:at] if at > start else head


def _share(costs: list[int], room: int) -> list[int]:
    """Caps that fit `costs` into `room`: short ones whole, the long ones an equal share."""
    left = max(0, room)
    cap = left
    for i, cost in enumerate(sorted(costs)):
        share = left // (len(costs) - i)
        if cost > share:
            cap = share
            break
        left -= cost
    return [cap] * len(costs)


class AutocompactStrategy:
    level = Level.AUTOCOMPACT

    def __init__(self, config: AutocompactConfig, summarize: Summarize | None,
                 breaker: AutocompactBreaker | None = None, pin_first_user: bool = True,
                 precomputed: dict[str, dict[str, Any]] | None = None) -> None:
        self.config = config
        self.summarize = summarize
        self.breaker = breaker or AutocompactBreaker(max_failures=config.max_failures)
        self.pin_first_user = pin_first_user
        self.precomputed = precomputed or {}
        """Summaries made ahead of time (speculative Autocompact): plan key -> {summary, length}."""

    def plan(self, request: CompressionRequest, window_only: bool = False) -> SummaryPlan | None:
        """The tail-to-head scan: keep the recent window, then (unless `window_only`) the newest
        units while they fit what the budget leaves after the head and the recovery message,
        and summarise everything older. None when there is nothing older."""
        messages, budget, counter = request.messages, request.token_budget, request.counter
        shape = request.shape(self.pin_first_user)
        fixed = counter.count_messages(messages[:shape.head]) + self.summary_tokens(budget) + 80
        fixed += ledger_room(request.conversation, shape.head, shape.tail, budget, counter)
        fixed += sum(counter.count_structured(messages[i]) for i in shape.pinned)
        room = budget - fixed
        start = shape.tail
        kept = sum(counter.count_structured(m) for m in messages[shape.tail:])
        for unit in reversed(shape.units):
            if unit.start >= shape.tail or unit.start < shape.head:
                continue
            cost = sum(counter.count_structured(messages[i]) for i in range(unit.start, unit.end)
                       if i not in shape.pinned)
            if kept + cost > room or window_only:
                break
            kept += cost
            start = unit.start
        if start <= shape.head:
            return None
        history = [m for i, m in enumerate(messages[shape.head:start], shape.head) if i not in shape.pinned]
        if not history:
            return None
        key = span_hash(message_fingerprint(m) for m in history)
        prompt = [{"role": "system", "content": SUMMARY_PROMPT},
                  {"role": "user", "content": "Conversation history:\n\n" + serialise(history, counter)}]
        return SummaryPlan(start=shape.head, end=start, key=key, prompt=prompt, length=len(history),
                           history=tuple(history))

    def summary_tokens(self, budget: int) -> int:
        """The summary's allowance: the configured maximum, but never more than 1/8 of the budget."""
        return min(self.config.summary_max_tokens, max(100, budget // 8))

    async def summarise(self, plan: SummaryPlan) -> str:
        """The LLM call, with its timeout and the breaker's bookkeeping."""
        if self.summarize is None:
            raise RuntimeError("no summarising model configured")
        try:
            text = await asyncio.wait_for(self.summarize(plan.prompt), self.config.timeout_s)
        except Exception as e:  # every failure counts towards the breaker, whatever its kind
            reason = "timed out" if isinstance(e, asyncio.TimeoutError) else f"{type(e).__name__}: {e}"
            self.breaker.failed(reason)
            raise
        self.breaker.succeeded()
        return text

    async def compress(self, request: CompressionRequest) -> CompressionResult | None:
        watch = Stopwatch()
        counter = request.counter
        degrade = request.reason == "degrade"
        if degrade:
            request = replace(request, window=RecentWindow(messages=DEGRADE_KEEP, steps=0))
        plan = self.plan(request, window_only=degrade)
        if plan is None:
            return None
        summary = self._ready_summary(plan)
        end = plan.end
        shape = request.shape(self.pin_first_user)
        # A task statement pinned after a demonstration comes before the recovery note, as it
        # does when it follows the instructions: instructions, task, then what ctxgate adds.
        task = request.conversation.task
        lead = [request.messages[i] for i in sorted(shape.pinned) if i < end and i == task]
        pinned = [request.messages[i] for i in sorted(shape.pinned) if i < end and i != task]

        kept = ""
        keep = request.cuts.keep if request.cuts is not None else None
        if keep is not None:
            kept = f" (the originals: ref {keep(render_span(list(plan.history)))})"
        # The steps it removes, by number: the summary may leave them out, the ledger does not.
        ledger = ledger_text(request.conversation, (i for i in range(plan.start, end) if i not in shape.pinned),
                             request.token_budget, counter, keep)

        def compacted(text: str) -> list[Message]:
            # The summary is written from tool output and the agent's turns: quoted data.
            recovery = context_note(SUMMARY, "compaction summary",
                                    RECOVERY.format(marker=AUTOCOMPACT_MARKER, kept=kept,
                                                    summary=f"{text}\n\n{ledger}" if ledger else text),
                                    then=RECOVERY_INSTRUCTIONS)
            return request.messages[:plan.start] + lead + [recovery] + pinned + request.messages[end:]

        if summary is None:
            if counter.count_messages(compacted("")) + MIN_SUMMARY_TOKENS >= counter.count_messages(request.messages):
                return None  # the note alone outweighs the span: the chain would throw the summary away
            if self.breaker.open:
                return self._unchanged(request, f"autocompact: off for this session after {self.breaker.failures} "
                                                f"failures in a row ({self.breaker.last_error})")
            try:
                summary = await self.summarise(plan)
            except Exception:
                return self._unchanged(request, f"autocompact: summary failed ({self.breaker.last_error})")

        # The summary gets what the budget leaves once the rest is in place, within its
        # allowance: a fixed reserve would overshoot a budget the kept messages nearly fill.
        # When even the shortest summary cannot make it fit, shortening it only loses state.
        room = request.token_budget - counter.count_messages(compacted(""))
        allowance = self.summary_tokens(request.token_budget)
        if MIN_SUMMARY_TOKENS <= room < allowance:
            allowance = room
        out = compacted(shorten(summary, allowance, counter))
        over = counter.count_messages(out) - request.token_budget
        if 0 < over and allowance > MIN_SUMMARY_TOKENS:
            # Tokens can merge across the summary's edges: take off what that added.
            out = compacted(shorten(summary, max(MIN_SUMMARY_TOKENS, allowance - over), counter))
        hints = [f"autocompact: summarised {end - plan.start} messages, kept the last {len(request.messages) - end}"]
        return level_result(self.level, request, out, (plan.start, end), watch, end - plan.start, hints)

    def _ready_summary(self, plan: SummaryPlan) -> str | None:
        """A summary of exactly this span made ahead of time, if there is one."""
        entry = self.precomputed.get(plan.key)
        return entry["summary"] if entry else None

    def _unchanged(self, request: CompressionRequest, hint: str) -> CompressionResult:
        """Tried and failed: no step, the input as it was, and why."""
        tokens = request.counter.count_messages(request.messages)
        return CompressionResult(compressed_messages=request.messages, tokens_freed=0, level_used=self.level,
                                 recovery_hints=[hint], steps=[], tokens_after=tokens,
                                 fits=tokens <= request.token_budget)
