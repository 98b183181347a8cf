"""From a client's `model` to an upstream deployment, as litellm's model_list says.

litellm resolves the provider, the upstream model name and the model's limits; ctxgate
only decides whether the deployment speaks the OpenAI API (then its own pooled client
forwards the body as is) or needs litellm's translation.
"""
from __future__ import annotations

import fnmatch
import itertools
import logging
import os
import re
from dataclasses import dataclass, field
from typing import Any, Iterator

from ..config import Config, ModelEntry
from ..errors import ErrorKind, GatewayError
from ctxgate.pipeline.policy import Prices
from .fallbacks import Fallbacks, read_fallbacks
from .prices import prices_for
from .retry import RetryPolicy

log = logging.getLogger("ctxgate.routing")

DEMO_MODEL = "ctxgate-demo"
DEMO_PROVIDER = "ctxgate-demo"
# Providers whose chat-completions API is OpenAI's own wire format.
OPENAI_COMPATIBLE = {"openai", "custom_openai", "hosted_vllm", "openai_like", "lm_studio", "llamafile"}
# litellm_params keys that choose the deployment; the rest are call parameters.
_ROUTING_KEYS = {"model", "api_base", "base_url", "api_key", "custom_llm_provider", "api_version", "organization",
                 "timeout", "stream_timeout", "max_retries", "num_retries", "rpm", "tpm", "order", "weight"}
# LiteLLM's routing features ctxgate does not have yet: a config that sets them is told so at start.
_UNPRICED: set[str] = set()
"""Models already named in the log as having no known prices (said once per process)."""
_UNSUPPORTED = ("content_policy_fallbacks",)


@dataclass(frozen=True)
class Route:
    model_name: str
    litellm_params: dict[str, Any]
    provider: str
    upstream_model: str
    api_base: str | None
    api_key: str | None
    max_input_tokens: int
    limit_source: str
    direct: bool
    call_params: dict[str, Any] = field(default_factory=dict)
    """Parameters the config sets for every call (e.g. temperature); the client's win."""
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    prices: Prices | None = None
    """Its list prices from litellm's cost map; None when the map has none (`upstream/prices.py`)."""
    single_system: bool = False
    """`model_info.single_system_message`: the route's chat template takes one leading system
    message (many local OpenAI-compatible servers), so ctxgate's own notice joins it."""

    @property
    def demo(self) -> bool:
        return self.provider == DEMO_PROVIDER


def _env_ref(value: Any) -> Any:
    """litellm's `os.environ/NAME` convention for secrets in config files."""
    if isinstance(value, str) and value.startswith("os.environ/"):
        return os.environ.get(value.split("/", 1)[1])
    return value


def _max_input_tokens(entry: ModelEntry, upstream_model: str, provider: str, default: int) -> tuple[int, str]:
    info = entry.model_info
    for key in ("max_input_tokens", "max_tokens"):
        if isinstance(info.get(key), int) and info[key] > 0:
            return info[key], "model_info"
    import litellm

    for name in (entry.litellm_params["model"], f"{provider}/{upstream_model}", upstream_model, entry.model_name):
        try:
            got = litellm.get_model_info(name).get("max_input_tokens")
        except Exception:  # litellm raises a bare Exception for unmapped models
            continue
        if got:
            return int(got), "litellm"
    return default, "default"


def _flag(entry: ModelEntry, key: str) -> bool:
    """A yes/no setting of a route's `model_info` (default off); anything but a boolean is refused at start."""
    value = entry.model_info.get(key, False)
    if not isinstance(value, bool):
        raise GatewayError(ErrorKind.INVALID_REQUEST, f"model_list entry {entry.model_name!r}: model_info.{key} "
                                                      f"must be true or false, not {value!r}")
    return value


def _settings(config: Config, section: str) -> dict[str, Any]:
    """A LiteLLM proxy section of the config (`router_settings`, `litellm_settings`), or {}."""
    found = (config.model_extra or {}).get(section)
    return found if isinstance(found, dict) else {}


