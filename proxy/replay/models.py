"""The model a session is replayed against: its context limit, its tokenizer, its prices,
and whether it can write the summaries, read from the config as the gateway reads it
(the route's `max_input_tokens`, the tokenizer rules) or, for a model the config does not
name, from litellm's model map.
"""
from __future__ import annotations

import logging
import tempfile
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ctxgate.pipeline.tokens import TokenCounter, TokenizerRegistry, TokenizerRule
from ..config import Config
from ..errors import GatewayError
from ..upstream.routing import Route, Router
from .costs import Prices, prices_for

if TYPE_CHECKING:
    from ..gateway import Gateway

DEFAULT_MODEL = "gpt-4o"
log = logging.getLogger("ctxgate.replay")


@dataclass(frozen=True)
class ModelTarget:
    name: str
    limit: int
    limit_source: str
    counter: TokenCounter
    prices: Prices | None


class Models:
    """Every model name a replay meets, resolved once."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.router = Router(config)
        self.tokenizers = TokenizerRegistry([TokenizerRule(pattern=r.pattern, tokenizer=r.tokenizer)
                                             for r in config.ctxgate.tokenizers])
        self._found: dict[str, ModelTarget] = {}

    def default_name(self, recorded: str) -> str:
        """The config's first model, else the model the recording names, else gpt-4o."""
        if not self.router.demo_only:
            return self.router.model_names()[0]
        return recorded or DEFAULT_MODEL

    def route(self, name: str) -> Route | None:
        if self.router.demo_only:
            return None
        try:
            return self.router.resolve(name)
        except GatewayError:
            return None

    def target(self, name: str) -> ModelTarget:
        if name not in self._found:
            self._found[name] = self._resolve(name)
        return self._found[name]

    def _resolve(self, name: str) -> ModelTarget:
        route = self.route(name)
        if route is not None:
            counter = self.tokenizers.for_model(route.model_name, route.upstream_model)
            prices = prices_for(str(route.litellm_params.get("model") or "")) or prices_for(route.upstream_model)
            return ModelTarget(name, route.max_input_tokens, route.limit_source, counter, prices)
        import litellm

        litellm.suppress_debug_info = True  # an unmapped model is expected here: no "Provider List" banner
        limit, source = self.config.ctxgate.default_max_input_tokens, "default"
        try:
            found = litellm.get_model_info(name).get("max_input_tokens")
        except Exception:  # litellm raises a bare Exception for an unmapped model
            found = None
        if found:
            limit, source = int(found), "litellm"
        return ModelTarget(name, limit, source, self.tokenizers.for_model(name), prices_for(name))

    def summarizing_gateway(self, name: str) -> "Gateway | None":
        """A gateway that can ask `name` (the `autocompact.model` or the session's) for a summary:
        only when the config routes it to a real provider with a key; None otherwise."""
        route = self.route(name)
        if route is None or route.demo or not route.api_key:
            return None
        from ..gateway import Gateway

        try:
            return Gateway.build(self.config, tempfile.mkdtemp(prefix="ctxgate-replay-gateway-"))
        except Exception as e:  # a gateway that cannot start is a model that cannot be reached
            log.warning("replay: summaries offline, the gateway for %s did not start: %s", name, e)
            return None
