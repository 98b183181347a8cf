"""Which model group answers when a model cannot: LiteLLM's `fallbacks`,
`default_fallbacks` and `context_window_fallbacks`, read from `router_settings` or
`litellm_settings` (the first that sets a key wins) in LiteLLM's own format:

    router_settings:
      fallbacks: [{"gpt-4o": ["gpt-4o-mini", "claude-sonnet"]}]
      default_fallbacks: ["gpt-4o-mini"]          # for a model with no entry of its own
      context_window_fallbacks: [{"gpt-4o-mini": ["gpt-4.1"]}]

A fallback is taken only before any byte of a reply has reached the client (the turn
engine's forward fails before it hands back a reply), after the failed model's own
retries. Each fallback is a new route: the turn is planned again for it, counted with
its tokenizer against its limit.

How context-window fallbacks and compaction combine: compaction first. A turn over a
model's budget is compacted for that model (the session keeps its model, its prompt
cache and its price); a larger model is taken only when compaction cannot make the
turn fit, where the turn would otherwise be refused with CONTEXT_EXHAUSTED.
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Any

from ..errors import ErrorKind, GatewayError

FALLBACK_STATUSES = frozenset({401, 403, 404, 408, 429, 500, 502, 503, 504, 529})
"""An upstream status that says this deployment cannot serve now (its key, its model, its
load), not that the request is wrong: another model may answer."""
CONTEXT_WINDOW = "context_window"


@dataclass(frozen=True)
class Fallbacks:
    general: dict[str, tuple[str, ...]] = field(default_factory=dict)
    default: tuple[str, ...] = ()
    context_window: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def names(self) -> set[str]:
        """Every model group a fallback names (each must be in the model_list)."""
        named = set(self.default)
        for table in (self.general, self.context_window):
            for targets in table.values():
                named.update(targets)
        return named

    def context_window_for(self, model: str) -> tuple[str, ...]:
        return _lookup(self.context_window, model)

    def candidates(self, model: str, error: GatewayError) -> tuple[tuple[str, ...], str] | None:
        """The model groups to try after `model` failed with `error`, in order, and why; None
        when the failure is one no other model would avoid (the request's own fault)."""
        if error.code == "context_exhausted":
            return self.context_window_for(model), CONTEXT_WINDOW
        reason = _failure_reason(error)
        if reason is None:
            return None
        found = _lookup(self.general, model)
        return (found or self.default), reason


def _lookup(table: dict[str, tuple[str, ...]], model: str) -> tuple[str, ...]:
    if model in table:
        return table[model]
    for pattern, targets in table.items():
        if "*" in pattern and fnmatch.fnmatchcase(model, pattern):
            return targets
    return ()


def _failure_reason(error: GatewayError) -> str | None:
    if error.kind is ErrorKind.UPSTREAM and error.upstream_status in FALLBACK_STATUSES:
        return str(error.upstream_status)
    if error.kind is ErrorKind.TIMEOUT:
        return "timeout"
    if error.kind is ErrorKind.UPSTREAM_UNREACHABLE and error.code != "upstream_bad_reply":
        return "connection"
    return None


def _table(where: str, value: Any) -> dict[str, tuple[str, ...]]:
    """LiteLLM's list of one-key mappings (`[{"a": ["b", "c"]}]`); a plain mapping is taken too."""
    items: list[Any] = value if isinstance(value, list) else [value]
    table: dict[str, tuple[str, ...]] = {}
    for item in items:
        if not isinstance(item, dict):
            raise ValueError(f"{where}: each entry must map a model group to a list of model groups, not {item!r}")
        for model, targets in item.items():
            table[str(model)] = _names(f"{where}[{model}]", targets)
    return table


def _names(where: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ValueError(f"{where}: must be a list of model group names, not {value!r}")
    return tuple(value)


def read_fallbacks(sections: dict[str, dict[str, Any]], known: set[str]) -> Fallbacks:
    """The fallbacks the config sets, checked against the model groups it has (`known`;
    a wildcard group matches a name it covers): a name that no group serves is refused at
    start, not found out in the middle of an outage."""
    def first(key: str) -> tuple[str, Any] | None:
        for section in ("router_settings", "litellm_settings"):
            value = sections.get(section, {}).get(key)
            if value:
                return f"{section}.{key}", value
        return None

    general = first("fallbacks")
    default = first("default_fallbacks")
    window = first("context_window_fallbacks")
    found = Fallbacks(general=_table(*general) if general else {},
                      default=_names(*default) if default else (),
                      context_window=_table(*window) if window else {})
    patterns = [name for name in known if "*" in name]
    for name in sorted(found.names()):
        if name not in known and not any(fnmatch.fnmatchcase(name, p) for p in patterns):
            raise ValueError(f"fallback model {name!r} is not in the model_list (known: {', '.join(sorted(known))})")
    return found
