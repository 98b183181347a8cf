"""A compaction the client asked for (OpenAI's `context_management` compaction,
`/responses/compact`, a `compaction_trigger` item; Anthropic's `compact_20260112`), run on
the one compaction entry point (`pipeline/planner.plan`, through `Compactor.client_asked`)
and kept so a sealed reference can name it (docs/native-context.md).

What the point kept is stored in the session's content store under a reference of its own
(so it lives as long as expansion originals do, and goes with the session's data); the
client gets a sealed reference to it. The session's record, WAL events and compaction log
show it like any other compaction, with the reason `client`.
"""
from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from ctxgate.pipeline.notes import with_notice
from ..errors import ErrorKind, GatewayError
from ..tenancy import Caller
from ..upstream.routing import Route
from .compaction import fingerprints_of
from .sealed import Reference, SealError, Sealer
from .turn_budget import Turn, budget_of

if TYPE_CHECKING:
    from ..gateway import Gateway

REF_PREFIX = "cmp-"
"""Content-store keys of client-asked compactions (expansion references are `ctx:HEX`)."""


@dataclass
class Usage:
    """What the compaction itself cost: the summary calls, in the summariser's tokens as ctxgate counts them."""
    input_tokens: int = 0
    output_tokens: int = 0
    calls: int = 0


@dataclass
class ClientCompaction:
    messages: list[dict[str, Any]]
    """The conversation as the compaction left it (neutral model, ctxgate's notes in)."""
    tokens_before: int
    tokens_after: int
    levels: list[str]
    usage: Usage


def sealer_of(gw: "Gateway") -> Sealer:
    """The gateway's sealer, made once from the config."""
    return _sealer(tuple(gw.config.ctxgate.native_context.keys), str(gw.data_dir))


@lru_cache(maxsize=8)
def _sealer(keys: tuple[str, ...], data_dir: str) -> Sealer:
    return Sealer.from_config(list(keys), Path(data_dir))


def seal_ttl(gw: "Gateway", caller: Caller) -> float:
    configured = gw.config.ctxgate.native_context.seal_ttl_s
    return configured or gw.pipeline_config(caller.profile, caller.tenant).expand.store_ttl_s


async def compact(gw: "Gateway", caller: Caller, route: Route, session_id: str, messages: list[dict[str, Any]],
                  tools: list[dict[str, Any]] | None, threshold: int | None,
                  instructions: str | None = None) -> ClientCompaction:
    """Compact `messages` now: to below `threshold` as the client set it (where ctxgate's
    trigger would stand, its target below in the same proportion), or, with no threshold,
    to the configured target share of what it counts now. `instructions`: the client's own
    for the summary (Anthropic's `compact_20260112`), after ctxgate's prompt."""
    counter = gw.tokenizers.for_model(route.model_name, route.upstream_model)
    config = gw.pipeline_config(caller.profile, caller.tenant)
    usage = Usage()
    model = config.autocompact.model or route.model_name

    async def summarize(prompt: list[dict[str, Any]]) -> str:
        if instructions:
            prompt = [*prompt, {"role": "user", "content": f"Additional instructions for the summary: {instructions}"}]
        text = await gw.summarizer.complete(model, prompt)
        usage.calls += 1
        usage.input_tokens += counter.count_messages(prompt)
        usage.output_tokens += counter.count(text)
        return text

    turn = Turn(messages=messages, fingerprints=fingerprints_of(messages), tools=tools, counter=counter,
                config=config, max_input_tokens=caller.budget or route.max_input_tokens, summarize=summarize)
    before = counter.count_messages(with_notice(messages))
    share = config.target_ratio / config.trigger_ratio if threshold is not None else config.target_ratio
    aim = max(1, int((threshold if threshold is not None else before) * share) - turn.fixed_tokens())
    async with gw.sessions.transaction(caller.tenant, session_id) as tx:
        target = min(aim, turn.target(budget_of(tx.state, turn), config.target_ratio))
        plan = await gw.compactor.client_asked(tx.state, turn, target)
        tx.write_log = lambda s: gw.journal.log_request(s, turn, plan.tokens_out, budget_of(s, turn))
    after = counter.count_messages(with_notice(plan.messages))
    return ClientCompaction(plan.messages, before, after, plan.levels, usage)


async def keep(gw: "Gateway", caller: Caller, session_id: str, content: Any) -> str:
    """`content` kept for the session, and a sealed reference to it."""
    ttl = seal_ttl(gw, caller)
    ref = REF_PREFIX + secrets.token_hex(16)
    store_max = gw.pipeline_config(caller.profile, caller.tenant).expand.store_max_bytes
    await gw.compactor.content.put(caller.tenant, session_id, {ref: orjson.dumps(content).decode()}, store_max, ttl)
    return sealer_of(gw).seal(caller.tenant, Reference(session_id, ref, time.time() + ttl))


async def kept(gw: "Gateway", caller: Caller, token: Any, param: str) -> Any:
    """What a sealed reference names; a 400 naming `param` when it does not open or its content is gone."""
    if not isinstance(token, str) or not token:
        raise GatewayError(ErrorKind.INVALID_REQUEST, f"{param}: a compaction item needs its `encrypted_content`",
                           param=param, code="invalid_encrypted_content")
    try:
        reference = sealer_of(gw).open(caller.tenant, token)
    except SealError as e:
        raise GatewayError(ErrorKind.INVALID_REQUEST, f"{param}: {e}", param=param,
                           code="invalid_encrypted_content") from None
    found = await gw.compactor.content.get(caller.tenant, reference.session_id, reference.ref, seal_ttl(gw, caller))
    if found is None:
        raise GatewayError(ErrorKind.INVALID_REQUEST, f"{param}: the compaction item has expired (what it names "
                           "is no longer kept)", param=param, code="invalid_encrypted_content")
    return orjson.loads(found)
