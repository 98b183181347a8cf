"""Level 1, Snip: drop the oldest contiguous block of history and say so.

Take the oldest N messages whose tokens cover what must be freed, and
put a note in their place: a ledger line for each step it removed (`pipeline/ledger.py`) and
an 80-character preview of each other message, so the model knows the context was cut and
which steps ran (quoted data: the lines quote tool calls, tool output and other turns).
No Snip when N < 5 or the conversation has fewer than 10
messages. A proxy adds: cuts fall on unit boundaries (a tool call and its results go
together; in a text protocol, an action and the user turn that answers it), the leading
instructions, the pinned task statement and the recent window stay, and the newest
`keep_recent` messages are never cut.
"""
from __future__ import annotations

from .config import SnipConfig
from .conversation import Conversation, Kind, counted_result
from .fingerprint import message_fingerprint
from .ledger import Entry, Keep, fit, folded_runs, heading_tokens, render, runs, size, span_entries
from .notes import SNIP, SNIP_MARKER, context_note, plain_note
from .previews import preview
from .refs import SIZING_REF, content_ref, render_span
from .strategy import Stopwatch
from .tokens import REPLY_PRIMING, TokenCounter
from .request import CompressionRequest
from .types import CompressionResult, Level, Message

__all__ = ["SnipNote", "SnipStrategy", "preview"]

NOTE_SHARE = 0.05
"""The note's header and previews take at most this share of the budget; the previews beyond
it are counted."""
LEDGER_SHARE = 0.05
"""The note's step ledger takes at most this share of the budget besides: it folds its oldest
lines into ranges to fit. Its own share, since each of its lines names a command the agent
ran, and the previews are what gives way (a shared allowance folded a four-step ledger at a
4,000-token budget into "steps 7–8: bash ×2", naming neither command)."""
SOURCE = "compaction: snip previews"


