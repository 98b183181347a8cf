"""What every door's stream watch shares (`engine.wire.StreamWatch`): every byte kept when
asked (an idempotent request's stored reply), whole lines across network chunks (a chunk
may end mid-event), and whether the stream completed or carried an error."""
from __future__ import annotations


class SseWatch:
    def __init__(self, keep_all: bool) -> None:
        self._partial = b""
        """The end of the last chunk after its last newline."""
        self._all: bytearray | None = bytearray() if keep_all else None
        self._done = False
        self._failed = False

    @property
    def complete(self) -> bool:
        return self._done

    @property
    def failed(self) -> bool:
        return self._failed

    def body(self) -> bytes:
        return bytes(self._all) if self._all is not None else b""

    def _lines(self, data: bytes) -> list[bytes]:
        """The lines `data` completes (kept, when asked to keep every byte)."""
        if self._all is not None:
            self._all += data
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        return lines
