"""The step ledger: what a compaction note keeps of each agent step it removed.

Every level that removes actions (Snip, Autocompact, the last resort; a fold of earlier notes)
writes one line per step in its note: the step's number, its tool and key argument, its outcome
(the exit status, else the failure line, else ok) and its reference, so the agent can still
say which steps ran and ask for any of them whole:

    - step 12: bash(pytest -q tests/test_calc.py) -> exit 1: AssertionError: 3 != 4; ref ctx:…
    - steps 1–11: bash ×8, str_replace ×3; last failure step 7: SyntaxError: …; ref ctx:…

A step's number is the ordinal of its action among all the actions of the session: counted
from the highest number the notes before it name (`step_numbers`), so it does not shift as
history is cut. The notes are anchored (byte-identical at later points), so their ledgers are
too. When a ledger does not fit its note's allowance, or earlier notes are folded into one,
the oldest lines fold into a range whose reference gives back the lines it replaced: every
step number stays named however many points came before.
"""
from __future__ import annotations

import re
from bisect import bisect_right
from dataclasses import dataclass
from typing import Callable, Iterable

from .conversation import Conversation, Kind, Unit
from .fingerprint import message_fingerprint
from .notes import SNIP, SNIP_MARKER, context_note, is_compaction_note, merged_note, plain_note, quoted_text
from .previews import call_text, output_body
from .protocols.base import Action, Observation
from .refs import SIZING_REF, clip, render_span
from .tokens import TokenCounter
from .types import Message

CALL_CHARS = 72
"""A line's `tool(key argument)` at most."""
OUTCOME_CHARS = 72
"""A line's failure line at most."""
HEADING = "Steps removed (by number; a step's ref gives it back whole):"
Keep = Callable[[str], str]
"""Keeps an original and returns its reference (`CutLog.keep`)."""

_REF = r"(?:; ref ctx:[0-9a-f]{12})?"
_STEP = re.compile(r"^- step (\d+): ([^\s(]*)(?:\((.*)\))? -> (.*?)" + _REF + "$")
_RANGE = re.compile(r"^- steps (\d+)–(\d+): (.*?)(?:; last failure step (\d+): (.*?))?" + _REF + "$")


@dataclass(frozen=True)
class Entry:
    """One ledger line: a step, or a range of steps folded together."""
    first: int
    last: int
    tools: tuple[tuple[str, int], ...]
    """Each tool the steps called, with how many times, in order of first use."""
    failure: tuple[int, str] | None
    """The newest failed step among them and its failure line."""
    text: str


def _outcome(observation: Observation | None) -> tuple[str, str]:
    """A step's outcome as its line says it, and its failure line ('' when it did not fail)."""
    if observation is None:
        return "no result", ""
    code = output_body(observation.output)[0]
    code = observation.exit_status if observation.exit_status is not None else code
    failure = " ".join(observation.error_line.split())
    if code not in (None, 0) or (code is None and failure):
        failure = clip(failure, OUTCOME_CHARS) or f"exit {code}"
        return (f"exit {code}: {failure}" if code is not None else f"failed: {failure}"), failure
    return ("exit 0" if code == 0 else "ok"), ""


def step_entry(number: int, action: Action, observation: Observation | None, ref: str | None) -> Entry:
    outcome, failure = _outcome(observation)
    tool = "".join(action.tool.split()) or "?"
    text = f"- step {number}: {call_text(Action(tool, action.arguments, action.command), CALL_CHARS)} -> {outcome}"
    return Entry(number, number, ((tool, 1),), (number, failure) if failure else None,
                 text + (f"; ref {ref}" if ref else ""))


def folded(entries: list[Entry], ref: str | None, failures: bool = True) -> Entry:
    """`entries` as one range line (`ref`: what gives their lines back); without `failures`,
    its last failure's line left out (tool names and numbers only: ctxgate's own wording)."""
    tools: dict[str, int] = {}
    for entry in entries:
        for tool, n in entry.tools:
            tools[tool] = tools.get(tool, 0) + n
    failure = max((e.failure for e in entries if e.failure), default=None) if failures else None
    first, last = min(e.first for e in entries), max(e.last for e in entries)
    text = f"- steps {first}–{last}: " + ", ".join(f"{t} ×{n}" for t, n in tools.items())
    if failure:
        text += f"; last failure step {failure[0]}: {failure[1]}"
    return Entry(first, last, tuple(tools.items()), failure, text + (f"; ref {ref}" if ref else ""))


