"""Where ctxgate may cut text: never inside a word, a character or a reference.

Every place that shortens text (summaries, Microcompact's head and tail, previews, excerpts,
what the summariser reads) keeps a start or an end of it that stops at a boundary, the
nearest one to the room it has of the first kind that is near enough:

1. a line break, when cutting there keeps at least `LINE_KEEP` of the room: a log or a file
   reads best in whole lines, but not at the price of most of what there was room for;
2. a word boundary (a space, just after a `,` `;` or a CJK clause mark, either side of a CJK
   character) within `WORD_REACH` characters of the room's edge, which may be the text's own
   edge: a word that does not fit is left out whole, not shown in part;
3. else, in text with no spaces near the edge (CJK, minified JSON, base64, a long path), any
   character boundary: never between a character and the combining mark, joiner, variation
   selector or skin tone that belongs to it, nor between the halves of a surrogate pair or
   of a flag.

And never inside a `ref ctx:HEX`: a model reading `ref ctx:96` asks for a reference that
does not exist, so a cut that would split one moves to its edge, off the kept side.
"""
from __future__ import annotations

import re
import unicodedata

LINE_KEEP = 0.5
"""A line break is used when the cut there keeps at least this share of the room."""
WORD_REACH = 32
"""How far back (or forward, for an end) a word boundary is looked for, in characters: longer
than nearly every word, short enough that a long path or URL costs little when it is split."""
_SOFT = frozenset(",;\u3001\u3002\uff0c\uff1b\uff1a\uff01\uff1f")
"""Marks a word boundary may follow: list separators, and CJK clause and sentence marks."""
_REF = re.compile(r"\bref ctx:[0-9a-f]*")
_JOINERS = frozenset("\u200c\u200d")


def _between_words(text: str, k: int) -> bool:
    """Position k of `text` (0 < k < len) is a word boundary: next to a space, just after a soft
    mark, or next to a wide (CJK) character, which text may break on either side of."""
    before, after = text[k - 1], text[k]
    return (before.isspace() or after.isspace() or before in _SOFT
            or (_wide(before) or _wide(after)) and not _splits_character(text, k))


def _word_edge(text: str, k: int) -> bool:
    """A word boundary a cut may stop at. An edge of the text is one only when the word there
    is short (a boundary within `WORD_REACH` of it): that word is left out whole, while a run
    with no spaces (base64, minified JSON) is cut by characters instead."""
    if 0 < k < len(text):
        return _between_words(text, k)
    if len(text) <= WORD_REACH:
        return True
    near = range(1, WORD_REACH + 1) if k <= 0 else range(len(text) - WORD_REACH, len(text))
    return any(_between_words(text, j) for j in near)


def _wide(char: str) -> bool:
    return char >= "\u1100" and unicodedata.east_asian_width(char) in ("W", "F")


def _splits_character(text: str, k: int) -> bool:
    """Cutting between text[k - 1] and text[k] splits what reads as one character."""
    if not 0 < k < len(text):
        return False
    before, after = text[k - 1], text[k]
    if before in _JOINERS or after in _JOINERS or unicodedata.combining(after):
        return True
    code, prior = ord(after), ord(before)
    return (0xFE00 <= code <= 0xFE0F or 0x1F3FB <= code <= 0x1F3FF or 0xE0020 <= code <= 0xE007F
            or unicodedata.category(after) in ("Mc", "Me")
            or (0xD800 <= prior <= 0xDBFF and 0xDC00 <= code <= 0xDFFF)
            or (0x1F1E6 <= prior <= 0x1F1FF and 0x1F1E6 <= code <= 0x1F1FF))


def _inside_ref(text: str, k: int) -> tuple[int, int] | None:
    """The `ref ctx:HEX` that position k falls strictly inside, as (start, end); None if none."""
    lo = max(0, k - 8 - 32)
    for found in _REF.finditer(text, lo, min(len(text), k + 64)):
        if found.start() < k < found.end():
            return found.start(), found.end()
    return None


def head_at_boundary(text: str, chars: int) -> str:
    """The longest start of `text` of at most `chars` characters that ends at a boundary."""
    if chars >= len(text):
        return text
    if chars <= 0:
        return ""
    k = _head_cut(text, chars)
    ref = _inside_ref(text, k)
    if ref is not None:
        k = ref[0]
    while k > 0 and text[k - 1] in " \t\r":
        k -= 1
    return text[:k]


def tail_at_boundary(text: str, chars: int) -> str:
    """The longest end of `text` of at most `chars` characters that starts at a boundary."""
    if chars >= len(text):
        return text
    if chars <= 0:
        return ""
    k = _tail_cut(text, len(text) - chars)
    ref = _inside_ref(text, k)
    if ref is not None:
        k = ref[1]
    while 0 < k < len(text) and text[k] in " \t" and text[k - 1] != "\n":
        k += 1  # the spaces before a word, not the indentation of a line kept whole
    return text[k:]


def _head_cut(text: str, chars: int) -> int:
    line = text.rfind("\n", 0, chars + 1)
    if line > 0 and line >= chars * LINE_KEEP:
        return line
    for k in range(chars, max(0, chars - WORD_REACH) - 1, -1):
        if _word_edge(text, k):
            return k
    k = chars
    while k > 0 and _splits_character(text, k):
        k -= 1
    return k


def _tail_cut(text: str, start: int) -> int:
    room = len(text) - start
    line = text.find("\n", max(0, start - 1))
    if line != -1 and line + 1 < len(text) and len(text) - line - 1 >= room * LINE_KEEP:
        return line + 1
    for k in range(start, min(len(text), start + WORD_REACH) + 1):
        if _word_edge(text, k):
            return k
    k = start
    while k < len(text) and _splits_character(text, k):
        k += 1
    return k
