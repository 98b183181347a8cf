"""Request bodies that resend the last one's bytes: only what follows them is parsed.

A stateless client resends its whole history every turn, serialised the same way, so the next
body starts with the bytes of the last one up to the end of its history list (`{"messages":
[m0, ..., mN-1`), then appends (`, mN, mN+1], "stream": true}`). Parsing those bytes again
costs a millisecond per 800 KB, the largest part of a steady turn's work. This keeps, per
(tenant, door, session named in the headers), the last few bodies' bytes up to that point with
what they parsed to; a body that starts with those bytes gets the same values (the same
objects) for them, and only its tail is parsed, as `{"<history>":["<mark>"` + tail: the same parser
state (inside the history list, after an item), so the tail parses exactly as it does in the
whole body.

The cut is found once per body, after its parse, from the end (or known, below): each `]` is tried as the one
closing the history list by parsing the rest as above and comparing with the fields the whole
body has after its history. A `]` in a string cannot pass (the string's quotes would be
unbalanced); one closing another top-level list could pass only if a key after the history
were repeated, so a body is kept only when each of those keys is written once as a key
(`"key":`) in what follows the kept part (the whole body, the first time), and none repeats
a field before the history. A tail that holds the history's key again (`"messages"` as a
token) is parsed whole; one spelling it with escapes cannot pass either: the synthetic list
starts with a mark of this process's own, which the list a repeated key names would have to
start with.

What follows the history (`], "tools": [...], "stream": true}`) is mostly resent as it was
too (an agent's tools, system instruction and settings), and may be large (Gemini CLI's
tools). So the bytes from the history's last item on are kept with the fields they parsed
to: a body that starts with a kept prefix and ends with exactly those bytes has only what is
between parsed, as `[[0` + between + `]]`, which must be one list of one list: only items
can be in it (no key, so a between that closes the history and names another field is
refused), in the parser state they have in the whole body, so the kept bytes after them
parse as they did. Its fields after the history are the kept ones, the same objects: a door
that checked or converted them last turn knows them by identity (`is`). Its cut is where
those bytes start, when the item before them ends the way a kept prefix must (`}`).

A client that moves a cache breakpoint to its newest message every turn (Claude Code) sends
the last turn's newest message again without it: the next body does not start with the kept
bytes, but with them up to the end of the history's second-to-last item. That second cut is
kept too (with the items before it), and a body starting there has the rest parsed the same
way. It is found once per body, after the first: from the end of the last item, a lexer
walking backwards (a quote is a string's delimiter unless an odd run of backslashes precedes
it, exact for JSON read from a point outside strings) finds the last item's opening brace and
the comma before it, in windows that grow from the end, so the work is bounded by the last
item's size. The lexer only proposes: the comma is taken when the bytes from it to the first
cut parse, as `[[0` + bytes + `]]`, to one list holding 0 and the last item alone. A comma
inside a string cannot pass (from it to the cut the string's quotes are read inverted, and the
cut is outside any string, so the synthetic ends inside one, or meets a backslash outside
one); one inside the last item cannot either (those bytes close more lists or objects than
they open); one before an earlier item gives two items. So only the comma between the last two
items passes, and the second cut is where the item before it ends (`}`).

The body's bytes are kept as the object the door read (no copy): the cuts are offsets into
it, compared through memoryviews; what is counted against the limit is its length.

The kept items and fields are shared with the history cache and the engine, which never change
a parsed message or field in place (they build new ones), as the history cache already relies on.
"""
from __future__ import annotations

import re
import secrets
import threading
from collections import OrderedDict
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import orjson

DEFAULT_MAX_BYTES = 64 * 1024 * 1024
DEFAULT_MAX_ENTRIES = 1024
PER_KEY = 4
"""Bodies kept per key: requests that name no session share a key (their door's), so the last
few conversations of a tenant's unnamed sessions each keep theirs."""
MIN_BYTES = 16 * 1024
"""Below this a body is parsed whole: the parse costs less than keeping it."""
MAX_BODY_BYTES = 8 * 1024 * 1024
"""Above this a body is not kept: past any model's context, and keeping it (a copy, a count of
its keys) would hold the GIL for tens of milliseconds in one C call."""
_WHITESPACE = b" \t\r\n"
_MARK = secrets.token_hex(16)
"""The first item of the synthetic history list (see the module's docstring)."""


