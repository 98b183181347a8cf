"""Memory in the request path: who the memory is for, the block a
session injects (byte-identical until memory changes), and where it goes: quoted data in a
user-role block (`source="memory"`), never a system message, with ctxgate's fixed notice at
system level saying what such blocks are."""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable, Mapping

from ctxgate.memory.capture import project_id, text_of, workspace_root
from ctxgate.memory.config import MemoryConfig
from ctxgate.memory.file_store import FileMemoryStore
from ctxgate.memory.manager import MemoryManager
from ctxgate.memory.short_term import LocalShortTermStore, ShortTermStore
from ctxgate.memory.store import LongTermStore
from ctxgate.pipeline.notes import MEMORY, context_note, with_notice
from ctxgate.pipeline.tokens import TokenCounter
from ..errors import ErrorKind, GatewayError
from ..ids import derived_id, require_id
from .state import SessionState
from .turn_budget import Turn, budget_of

log = logging.getLogger("ctxgate.memory")
Embed = Callable[[list[str]], Awaitable[list[list[float]]]]
_QUERY_CHARS = 2000


@dataclass(frozen=True)
class MemoryScope:
    user: str | None
    project: str | None

    @property
    def key(self) -> str:
        return f"{self.user or ''}\x00{self.project or ''}"


def scope_of(headers: Mapping[str, str], user: Any, messages: list[dict[str, Any]],
             root: Callable[[list[dict[str, Any]]], str | None] = workspace_root) -> MemoryScope:
    """User: `X-Ctx-User` (an id under the one rule, else 400), else the body's free-form
    end-user id (OpenAI `user`, Anthropic `metadata.user_id`), which clients fill with
    emails or anything: one that breaks the rule is hashed into an id, never refused.
    Project: `X-Ctx-Project` (the rule, else 400), else the workspace root the conversation
    names (`root`: `workspace_root`, or a door's copy of it found already), as an id
    (`/workspace/shop` is `workspace:shop`)."""
    header_user = headers.get("X-Ctx-User")
    if header_user is not None:
        user = require_id(header_user, "user", "X-Ctx-User")
    elif user is not None:
        if not isinstance(user, str):
            raise GatewayError(ErrorKind.INVALID_REQUEST, f"user must be a string, not {type(user).__name__}",
                               param="user", code="invalid_user")
        user = derived_id(user) if user else None
    project = headers.get("X-Ctx-Project")
    if project is not None:
        return MemoryScope(user, require_id(project, "project", "X-Ctx-Project"))
    found = root(messages)
    return MemoryScope(user, project_id(found) if found else None)


def query_of(messages: list[dict[str, Any]]) -> str:
    """What the turn is about: the newest user and tool messages."""
    parts: list[str] = []
    for m in reversed(messages):
        if m.get("role") in ("user", "tool"):
            parts.append(text_of(m.get("content"))[:_QUERY_CHARS])
            if len(parts) == 2:
                break
    return "\n".join(parts)


class BlockRefresher:
    """The session's block, rebuilt only when the tenant's memory or the session's scope
    changed. A session's first block is built before its first turn; a later change is
    rebuilt in the background and taken up by the next turn, so no turn waits for a store
    re-reading thousands of entries."""

    def __init__(self) -> None:
        self._ready: dict[tuple[str, str], tuple[int, str, str]] = {}
        self._building: dict[tuple[str, str], asyncio.Task[None]] = {}

    async def block(self, state: SessionState, version: int, scope: MemoryScope,
                    build: Callable[[], Awaitable[str]]) -> str:
        if state.memory_version == version and state.memory_scope == scope.key:
            return state.memory_block
        ready = self._ready.pop(state.key, None)
        if ready is not None and ready[:2] == (version, scope.key):
            state.memory_version, state.memory_scope, state.memory_block = ready
        elif state.memory_version is None:
            state.memory_block = await build()
            state.memory_version, state.memory_scope = version, scope.key
        elif state.key not in self._building:
            self._building[state.key] = asyncio.create_task(self._build(state.key, version, scope.key, build))
        return state.memory_block

    async def _build(self, key: tuple[str, str], version: int, scope_key: str,
                     build: Callable[[], Awaitable[str]]) -> None:
        try:
            self._ready[key] = (version, scope_key, await build())
        except Exception as e:  # memory is an aid: the session keeps its last block
            log.warning("session %s: memory block not rebuilt: %s", key[1], e)
        finally:
            self._building.pop(key, None)


