"""Level 3, Context-Collapse: a read-time projection that folds long runs of
non-decision-critical messages into one template summary (no LLM).

The client's messages are never changed: the `CollapseStore` remembers what was folded,
and `project()` replaces each folded span with its summary whenever the span is seen
again. Spans are keyed by the fingerprints of their messages rather than by index, so a
fold still applies when the client resends its history. A bloom filter of folded spans
and folded messages keeps a span from being folded twice.
"""
from __future__ import annotations

import base64

import time
from dataclasses import asdict, dataclass
from typing import Any

from rbloom import Bloom

from .config import CollapseConfig
from .conversation import Conversation, Kind, counted_result, read_conversation
from .fingerprint import message_fingerprint, span_hash
from .notes import COLLAPSE, COLLAPSE_MARKER, context_note
from .refs import render_span
from .strategy import Stopwatch
from .tokens import TokenCounter
from .request import CompressionRequest
from .types import CompressionResult, Level, Message


def _stable_hash(item: Any) -> int:
    """rbloom needs a hash that survives a restart: Python's own hash() is salted."""
    return int(str(item)[:32], 16) - (1 << 127)


@dataclass
class CollapseEntry:
    original_span: tuple[int, int]
    first_fingerprint: str
    span_hash: str
    length: int
    collapsed_tokens: int
    summary: str
    collapsed_at: float
    original_total_tokens: int
    ref: str = ""
    """The folded messages' reference (`refs.content_ref`), when the fold kept them; empty otherwise."""