@dataclass(frozen=True)
class Resent:
    """A body parsed from a kept prefix: the whole body (its history's items from the prefix the
    same objects as last time), and the bytes parsed anew."""
    body: dict[str, Any]
    parsed_bytes: int
    cut: int | None = None
    """Where its history's last item ends, when what follows is the kept bytes (its fields the kept ones)."""
    start: int = 0
    """Where the bytes parsed anew start: the end of a kept item."""


@dataclass(frozen=True)
class _Kept:
    raw: bytes
    """The body's bytes, the door's own object."""
    cut: int
    """Where its history list's last item ends: the bytes after it are the list's end and the
    fields after it."""
    second: int | None
    """Where the item before that ends (the second cut), when the history has one."""
    head: dict[str, Any]
    """The fields before the history list, as parsed."""
    items: list[Any]
    tail: dict[str, Any]
    """The fields after the history list, as parsed."""

    def shortest(self) -> memoryview:
        return memoryview(self.raw)[:self.cut if self.second is None else self.second]

    def start(self, raw: bytes) -> tuple[int, list[Any]] | None:
        """Where `raw` leaves this body's bytes, at a cut, with the items before it; None: before both."""
        if not raw.startswith(self.shortest()):
            return None
        if self.second is None or raw.startswith(memoryview(self.raw)[self.second:self.cut], self.second):
            return self.cut, self.items
        return self.second, self.items[:-1]


class ResentBodies:
    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        self._kept: OrderedDict[tuple[str, ...], list[_Kept]] = OrderedDict()
        self._bytes = 0
        self._entries = 0
        self._max_bytes = max_bytes
        self._max_entries = max_entries
        self.hits = 0
        self.second_hits = 0
        """Of the hits, the bodies read from a second cut."""
        self._lock = threading.Lock()

    def parse(self, key: tuple[str, ...], raw: bytes, history: str) -> Resent | None:
        """`raw` from a kept prefix of `key`, or None: parse it whole (also when its tail is
        not JSON, so that the error names its place in the whole body)."""
        kept = self._kept.get(key)
        if kept is None or len(raw) < MIN_BYTES:
            return None
        found, at = next(((k, at) for k in kept if (at := k.start(raw)) is not None), (None, None))
        if found is None or at is None:
            return None
        start, items = at
        after = memoryview(found.raw)[found.cut:]
        end = len(raw) - len(after)
        if end >= start and raw.endswith(after):
            between = _items_between(raw, start, end)
            if between is not None:  # only new items before the kept bytes: the kept fields after them
                self._hit(start != found.cut)
                return Resent({**found.head, history: items + between, **found.tail}, end - start, end, start)
        if raw.find(b'"' + history.encode() + b'"', start) >= 0:
            return None  # the history's key again: the whole body decides which one counts
        try:
            parsed = orjson.loads(_synthetic(history, memoryview(raw)[start:]))
        except orjson.JSONDecodeError:
            return None
        if not isinstance(parsed, dict):
            return None
        new = parsed.pop(history, None)
        if not isinstance(new, list) or not new or new[0] != _MARK:
            return None
        if not parsed.keys().isdisjoint(found.head):
            return None  # a field before the history repeated after it: the whole body decides
        self._hit(start != found.cut)
        body = {**found.head, history: items + new[1:], **parsed}
        return Resent(body, len(raw) - start, start=start)

    def _hit(self, second: bool) -> None:
        self.hits += 1
        self.second_hits += second

    def keep(self, key: tuple[str, ...], raw: bytes, body: dict[str, Any], history: str,
             known: Resent | None = None) -> None:
        """Keep `raw`, parsed as `body`, for the next body of `key`; `known`: what `parse` found
        of it (the cut is then looked for only in its tail)."""
        items = body.get(history)
        if not MIN_BYTES <= len(raw) <= MAX_BODY_BYTES or not isinstance(items, list) or not items:
            return
        keys = list(body)
        at = keys.index(history)
        head, after = {k: body[k] for k in keys[:at]}, {k: body[k] for k in keys[at + 1:]}
        cut: int | None
        lowest = known.start if known is not None else 0
        if known is not None and known.cut is not None and known.body is body and raw[known.cut - 1] == ord("}"):
            cut = known.cut  # the kept bytes follow its items: their cut holds
        else:
            if not all(_once(raw, k, lowest) for k in after):
                return  # a field after the history named twice (or spelt otherwise): see `_cut`
            cut = _cut(raw, history, after, lowest)
        if cut is None:
            return
        second = _second_cut(raw, cut, items[-1], lowest) if len(items) > 1 else None
        # The items copied: callers may build on theirs.
        self._add(key, _Kept(raw, cut, second, head, list(items), after))

    def _add(self, key: tuple[str, ...], kept: _Kept) -> None:
        with self._lock:  # a large request's door keeps its body from a thread (`HeavyWork`)
            self._added(key, kept)

    def _added(self, key: tuple[str, ...], kept: _Kept) -> None:
        entries = [kept]
        for old in self._kept.pop(key, []):
            if len(entries) < PER_KEY and not kept.raw.startswith(old.shortest()):
                entries.append(old)
            else:  # the same conversation's earlier body, or one too many
                self._drop(old)
        self._kept[key] = entries
        self._bytes += len(kept.raw)
        self._entries += 1
        while self._kept and (self._bytes > self._max_bytes or self._entries > self._max_entries):
            _, oldest = self._kept.popitem(last=False)
            for k in oldest:
                self._drop(k)

    def _drop(self, kept: _Kept) -> None:
        self._bytes -= len(kept.raw)
        self._entries -= 1

    def __len__(self) -> int:
        return self._entries


