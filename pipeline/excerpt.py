"""An original given back within a token limit: what a model asking for a cut most needs.

Expanding a reference must not undo the compaction that made room (the follow-up request
stays within the budget), yet a long log's useful line is rarely at its start. So an
original that does not fit keeps its head and its tail, and before those the lines that say
what failed, newest first, each with a line either side. Every run of lines left out is
named by its own reference (`[... N lines, M tokens: ref ctx:HEX]`), kept in the `CutLog`,
so the model can ask for exactly that part next. A span of messages (what Snip, Collapse and
Autocompact keep) that does not fit becomes an index when that fits, a line per message with
its own reference, so the message the model wants is one more call away.
"""
from __future__ import annotations

from .failures import is_error_line
from .refs import CutLog, clip, span_messages
from .tokens import TokenCounter

GAP = "[... {lines} lines, {tokens} tokens: ref {ref}]\n"
GAP_TOKENS = 24
"""What one gap's note costs, with room to spare (its figures and reference vary)."""
ERROR_SHARE = 0.5
"""At most this share of the limit goes to failure lines; head and tail share the rest 3:1."""
WHOLE_ENTRY = 48
"""A message of a span index this short is shown whole rather than by reference."""
ENTRY_CHARS = 120


def excerpt(text: str, limit: int, counter: TokenCounter, cuts: CutLog) -> str:
    """`text` whole when it is at most `limit` tokens; otherwise its head, tail and failure
    lines within `limit`, each gap named by a reference kept in `cuts`."""
    if counter.count(text) <= limit:
        return text
    messages = span_messages(text)
    if messages is not None and len(messages) > 1:
        index = CutLog()
        listed = _index(messages, counter, index)
        if counter.count(listed) <= limit:
            cuts.originals.update(index.originals)
            return listed
    lines = text.splitlines(keepends=True)
    sizes = [counter.count(line) for line in lines]
    room = limit - 2 * GAP_TOKENS
    if len(lines) < 3 or max(sizes) > room // 4:
        return _head_only(text, limit, counter, cuts)
    kept: set[int] = set()
    spent = 0
    for at in reversed([i for i, line in enumerate(lines) if is_error_line(line)]):
        around = [i for i in range(at - 1, at + 2) if 0 <= i < len(lines) and i not in kept]
        cost = sum(sizes[i] for i in around) + GAP_TOKENS
        if spent + cost > room * ERROR_SHARE:
            break
        kept.update(around)
        spent += cost
    spent += _take(range(len(lines)), sizes, kept, (room - spent) * 3 // 4)
    _take(range(len(lines) - 1, -1, -1), sizes, kept, room - spent)
    return _render(lines, sizes, kept, cuts)


def _index(messages: list[str], counter: TokenCounter, cuts: CutLog) -> str:
    """A span of messages too long to give back whole, as one line per message (its start,
    its size, its own reference, and the line that says what failed, if any): the model
    finds the message it wants and asks for it. A short message is shown whole."""
    entries = []
    for text in messages:
        tokens = counter.count(text)
        if tokens <= WHOLE_ENTRY:
            entries.append(" ".join(text.split()))
            continue
        lines = text.splitlines()
        failed = next((line.strip() for line in reversed(lines[1:]) if is_error_line(line)), "")
        entries.append(f"{clip(lines[0], ENTRY_CHARS)} ... ({tokens} tokens: ref {cuts.keep(text)})"
                       + (f" | {clip(failed, ENTRY_CHARS)}" if failed else ""))
    return f"{len(messages)} messages, each whole under its reference:\n" + "\n".join(entries) + "\n"


def _take(order: range, sizes: list[int], kept: set[int], tokens: int) -> int:
    """Lines in `order` kept (past those already kept) until `tokens` are spent; what was spent."""
    spent = 0
    for i in order:
        if i in kept:
            continue
        if spent + sizes[i] > tokens:
            break
        kept.add(i)
        spent += sizes[i]
    return spent


def _render(lines: list[str], sizes: list[int], kept: set[int], cuts: CutLog) -> str:
    out: list[str] = []
    gap: list[int] = []
    for i in range(len(lines) + 1):
        if i < len(lines) and i not in kept:
            gap.append(i)
            continue
        if gap:
            ref = cuts.keep("".join(lines[j] for j in gap))
            out.append(GAP.format(lines=len(gap), tokens=sum(sizes[j] for j in gap), ref=ref))
            gap = []
        if i < len(lines):
            out.append(lines[i] if lines[i].endswith("\n") else lines[i] + "\n")
    return "".join(out)


def _head_only(text: str, limit: int, counter: TokenCounter, cuts: CutLog) -> str:
    """A text with no lines to choose between (one long line): its head, the rest by reference."""
    head = counter.head(text, max(0, limit - GAP_TOKENS))  # at a line or word boundary
    rest = text[len(head):]
    tokens = counter.count(rest)
    return f"{head}\n[... {tokens} more tokens: ref {cuts.keep(rest)}]"