def block_message(block: str) -> dict[str, Any]:
    """The memory block as quoted data: entries other sessions captured are information, not instructions."""
    return context_note(MEMORY, "memory", block)


def block_tokens(block: str, counter: TokenCounter) -> int:
    """The memory block with the notice it brings (a session with a memory block always has one)."""
    if not block:
        return 0
    return counter.count_structured(block_message(block)) + counter.count_structured(with_notice(
        [block_message(block)])[0])


def inject(messages: list[dict[str, Any]], block: str) -> list[dict[str, Any]]:
    """The memory block right after the client's own system prompt."""
    if not block:
        return messages
    at = 0
    while at < len(messages) and messages[at].get("role") in ("system", "developer"):
        at += 1
    return [*messages[:at], block_message(block), *messages[at:]]


def forwarded(messages: list[dict[str, Any]], block: str, join_notice: bool) -> list[dict[str, Any]]:
    """What a turn sends: the planned messages with the memory block in, and ctxgate's notice
    when any quoted block is among them (`join_notice`: in the client's leading system message)."""
    return with_notice(inject(messages, block), join_notice)


def open_short_term(state_url: str) -> ShortTermStore:
    """Short-term buffers live where the session state does: in Redis every replica shares
    them (and a replica killed with -9 loses none), in memory they are this process's."""
    if state_url == "memory":
        return LocalShortTermStore()
    from ctxgate.memory.redis_short_term import RedisShortTermStore

    return RedisShortTermStore(state_url)


def open_memory_store(config: MemoryConfig, state_url: str, data_dir: Path, embed: Embed | None) -> LongTermStore:
    kind = config.store or ("redis" if state_url != "memory" else "files")
    if state_url != "memory" and (kind == "files" or (kind == "vector" and not config.qdrant_url)):
        # Chosen explicitly beside a shared state: one replica alone is fine, several each
        # keep a memory of their own, and a tenant's entries depend on which replica served it.
        log.warning("ctxgate.memory.store: %s keeps long-term memory under this replica's data directory (%s): "
                    "other replicas sharing the Redis state do not see it (use redis, or vector with "
                    "memory.qdrant_url)", kind, data_dir)
    if kind == "redis":
        from ctxgate.memory.redis_store import RedisMemoryStore

        if state_url == "memory":
            raise ValueError("ctxgate.memory.store: redis keeps memory next to the session state: set ctxgate.state "
                             "to a redis:// or redis+cluster:// URL")
        return RedisMemoryStore(state_url)
    if kind == "vector":
        if embed is None:
            raise ValueError("ctxgate.memory.store: vector needs ctxgate.memory.embedding_model (a model_name of "
                             "model_list that serves /v1/embeddings)")
        from ctxgate.memory.vector_store import QdrantMemoryStore

        if config.qdrant_url:
            return QdrantMemoryStore(embed, url=config.qdrant_url)
        return QdrantMemoryStore(embed, path=config.qdrant_path or str(data_dir / "qdrant"))
    return FileMemoryStore(data_dir / "memory")


async def session_block(memory: MemoryManager, blocks: BlockRefresher, state: SessionState, scope: MemoryScope,
                        turn: Turn) -> str:
    """The session's memory block for this turn; a memory store that fails leaves the last one in place."""
    budget = int(budget_of(state, turn) * memory.config.budget_share)
    try:
        version = await memory.store.version(state.tenant)
        return await blocks.block(state, version, scope, lambda: memory.context_block(
            state.tenant, scope.user, scope.project, query_of(turn.messages), budget, turn.counter.count))
    except Exception as e:
        log.warning("session %s: memory unavailable (%s); the previous block is kept", state.session_id, e)
        return state.memory_block
