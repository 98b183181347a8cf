"""What the turn engine needs of a door's wire format, and what it learns from a reply.

A door (chat completions, Anthropic Messages, OpenAI Responses) parses its format into
the neutral conversation model and implements `Wire`: how to render the forwarded body
from the model, where to send it, and how to read the upstream's reply (usage and tool
calls, whole or streamed). The engine knows nothing of any wire format beyond this.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from ..errors import GatewayError
from ..tenancy import Caller
from ..upstream.forwarders import Reply
from ..upstream.routing import Route


@dataclass
class ReplyFacts:
    """What ctxgate keeps of a completed reply."""
    prompt_tokens: int | None = None
    """The provider's count of the prompt it was sent (for calibration)."""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    """As chat completions has them: `{"id", "function": {"name", "arguments"}}`."""
    response: dict[str, Any] | None = None
    """The whole reply object, for a door that keeps replies (Responses' `previous_response_id`)."""
    malformed: str | None = None
    """What makes a whole reply's body not this API's reply ("not JSON", "no `choices` list"):
    the edge answers 502 instead of passing it on. None for a reply."""


class StreamWatch(Protocol):
    """Watches a streamed reply go by, on its way to the client."""

    def feed(self, data: bytes) -> None: ...

    @property
    def complete(self) -> bool:
        """The reply's last event went by: the turn can be settled before the client hangs up."""
        ...

    @property
    def failed(self) -> bool:
        """The stream carried the API's own error event: the upstream call did not succeed."""
        ...

    def body(self) -> bytes:
        """Every byte, when asked to keep them (an idempotent request's stored reply)."""
        ...

    def facts(self) -> ReplyFacts: ...


class Wire(Protocol):
    name: str
    """The door, as `door` in logs and metrics: chat, messages, responses."""

    def payload(self, messages: list[dict[str, Any]], route: Route) -> dict[str, Any]:
        """The body to forward: the client's body with `messages` (the compacted conversation,
        memory and restore blocks in) written back in this wire format."""
        ...

    async def send(self, route: Route, payload: dict[str, Any], *, stream: bool, api_key: str | None) -> Reply: ...

    def reply_facts(self, body: bytes) -> ReplyFacts: ...

    def stream_watch(self, keep_all: bool) -> StreamWatch: ...

    def error_event(self, error: GatewayError) -> bytes:
        """An error after the reply's headers went out, as this API's stream says it."""
        ...

    async def settled(self, tenant: str, facts: ReplyFacts) -> None:
        """The reply completed and is logged (a door that keeps replies keeps it now)."""
        ...

    async def upstream_count(self, route: Route, messages: list[dict[str, Any]], api_key: str | None) -> int | None:
        """The provider's own count of `messages` as this door would forward them, where the
        route offers one (Anthropic's count_tokens, for models with no public tokenizer); None
        elsewhere. May raise GatewayError: a count is an aid, the engine goes on without it."""
        ...


def upstream_key(caller: Caller, route: Route) -> str | None:
    """The key the upstream is called with: the route's, or the caller's own when its tenant passes it through."""
    return caller.bearer if caller.tenant_config.pass_through_key else route.api_key
