"""A session restored to one of its WAL checkpoints, for the API and the dashboard alike."""
from __future__ import annotations

from typing import TYPE_CHECKING

import orjson

from ..engine.journal import RollbackError
from ..engine.state import SessionState
from ..errors import ErrorKind, GatewayError

if TYPE_CHECKING:
    from ..gateway import Gateway


def requested_seq(raw: bytes) -> int:
    """The checkpoint a `{"to_seq": N}` body names."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        body = None
    to_seq = body.get("to_seq") if isinstance(body, dict) else None
    if not isinstance(to_seq, int) or isinstance(to_seq, bool) or to_seq < 1:
        raise GatewayError(ErrorKind.INVALID_REQUEST, 'the body must be {"to_seq": <checkpoint seq, a positive '
                           'integer>}', param="to_seq", code="invalid_request")
    return to_seq


async def roll_back(gw: "Gateway", tenant: str, session_id: str, to_seq: int) -> SessionState:
    """The checkpoint's state, written as a new checkpoint and saved, in the session's transaction."""
    async with gw.sessions.transaction(tenant, session_id) as tx:
        try:
            tx.state = await gw.journal.rollback(tenant, session_id, to_seq)
        except RollbackError as e:
            raise GatewayError(ErrorKind.NOT_FOUND, str(e), param="to_seq", code="checkpoint_not_found") from None
        return tx.state
