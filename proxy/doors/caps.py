"""What one request may ask: at most a tenant's `max_messages` messages and `max_content_parts`
content parts (`TenantConfig`). Checked right after the body is parsed, before any work in
proportion to its size, any state or log, any upstream call; every door calls it on its own
list (chat and Messages: `messages`, Responses: `input`, Gemini: `contents` and `parts`)."""
from __future__ import annotations

from typing import Any

from ..config import TenantConfig
from ..errors import ErrorKind, GatewayError


def check_caps(limits: TenantConfig, items: Any, where: str, body_bytes: int, parts_key: str = "content",
               extra_parts: int = 0) -> None:
    """`items`: the request's list of messages as sent (anything else is left to the door's
    validation); each one's `parts_key` list counts as its parts, with `extra_parts` (a system
    prompt's blocks) beside them. Past a cap: a 400 naming it. `body_bytes`: the body's size,
    which bounds its parts: a list of n values is at least 2n - 1 bytes of JSON, so a body
    under twice the cap (2 MB by default) cannot pass it, and its parts are not counted (every
    turn resends its whole history)."""
    if not isinstance(items, list):
        return
    if len(items) > limits.max_messages:
        raise GatewayError(ErrorKind.INVALID_REQUEST, f"{where}: {len(items)} messages, over this tenant's cap of "
                           f"{limits.max_messages} (max_messages)", param=where, code="too_many_messages")
    if extra_parts + (body_bytes + 1) // 2 <= limits.max_content_parts:
        return
    parts = extra_parts
    for item in items:
        found = item.get(parts_key) if type(item) is dict else None
        if type(found) is list:
            parts += len(found)
    if parts > limits.max_content_parts:
        raise GatewayError(ErrorKind.INVALID_REQUEST, f"{where}: {parts} content parts, over this tenant's cap of "
                           f"{limits.max_content_parts} (max_content_parts)", param=where,
                           code="too_many_content_parts")
