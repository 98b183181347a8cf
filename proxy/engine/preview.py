"""How many tokens a conversation would be sent as now, changing nothing (the doors' count
endpoints: `input_tokens`, `count_tokens`).

The session is read, never saved: its stored compactions applied, the levels that need no
model call run if it is over the trigger, the memory block in; then the provider's own count
of that where it offers one, else ctxgate's, calibrated. Kept apart from `turn.py`, whose
turns change the session.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from ..errors import ErrorKind, GatewayError
from ..tenancy import Caller
from ..upstream.routing import Route
from .compaction import Compactor, fingerprints_of
from .memory_turn import block_tokens, forwarded
from .provider_count import ProviderCounts
from .state import SessionState
from .turn_budget import Turn, count_offset_key, watermark
from .wire import Wire, upstream_key

if TYPE_CHECKING:
    from ..gateway import Gateway

log = logging.getLogger("ctxgate.turn")


async def preview(gw: "Gateway", provider_counts: ProviderCounts, caller: Caller, route: Route, session_id: str,
                  messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, memory: bool, wire: Wire,
                  headers: dict[str, str]) -> int:
    """The tokens the upstream would be sent for `messages` and `tools` now (see the module);
    `memory`: the request has a memory scope (its block goes in)."""
    counter = gw.tokenizers.for_model(route.model_name, route.upstream_model)
    fps = fingerprints_of(messages)
    config = gw.pipeline_config(caller.profile, caller.tenant)
    config = config.model_copy(update={"levels": [lv for lv in config.levels if lv != "autocompact"]})
    turn = Turn(messages=messages, fingerprints=fps, tools=tools, counter=counter, config=config,
                max_input_tokens=caller.budget or route.max_input_tokens, summarize=_no_summary)
    found = await gw.sessions.read(caller.tenant, session_id)
    state = SessionState.from_dict(found.to_dict()) if found else SessionState(caller.tenant, session_id)
    offset_key = count_offset_key(route.model_name, turn.tools)
    if state.count_offset_key == offset_key:
        turn.count_offset, turn.count_scale = state.count_offset, state.count_scale
    block = state.memory_block if memory else ""
    turn.reserved_tokens = block_tokens(block, counter)
    headers["X-Ctx-Tokenizer"] = counter.name
    tokens_in = counter.count_request(messages, tools, fps)
    if state.count_offset_key != offset_key and tokens_in + turn.reserved_tokens > watermark(turn, state):
        await provider_counts.calibrate(wire, route, turn, state, offset_key, headers, upstream_key(caller, route))
    plan = await Compactor().prepare(state, turn, fit=False)  # a count, however large
    headers["X-Ctx-Levels"] = ",".join(plan.levels) or "none"
    try:
        exact = await wire.upstream_count(route, forwarded(plan.messages, block, route.single_system),
                                          upstream_key(caller, route))
    except GatewayError as e:
        log.warning("session %s: the provider's count failed (%s); the estimate answers", session_id, e.message)
        exact = None
    if exact is not None:
        headers["X-Ctx-Tokenizer"] = f"{route.provider}:count_tokens"
        return exact
    # In the provider's tokens, as calibrated: the tools schema and the memory block included.
    return round(plan.counted_tokens() * turn.count_scale) + turn.count_offset


async def _no_summary(messages: list[dict[str, Any]]) -> str:
    raise GatewayError(ErrorKind.INTERNAL, "a preview never asks for a summary")
