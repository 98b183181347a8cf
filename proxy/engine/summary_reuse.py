"""A summary paid for is not paid for again.

A compaction point asks for its summary before the turn commits. When the commit then fails
(a lost lease, a Redis log that no replica acknowledges, a gateway killed after the call),
the client retries, and the retry, on this replica or another, asks for the very same
summary: the same prompt, byte for byte, since compaction is a function of the history.
Each summary is therefore kept in the session's content store (in the process, in files, or
in Redis, shared by replicas) under the hash of its model and prompt, and a request for the
same prompt reads it instead of paying again. It lives and goes with the session's other
originals (`expand.store_ttl_s`, `expand.store_max_bytes`, erased with the session).
"""
from __future__ import annotations

import hashlib
from typing import Any, Awaitable, Callable

import orjson

from ctxgate.pipeline.config import ExpandConfig

from .content_store import ContentStore

Summarize = Callable[[list[dict[str, Any]]], Awaitable[str]]


class ReusedSummary(str):
    """A summary read back from the content store: an earlier attempt paid for it, so this
    point's cost (`summary_cost.costed`) does not count it again."""


def summary_ref(model: str, prompt: list[dict[str, Any]]) -> str:
    """The content store's key for the summary `model` writes for `prompt`."""
    digest = hashlib.sha256(model.encode() + b"\0" + orjson.dumps(prompt, option=orjson.OPT_SORT_KEYS))
    return f"summary-{digest.hexdigest()[:40]}"


def reusing_summaries(content: ContentStore, tenant: str, session_id: str, model: str, store: ExpandConfig,
                      complete: Callable[[str, list[dict[str, Any]]], Awaitable[str]]) -> Summarize:
    """`complete(model, prompt)` for this session, paying once for each prompt."""
    async def summarize(prompt: list[dict[str, Any]]) -> str:
        ref = summary_ref(model, prompt)
        kept = await content.get(tenant, session_id, ref, store.store_ttl_s)
        if kept is not None:
            return ReusedSummary(kept)
        text = await complete(model, prompt)
        await content.put(tenant, session_id, {ref: text}, store.store_max_bytes, store.store_ttl_s)
        return text

    return summarize