def _once(raw: bytes, key: str, start: int) -> bool:
    """Whether `raw` from `start` writes `key` as a key exactly once."""
    token = orjson.dumps(key)
    found = raw.count(token, start)
    return found == 1 or (found > 1 and len(_key_token(token).findall(raw, start)) == 1)


@lru_cache(maxsize=256)
def _key_token(token: bytes) -> re.Pattern[bytes]:
    """`"key":` as a key is written (a string value is never followed by a colon)."""
    return re.compile(re.escape(token) + rb"[ \t\r\n]*:")


_BACKWARDS = re.compile(rb'"[^"]*(?:"(?=(?:\\\\)*\\(?!\\))[^"]*)*"|([\]}])|([\[{])|(,)')
"""JSON's tokens read from the end, reversed: a string (its quotes preceded by an odd run of
backslashes are in it), a closing and an opening bracket, a comma."""
_WINDOW = 4096


def _second_cut(raw: bytes, cut: int, last: Any, lowest: int) -> int | None:
    """Where the history's second-to-last item ends in `raw`, `cut` being where its last item
    (`last`) ends, not below `lowest`; None when no comma passes (see the module's docstring)."""
    window = _WINDOW
    while True:
        low = max(lowest, cut - window)
        depth = 0
        for token in _BACKWARDS.finditer(raw[low:cut][::-1]):
            kind = token.lastindex
            depth += 1 if kind == 1 else -1 if kind == 2 else 0
            if depth < 0:
                break  # the history's own `[` (or a string cut by the window)
            if kind == 3 and depth == 0:
                at = cut - 1 - token.start()
                if _items_between(raw, at, cut) == [last]:
                    return _ends_item(raw, at)
                break  # a comma in a string cut by the window
        if low == lowest:
            return None
        window *= 4


def _synthetic(history: str, tail: bytes | memoryview) -> bytes:
    return b'{"' + history.encode() + b'":["' + _MARK.encode() + b'"' + bytes(tail)


def _items_between(raw: bytes, start: int, end: int) -> list[Any] | None:
    """The items `raw[start:end]` adds to a list (`, item, item`), or None when it is anything
    else (see the module's docstring)."""
    try:
        parsed = orjson.loads(b"[[0" + raw[start:end] + b"]]")
    except orjson.JSONDecodeError:
        return None
    return parsed[0][1:] if len(parsed) == 1 else None


def _cut(raw: bytes, history: str, after: dict[str, Any], lowest: int) -> int | None:
    """Where the history list's last item ends in `raw`, found from the end (see the module's
    docstring), not below `lowest`; None when no `]` passes."""
    at = len(raw)
    while True:
        at = raw.rfind(b"]", lowest, at)
        if at < 0:
            return None
        try:
            parsed = orjson.loads(_synthetic(history, memoryview(raw)[at:]))
        except orjson.JSONDecodeError:
            continue
        if isinstance(parsed, dict) and parsed.pop(history, None) == [_MARK] and parsed == after:
            return _ends_item(raw, at)


def _ends_item(raw: bytes, at: int) -> int | None:
    """Where the item before `at` (and whitespace) ends, when it is an object: a kept prefix ends there."""
    while at > 0 and raw[at - 1] in _WHITESPACE:
        at -= 1
    return at if at > 0 and raw[at - 1] == ord("}") else None