class CollapseStore:
    """The folds made so far, plus the bloom filter of what it already folded."""

    def __init__(self, config: CollapseConfig | None = None) -> None:
        self.config = config or CollapseConfig()
        self.entries: dict[str, CollapseEntry] = {}
        """Keyed by the fingerprint of the span's first message."""
        self.bloom = Bloom(self.config.bloom_capacity, self.config.bloom_error_rate, _stable_hash)

    def already_folded(self, fingerprint_or_span: str) -> bool:
        return fingerprint_or_span in self.bloom

    def add(self, entry: CollapseEntry, message_keys: list[str]) -> None:
        self.entries[entry.first_fingerprint] = entry
        self.bloom.add(entry.span_hash)
        for key in message_keys:
            self.bloom.add(key)

    def to_dict(self) -> dict[str, Any]:
        return {"config": self.config.model_dump(), "entries": [asdict(e) for e in self.entries.values()],
                "bloom_b64": base64.b64encode(self.bloom.save_bytes()).decode()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "CollapseStore":
        store = cls(CollapseConfig(**data.get("config", {})))
        for raw in data.get("entries", []):
            entry = CollapseEntry(**{**raw, "original_span": tuple(raw["original_span"])})
            store.entries[entry.first_fingerprint] = entry
        if data.get("bloom_b64"):
            store.bloom = Bloom.load_bytes(base64.b64decode(data["bloom_b64"]), _stable_hash)
        elif data.get("bloom"):  # state saved before base64 (hex: a third larger)
            store.bloom = Bloom.load_bytes(bytes.fromhex(data["bloom"]), _stable_hash)
        return store

    def project(self, messages: list[Message], fingerprints: list[str] | None = None) -> list[Message]:
        """The projection: folded spans replaced by their summaries."""
        if not self.entries:
            return messages
        return self.project_with_fingerprints(messages, fingerprints)[0]

    def project_with_fingerprints(self, messages: list[Message],
                                  fingerprints: list[str] | None = None) -> tuple[list[Message], list[str]]:
        """project(), with the fingerprints of what it returns."""
        fps = fingerprints or [message_fingerprint(m) for m in messages]
        if not self.entries:
            return messages, fps
        out: list[Message] = []
        out_fps: list[str] = []
        i = 0
        while i < len(messages):
            entry = self.entries.get(fps[i])
            if entry is not None and span_hash(fps[i:i + entry.length]) == entry.span_hash:
                note = collapse_note(entry)
                out.append(note)
                out_fps.append(message_fingerprint(note))
                i += entry.length
                continue
            out.append(messages[i])
            out_fps.append(fps[i])
            i += 1
        return out, out_fps


def context_keys(fingerprints: list[str]) -> list[str]:
    """What the bloom filter remembers of each folded message: its fingerprint with its
    predecessor's. A message folded before is recognised where it was; the same text
    repeated elsewhere (an agent's stock "Please continue" nudge) is not, so it does not
    keep a new run from being folded."""
    return [span_hash((fingerprints[i - 1] if i else "", fp)) for i, fp in enumerate(fingerprints)]


def note_text(entry: CollapseEntry) -> str:
    kept = f", the originals: ref {entry.ref}" if entry.ref else ""
    return f"{COLLAPSE_MARKER} ({entry.length} messages{kept})\n{entry.summary}"


def collapse_note(entry: CollapseEntry) -> Message:
    """The fold's note: its template lines quote the folded messages, so it is quoted data."""
    return context_note(COLLAPSE, "compaction: collapse", note_text(entry))


CRITICAL_KINDS = frozenset({Kind.ACTION, Kind.PLAN, Kind.NOTE})


def is_decision_critical(conversation: Conversation, index: int) -> bool:
    """Tool calls, plan changes and task status changes are decision-critical. In
    any dialect that is every action (a tool call, or a command in a text protocol), every
    plan or todo update, a failed observation, and ctxgate's own notes. An observation that
    succeeded goes with its action: they are one unit, kept or folded together."""
    info = conversation.infos[index]
    return info.kind in CRITICAL_KINDS or any(o.failed for o in info.observations)


def collapse_summary(messages: list[Message], counter: TokenCounter, user_chars: int) -> str:
    """The fold's summary: a template, one line per message."""
    lines: list[str] = []
    for m in messages:
        content = m.get("content")
        text = content if isinstance(content, str) else ""
        role = m.get("role")
        if role == "user":
            lines.append("User: " + " ".join(text.split())[:user_chars])
        elif role == "assistant" and m.get("tool_calls"):
            lines.append("Called tools: " + " ".join((tc.get("function") or {}).get("name", "?")
                                                     for tc in m["tool_calls"]))
        elif role == "tool":
            lines.append(f"Tool result ({counter.count_cached(text)} tokens)")
        else:
            lines.append(f"Message from {role} ({counter.count_cached(text)} tokens)")
    return "\n".join(lines)


class CollapseStrategy:
    level = Level.COLLAPSE

    def __init__(self, config: CollapseConfig, store: CollapseStore, pin_first_user: bool = True) -> None:
        self.config = config
        self.store = store
        self.pin_first_user = pin_first_user

    def _runs(self, request: CompressionRequest, conversation: Conversation) -> list[tuple[int, int]]:
        """Runs of at least `window` consecutive non-critical messages inside the workable range
        (kept with the reading: they depend on its content alone)."""
        memo = conversation.memo(("collapse-runs", self.pin_first_user, request.window, request.anchored))
        found = memo.get(self.config.window)
        if found is None:
            found = memo[self.config.window] = self._find_runs(request, conversation)
        return list(found)

    def _find_runs(self, request: CompressionRequest, conversation: Conversation) -> list[tuple[int, int]]:
        shape = conversation.shape(self.pin_first_user, request.window, request.anchored)
        runs: list[tuple[int, int]] = []
        start: int | None = None
        for unit in conversation.units:
            ok = (shape.head <= unit.start and unit.end <= shape.tail
                  and not any(i in shape.pinned for i in range(unit.start, unit.end))
                  and not any(is_decision_critical(conversation, i) for i in range(unit.start, unit.end)))
            if ok and start is None:
                start = unit.start
            elif not ok and start is not None:
                runs.append((start, unit.start))
                start = None
        if start is not None:
            runs.append((start, shape.tail))
        return [(a, b) for a, b in runs if b - a >= self.config.window]

    async def compress(self, request: CompressionRequest) -> CompressionResult | None:
        watch = Stopwatch()
        counter = request.counter
        conversation = request.conversation
        original = conversation.fingerprints
        messages, fps = self.store.project_with_fingerprints(request.messages, original)
        projected = (conversation if messages is request.messages
                     else read_conversation(messages, request.dialect, fingerprints=fps))
        memo = projected.memo("collapse-keys")
        keys = memo.get("keys")
        if keys is None:
            keys = memo["keys"] = context_keys(fps)
        for a, b in self._runs(request, projected):
            span = fps[a:b]
            if self.store.already_folded(span_hash(span)) or any(self.store.already_folded(k) for k in keys[a:b]):
                continue  # folded before: project() below shows it folded, never folds it again
            folded = messages[a:b]
            summary = collapse_summary(folded, counter, self.config.user_chars)
            entry = CollapseEntry(original_span=(a, b), first_fingerprint=span[0], span_hash=span_hash(span),
                                  length=b - a, collapsed_tokens=0, summary=summary, collapsed_at=time.time(),
                                  original_total_tokens=sum(counter.count_structured(m, fp)
                                                            for m, fp in zip(folded, span)),
                                  ref=request.cuts.keep(render_span(folded)) if request.cuts is not None else "")
            entry.collapsed_tokens = counter.count_structured(collapse_note(entry))
            self.store.add(entry, keys[a:b])
        out, out_fps = self.store.project_with_fingerprints(messages, fps)
        if len(out) == len(request.messages):
            return None
        changed = [i for i, fp in enumerate(original) if fp in self.store.entries]
        changed_span = (changed[0], changed[-1] + 1) if changed else (0, 0)
        return counted_result(self.level, request, conversation, out, out_fps, changed_span, watch,
                              len(request.messages) - len(out),
                              [f"collapse: folded {len(request.messages) - len(out)} messages"])
