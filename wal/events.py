"""Event lines: one JSON object per line, ending in a CRC32 of the line's own bytes.

`{"seq":3,"type":"TOOL_RESULT",...,"crc":"1a2b3c4d"}`: the checksum covers the object
as written without its `crc` member, so verifying needs no re-serialisation.
"""
from __future__ import annotations

import re
import time
import zlib
from datetime import datetime, timezone
from enum import Enum
from typing import Any

import orjson
import xxhash


class EventType(str, Enum):
    USER_INPUT = "USER_INPUT"
    TOOL_CALL = "TOOL_CALL"
    TOOL_RESULT = "TOOL_RESULT"
    COMPRESSION = "COMPRESSION"
    CHECKPOINT = "CHECKPOINT"
    AUTO_DREAM = "AUTO_DREAM"
    RESPONSE = "RESPONSE"
    """The upstream call of a turn completed (what the last successful step was)."""
    SPECULATION = "SPECULATION"
    """A background compaction started over a prefix; a restart runs it again if it did not land."""
    EXPANSION = "EXPANSION"
    """The model asked for an original a compaction cut and the gateway gave it back (ref, tokens, turn)."""


class DamagedLine(ValueError):
    """A line that is not what ctxgate wrote: bad JSON, no checksum, or a checksum mismatch."""


_CRC_TAIL = re.compile(rb',"crc":"([0-9a-f]{8})"\}\n?$')


def encode_line(event: dict[str, Any]) -> bytes:
    body = orjson.dumps(event)
    return body[:-1] + b',"crc":"%08x"}\n' % zlib.crc32(body)


def decode_line(line: bytes) -> dict[str, Any]:
    found = _CRC_TAIL.search(line)
    if found is None:
        raise DamagedLine("no checksum at the end of the line")
    body = line[:found.start()] + b"}"
    if zlib.crc32(body) != int(found.group(1), 16):
        raise DamagedLine("checksum mismatch")
    try:
        event = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise DamagedLine(f"not JSON: {e}") from None
    if not isinstance(event, dict) or not isinstance(event.get("seq"), int) or "type" not in event:
        raise DamagedLine("not an event (no seq or type)")
    return event


def timestamp(now: float | None = None) -> str:
    t = time.time() if now is None else now
    return datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def content_hash(value: Any) -> str:
    """What the WAL keeps of user content by default: enough to tell inputs apart, not to read them."""
    raw = value.encode() if isinstance(value, str) else orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
    return xxhash.xxh3_128_hexdigest(raw)
