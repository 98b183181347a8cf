"""A request body sent as the pieces it was made of, not joined into one buffer first.

A chat route's body for a Gemini conversation is its settings, then the JSON of each turn's
new messages (kept with the session's history, `gemini_chat.ChatJson`): joining them copied the
whole conversation (~400 KB at 100K tokens) every turn. aiohttp writes a `Payload` piece by
piece and declares its `size` as the Content-Length, so the upstream reads the same bytes.
Small pieces side by side are joined first: a write of its own costs a send() when nothing is
queued on the socket (a 1K-token turn's ten pieces made seven more sends than its joined body,
~135 us), more than copying it costs.
"""
from __future__ import annotations

from typing import Sequence

from aiohttp.abc import AbstractStreamWriter
from aiohttp.payload import Payload

JOINED_BELOW = 1 << 16
"""Pieces under this many bytes are joined with their small neighbours; larger ones are written as they are."""


class Pieces(Payload):
    """`pieces`, in order, as one body of their summed length. Its first piece should be small:
    aiohttp joins the first write with the request's headers."""

    _autoclose = True  # bytes in memory: nothing to close, and a retry may send it again

    def __init__(self, pieces: Sequence[bytes]) -> None:
        super().__init__(_coalesced(pieces), content_type="application/json")
        self._size = sum(map(len, self._value))

    def joined(self) -> bytes:
        return b"".join(self._value)

    def decode(self, encoding: str = "utf-8", errors: str = "strict") -> str:
        return self.joined().decode(encoding, errors)

    async def as_bytes(self, encoding: str = "utf-8", errors: str = "strict") -> bytes:
        return self.joined()

    async def write(self, writer: AbstractStreamWriter) -> None:
        # Payload.write_with_length comes here too: the writer clips what passes a declared length.
        for piece in self._value:
            await writer.write(piece)


def _coalesced(pieces: Sequence[bytes]) -> tuple[bytes, ...]:
    """`pieces` with each run of small ones joined."""
    out: list[bytes] = []
    run: list[bytes] = []
    for piece in pieces:
        if len(piece) < JOINED_BELOW:
            run.append(piece)
            continue
        if run:
            out.append(b"".join(run))
            run = []
        out.append(piece)
    if run:
        out.append(b"".join(run))
    return tuple(out)
