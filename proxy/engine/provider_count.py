"""The provider's own count of a conversation, as the calibration of ctxgate's.

A session with no measured count offset for its model and tools (its first turn, or new
tools) that may compact asks the provider, where it offers a count, how many tokens its
conversation is; the offset that gives is kept until a reply's usage measures a newer one.
The answers are cached per conversation, so a retried turn asks again for nothing. Kept
apart from `turn.py`: its own cache, its own upstream call and its failure rule (the
estimate decides).
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ..errors import GatewayError
from ..upstream.routing import Route
from .state import SessionState
from .turn_budget import Turn, calibration_of
from .wire import Wire

if TYPE_CHECKING:
    from ..gateway import Gateway

log = logging.getLogger("ctxgate.turn")
MAX_PROVIDER_COUNTS = 4096


class ProviderCounts:
    def __init__(self, gw: "Gateway") -> None:
        self.gw = gw
        self._counts: dict[str, int] = {}
        """The provider's counts of whole conversations, by model, tools and prefix hash (oldest first)."""

    async def calibrate(self, wire: Wire, route: Route, turn: Turn, state: SessionState, offset_key: str,
                        headers: dict[str, str], api_key: str | None) -> None:
        """The turn and the session calibrated by the provider's count of the conversation
        (called with `api_key`); unchanged when the provider offers none or it fails."""
        key = f"{offset_key}:{turn.prefix_hashes[-1]}" if turn.messages else offset_key
        reported = self._counts.get(key)
        if reported is None:
            try:
                reported = await wire.upstream_count(route, turn.messages, api_key)
            except GatewayError as e:
                log.warning("session %s: the provider's count failed (%s); the estimate decides", state.session_id,
                            e.message)
                return
            if reported is None:
                return
            self._counts[key] = reported
            while len(self._counts) > MAX_PROVIDER_COUNTS:
                self._counts.pop(next(iter(self._counts)))
        counted = turn.tokens_in()
        turn.count_offset, turn.count_scale = calibration_of(turn, counted, reported)
        state.count_offset, state.count_scale, state.count_offset_key = turn.count_offset, turn.count_scale, offset_key
        headers["X-Ctx-Tokenizer"] = f"{route.provider}:count_tokens"
        self.gw.metrics.calibrate(route.model_name, counted, reported)
