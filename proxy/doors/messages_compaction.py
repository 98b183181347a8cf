"""Anthropic's `compact_20260112` on the Messages door, for any route (docs/native-context.md).

Past the edit's trigger the conversation is compacted by the one compaction entry point
(engine/client_compaction.py) and the reply starts with a `compaction` block: its `content`
the notes and summary the point wrote, its `encrypted_content` ctxgate's sealed reference to
the compacted messages. With `pause_after_compaction` the block is the whole reply
(`stop_reason: "compaction"`), without a model turn. A `compaction` block that comes back in
`messages` stands for everything before it: ctxgate's is replaced by the messages it names,
another's (its `content` a summary) by that summary as text.
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass, replace
from typing import Any, AsyncIterator

import orjson

from ..engine.client_compaction import ClientCompaction, kept
from ..engine.sealed import PREFIX
from ..gateway import Gateway
from ..tenancy import Caller
from ..upstream.forwarders import Reply
from .sse import rewrite_events, with_data

COMPACTION = "compaction"


def _blocks(message: Any) -> list[Any]:
    content = message.get("content") if isinstance(message, dict) else None
    return content if isinstance(content, list) else []


async def expanded(gw: Gateway, caller: Caller, messages: list[dict[str, Any]], emulating: bool
                   ) -> list[dict[str, Any]]:
    """`messages` from their last compaction block on, what came before it replaced by what
    the block names (the same list when there is none, or the block is the vendor's to read)."""
    at = next(((i, j) for i in range(len(messages) - 1, -1, -1) for j, b in enumerate(_blocks(messages[i]))
               if isinstance(b, dict) and b.get("type") == COMPACTION), None)
    if at is None:
        return messages
    i, j = at
    block, message = messages[i]["content"][j], messages[i]
    rest = message["content"][j + 1:]
    after = ([{**message, "content": rest}] if rest else []) + messages[i + 1:]
    token = block.get("encrypted_content")
    if isinstance(token, str) and token.startswith(PREFIX):
        found = await kept(gw, caller, token, f"messages.{i}.content.{j}.encrypted_content")
        return [*found, *after]
    if not emulating:
        return messages
    summary = block.get("content")
    if not isinstance(summary, str) or not summary:  # a failed compaction: Anthropic treats it as a no-op
        return [*messages[:i], *([{**message, "content": message["content"][:j] + rest}] if
                                 message["content"][:j] + rest else []), *messages[i + 1:]]
    return [{"role": "user", "content": [{"type": "text", "text": summary}]}, *after]


def summary_of(done: ClientCompaction, before: list[dict[str, Any]]) -> str:
    """What the compaction wrote: the text of the messages it made (notes, the summary)."""
    old = {orjson.dumps(m) for m in before}
    parts = []
    for m in done.messages:
        if orjson.dumps(m) in old:
            continue
        content = m.get("content")
        parts.append(content if isinstance(content, str) else "".join(
            str(p.get("text") or "") for p in content or [] if isinstance(p, dict)))
    return "\n\n".join(p for p in parts if p) or "(earlier conversation compacted)"


def usage_entry(done: ClientCompaction) -> dict[str, Any]:
    """The compaction's cost as an entry of `usage.iterations`."""
    return {"type": "compaction", "input_tokens": done.usage.input_tokens, "output_tokens": done.usage.output_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}


@dataclass
class BlockInjection:
    """The compaction block first in a forwarded turn's reply, its cost in `usage.iterations`."""
    block: dict[str, Any]
    done: ClientCompaction

    def message(self, data: dict[str, Any]) -> dict[str, Any]:
        usage = data.get("usage")
        if isinstance(usage, dict):
            usage = {**usage, "iterations": [usage_entry(self.done), *(usage.get("iterations") or [])]}
        return {**data, "content": [self.block, *data.get("content", [])], "usage": usage}

    def reply(self, reply: Reply) -> Reply:
        if reply.chunks is not None:
            return replace(reply, chunks=self._stream(reply.chunks))
        try:
            data = orjson.loads(reply.body or b"")
        except orjson.JSONDecodeError:
            return reply
        if not isinstance(data, dict) or data.get("type") != "message":
            return reply
        return replace(reply, body=orjson.dumps(self.message(data)))

    def _stream(self, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """The compaction block's events before the first content block, every later index moved up."""
        inserted = False

        def rewrite(event: bytes, found: dict[str, Any]) -> bytes:
            nonlocal inserted
            head = b""
            if not inserted and found.get("type") != "message_start":
                inserted, head = True, block_events(self.block, 0)
            if inserted and isinstance(found.get("index"), int):
                found = {**found, "index": found["index"] + 1}
            return head + with_data(event, found)

        return rewrite_events(chunks, rewrite)


def compaction_block(summary: str, token: str) -> dict[str, Any]:
    return {"type": COMPACTION, "content": summary, "encrypted_content": token}


def _event(kind: str, data: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **data}) + b"\n\n"


def block_events(block: dict[str, Any], index: int) -> bytes:
    """A compaction block as Anthropic streams it: an empty block, its one delta, its stop."""
    return (_event("content_block_start", {"index": index, "content_block": {"type": COMPACTION, "content": None}})
            + _event("content_block_delta", {"index": index, "delta": {
                "type": "compaction_delta", "content": block["content"],
                "encrypted_content": block["encrypted_content"]}})
            + _event("content_block_stop", {"index": index}))


def paused(model: str, block: dict[str, Any], done: ClientCompaction,
           context_management: dict[str, Any] | None) -> dict[str, Any]:
    """`pause_after_compaction`: the reply is the compaction block alone."""
    message: dict[str, Any] = {
        "id": "msg_" + secrets.token_hex(12), "type": "message", "role": "assistant", "model": model,
        "content": [block], "stop_reason": "compaction", "stop_sequence": None,
        "usage": {"input_tokens": 0, "output_tokens": 0, "iterations": [usage_entry(done)]}}
    if context_management is not None:
        message["context_management"] = context_management
    return message


def paused_events(message: dict[str, Any]) -> bytes:
    start = {**message, "content": [], "stop_reason": None}
    start.pop("context_management", None)
    delta: dict[str, Any] = {"delta": {"stop_reason": "compaction", "stop_sequence": None}, "usage": message["usage"]}
    if "context_management" in message:
        delta["context_management"] = message["context_management"]
    return (_event("message_start", {"message": start}) + block_events(message["content"][0], 0)
            + _event("message_delta", delta) + _event("message_stop", {}))

