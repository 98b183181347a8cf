"""The one reading of a number a client sends in a query parameter or a header: ASCII digits
only (`[0-9]+`), within a range; anything else is a 400 naming the parameter. Python's own
`str.isdigit` and `int` take more than that (superscripts, other scripts' digits, a sign,
spaces around, underscores), so neither decides alone: `limit=²` passed `isdigit` and then
failed in `int`, a 500."""
from __future__ import annotations

import re

from .errors import ErrorKind, GatewayError
from .ids import shown

_DIGITS = re.compile(r"[0-9]+")


def whole_number(raw: str, param: str, low: int, high: int, *, code: str | None = None) -> int:
    """`raw` as an int from `low` to `high`, else the 400 every door answers in its own shape,
    with `param` and `code` (`invalid_<param>` unless given)."""
    digits = (raw.lstrip("0") or "0") if _DIGITS.fullmatch(raw) else None
    # Longer than `high` is out of range without parsing it: int() refuses past 4300 digits.
    if digits is None or len(digits) > len(str(high)) or not low <= int(digits) <= high:
        raise GatewayError(ErrorKind.INVALID_REQUEST, f"{param} must be a whole number from {low} to {high} "
                           f"in ASCII digits, not {shown(raw)}", param=param, code=code or f"invalid_{param}")
    return int(digits)
