"""Tenant and session ids reach file names (the WAL) and Redis keys: only safe ones pass."""
from __future__ import annotations

import re

MAX_ID_LENGTH = 128
_SAFE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:@-]*")


class InvalidId(ValueError):
    pass


def validate_id(value: str, what: str) -> str:
    if not value or len(value) > MAX_ID_LENGTH:
        raise InvalidId(f"{what} id must be 1 to {MAX_ID_LENGTH} characters")
    if not _SAFE.fullmatch(value) or ".." in value:
        raise InvalidId(f"{what} id may only contain letters, digits and _ . : @ - (no path characters)")
    return value


def is_valid_id(value: str) -> bool:
    try:
        validate_id(value, "")
    except InvalidId:
        return False
    return True
