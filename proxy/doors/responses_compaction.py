"""OpenAI's compaction on the Responses door, for any route (docs/native-context.md):
`context_management: [{"type": "compaction", "compact_threshold": N}]`, the
`compaction_trigger` input item and `POST /v1/responses/compact`.

Where the route's vendor compacts itself (`context_settings.vendor_applies`) the fields go
through untouched. Elsewhere ctxgate reads them: the field is taken out of the forwarded
body; past the threshold (or asked by a trigger or the endpoint) the conversation is compacted
by the one compaction entry point (engine/client_compaction.py) and the client is handed a
`compaction` item whose `encrypted_content` is ctxgate's sealed reference to what it kept.
A `compaction` item that comes back in `input` stands for everything before it: it is
replaced by what it names before the conversation is read, so every route (a fallback's
too) is sent the conversation, never the blob.
"""
from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, replace
from typing import Any, AsyncIterator

import orjson

from ..context_settings import mode_for, vendor_applies
from ..engine.client_compaction import ClientCompaction, Usage, kept, keep
from ..engine.sealed import PREFIX
from ..errors import ErrorKind, GatewayError
from ..gateway import Gateway
from ..tenancy import Caller
from ..upstream.forwarders import Reply
from ..upstream.routing import Route
from .sse import rewrite_events, with_data

COMPACTION, TRIGGER = "compaction", "compaction_trigger"
MIN_THRESHOLD, MAX_THRESHOLD = 1000, 100_000_000
"""OpenAI refuses a `compact_threshold` under 1000 tokens."""
FIELD = "context_management"


def _bad(message: str, param: str, code: str = "invalid_request") -> GatewayError:
    return GatewayError(ErrorKind.INVALID_REQUEST, message, param=param, code=code)


def threshold_of(body: dict[str, Any]) -> int | None:
    """The client's `compact_threshold`, checked; None without `context_management`.
    A compaction entry with no threshold compacts at ctxgate's own trigger (None too)."""
    entries = body.get(FIELD)
    if entries is None:
        return None
    if not isinstance(entries, list):
        raise _bad(f"{FIELD}: must be a list of context management entries", FIELD)
    threshold: int | None = None
    for i, entry in enumerate(entries):
        where = f"{FIELD}.{i}"
        if not isinstance(entry, dict):
            raise _bad(f"{where}: must be an object", where)
        if entry.get("type") != COMPACTION:
            raise _bad(f"{where}.type: unknown context management type {entry.get('type')!r} (supported: "
                       f"'{COMPACTION}')", f"{where}.type")
        value = entry.get("compact_threshold")
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not MIN_THRESHOLD <= value <= MAX_THRESHOLD:
            raise _bad(f"{where}.compact_threshold: must be an integer from {MIN_THRESHOLD} to {MAX_THRESHOLD}, "
                       f"got {value!r}", f"{where}.compact_threshold")
        threshold = value
    return threshold


def emulated(gw: Gateway, caller: Caller, route: Route) -> bool:
    """Whether ctxgate applies OpenAI's compaction on this route (not its vendor)."""
    mode = mode_for(gw.config.ctxgate.native_context, caller.tenant_config.native_context, route.model_name)
    return not vendor_applies(mode, "openai_compaction", route.provider, route.api_base)


def triggered(items: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], bool]:
    """The items without a final `compaction_trigger`, and whether there was one (elsewhere: a 400)."""
    for i, item in enumerate(items):
        if isinstance(item, dict) and item.get("type") == TRIGGER and i != len(items) - 1:
            raise _bad(f"input.{i}: a compaction_trigger item must be the last input item", f"input.{i}")
    if items and isinstance(items[-1], dict) and items[-1].get("type") == TRIGGER:
        return items[:-1], True
    return items, False


async def expanded(gw: Gateway, caller: Caller, items: list[dict[str, Any]], emulating: bool
                   ) -> list[dict[str, Any]]:
    """The conversation with its last ctxgate compaction item replaced by what it names (what
    came before it is in there). A compaction item ctxgate did not make goes to a route whose
    vendor reads it; on an emulated route it is a 400."""
    last = None
    for i, item in enumerate(items):
        if isinstance(item, dict) and item.get("type") == COMPACTION:
            content = item.get("encrypted_content")
            if isinstance(content, str) and content.startswith(PREFIX):
                last = i
            elif emulating:
                raise _bad(f"input.{i}.encrypted_content: a compaction item this gateway did not make cannot be "
                           "read on this route", f"input.{i}.encrypted_content", "invalid_encrypted_content")
    if last is None:
        return items
    for i in range(last):  # each earlier one must still open: a tampered item is refused wherever it is
        item = items[i]
        if isinstance(item, dict) and item.get("type") == COMPACTION:
            await kept(gw, caller, item.get("encrypted_content"), f"input.{i}.encrypted_content")
    found = await kept(gw, caller, items[last].get("encrypted_content"), f"input.{last}.encrypted_content")
    if not isinstance(found, list):
        raise _bad(f"input.{last}.encrypted_content: not a conversation", f"input.{last}.encrypted_content")
    return [*found, *items[last + 1:]]


