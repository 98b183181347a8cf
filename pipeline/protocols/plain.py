"""The fallback for text nobody recognised: an assistant turn is not parsed for actions,
but the user turn after it is read as what answered it (an agent whose protocol is
unknown most likely gets its observations that way)."""
from __future__ import annotations

from .base import Action, Observation, observation


class PlainReader:
    name = "plain"

    def learn(self, instructions: str) -> "PlainReader":
        return self

    def actions(self, text: str) -> list[Action]:
        return []

    def signals(self, text: str, role: str) -> bool:
        return False

    def observation(self, text: str, tool: str | None) -> Observation:
        return observation(tool, text)
