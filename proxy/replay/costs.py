"""What a session's requests cost at the provider's list prices, prompt cache included.

Prices come from litellm's model cost map as installed (`litellm.model_cost`; the package
sets `LITELLM_LOCAL_MODEL_COST_MAP` before litellm is imported, so nothing is fetched).
A provider caches a request's prefix: the part of a request that repeats the previous
request's start is read from the cache at its discounted price (`cache_read_input_token_cost`);
the rest is paid in full, or at the cache-write price where the provider charges one
(Anthropic's `cache_creation_input_token_cost`). Prefixes under `CACHE_MIN_TOKENS` are
not cached (OpenAI's and Anthropic's minimum). Only input is priced for the agent's own
requests: its replies are the same with or without ctxgate. The summaries ctxgate asks
for are priced in and out.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

CACHE_MIN_TOKENS = 1024


@dataclass(frozen=True)
class Prices:
    """USD per token."""
    model: str
    """The cost map's entry the prices were read from."""
    input: float
    cache_read: float
    cache_write: float
    output: float

    def request(self, tokens: int, cached: int) -> float:
        """One request of `tokens` input tokens whose first `cached` the provider has cached."""
        hit = cached if cached >= CACHE_MIN_TOKENS else 0
        hit = min(hit, tokens)
        return hit * self.cache_read + (tokens - hit) * self.cache_write

    def summary(self, prompt: int, output: int) -> float:
        """One summary call: its prompt is new every time (no cache), its reply is output."""
        return prompt * self.input + output * self.output


def _candidates(model: str) -> list[str]:
    """Names the cost map may know `model` by: as given, without its provider prefix, and
    without a date suffix (`claude-sonnet-4-5-20250929` → `claude-sonnet-4-5`)."""
    bare = model.split("/", 1)[1] if "/" in model else model
    parts = bare.rsplit("-", 1)
    undated = parts[0] if len(parts) == 2 and parts[1].isdigit() and len(parts[1]) == 8 else bare
    return list(dict.fromkeys([model, bare, undated]))


def prices_for(model: str) -> Prices | None:
    """The model's prices, or None when the cost map has no input price for it."""
    import litellm

    cost_map: dict[str, Any] = litellm.model_cost
    for name in _candidates(model):
        entry = cost_map.get(name)
        if not entry or not entry.get("input_cost_per_token"):
            continue
        full = float(entry["input_cost_per_token"])
        return Prices(model=name, input=full, cache_read=float(entry.get("cache_read_input_token_cost") or full),
                      cache_write=float(entry.get("cache_creation_input_token_cost") or full),
                      output=float(entry.get("output_cost_per_token") or 0.0))
    return None
