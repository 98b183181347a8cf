"""Level 1, Snip: drop the oldest contiguous block of history and say so.

Take the oldest N messages whose tokens cover what must be freed, and
put a note in their place with an 80-character preview of each, so the model
knows the context was cut (quoted data: the previews are of tool output and other turns).
No Snip when N < 5 or the conversation has fewer than 10
messages. A proxy adds: cuts fall on unit boundaries (a tool call and its results go
together; in a text protocol, an action and the user turn that answers it), the leading
instructions, the pinned task statement and the recent window stay, and the newest
`keep_recent` messages are never cut.
"""
from __future__ import annotations

from .config import SnipConfig
from .conversation import Kind, counted_result
from .fingerprint import message_fingerprint
from .notes import SNIP, SNIP_MARKER, context_note, plain_note
from .refs import SIZING_REF, clip, content_ref, render_span
from .strategy import Stopwatch
from .tokens import REPLY_PRIMING, TokenCounter
from .request import CompressionRequest
from .types import CompressionResult, Level, Message

NOTE_SHARE = 0.05
"""The note's previews take at most this share of the budget; the rest are counted."""
SOURCE = "compaction: snip previews"


def preview(message: Message, chars: int) -> str:
    content = message.get("content")
    if isinstance(content, list):
        content = " ".join(p.get("text", "") for p in content if isinstance(p, dict))
    content = content or ""
    # Only the start is shown: whitespace-normalising a prefix gives a prefix of the whole
    # text normalised, so a long output is not split in full for its first `chars` characters.
    text = " ".join(content[:4 * chars + 64].split())
    if len(text) < chars + 1 and len(content) > 4 * chars + 64:
        text = " ".join(content.split())
    if not text and message.get("tool_calls"):
        text = "called " + ", ".join((tc.get("function") or {}).get("name", "?") for tc in message["tool_calls"])
    return clip(text, chars)


class SnipNote:
    """The note that takes the cut messages' place, built one dropped message at a time so
    Snip can count what the note costs while it decides how much to cut."""

    def __init__(self, counter: TokenCounter, budget: int, preview_chars: int, with_ref: bool = False) -> None:
        self.counter = counter
        self.preview_chars = preview_chars
        self.allowance = max(40, int(budget * NOTE_SHARE))
        self.lines: list[str] = []
        self.dropped = 0
        self.shown = 0
        self.ref: str | None = None
        """The dropped messages' reference, set once they are all known."""
        self.used = counter.count(self._header(0, SIZING_REF if with_ref else None, preview_chars > 0))
        self.used += 4 if with_ref else 0  # a hash's digits may split into more tokens than zeros do
        if preview_chars > 0:  # the previews are quoted: the quote's delimiters
            self.used += counter.count(str(context_note(SNIP, SOURCE, "")["content"]))

    @staticmethod
    def _header(n: int, ref: str | None, previews: bool = True) -> str:
        kept = f" (the originals: ref {ref})" if ref else ""
        return (f"{SNIP_MARKER} {n} earlier messages were removed to fit the context budget{kept}."
                + (" A short preview of each:" if previews else ""))

    def add(self, message: Message) -> None:
        self.dropped += 1
        if self.preview_chars <= 0 or self.shown < self.dropped - 1:
            return  # the previews already filled their allowance: the rest are counted
        line = f"- {message.get('role')}: {preview(message, self.preview_chars)}"
        cost = self.counter.count(line) + 1
        if self.used + cost <= self.allowance:
            self.lines.append(line)
            self.used += cost
            self.shown += 1

    @property
    def tokens(self) -> int:
        """What the note will count as a message: a little over, never under (line joins
        can only merge tokens), plus the "... and N more" line and the header's number."""
        return self.used + (8 if self.preview_chars > 0 and self.shown < self.dropped else 0) + 8

    def message(self) -> Message:
        lines = [self._header(self.dropped, self.ref, self.preview_chars > 0)] + self.lines
        if self.preview_chars > 0 and self.shown < self.dropped:
            lines.append(f"- ... and {self.dropped - self.shown} more")
        if self.preview_chars <= 0:
            return plain_note(SNIP, lines[0])  # a count and a reference: ctxgate's own wording only
        return context_note(SNIP, SOURCE, "\n".join(lines))


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
        conversation = request.conversation
        # What Snip cuts depends on the messages' content, the budget, the counter and the
        # settings alone: decided once per content, and re-applied when the history comes again.
        plans = conversation.memo(("snip", counter, request.token_budget, self.pin_first_user, request.window,
                                   request.anchored, cfg.keep_recent, cfg.min_block, cfg.preview_chars,
                                   request.cuts is not None))
        if "plan" not in plans:
            plans["plan"] = self._plan(request)
        plan = plans["plan"]
        if plan is None:
            return None
        head, cut, dropped, kept_inside, made, made_fp, made_count, original = plan
        if request.cuts is not None and original is not None:
            request.cuts.keep(original)
        fps, counts = conversation.fingerprints, conversation.counts(counter)
        out = messages[:head] + [dict(made)] + [messages[i] for i in kept_inside] + messages[cut:]
        out_fps = fps[:head] + [made_fp] + [fps[i] for i in kept_inside] + fps[cut:]
        after = (REPLY_PRIMING + sum(counts[:head]) + made_count + sum(counts[i] for i in kept_inside)
                 + sum(counts[cut:]))
        return counted_result(self.level, request, conversation, out, out_fps, (head, cut), watch,
                              dropped, [f"snip: cut {dropped} messages"], after=after)

    def _plan(self, request: CompressionRequest) -> tuple[int, int, int, list[int], Message, str, int,
                                                         str | None] | None:
        """(head, cut, how many dropped, indices kept inside [head, cut), the note, its fingerprint,
        its count, the dropped messages' original when the request keeps cuts), or None when
        Snip has nothing to do."""
        messages, counter, cfg = request.messages, request.counter, self.config
        conversation = request.conversation
        need = conversation.total(counter) - request.token_budget
        if need <= 0:
            return None
        counts = conversation.counts(counter)
        shape = request.shape(self.pin_first_user)
        limit = min(shape.tail, max(shape.head, len(messages) - cfg.keep_recent))
        note = SnipNote(counter, request.token_budget, cfg.preview_chars, with_ref=request.cuts is not None)
        dropped: list[int] = []
        kept_inside: list[int] = []
        freed, cut = 0, shape.head
        for unit in shape.units:
            if unit.start < shape.head:
                continue
            if unit.end > limit:
                break
            members = range(unit.start, unit.end)
            if any(i in shape.pinned or conversation.kind(i) is Kind.NOTE for i in members):
                # Pinned messages stay, and so do earlier compactions' notes: a summary is what
                # remains of the oldest history, and Snip cuts what came after it, no LLM call.
                kept_inside.extend(members)
            else:
                dropped.extend(members)
                for i in members:
                    freed += counts[i]
                    note.add(messages[i])
            cut = unit.end
            if freed >= need and len(dropped) < cfg.min_block:
                return None  # no Snip when fewer than N=5 messages would cover it
            if freed >= need + note.tokens:  # the note takes room too
                break
        if len(dropped) < cfg.min_block:
            return None
        original = render_span([messages[i] for i in dropped]) if request.cuts is not None else None
        if original is not None:
            note.ref = content_ref(original)
        made = note.message()
        made_fp = message_fingerprint(made)
        return (shape.head, cut, len(dropped), kept_inside, made, made_fp, counter.count_structured(made, made_fp),
                original)