def _number(where: str, value: Any, integer: bool = False) -> float | None:
    """A config value as a number >= 0 (YAML or an environment reference may give a string)."""
    if value is None:
        return None
    try:
        number = float(value) if not isinstance(value, bool) else -1.0
    except (TypeError, ValueError):
        number = -1.0
    if number < 0 or (integer and not number.is_integer()):
        raise ValueError(f"{where}: must be a {'whole ' if integer else ''}number >= 0, not {value!r}")
    return number


def _first(*found: tuple[str, Any]) -> float | None:
    """The first key of `found` (dotted name, value) that is set, checked as a number."""
    for where, value in found:
        got = _number(where, value, integer=where.endswith("num_retries"))
        if got is not None:
            return got
    return None


def retry_policy(config: Config, model_name: str, params: dict[str, Any]) -> RetryPolicy:
    """A deployment's retries and timeout from LiteLLM's keys: its own `litellm_params` first,
    then `router_settings`, then `litellm_settings`, then `ctxgate.upstream_timeout_s`."""
    router, settings = _settings(config, "router_settings"), _settings(config, "litellm_settings")
    here = f"model_list[{model_name}].litellm_params"
    retries = _first((f"{here}.num_retries", params.get("num_retries")),
                     ("router_settings.num_retries", router.get("num_retries")),
                     ("litellm_settings.num_retries", settings.get("num_retries")))
    timeout = _first((f"{here}.timeout", params.get("timeout")), ("router_settings.timeout", router.get("timeout")),
                     ("litellm_settings.request_timeout", settings.get("request_timeout")),
                     ("litellm_settings.timeout", settings.get("timeout")))
    min_wait = _first(("router_settings.retry_after", router.get("retry_after")))
    return RetryPolicy(num_retries=int(retries or 0), min_wait_s=float(min_wait or 0.0),
                       timeout_s=float(timeout) if timeout else config.ctxgate.upstream_timeout_s)


def warn_unsupported(config: Config) -> None:
    """LiteLLM's keys ctxgate does not act on: say so rather than ignore them silently."""
    for section in ("router_settings", "litellm_settings"):
        for key in _UNSUPPORTED:
            if _settings(config, section).get(key):
                log.warning("%s.%s is not supported by ctxgate yet and is ignored: a failed call is answered "
                            "with its error (after the configured retries)", section, key)


def _route(entry: ModelEntry, config: Config, forwarding: str) -> Route:
    import litellm

    lp = {k: _env_ref(v) for k, v in entry.litellm_params.items()}
    api_base = lp.get("api_base") or lp.get("base_url")
    try:
        upstream_model, provider, dynamic_key, resolved_base = litellm.get_llm_provider(
            model=lp["model"], custom_llm_provider=lp.get("custom_llm_provider"), api_base=api_base)
    except Exception as e:
        raise GatewayError(ErrorKind.INVALID_REQUEST, f"model_list entry {entry.model_name!r}: "
                            f"litellm cannot route {lp['model']!r}: {e}") from None
    api_base = api_base or resolved_base
    api_key = lp.get("api_key") or dynamic_key
    if provider == "openai":
        api_base = api_base or "https://api.openai.com/v1"
        api_key = api_key or os.environ.get("OPENAI_API_KEY")
    elif provider == "anthropic":  # the Messages door calls Anthropic itself, not through litellm
        api_base = api_base or os.environ.get("ANTHROPIC_API_BASE")
        api_key = api_key or os.environ.get("ANTHROPIC_API_KEY")
    limit, source = _max_input_tokens(entry, upstream_model, provider, config.ctxgate.default_max_input_tokens)
    if source == "default":
        log.warning("no context limit known for %s; using %d (set model_info.max_input_tokens)",
                    entry.model_name, limit)
    direct = forwarding == "auto" and provider in OPENAI_COMPATIBLE and bool(api_base)
    prices = prices_for(str(lp["model"])) or prices_for(upstream_model)
    if prices is None and lp["model"] not in _UNPRICED:
        _UNPRICED.add(lp["model"])
        log.info("no prices known for %s: the compaction cost model uses conservative defaults (input 1, cache read "
                 "0.1, cache write 1.25; set ctxgate.pipeline.cost.prices)", lp["model"])
    return Route(model_name=entry.model_name, litellm_params=lp, provider=provider, upstream_model=upstream_model,
                 api_base=api_base.rstrip("/") if api_base else None, api_key=api_key, max_input_tokens=limit,
                 limit_source=source, direct=direct,
                 call_params={k: v for k, v in lp.items() if k not in _ROUTING_KEYS},
                 retry=retry_policy(config, entry.model_name, lp), prices=prices,
                 single_system=_flag(entry, "single_system_message"))


