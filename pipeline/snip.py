"""Level 1, Snip: drop the oldest contiguous block of history and say so.

As the spec says: take the oldest N messages whose tokens cover what must be freed, and
put a system note in their place with an 80-character preview of each, so the model
knows the context was cut. No Snip when N < 5 or the conversation has fewer than 10
messages. A proxy adds: cuts fall on unit boundaries (a tool call and its results go
together), the leading instructions and the pinned task statement stay, and the newest
`keep_recent` messages are never cut.
"""
from __future__ import annotations

from .config import SnipConfig
from .notes import SNIP_MARKER, system_note
from .strategy import Stopwatch, level_result
from .turns import shape_of
from .types import CompressionRequest, CompressionResult, Level, Message

NOTE_SHARE = 0.05
"""The note's previews take at most this share of the budget; the rest are counted."""


def preview(message: Message, chars: int) -> str:
    content = message.get("content")
    if isinstance(content, list):
        content = " ".join(p.get("text", "") for p in content if isinstance(p, dict))
    text = " ".join((content or "").split())
    if not text and message.get("tool_calls"):
        text = "called " + ", ".join((tc.get("function") or {}).get("name", "?") for tc in message["tool_calls"])
    return text[:chars]


class SnipStrategy:
    level = Level.SNIP

    def __init__(self, config: SnipConfig, pin_first_user: bool = True) -> None:
        self.config = config
        self.pin_first_user = pin_first_user

    async def compress(self, request: CompressionRequest) -> CompressionResult | None:
        watch = Stopwatch()
        messages, counter, cfg = request.messages, request.counter, self.config
        if len(messages) < cfg.min_messages:
            return None
        need = counter.count_messages(messages) - request.token_budget
        if need <= 0:
            return None
        shape = shape_of(messages, self.pin_first_user)
        limit = min(shape.tail, max(shape.head, len(messages) - cfg.keep_recent))
        dropped: list[int] = []
        kept_inside: list[int] = []
        freed, cut = 0, shape.head
        for unit in shape.units:
            if unit.start < shape.head:
                continue
            if unit.end > limit or freed >= need:
                break
            members = range(unit.start, unit.end)
            if any(i in shape.pinned for i in members):
                kept_inside.extend(members)
            else:
                dropped.extend(members)
                freed += sum(counter.count_structured(messages[i]) for i in members)
            cut = unit.end
        if len(dropped) < cfg.min_block:
            return None
        note = system_note(self._note_text([messages[i] for i in dropped], request.token_budget, counter))
        out = messages[:shape.head] + [note] + [messages[i] for i in kept_inside] + messages[cut:]
        return level_result(self.level, request, out, (shape.head, cut), watch, len(dropped),
                            [f"snip: cut {len(dropped)} messages"])

    def _note_text(self, dropped: list[Message], budget: int, counter) -> str:
        lines = [f"{SNIP_MARKER} {len(dropped)} earlier messages were removed to fit the context budget. "
                 "A short preview of each:"]
        allowance = max(40, int(budget * NOTE_SHARE))
        used = counter.count(lines[0])
        for i, m in enumerate(dropped):
            line = f"- {m.get('role')}: {preview(m, self.config.preview_chars)}"
            cost = counter.count(line) + 1
            if used + cost > allowance:
                lines.append(f"- ... and {len(dropped) - i} more")
                break
            lines.append(line)
            used += cost
        return "\n".join(lines)
