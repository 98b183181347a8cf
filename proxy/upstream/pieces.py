"""A request body sent as the pieces it was made of, not joined into one buffer first.

A chat route's body for a Gemini conversation is its settings, then the JSON of each turn's
new messages (kept with the session's history, `gemini_chat.ChatJson`): joining them copied the
whole conversation (~400 KB at 100K tokens) every turn. aiohttp writes a `Payload` piece by
piece and declares its `size` as the Content-Length, so the upstream reads the same bytes.
"""
from __future__ import annotations

from typing import Sequence

from aiohttp.abc import AbstractStreamWriter
from aiohttp.payload import Payload


class Pieces(Payload):
    """`pieces`, in order, as one body of their summed length. Its first piece should be small:
    aiohttp joins the first write with the request's headers."""

    _autoclose = True  # bytes in memory: nothing to close, and a retry may send it again

    def __init__(self, pieces: Sequence[bytes]) -> None:
        super().__init__(tuple(pieces), content_type="application/json")
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
