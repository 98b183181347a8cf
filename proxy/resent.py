"""Request bodies that resend the last one's bytes: only what follows them is parsed.

A stateless client resends its whole history every turn, serialised the same way, so the next
body starts with the bytes of the last one up to the end of its history list (`{"messages":
[m0, ..., mN-1`), then appends (`, mN, mN+1], "stream": true}`). Parsing those bytes again
costs a millisecond per 800 KB, the largest part of a steady turn's work. This keeps, per
(tenant, door, session named in the headers), the last few bodies' bytes up to that point with
what they parsed to; a body that starts with those bytes gets the same values (the same
objects) for them, and only its tail is parsed, as `{"<history>":[0` + tail: the same parser
state (inside the history list, after an item), so the tail parses exactly as it does in the
whole body.

The cut is found once per body, after its parse, from the end: each `]` is tried as the one
closing the history list by parsing the rest as above and comparing with the fields the whole
body has after its history. A `]` in a string cannot pass (the string's quotes would be
unbalanced); one closing another top-level list could pass only if a key after the history
were repeated, so a body is kept only when each of those keys is written once as a key
(`"key":`) in what follows the kept part (the whole body, the first time), and none repeats
a field before the history. A tail that holds the history's key again (`"messages"` as a
token) is parsed whole.

The kept items are shared with the history cache and the engine, which never change a
parsed message in place (they build new ones), as the history cache already relies on.
"""
from __future__ import annotations

import re
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


@dataclass(frozen=True)
class Resent:
    """A body parsed from a kept prefix: the whole body (its history's items from the prefix the
    same objects as last time), and the bytes parsed anew."""
    body: dict[str, Any]
    parsed_bytes: int


@dataclass(frozen=True)
class _Kept:
    prefix: bytes
    """The body's bytes up to the end of its history list's last item."""
    head: dict[str, Any]
    """The fields before the history list, as parsed."""
    items: list[Any]


class ResentBodies:
    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        self._kept: OrderedDict[tuple[str, ...], list[_Kept]] = OrderedDict()
        self._bytes = 0
        self._entries = 0
        self._max_bytes = max_bytes
        self._max_entries = max_entries
        self.hits = 0
        self._lock = threading.Lock()

    def parse(self, key: tuple[str, ...], raw: bytes, history: str) -> Resent | None:
        """`raw` from a kept prefix of `key`, or None: parse it whole (also when its tail is
        not JSON, so that the error names its place in the whole body)."""
        kept = self._kept.get(key)
        if kept is None or len(raw) < MIN_BYTES:
            return None
        found = next((k for k in kept if raw.startswith(k.prefix)), None)
        if found is None:
            return None
        start = len(found.prefix)
        if raw.find(b'"' + history.encode() + b'"', start) >= 0:
            return None  # the history's key again: the whole body decides which one counts
        try:
            parsed = orjson.loads(_synthetic(history, memoryview(raw)[start:]))
        except orjson.JSONDecodeError:
            return None
        if not isinstance(parsed, dict):
            return None
        items = parsed.pop(history, None)
        if not isinstance(items, list) or not items or type(items[0]) is not int or items[0] != 0:
            return None
        if not parsed.keys().isdisjoint(found.head):
            return None  # a field before the history repeated after it: the whole body decides
        self.hits += 1
        body = {**found.head, history: found.items + items[1:], **parsed}
        return Resent(body, len(raw) - start)

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
        lowest = len(raw) - known.parsed_bytes if known is not None else 0
        if not all(_once(raw, k, lowest) for k in after):
            return  # a field after the history named twice (or spelt otherwise): see `_cut`
        cut = _cut(raw, history, after, lowest)
        if cut is None:
            return
        self._add(key, _Kept(raw[:cut], head, list(items)))  # a copy: callers may build on theirs

    def _add(self, key: tuple[str, ...], kept: _Kept) -> None:
        with self._lock:  # a large request's door keeps its body from a thread (`HeavyWork`)
            self._added(key, kept)

    def _added(self, key: tuple[str, ...], kept: _Kept) -> None:
        entries = [kept]
        for old in self._kept.pop(key, []):
            if len(entries) < PER_KEY and not kept.prefix.startswith(old.prefix):
                entries.append(old)
            else:  # the same conversation's earlier body, or one too many
                self._drop(old)
        self._kept[key] = entries
        self._bytes += len(kept.prefix)
        self._entries += 1
        while self._kept and (self._bytes > self._max_bytes or self._entries > self._max_entries):
            _, oldest = self._kept.popitem(last=False)
            for k in oldest:
                self._drop(k)

    def _drop(self, kept: _Kept) -> None:
        self._bytes -= len(kept.prefix)
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


def _synthetic(history: str, tail: bytes | memoryview) -> bytes:
    return b'{"' + history.encode() + b'":[0' + bytes(tail)


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
        if isinstance(parsed, dict) and parsed.pop(history, None) == [0] and parsed == after:
            end = at
            while end > 0 and raw[end - 1] in _WHITESPACE:
                end -= 1
            return end if end > 0 and raw[end - 1] == ord("}") else None
