"""Short, stable references to what a level cut, for reversible compaction.

Every level that removes or shortens content names what it took out as `ref ctx:HEX` in
its note, when the request asks for it (`CompressionRequest.cuts`). The reference is the
content's own hash, so the same cut gets the same reference on every turn and on every
replica, and the note (part of the compacted prefix) stays byte-identical. The pipeline
only collects the originals in a `CutLog`; keeping them is the caller's business.
"""
from __future__ import annotations

import hashlib
import re

from .boundaries import head_at_boundary
from .protocols.base import readable_text
from .types import Message

REF_HEX = 12
"""Hex digits of a reference: 48 bits, so a session's few hundred cuts never collide."""
REF_RE = re.compile(r"ref (ctx:[0-9a-f]{%d})" % REF_HEX)
"""A reference as notes write it."""


def clip(text: str, chars: int) -> str:
    """At most the first `chars` characters of `text`, ending at a boundary (boundaries.py):
    never inside a word, a character or a reference."""
    return head_at_boundary(text, chars)


def content_ref(text: str) -> str:
    """`ctx:` and the first hex digits of the content's blake2b."""
    return "ctx:" + hashlib.blake2b(text.encode(), digest_size=REF_HEX // 2).hexdigest()


SIZING_REF = content_ref("")
"""A stand-in reference, to size a note before what it names is known: hex digits like any
reference's (another's may still split into a token or two more)."""


class CutLog:
    """The originals a compaction cut, by reference (filled by the levels, read by the caller)."""

    def __init__(self) -> None:
        self.originals: dict[str, str] = {}

    def keep(self, text: str) -> str:
        """`text` kept under its own hash, which is returned."""
        ref = content_ref(text)
        self.originals.setdefault(ref, text)
        return ref


_SPAN_BREAK = re.compile(r"\n\n(?=\[(?:system|developer|user|assistant|tool)\] )")


def render_span(messages: list[Message]) -> str:
    """A removed span as the model reads it back: each message's role and everything it showed."""
    return "\n\n".join(f"[{m.get('role')}] {readable_text(m)}" for m in messages)


def span_messages(text: str) -> list[str] | None:
    """A `render_span` text cut back into its messages; None when `text` is not one."""
    if not re.match(r"\[(?:system|developer|user|assistant|tool)\] ", text):
        return None
    return _SPAN_BREAK.split(text)
