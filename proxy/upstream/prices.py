"""A model's list prices, prompt cache included, from litellm's model cost map as installed
(`litellm.model_cost`; the package sets `LITELLM_LOCAL_MODEL_COST_MAP` before litellm is
imported, so nothing is fetched). The compaction cost model (`pipeline/policy.py`) and
`ctxgate replay` read them."""
from __future__ import annotations

from typing import Any

from ctxgate.pipeline.policy import Prices


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