def runs(entries: list[Entry]) -> list[list[Entry]]:
    """`entries` in order of their numbers, in runs of consecutive numbers: a range names the
    numbers of one run only, never one a step kept in place between them has."""
    out: list[list[Entry]] = []
    for entry in sorted(entries, key=lambda e: e.first):
        if out and entry.first <= max(e.last for e in out[-1]) + 1:
            out[-1].append(entry)
        else:
            out.append([entry])
    return out


def folded_runs(entries: list[Entry], ref: str | None, failures: bool = True) -> list[Entry]:
    """`entries` as range lines, one per run of consecutive numbers (`runs`), each as `folded`."""
    return [folded(run, ref, failures) for run in runs(entries)]


def parse(text: str) -> list[Entry]:
    """The ledger lines of a note's text."""
    out: list[Entry] = []
    for line in text.splitlines():
        if found := _STEP.match(line):
            number, outcome = int(found.group(1)), found.group(4)
            bad = not outcome.startswith(("ok", "exit 0", "no result"))
            failure = outcome.split(": ", 1)[-1] if bad else ""
            out.append(Entry(number, number, ((found.group(2), 1),), (number, failure) if bad else None, line))
        elif found := _RANGE.match(line):
            tools = tuple((t, int(n)) for t, _, n in (part.rpartition(" ×") for part in found.group(3).split(", "))
                          if n.isdigit())
            failure = (int(found.group(4)), found.group(5)) if found.group(4) else None
            out.append(Entry(int(found.group(1)), int(found.group(2)), tools, failure, line))
    return out


def note_entries(message: Message) -> list[Entry]:
    """The ledger of one of ctxgate's compaction notes (none for anything else)."""
    return parse(quoted_text(message)) if is_compaction_note(message) else []


def step_numbers(conversation: Conversation) -> list[tuple[int, ...]]:
    """Per message, the numbers of the steps its actions are: counted on from the highest
    number the notes before it name, and after the task from the highest that notes taken out
    of the messages named (`Conversation.steps_before`: a note made without them numbers on,
    where it would name steps 1, 2, … again beside the line that names those). A number a note's
    ledger skips between the steps it names is a step kept in place inside its cut (a pinned
    action, placed after the note): the actions after the note take those numbers first."""
    memo = conversation.memo(("ledger-numbers", conversation.steps_before, conversation.steps_named))
    found = memo.get("numbers")
    if found is None:
        n, found = 0, []
        held: list[int] = []
        after_task = 0 if conversation.task is None else conversation.task + 1

        def note(named: set[int] | frozenset[int]) -> None:
            nonlocal n, held
            held = [k for k in held if k not in named]
            # A number it skips is a step kept in place, after it; one a shed note or a point
            # with no room for a note took is below `n` already (`steps_before`).
            held += [k for k in range(n + 1, max(named, default=n)) if k not in named]
            n = max([n, *named])

        for i, (message, info) in enumerate(zip(conversation.messages, conversation.infos)):
            if i == after_task:
                n = max(n, conversation.steps_before)
                note(conversation.steps_named)
            if info.kind is Kind.NOTE:
                note({k for e in note_entries(message) for k in range(e.first, e.last + 1)})
                found.append(())
            elif info.actions and info.kind in (Kind.ACTION, Kind.PLAN):
                numbers = []
                for _ in info.actions:
                    if not held:
                        n += 1
                    numbers.append(held.pop(0) if held else n)
                found.append(tuple(numbers))
            else:
                found.append(())
        memo["numbers"] = found
    return found


def highest_step(messages: list[Message]) -> int:
    """The highest step number the ledgers of the compaction notes among `messages` name (0: none)."""
    return max((e.last for m in messages for e in note_entries(m)), default=0)


