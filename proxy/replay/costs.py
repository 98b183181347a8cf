"""What a session's requests cost at the provider's list prices, prompt cache included.

A provider caches a request's prefix: the part of a request that repeats the previous
request's start is read from the cache at its discounted price (`cache_read_input_token_cost`);
the rest is paid in full, or at the cache-write price where the provider charges one
(Anthropic's `cache_creation_input_token_cost`). Prefixes under `CACHE_MIN_TOKENS` are
not cached. Only input is priced for the agent's own requests: its replies are the same
with or without ctxgate. The summaries ctxgate asks for are priced in and out. The prices
and their arithmetic are the compaction cost model's (`pipeline/policy.py`), read from
litellm's cost map by `upstream/prices.py`.
"""
from __future__ import annotations

from ctxgate.pipeline.policy import CACHE_MIN_TOKENS, Prices
from ..upstream.prices import prices_for

__all__ = ["CACHE_MIN_TOKENS", "Prices", "prices_for"]
