"""One model of an agent conversation, whatever protocol the agent speaks.

A read-only view over the wire messages: for each message what it is (the agent's
instructions, the task, an action, an observation, a plan or todo update, plain talk,
or a note ctxgate added), the actions and observations in it, and how messages group
into *units*, the smallest pieces a strategy may drop: an action with the observation
that answers it (a *step*), or any other single message. Every strategy reads the
conversation through this view and nothing else, so a text-protocol agent is compacted
by the same rules as a tool-calling one.

The *recent window* is what every level leaves byte-identical: the newest
`RecentWindow.messages` messages, and never fewer than the last `RecentWindow.steps`
complete steps, widened to a unit boundary.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, Collection, Iterator

from .fingerprint import message_fingerprint
from .notes import is_compaction_note, is_ctxgate_message
from .protocols import STRUCTURAL_DIALECTS, detect_dialect, text_reader
from .protocols.anthropic import has_results, results_of, uses_of
from .protocols.base import Action, Observation, id_of, text_of
from .protocols.tool_calls import calls_of, result_of
from .turns import INSTRUCTION_ROLES, leading_instructions, newest_user_index, task_index
from .types import RecentWindow

from .tokens import REPLY_PRIMING

if TYPE_CHECKING:
    from .tokens import TokenCounter

Message = dict[str, Any]
PLAN_TOOLS = ("update_plan", "plan", "set_plan")
TODO_TOOLS = ("TodoWrite", "todo_write", "task_tracker", "todo")
"""Tools whose calls update the plan or the todo list (restore's defaults too)."""

__all__ = ["Action", "Conversation", "Kind", "MessageInfo", "Observation", "RecentWindow", "Shape", "Unit",
           "client_task_index", "read_conversation", "shape_of", "split_units"]


class Kind(str, Enum):
    INSTRUCTIONS = "instructions"
    TASK = "task"
    ACTION = "action"
    OBSERVATION = "observation"
    PLAN = "plan"
    """An action that updates the plan or the todo list."""
    TALK = "talk"
    NOTE = "note"
    """A note or restore block ctxgate itself added."""


@dataclass(frozen=True)
class MessageInfo:
    kind: Kind
    actions: tuple[Action, ...] = ()
    observations: tuple[Observation, ...] = ()
    answers: int | None = None
    """For an observation: the index of the message whose action it answers."""


@dataclass(frozen=True)
class Unit:
    start: int
    end: int
    """Half-open: messages[start:end]."""


@dataclass(frozen=True)
class Shape:
    """Where a strategy may work: messages[head:tail], minus the pinned ones."""
    head: int
    """Leading instructions, plus the task statement when it is pinned and follows them."""
    tail: int
    """Start of the recent window: nothing from here on is dropped or altered."""
    pinned: frozenset[int]
    """Indices inside [head, tail) that are never dropped or altered: the newest user message,
    and a pinned task statement that comes after a demonstration."""
    units: tuple[Unit, ...]

    def droppable_units(self) -> list[Unit]:
        return [u for u in self.units if u.start >= self.head and u.end <= self.tail
                and not any(p in self.pinned for p in range(u.start, u.end))]


class Conversation:
    def __init__(self, messages: list[Message], dialect: str, infos: list[MessageInfo], units: list[Unit],
                 task: int | None | object = ..., fingerprints: list[str] | None = None,
                 memo: dict[Any, Any] | None = None, steps_before: int = 0,
                 steps_named: frozenset[int] = frozenset()) -> None:
        self.messages = messages
        self.dialect = dialect
        self.infos = infos
        self.units = units
        self.task: int | None = task_index(messages) if task is ... else task  # type: ignore[assignment]
        self._fingerprints = fingerprints
        self._memo: dict[Any, Any] = {} if memo is None else memo
        """What is derived from the messages' content alone (shapes, token counts), shared by
        every reading of the same messages (`read_conversation` memoises them)."""
        self.steps_before = steps_before
        """The highest step number that notes taken out of these messages named: the agent's
        steps after the task are numbered on from it (`ledger.step_numbers`)."""
        self.steps_named = steps_named
        """The step numbers that notes taken out of these messages named, where they are known
        (a fallback shed them): read after the task as a note naming them would be, so a step
        kept in place between them keeps its number (`ledger.step_numbers`)."""

    @property
    def fingerprints(self) -> list[str]:
        """`message_fingerprint` of each message, computed once per reading."""
        if self._fingerprints is None:
            self._fingerprints = [message_fingerprint(m) for m in self.messages]
        return self._fingerprints

    def memo(self, key: Any) -> dict[Any, Any]:
        """A dict a strategy keeps derived values of this content in, under `key`."""
        found = self._memo.get(key)
        if found is None:
            found = self._memo[key] = {}
        return found

    def counts(self, counter: "TokenCounter") -> list[int]:
        """`counter.count_structured` of each message, counted once per content."""
        key = ("counts", counter)
        found = self._memo.get(key)
        if found is None:
            found = [counter.count_structured(m, fp) for m, fp in zip(self.messages, self.fingerprints)]
            self._memo[key] = found
        return found

    def total(self, counter: "TokenCounter") -> int:
        """`counter.count_messages(self.messages)`, from the memoised counts."""
        key = ("total", counter)
        found = self._memo.get(key)
        if found is None:
            found = self._memo[key] = counter.count_messages(self.messages, self.fingerprints)
        return found

    def kind(self, index: int) -> Kind:
        return self.infos[index].kind

    def is_complete_step(self, unit: Unit) -> bool:
        """An action together with an observation that answers it."""
        return (bool(self.infos[unit.start].actions)
                and any(self.infos[i].kind is Kind.OBSERVATION for i in range(unit.start + 1, unit.end)))

    def recent_start(self, window: RecentWindow) -> int:
        """Where the recent window begins (0 for a conversation shorter than it)."""
        start = max(0, len(self.messages) - window.messages)
        if window.steps > 0:
            steps = [u for u in self.units if self.is_complete_step(u)]
            if steps:
                start = min(start, steps[-min(window.steps, len(steps))].start)
        return next((u.start for u in self.units if u.start <= start < u.end), start)

    def shape(self, pin_first_user: bool = True, window: RecentWindow | None = None, anchored: bool = False,
              keep: frozenset[str] = frozenset()) -> Shape:
        """`keep`: fingerprints of messages pinned too (`CompressionRequest.keep`)."""
        key = ("shape", pin_first_user, window or RecentWindow(), anchored, keep)
        found = self._memo.get(key)
        if found is None:
            found = self._memo[key] = self._shape(pin_first_user, window, anchored, keep)
        return found

    def anchor(self, pin_first_user: bool = True) -> tuple[int, int]:
        """(start, end) of the run of ctxgate's compaction notes right after the leading
        instructions and the pinned task: what earlier compaction points left, oldest first."""
        start = leading_instructions(self.messages)
        if pin_first_user and self.task == start and start < len(self.messages):
            start += 1
        end = start
        while end < len(self.messages) and is_compaction_note(self.messages[end]):
            end += 1
        return start, end

    def _shape(self, pin_first_user: bool, window: RecentWindow | None, anchored: bool,
               keep: frozenset[str]) -> Shape:
        head, notes_end = self.anchor(pin_first_user)
        if anchored:
            head = notes_end
        tail = max(self.recent_start(window or RecentWindow()), head)
        pinned = set()
        kept = [i for i in range(head, tail) if self.fingerprints[i] in keep] if keep else []
        for index in (newest_user_index(self.messages), self.task if pin_first_user else None, *kept):
            if index is not None and head <= index < tail:
                pinned.add(index)
        # A unit across the head (a reader pairing the instructions' last turn with the message
        # after them) is split there: what follows the head is weighed as a unit of its own.
        units = [part for u in self.units
                 for part in ((Unit(u.start, head), Unit(head, u.end)) if u.start < head < u.end else (u,))]
        return Shape(head=head, tail=tail, pinned=frozenset(pinned), units=tuple(units))

    def steps(self) -> Iterator[tuple[int, Action, Observation | None]]:
        """Every action, oldest first, with the observation that answers it (if any yet)."""
        by_call: dict[str, Observation] = {}
        by_answer: dict[int, Observation] = {}
        for i, info in enumerate(self.infos):
            for found in info.observations:
                if found.call_id:
                    by_call[found.call_id] = found
                elif info.answers is not None:
                    by_answer.setdefault(info.answers, found)
        for i, info in enumerate(self.infos):
            for action in info.actions:
                yield i, action, by_call.get(action.call_id or "") if action.call_id else by_answer.get(i)

    def latest_failure(self) -> tuple[int, Observation] | None:
        """The newest observation that reports a failure, after the task statement: what came
        before it (a SWE-agent demonstration of another task) is not this agent's work."""
        for i in range(len(self.infos) - 1, self.task if self.task is not None else -1, -1):
            for found in reversed(self.infos[i].observations):
                if found.failed:
                    return i, found
        return None


_MEMO_SIZE = 16
_memo: OrderedDict[tuple[Any, ...], tuple[str, list[MessageInfo], list[Unit], int | None, dict[Any, Any]]] = \
    OrderedDict()
_memo_lock = threading.Lock()


def counted_result(level: Any, request: Any, conversation: Conversation, messages: list[Message],
                   fingerprints: list[str], span: tuple[int, int], watch: Any, affected: int,
                   hints: list[str] | None = None, after: int | None = None) -> Any:
    """`strategy.level_result` for a level whose output's fingerprints it already knows:
    the same result, counted from the reading's memoised counts instead of hashing both
    message lists again (`after`: the output's count, when the level has it already)."""
    from .types import CompactionStep, CompressionResult
    counter = request.counter
    before = conversation.total(counter)
    if after is None:
        known = conversation.memo(("counts-by-fingerprint", counter))
        if not known:
            known.update(zip(conversation.fingerprints, conversation.counts(counter)))
        after = REPLY_PRIMING
        for m, fp in zip(messages, fingerprints):
            n = known.get(fp)
            after += counter.count_structured(m, fp) if n is None else n
    step = CompactionStep(level=level, span=span, tokens_before=before, tokens_after=after,
                          duration_ms=watch.ms, messages_affected=affected)
    return CompressionResult(compressed_messages=messages, tokens_freed=max(0, before - after), level_used=level,
                             recovery_hints=list(hints or []), steps=[step], tokens_after=after,
                             fits=after <= request.token_budget)


def read_conversation(messages: list[Message], dialect: str | None = None,
                      plan_tools: Collection[str] = PLAN_TOOLS + TODO_TOOLS,
                      fingerprints: list[str] | None = None, steps_before: int = 0,
                      steps_named: frozenset[int] = frozenset(), task: str | None = None) -> Conversation:
    """Read `messages` in `dialect` (detected from the messages when None). `plan_tools`
    names the tools whose calls update the plan or the todo list. A reading depends on the
    messages' content alone, so the last few are memoised by the messages' fingerprints
    (`fingerprints` when the caller has them): the same history sent again, or read again
    by the next level of the chain, is not parsed again. `steps_before`, `steps_named`: `Conversation`'s.
    `task`: the fingerprint of the client's task statement, where the caller knows it
    (`client_task_index`)."""
    fps = [message_fingerprint(m) for m in messages] if fingerprints is None else fingerprints
    at = _told(fps, task)
    key = (dialect, frozenset(name.lower() for name in plan_tools), tuple(fps), at)
    with _memo_lock:
        seen = _memo.get(key)
        if seen is not None:
            _memo.move_to_end(key)
    if seen is None:
        read = _read_conversation(messages, dialect, plan_tools, at)
        seen = (read.dialect, read.infos, read.units, read.task, read._memo)
        with _memo_lock:
            _memo[key] = seen
            if len(_memo) > _MEMO_SIZE:
                _memo.popitem(last=False)
    found_dialect, infos, units, found_task, memo = seen
    return Conversation(messages, found_dialect, infos, units, task=found_task, fingerprints=fps, memo=memo,
                        steps_before=steps_before, steps_named=steps_named)


def client_task_index(messages: list[Message], task: str | None, fingerprints: list[str] | None = None) -> int | None:
    """Where `messages` hold the client's task statement, `task` its fingerprint (None: unknown):
    the message that has it, wherever a view puts it, when one alone has it; else the task as
    `task_index` reads these messages. In a view an earlier point made, the task kept beside a
    note can sit right before a reply that was never its own (aider's "Ok" to a command's output
    whose turn was cut): read alone, that is context the client acknowledged, and the next user
    turn ("continue") the task, which a level would then keep ahead of its note and the real
    task after it."""
    at = None if task is None else _told(
        [message_fingerprint(m) for m in messages] if fingerprints is None else fingerprints, task)
    return task_index(messages) if at is None else at


def _told(fingerprints: list[str], task: str | None) -> int | None:
    """Where the one message with the fingerprint `task` is; None: unknown, or not one alone."""
    return fingerprints.index(task) if task is not None and fingerprints.count(task) == 1 else None


def _read_conversation(messages: list[Message], dialect: str | None,
                       plan_tools: Collection[str], told: int | None) -> Conversation:
    task = task_index(messages) if told is None else told
    dialect = dialect or detect_dialect(messages, task)
    reader = text_reader(dialect, messages)
    plan = {name.lower() for name in plan_tools}
    call_tools: dict[str, str] = {}
    call_owner: dict[str, int] = {}
    infos: list[MessageInfo] = []
    for i, m in enumerate(messages):
        role = m.get("role")
        if is_ctxgate_message(m):
            infos.append(MessageInfo(Kind.NOTE))
        elif role in INSTRUCTION_ROLES:
            infos.append(MessageInfo(Kind.INSTRUCTIONS))
        elif i == task:
            infos.append(MessageInfo(Kind.TASK))
        elif role == "assistant":
            actions = calls_of(m) or uses_of(m) or (reader.actions(text_of(m)) if reader else [])
            for action in actions:
                if action.call_id:
                    call_tools[action.call_id], call_owner[action.call_id] = action.tool, i
            kind = (Kind.PLAN if any(a.tool.lower() in plan for a in actions)
                    else Kind.ACTION if actions else Kind.TALK)
            infos.append(MessageInfo(kind, tuple(actions)))
        elif role == "tool":
            call_id = id_of(m.get("tool_call_id")) or ""
            infos.append(MessageInfo(Kind.OBSERVATION, observations=(result_of(m, call_tools.get(call_id)),),
                                     answers=call_owner.get(call_id)))
        elif role == "user" and has_results(m):
            found = results_of(m, call_tools)
            owner = next((call_owner[o.call_id] for o in found if o.call_id in call_owner), None)
            infos.append(MessageInfo(Kind.OBSERVATION, observations=tuple(found), answers=owner))
        elif role == "user" and reader is not None:
            infos.append(_text_turn(m, i, messages, infos, reader))
        else:
            infos.append(MessageInfo(Kind.TALK))
    return Conversation(messages, dialect, infos, _units(messages, infos, dialect), task=task)


def _text_turn(message: Message, i: int, messages: list[Message], infos: list[MessageInfo], reader: Any) -> MessageInfo:
    """A user turn in a text protocol: the observation of the action just before it, or one
    the protocol's header makes plain, or (the fallback) whatever answers an assistant turn."""
    text = text_of(message)
    after_assistant = i > 0 and messages[i - 1].get("role") == "assistant"
    previous = infos[i - 1] if after_assistant else None
    if previous is not None and previous.actions:
        return MessageInfo(Kind.OBSERVATION, observations=(reader.observation(text, previous.actions[-1].tool),),
                           answers=i - 1)
    if reader.signals(text, "user") or (after_assistant and reader.name == "plain"):
        return MessageInfo(Kind.OBSERVATION, observations=(reader.observation(text, None),),
                           answers=i - 1 if after_assistant else None)
    return MessageInfo(Kind.TALK)


def _units(messages: list[Message], infos: list[MessageInfo], dialect: str) -> list[Unit]:
    """An assistant message with what answers it (its `tool` results, the user turn of
    `tool_result` blocks, or in a text protocol the user turn after it); else one message."""
    units: list[Unit] = []
    i, n = 0, len(messages)
    paired_text = dialect not in STRUCTURAL_DIALECTS
    while i < n:
        m = messages[i]
        j = i + 1
        if m.get("role") == "assistant":
            ids = {a.call_id for a in infos[i].actions if a.call_id}
            if m.get("tool_calls"):
                while j < n and messages[j].get("role") == "tool" and id_of(messages[j].get("tool_call_id")) in ids:
                    j += 1
            elif j < n and infos[j].answers == i and messages[j].get("role") == "user":
                j += 1
            elif paired_text and j < n and messages[j].get("role") == "user" and infos[j].kind is not Kind.TASK:
                j += 1  # feedback on a turn that took no action (a format error) goes with it
        units.append(Unit(i, j))
        i = j
    return units


def split_units(messages: list[Message], dialect: str | None = None) -> list[Unit]:
    return read_conversation(messages, dialect).units


def shape_of(messages: list[Message], pin_first_user: bool = True, dialect: str | None = None,
             window: RecentWindow | None = None, anchored: bool = False) -> Shape:
    return read_conversation(messages, dialect).shape(pin_first_user, window, anchored)
