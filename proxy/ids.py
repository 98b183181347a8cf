"""The one rule for every id that names a tenant's thing: tenant, session, memory user and
project (headers, the memory API's scope and filters). Such ids reach file names (the WAL,
memory files) and Redis keys, so only safe ones pass; a client's id that breaks the rule is
a 400. A name ctxgate takes from elsewhere (another tool's session header, the body's
free-form OpenAI `user`) is made to follow it by `derived_id` instead. The layers below
the proxy, which never import it, keep the same rule as a backstop (`wal.paths.safe_name`,
which also turns a workspace path into a project id: memory/capture.py `project_id`)."""
from __future__ import annotations

import re

import xxhash

from .errors import ErrorKind, GatewayError

MAX_ID_LENGTH = 128
_SAFE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:@-]*")
_SHOWN_CHARS = 200
"""An invalid value is quoted in the error at most this long (a 1 MB header is not echoed)."""


class InvalidId(ValueError):
    pass


def shown(value: object) -> str:
    text = value if isinstance(value, str) else repr(value)
    return repr(text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS - 3] + "...")


def validate_id(value: str, what: str) -> str:
    if not isinstance(value, str) or not value or len(value) > MAX_ID_LENGTH:
        raise InvalidId(f"{what} id {shown(value)} must be 1 to {MAX_ID_LENGTH} characters")
    if not _SAFE.fullmatch(value) or ".." in value:
        raise InvalidId(f"{what} id {shown(value)} may only contain letters, digits and _ . : @ - "
                        "(starting with a letter or digit, no '..')")
    return value


def is_valid_id(value: str) -> bool:
    try:
        validate_id(value, "")
    except InvalidId:
        return False
    return True


def require_id(value: str, what: str, param: str) -> str:
    """`value` if it follows the rule, else the 400 every door answers in its own shape."""
    try:
        return validate_id(value, what)
    except InvalidId as e:
        raise GatewayError(ErrorKind.INVALID_REQUEST, f"{param}: {e}", param=param,
                           code=f"invalid_{what}") from None


def derived_id(value: str) -> str:
    """A name that is not ours to refuse, as an id: itself when it follows the rule, else
    `h-` and its hash (stable, so the same name always means the same thing)."""
    return value if is_valid_id(value) else "h-" + xxhash.xxh3_128_hexdigest(value.encode())

