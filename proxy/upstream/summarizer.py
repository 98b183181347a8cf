"""ctxgate's own LLM calls: Autocompact's summary and memory's consolidation, routed and
forwarded like any request, and how much one such call may hold."""
from __future__ import annotations

from typing import Any, Callable

import orjson

from ctxgate.pipeline.tokens import TokenizerRegistry

from ..errors import ErrorKind, GatewayError
from .forwarders import Forwarder
from .routing import Route, Router


class Summarizer:
    def __init__(self, router: Router, tokenizers: TokenizerRegistry,
                 forwarder_for: Callable[[Route], Forwarder]) -> None:
        self._router = router
        self._tokenizers = tokenizers
        self._forwarder_for = forwarder_for

    async def complete(self, model_name: str, messages: list[dict[str, Any]]) -> str:
        """The model's answer to `messages`: non-empty text, else an upstream error."""
        route = self._router.resolve(model_name)
        payload = {**route.call_params, "model": route.upstream_model, "messages": messages, "stream": False}
        reply = await self._forwarder_for(route).send(route, payload, stream=False, api_key=route.api_key)
        try:
            text = orjson.loads(reply.body or b"{}")["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError, orjson.JSONDecodeError):
            raise GatewayError(ErrorKind.UPSTREAM_UNREACHABLE, f"summarizer {model_name} gave no text") from None
        if not isinstance(text, str) or not text.strip():
            raise GatewayError(ErrorKind.UPSTREAM_UNREACHABLE, f"summarizer {model_name} gave an empty summary")
        return text

    def room(self, model_name: str) -> tuple[Callable[[str], int], int, Callable[[str, int], str]]:
        """A model's count, its input limit and its counter's cut (a text's start in at most n
        tokens, at a line or word boundary): what one call to it may hold, and how to fit it."""
        route = self._router.resolve(model_name)
        counter = self._tokenizers.for_model(route.model_name, route.upstream_model)
        return counter.count, route.max_input_tokens, counter.head