def covered_steps(conversation: Conversation, out: list[Message]) -> int:
    """The highest step number that `out` (a compaction point's messages for `conversation`'s)
    stands for ahead of the first action it keeps verbatim after the task, named or not: what
    the next point's reading numbers on from (`CompactionRecord.steps`), where a point with room
    for no note would leave it to number from 1 again."""
    numbers = step_numbers(conversation)
    kept = {message_fingerprint(m) for m in out}
    after_task = 0 if conversation.task is None else conversation.task + 1
    verbatim = {n for i, ns in enumerate(numbers) if i >= after_task and conversation.fingerprints[i] in kept
                for n in ns}
    every = named_steps(conversation.messages) | {n for ns in numbers for n in ns} | {conversation.steps_before} \
        | conversation.steps_named
    first = min(verbatim, default=max(every) + 1)
    return max((n for n in every if n < first and n not in verbatim), default=0)


def _answered(conversation: Conversation) -> dict[int, list[tuple[Action, Observation | None]]]:
    memo = conversation.memo("ledger-steps")
    found = memo.get("steps")
    if found is None:
        found = {}
        for i, action, observation in conversation.steps():
            found.setdefault(i, []).append((action, observation))
        memo["steps"] = found
    return found


def _units_over(conversation: Conversation, chosen: set[int]) -> list[Unit]:
    """The units holding any of `chosen`: only those between its first and last index are
    looked at (Snip asks unit by unit; scanning every unit each time was quadratic)."""
    if not chosen:
        return []
    memo = conversation.memo("ledger-units")
    starts = memo.get("starts")
    if starts is None:
        starts = memo["starts"] = [u.start for u in conversation.units]
    units = conversation.units
    first = max(0, bisect_right(starts, min(chosen)) - 1)
    last = bisect_right(starts, max(chosen))
    return units[first:last]


def span_entries(conversation: Conversation, indices: Iterable[int], keep: Keep | None) -> list[Entry]:
    """The ledger of the messages at `indices` (being removed): a line per step, each naming
    its unit's original (kept with `keep`), and the lines of the earlier notes among them."""
    chosen = set(indices)
    numbers, answered, messages = step_numbers(conversation), _answered(conversation), conversation.messages
    out: list[Entry] = []
    for unit in _units_over(conversation, chosen):
        members = [i for i in range(unit.start, unit.end) if i in chosen]
        ref: str | None = None
        for i in members:
            out += note_entries(messages[i])
            for number, (action, observation) in zip(numbers[i], answered.get(i, [])):
                if ref is None and keep is not None:
                    ref = keep(render_span([messages[j] for j in members]))
                out.append(step_entry(number, action, observation, ref))
    return sorted(out, key=lambda e: e.first)


def size(entries: list[Entry], counter: TokenCounter) -> int:
    """What the lines cost in a note (a newline each)."""
    return sum(counter.count_cached(e.text) + 1 for e in entries)


def fit(entries: list[Entry], allowance: int, counter: TokenCounter, keep: Keep | None) -> list[Entry]:
    """`entries` within `allowance` tokens: the fewest oldest lines folded into one range that
    make them fit (all of them when nothing less does); the range's reference gives back the
    lines it replaced."""
    if len(entries) < 2 or size(entries, counter) <= allowance:
        return entries
    costs = [counter.count_cached(e.text) + 1 for e in entries]
    after = [sum(costs[n:]) for n in range(len(costs) + 1)]
    sizing = SIZING_REF if keep is not None else None
    k = next((n for n in range(2, len(entries))
              if size(folded_runs(entries[:n], sizing), counter) + after[n] <= allowance), len(entries))
    head = entries[:k]
    ref = keep("\n".join(e.text for e in head)) if keep is not None else None
    return [*folded_runs(head, ref), *entries[k:]]


SHARE = 0.02
"""A ledger outside Snip's note (a summary's, a fold's) takes at most this share of the budget:
a summary tells the steps too, and a fold's ranges give back the lines they replaced (at 5%,
the per-dialect bench paid 0.04 more of an unmanaged run's cost at 50%, for more points)."""


def ledger_text(conversation: Conversation, indices: Iterable[int], budget: int, counter: TokenCounter,
                keep: Keep | None) -> str:
    """The ledger of the messages at `indices`, within its share of `budget`, as a note writes it."""
    return within_share(span_entries(conversation, indices, keep), budget, counter, keep)


def ledger_room(conversation: Conversation, start: int, end: int, budget: int, counter: TokenCounter) -> int:
    """What a note over messages[start:end] keeps for its ledger: the lines of the steps among
    them, within their share of `budget` (nothing when there is none)."""
    entries = span_entries(conversation, range(start, end), None)
    if not entries:
        return 0
    return heading_tokens(counter) + min(size(entries, counter) + 10 * len(entries), max(40, int(budget * SHARE)))