class SnipNote:
    """The note that takes the cut messages' place, built one dropped unit at a time so Snip
    can count what the note costs while it decides how much to cut: the step ledger of what
    it removed (`pipeline/ledger.py`) within its own allowance (it folds its oldest lines into
    ranges to fit), then a preview of each other message while they fit the note's."""

    def __init__(self, counter: TokenCounter, budget: int, preview_chars: int, with_ref: bool = False) -> None:
        self.counter = counter
        self.preview_chars = preview_chars
        self.allowance = max(40, int(budget * NOTE_SHARE))
        self.ledger_allowance = max(40, int(budget * LEDGER_SHARE))
        self.entries: list[Entry] = []
        self.ledger_used = 0
        self.lines: list[tuple[str, int]] = []
        """Previews of the dropped messages that are no step, with their cost."""
        self.previewed = 0
        """Dropped messages that are no step (each has a preview, or is counted)."""
        self.dropped = 0
        self.ref: str | None = None
        """The dropped messages' reference, set once they are all known."""
        self.originals: dict[str, str] = {}
        """What each step's reference names (kept only when the note has references)."""
        self.keep: Keep | None = self._keep if with_ref else None
        self.used = counter.count(self._header(0, SIZING_REF if with_ref else None, preview_chars > 0))
        self.used += 4 if with_ref else 0  # a hash's digits may split into more tokens than zeros do
        self.used += counter.count(str(context_note(SNIP, SOURCE, "")["content"]))  # the quote's delimiters

    def _keep(self, text: str) -> str:
        ref = content_ref(text)
        self.originals.setdefault(ref, text)
        return ref

    @staticmethod
    def _header(n: int, ref: str | None, previews: bool = True) -> str:
        kept = f" (the originals: ref {ref})" if ref else ""
        return (f"{SNIP_MARKER} {n} earlier messages were removed to fit the context budget{kept}."
                + (" A short preview of each:" if previews else ""))

    def add(self, conversation: Conversation, members: range) -> None:
        """The messages of one dropped unit."""
        self.dropped += len(members)
        entries = span_entries(conversation, members, self.keep)
        if entries:
            self.entries += entries
            self.ledger_used += size(entries, self.counter)
            return
        for i in members:
            self.previewed += 1
            if self.preview_chars <= 0 or len(self.lines) < self.previewed - 1:
                continue  # the previews already filled their allowance: the rest are counted
            message = conversation.messages[i]
            line = f"- {message.get('role')}: {preview(message, self.preview_chars)}"
            cost = self.counter.count(line) + 1
            if self.used + sum(c for _, c in self.lines) + cost <= self.allowance:
                self.lines.append((line, cost))

    @property
    def tokens(self) -> int:
        """What the note will count as a message: a little over, never under (line joins
        can only merge tokens), plus the "... and N more" line, the ledger's heading and
        folded range (the ledger within its allowance, or its one range) and the header's number."""
        ledger = 0
        if self.entries:  # within its allowance, or folded to it (one range may overrun it)
            room = self.ledger_allowance
            # One range per run of consecutive numbers (a step kept in place splits them).
            folded = max(room, 48) + 8 + 32 * (len(runs(self.entries)) - 1)
            ledger = heading_tokens(self.counter) + (self.ledger_used if self.ledger_used <= room else folded)
        more = 8 if len(self.lines) < self.previewed else 0
        return self.used + ledger + sum(c for _, c in self.lines) + more + 8

    def message(self) -> Message:
        header = self._header(self.dropped, self.ref, bool(self.previewed) and self.preview_chars > 0)
        if self.preview_chars <= 0:
            # A count, a reference and the steps' numbers and tool names: ctxgate's own wording
            # only, so no quote (nor the notice a quote brings) at a point with no room.
            if self.entries:
                lines = "\n".join(e.text for e in self.entries)
                ref = self.keep(lines) if self.keep else None
                header += "\n" + "\n".join(e.text for e in folded_runs(self.entries, ref, failures=False))
            return plain_note(SNIP, header)
        entries = fit(self.entries, self.ledger_allowance, self.counter, self.keep)
        room = self.allowance - self.used
        shown: list[str] = []
        for line, cost in self.lines:
            if cost > room:
                break
            shown.append(line)
            room -= cost
        body = [header, render(entries), *shown]
        if len(shown) < self.previewed:
            body.append(f"- ... and {self.previewed - len(shown)} more")
        return context_note(SNIP, SOURCE, "\n".join(b for b in body if b))


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
        # What Snip cuts depends on the messages' content, the budget, the counter, the settings
        # and the step number its ledger goes on from alone: decided once per content, and
        # re-applied when the history comes again.
        plans = conversation.memo(("snip", counter, request.token_budget, self.pin_first_user, request.window,
                                   request.anchored, cfg.keep_recent, cfg.min_block, cfg.preview_chars,
                                   request.cuts is not None, request.steps_before, request.steps_named))
        if "plan" not in plans:
            plans["plan"] = self._plan(request)
        plan = plans["plan"]
        if plan is None:
            return None
        head, cut, dropped, kept_inside, made, made_fp, made_count, originals = plan
        if request.cuts is not None:
            for original in originals:
                request.cuts.keep(original)
        fps, counts = conversation.fingerprints, conversation.counts(counter)
        # Earlier notes kept inside stay before the note (they name earlier steps, and keep their
        # place in the prefix); pinned steps come after it, where the numbers it skips are theirs.
        notes = [i for i in kept_inside if conversation.kind(i) is Kind.NOTE]
        order = notes + [i for i in kept_inside if i not in notes]
        at = head + len(notes)
        out = messages[:head] + [messages[i] for i in order] + messages[cut:]
        out_fps = fps[:head] + [fps[i] for i in order] + fps[cut:]
        out.insert(at, dict(made))
        out_fps.insert(at, made_fp)
        after = (REPLY_PRIMING + sum(counts[:head]) + made_count + sum(counts[i] for i in kept_inside)
                 + sum(counts[cut:]))
        return counted_result(self.level, request, conversation, out, out_fps, (head, cut), watch,
                              dropped, [f"snip: cut {dropped} messages"], after=after)

    def _plan(self, request: CompressionRequest) -> tuple[int, int, int, list[int], Message, str, int,
                                                         list[str]] | None:
        """(head, cut, how many dropped, indices kept inside [head, cut), the note, its fingerprint,
        its count, the originals its references name when the request keeps cuts), or None when
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
                freed += sum(counts[i] for i in members)
                note.add(conversation, members)
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
        originals = ([original] if original is not None else []) + list(note.originals.values())
        return (shape.head, cut, len(dropped), kept_inside, made, made_fp, counter.count_structured(made, made_fp),
                originals)
