"""The one line that names the steps of the compaction notes a fallback shed
(`ledger.covering_note`): the notes go to fit the budget, their steps stay named, and that line
goes back where room is left, in order of the numbers, naming only the steps no note still there
names (`over_budget.OverBudget.fit`)."""
from __future__ import annotations

from dataclasses import replace

from .conversation import client_task_index
from .ledger import covering_note, named_steps, widened
from .notes import is_compaction_note, is_restore_block, notice_tokens
from .tokens import TokenCounter
from .turns import leading_instructions
from .types import CompressionResult, Message


def named_once(before: list[Message], after: list[Message], counter: TokenCounter, limit: int) -> list[Message]:
    """`after` (`before` with notes shed), its line naming the shed notes' steps naming only those
    of the notes that are gone: it stands for them all, and a later note kept names its own."""
    notes = [m for m in before if is_compaction_note(m)]
    new = [i for i, m in enumerate(after) if is_compaction_note(m) and m not in notes]
    if len(new) != 1 or not named_steps([after[new[0]]]) & named_steps([m for m in after if m in notes]):
        return after
    cover = covering_note([m for m in notes if m not in after])
    out = [m for i, m in enumerate(after) if i != new[0] or cover is not None]
    if cover is not None:
        out[new[0]] = cover
    return out if counter.count_messages(out) + notice_tokens(counter, out) <= limit else after


def without_own_messages(result: CompressionResult, counter: TokenCounter, limit: int, pin_first_user: bool,
                         task: str | None = None) -> tuple[CompressionResult, Message | None]:
    """`result` without any of ctxgate's notes and restore blocks, but for the one line that
    names the notes' steps (`ledger.covering_note`) where it fits under `limit`; with that line
    when it was left out for want of room (`with_cover` puts it back when the oldest turns make
    some), else None. Without it the steps the notes named are lost from the agent's picture."""
    notes = [m for m in result.compressed_messages if is_compaction_note(m)]
    kept = [m for m in result.compressed_messages if not (is_compaction_note(m) or is_restore_block(m))]
    if len(kept) == len(result.compressed_messages):
        return result, None
    bare = replace(result, compressed_messages=kept,
                   tokens_after=counter.count_messages(kept) + notice_tokens(counter, kept))
    cover = covering_note(notes)
    if cover is None:
        return bare, None
    covered = with_cover(bare, cover, counter, limit, pin_first_user, task)
    return covered, (None if covered is not bare else cover)


def cover_of(notes: list[Message], result: CompressionResult) -> Message | None:
    """The one line naming the steps of those of `notes` that `result` no longer names."""
    named = named_steps(result.compressed_messages)
    return covering_note([m for m in notes if not named_steps([m]) <= named])


def with_cover(result: CompressionResult, cover: Message | None, counter: TokenCounter, limit: int,
               pin_first_user: bool, task: str | None = None) -> CompressionResult:
    """`result` with `cover` before the notes after the task that name later steps, if that fits under `limit`; else
    with its steps folded into the range of the note that counts the turns cut after them
    (`ledger.widened`), if that fits; as it is when its notes name those steps already. `task`:
    `CompressionRequest.task`."""
    messages = result.compressed_messages
    if cover is None or named_steps([cover]) <= named_steps(messages):
        return result
    at = leading_instructions(messages)
    if pin_first_user and at < len(messages) and client_task_index(messages, task) == at:
        at += 1
    first = min(named_steps([cover]))
    while at < len(messages) and is_compaction_note(messages[at]) and max(named_steps([messages[at]]),
                                                                           default=0) < first:
        at += 1  # after the notes naming earlier steps: the ledger reads in order of the numbers
    forms = [messages[:at] + [cover] + messages[at:]]
    forms += [messages[:i] + [wide] + messages[i + 1:] for i, m in enumerate(messages)
              if is_compaction_note(m) and (wide := widened(m, cover)) is not None]
    for out in forms:
        tokens = counter.count_messages(out) + notice_tokens(counter, out)
        if tokens <= limit:
            return replace(result, compressed_messages=out, tokens_after=tokens)
    return result
