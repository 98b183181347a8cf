"""An original given back within a token limit: what a model asking for a cut most needs.

Expanding a reference must not undo the compaction that made room (the follow-up request
stays within the budget), yet a long log's useful line is rarely at its start. So an
original that does not fit keeps its head and its tail, and before those the lines that say
what failed, newest first, each with a line either side. Every run of lines left out is
named by its own reference (`[... N lines, M tokens: ref ctx:HEX]`), kept in the `CutLog`,
so the model can ask for exactly that part next.
"""
from __future__ import annotations

from .failures import is_error_line
from .refs import CutLog
from .tokens import TokenCounter

GAP = "[... {lines} lines, {tokens} tokens: ref {ref}]\n"
GAP_TOKENS = 24
"""What one gap's note costs, with room to spare (its figures and reference vary)."""
ERROR_SHARE = 0.5
"""At most this share of the limit goes to failure lines; head and tail share the rest 3:1."""


def excerpt(text: str, limit: int, counter: TokenCounter, cuts: CutLog) -> str:
    """`text` whole when it is at most `limit` tokens; otherwise its head, tail and failure
    lines within `limit`, each gap named by a reference kept in `cuts`."""
    if counter.count(text) <= limit:
        return text
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
    head = counter.head(text, max(0, limit - GAP_TOKENS))
    rest = text[len(head):]
    tokens = counter.count(rest)
    return f"{head}\n[... {tokens} more tokens: ref {cuts.keep(rest)}]"