def within_share(entries: list[Entry], budget: int, counter: TokenCounter, keep: Keep | None) -> str:
    """`entries` as a note writes them, folded to fit their share of `budget`."""
    return render(fit(entries, max(40, int(budget * SHARE)) - heading_tokens(counter), counter, keep))


def covering_note(notes: list[Message]) -> Message | None:
    """What stands for compaction notes that must all go (a request with no room for them): one
    line of ctxgate's own wording naming every step their ledgers named, as a range of tool
    names, so the step numbers stay covered (quoted when a name does not read as one); None
    when they named no step."""
    entries = [e for m in notes for e in note_entries(m)]
    if not entries:
        return None
    text = (f"{SNIP_MARKER} Earlier compaction notes were dropped to fit the context budget.\n"
            + "\n".join(e.text for e in folded_runs(entries, None, failures=False)))
    return plain_note(SNIP, text) if all(map(_named_plainly, entries)) else context_note(
        SNIP, "compaction: dropped notes", text)


_TOOL_NAME = re.compile(r"[A-Za-z0-9_.:/\-]{1,64}")
"""A tool's or program's name as ctxgate may write it unquoted."""


def _named_plainly(entry: Entry) -> bool:
    """`entry` names its tools as names: a ledger line is read back from a note's quoted text,
    where a summary or a preview could hold a line shaped like one (and any words in it)."""
    return all(_TOOL_NAME.fullmatch(tool) for tool, _ in entry.tools)


def _own_words(entry: Entry) -> bool:
    """`entry` is a range of step numbers and tool names alone, as `folded` writes one without
    its failure: it may stand unquoted, as ctxgate's own wording."""
    line = f"- steps {entry.first}–{entry.last}: " + ", ".join(f"{t} ×{n}" for t, n in entry.tools)
    return (entry.failure is None and _named_plainly(entry)
            and re.fullmatch(re.escape(line) + _REF, entry.text) is not None)


def merged(notes: list[Message], counter: TokenCounter, keep: Keep) -> Message:
    """One note in the place of compaction `notes`, with no summary call: their text kept under
    one reference, their ledgers folded into one range (every step number stays named, and the
    range's reference gives their lines back). Ranges of tool names alone are ctxgate's own
    wording, as Snip's count is: not quoted, so they bring no delimiters and no notice."""
    entries = fit([e for m in notes for e in note_entries(m)], 0, counter, keep)
    own = all(map(_own_words, entries))
    ledger = "\n".join(e.text for e in entries) if own else render(entries)
    return merged_note(len(notes), keep(render_span(notes)), ledger, own_words=own)


def named_steps(messages: list[Message]) -> set[int]:
    """The step numbers the ledgers of the compaction notes among `messages` name."""
    return {n for m in messages for e in note_entries(m) for n in range(e.first, e.last + 1)}


def widened(note: Message, cover: Message) -> Message | None:
    """`note`, whose first ledger line is a range of the steps right after those `cover` names,
    with `cover`'s steps folded into that range: the line that names the earlier steps, where it
    has no room of its own, costs the range a few tool names. None when `note` is no such note."""
    content = note.get("content")
    before, found = note_entries(cover), note_entries(note)
    if not isinstance(content, str) or not before or not found or not found[0].text.startswith("- steps ") \
            or found[0].first != max(e.last for e in before) + 1:
        return None
    # No reference: the range's gave back the later lines only (the note's own still gives back
    # the messages it stands for), and `cover`'s lines had none. A note of ctxgate's own wording
    # (Snip's count) stays so: no failure line quoted in it.
    own = content.startswith(SNIP_MARKER)
    if own and not all(map(_named_plainly, [*before, found[0]])):
        return None
    line = "\n".join(e.text for e in folded_runs([*before, found[0]], None, failures=not own))
    return {**note, "content": content.replace(found[0].text, line, 1)}


def render(entries: list[Entry]) -> str:
    return "\n".join([HEADING, *(e.text for e in entries)]) if entries else ""


def heading_tokens(counter: TokenCounter) -> int:
    return counter.count_cached(HEADING) + 1
