"""Message fingerprints and prefix chain hashes.

A fingerprint is a fast hash of a message's canonical JSON (sorted keys), so two equal
messages have the same fingerprint whatever order their keys came in. A prefix hash chains
them, `h[i] = H(h[i-1] || fp[i])`, so one value names a whole prefix of a conversation:
that is what compaction records are keyed by.
"""
from __future__ import annotations

from typing import Any, Iterable

import orjson
import xxhash

EMPTY_PREFIX = "0" * 32


def message_fingerprint(message: dict[str, Any]) -> str:
    return xxhash.xxh3_128_hexdigest(orjson.dumps(message, option=orjson.OPT_SORT_KEYS))


def tools_fingerprint(tools: list[dict[str, Any]] | None) -> str:
    return message_fingerprint({"tools": tools}) if tools else ""


def extend_prefix(prefix_hash: str, fingerprint: str) -> str:
    return xxhash.xxh3_128_hexdigest((prefix_hash + fingerprint).encode())


def prefix_hashes(fingerprints: Iterable[str]) -> list[str]:
    """`out[i]` names the prefix made of the first `i + 1` messages."""
    out: list[str] = []
    h = EMPTY_PREFIX
    for fp in fingerprints:
        h = extend_prefix(h, fp)
        out.append(h)
    return out


def span_hash(fingerprints: Iterable[str]) -> str:
    """A hash of a span of messages, independent of where the span sits."""
    return xxhash.xxh3_128_hexdigest("".join(fingerprints).encode())