def compaction_item(token: str) -> dict[str, Any]:
    return {"id": "cmp_" + secrets.token_hex(12), "type": COMPACTION, "encrypted_content": token,
            "created_by": "ctxgate"}


def usage_of(usage: Usage) -> dict[str, Any]:
    """The compaction's cost in the Responses usage shape."""
    return {"input_tokens": usage.input_tokens, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": usage.output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.input_tokens + usage.output_tokens}


async def sealed_item(gw: Gateway, caller: Caller, session_id: str, items: list[dict[str, Any]]) -> dict[str, Any]:
    """A compaction item naming `items` (the compacted conversation as Responses input)."""
    return compaction_item(await keep(gw, caller, session_id, items))


def compacted_response(model: str, user_items: list[dict[str, Any]], item: dict[str, Any],
                       usage: Usage) -> dict[str, Any]:
    """`POST /responses/compact`'s answer: the user messages, then the one compaction item."""
    return {"id": "resp_cmp_" + secrets.token_hex(12), "object": "response.compaction", "created_at": int(time.time()),
            "model": model, "output": [*user_items, item], "usage": usage_of(usage)}


def trigger_response(model: str, item: dict[str, Any], usage: Usage) -> dict[str, Any]:
    """A `compaction_trigger` answered without a model call: a completed response whose output is the item."""
    return {"id": "resp_" + secrets.token_hex(12), "object": "response", "created_at": int(time.time()),
            "status": "completed", "model": model, "output": [item], "usage": usage_of(usage),
            "error": None, "incomplete_details": None, "parallel_tool_calls": True, "tool_choice": "auto",
            "tools": []}


def response_events(response: dict[str, Any]) -> bytes:
    """A whole response as the Responses stream's events (a trigger answered without a model call)."""
    item = response["output"][0]
    start = {**response, "status": "in_progress", "output": [], "usage": None}
    events = [("response.created", {"response": start}), ("response.in_progress", {"response": start}),
              ("response.output_item.added", {"output_index": 0, "item": item}),
              ("response.output_item.done", {"output_index": 0, "item": item}),
              ("response.completed", {"response": response})]
    return b"".join(b"event: " + kind.encode() + b"\ndata: "
                    + orjson.dumps({"type": kind, "sequence_number": n, **data}) + b"\n\n"
                    for n, (kind, data) in enumerate(events))


def user_items(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The user messages of `items` as output items (OpenAI's compact output lists them)."""
    return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": i["content"]}]
             if isinstance(i.get("content"), str) else i.get("content")}
            for i in items if isinstance(i, dict) and i.get("type") in (None, "message") and i.get("role") == "user"]


@dataclass
class Injection:
    """A compaction item to put first in a forwarded turn's reply, and what the compaction cost."""
    item: dict[str, Any]
    done: ClientCompaction

    def reply(self, reply: Reply) -> Reply:
        if reply.chunks is not None:
            return replace(reply, chunks=self._stream(reply.chunks))
        try:
            data = orjson.loads(reply.body or b"")
        except orjson.JSONDecodeError:
            return reply  # not a reply: the edge says so
        if not isinstance(data, dict) or not isinstance(data.get("output"), list):
            return reply
        return replace(reply, body=orjson.dumps(self._response(data)))

    def _response(self, response: dict[str, Any]) -> dict[str, Any]:
        usage = response.get("usage")
        cost = usage_of(self.done.usage)
        if isinstance(usage, dict):  # beside the turn's own, whose input_tokens calibrate ctxgate's count
            usage = {**usage, "compaction": cost}
        return {**response, "output": [self.item, *response.get("output", [])], "usage": usage}

    def _stream(self, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """The upstream's events, the compaction item's two events before its first output item,
        every later output index and sequence number moved up."""
        inserted = False

        def rewrite(event: bytes, found: dict[str, Any]) -> bytes:
            nonlocal inserted
            head = b""
            if not inserted and found.get("type") not in ("response.created", "response.in_progress"):
                inserted, head = True, self._item_events(found.get("sequence_number"))
            return head + with_data(event, self._moved(found, 2 if inserted else 0))

        return rewrite_events(chunks, rewrite)

    def _item_events(self, sequence: Any) -> bytes:
        start = sequence if isinstance(sequence, int) else 0
        return b"".join(b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(
            {"type": kind, "sequence_number": start + n, "output_index": 0, "item": self.item}) + b"\n\n"
            for n, kind in enumerate(("response.output_item.added", "response.output_item.done")))

    def _moved(self, data: dict[str, Any], shift: int) -> dict[str, Any]:
        data = dict(data)
        if shift and isinstance(data.get("sequence_number"), int):
            data["sequence_number"] += shift
        if shift and isinstance(data.get("output_index"), int):
            data["output_index"] += 1
        if data.get("type") in ("response.completed", "response.incomplete", "response.failed") \
                and isinstance(data.get("response"), dict):
            data["response"] = self._response(data["response"])
        return data