def _shown(model: str, limit: int = 200) -> str:
    """A client's model name as an error message quotes it: a 1 MB name is not echoed whole."""
    return model if len(model) <= limit else model[:limit] + f"... ({len(model)} characters)"


def demo_route() -> Route:
    return Route(model_name=DEMO_MODEL, litellm_params={"model": DEMO_MODEL}, provider=DEMO_PROVIDER,
                 upstream_model=DEMO_MODEL, api_base=None, api_key=None, max_input_tokens=128_000,
                 limit_source="demo", direct=False)


MAX_PATTERN_ROUTES = 1024
"""Models resolved through a wildcard entry that are kept resolved (a client chooses the names)."""


class Router:
    """Round-robin over the deployments that share a model_name, as litellm's router does.

    A `model_name` with a `*` (as litellm's proxy allows: `claude-*`, `anthropic/*`, `*`)
    serves every model it matches that no exact entry names; a `*` in its
    `litellm_params.model` becomes what the `*` matched, so `claude-*` ->
    `anthropic/claude-*` sends `claude-sonnet-4-5` to `anthropic/claude-sonnet-4-5`. Agents
    such as Claude Code and Codex choose their model names themselves."""

    def __init__(self, config: Config, forwarding: str | None = None) -> None:
        mode = forwarding or config.ctxgate.forwarding
        warn_unsupported(config)
        for entry in config.model_list:  # a bad retry or timeout value is refused at start, not per request
            retry_policy(config, entry.model_name, {k: _env_ref(v) for k, v in entry.litellm_params.items()})
        groups: dict[str, list[Route]] = {}
        self._patterns: list[ModelEntry] = []
        for entry in config.model_list:
            if "*" in entry.model_name:
                self._patterns.append(entry)
            else:
                groups.setdefault(entry.model_name, []).append(_route(entry, config, mode))
        if not groups and not self._patterns:
            groups[DEMO_MODEL] = [demo_route()]
        self._config, self._mode = config, mode
        self._groups = groups
        self._cycles: dict[str, Iterator[Route]] = {k: itertools.cycle(v) for k, v in groups.items()}
        self._matched: dict[str, Route] = {}
        self.fallbacks: Fallbacks = read_fallbacks(
            {section: _settings(config, section) for section in ("router_settings", "litellm_settings")},
            set(self.model_names()))

    @property
    def demo_only(self) -> bool:
        return list(self._groups) == [DEMO_MODEL]

    def model_names(self) -> list[str]:
        return list(self._groups) + [entry.model_name for entry in self._patterns]

    def resolve(self, model: str) -> Route:
        cycle = self._cycles.get(model)
        if cycle is not None:
            return next(cycle)
        found = self._matched.get(model) or self._match(model)
        if found is None:
            raise GatewayError(ErrorKind.NOT_FOUND, f"The model `{_shown(model)}` does not exist in this gateway's "
                               f"model_list (known: {', '.join(self.model_names())})", code="model_not_found",
                               param="model")
        return found

    def _match(self, model: str) -> Route | None:
        for entry in self._patterns:
            if not fnmatch.fnmatchcase(model, entry.model_name):
                continue
            star = re.fullmatch(re.escape(entry.model_name).replace(r"\*", "(.*)", 1).replace(r"\*", ".*"), model)
            matched = star.group(1) if star else model
            params = {**entry.litellm_params, "model": str(entry.litellm_params["model"]).replace("*", matched)}
            route = _route(entry.model_copy(update={"model_name": model, "litellm_params": params}),
                           self._config, self._mode)
            if len(self._matched) < MAX_PATTERN_ROUTES:
                self._matched[model] = route
            return route
        return None

    def first(self, model: str) -> Route:
        return self._groups[model][0]
