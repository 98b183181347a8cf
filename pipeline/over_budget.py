"""What a compaction point gives up when the chain's result is still over the budget
(docs/compaction.md, the recent window): each step runs only while the request is over, and
each keeps more of what the agent needs than the next one would."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from .chain import CompressionPipeline, restore_position
from .config import PipelineConfig
from .microcompact import LastObservationCut, MicrocompactStrategy, RecentWindowCut
from .protocols.base import readable_text
from .notes import (RESTORE, SNIP, SNIP_MARKER, is_compaction_note, is_ctxgate_message, is_quoted, is_summary_note,
                    kind_of, notice_message, notice_tokens, plain_note)
from .refs import SIZING_REF, render_span
from .restore import ActiveRestore, error_section, names_section, shed_own_messages, state_block
from .snip import SnipStrategy
from .conversation import client_task_index, read_conversation
from .covers import cover_of, named_once, with_cover, without_own_messages
from .ledger import covering_note, folded_runs, merged, named_steps, span_entries
from .tail import PROTECTED_TAIL
from .tokens import TokenCounter
from .turns import is_valid_sequence, leading_instructions
from .request import CompressionRequest
from .types import CompressionResult, Message, RecentWindow
from .depth import chain_config, with_window


@dataclass
class OverBudget:
    """The fallbacks of one compaction point, with what it runs them with."""
    config: PipelineConfig
    counter: TokenCounter
    pipeline_of: Callable[[PipelineConfig], CompressionPipeline]
    """The chain with this point's stores and its one summary call."""
    summaries: Callable[[], int]
    """Summary calls made so far at this point."""
    hard: int
    """The effective budget left for the messages."""
    limit: int
    """The context limit itself left for the messages (no safety margin)."""
    restore: ActiveRestore | None = None
    """What the point restores: its state's lines come back in the room the fallbacks leave."""

    async def fit(self, request: CompressionRequest, result: CompressionResult
                  ) -> tuple[CompressionRequest, CompressionResult]:
        """`result` brought within the budget as far as the fallbacks go, and the request it
        was last compacted with."""
        cfg, hard = self.config, self.hard
        # What goes before the recent window does: the restored files first, then (when no
        # summary was asked for yet) the earlier notes, merged by this point's one summary.
        result = self._keeping_names(request, result, lambda r: shed(r, self.counter, hard))
        if (result.tokens_after > hard and request.anchored and not self.summaries()
                and "autocompact" in cfg.levels):
            merging = replace(request, anchored=False)
            merged = shed(await self.pipeline_of(chain_config(cfg, request.window, True)).compact(merging),
                          self.counter, hard)
            if merged.tokens_after < result.tokens_after:
                request, result = merging, merged
        if result.tokens_after <= hard:
            return request, result
        # Still over: what the protected tail gives room with, before any of it is touched
        # (`tail.py`): everything older, as deep as the levels go; then the rest of the restored
        # state and the notes; then the oldest turns, whole, under a note that counts them.
        result = await self._turn_in_progress(request, result)
        # The notes may go from here on: a note made after them numbers its steps on from theirs,
        # and a step kept in place between theirs keeps its number.
        request = replace(request, steps_named=request.steps_named | named_steps(result.compressed_messages))
        notes = [m for m in result.compressed_messages if is_compaction_note(m)]
        result = shed(result, self.counter, hard, everything=True)
        if result.tokens_after > hard:  # not enough alone: they go all the same, before the tail gives any room
            result = without_own_messages(result, self.counter, hard, cfg.pin_first_user, request.task)[0]
        result = await self._oldest_turns(request, result, PROTECTED_TAIL)
        # Notes shed with the line naming their steps: it comes back in the room the oldest turns
        # left, naming those still not there (a note their cut kept again is not named twice).
        result = with_cover(result, cover_of(notes, result), self.counter, hard, cfg.pin_first_user, request.task)
        # The tail alone is over: its observations are cut oldest first, the newest last, and
        # then older turns of it go, down to the last message; then what ctxgate added (below).
        # Forwarding what the provider refuses would cost the turn.
        # Both leave room for the restored state's block (`_error_room`: the failure's line and the
        # names of the files out of view), and for the line naming the steps (`_cover_room`).
        cover = cover_of(notes, result)
        result = await self._tail(request, result, cover)
        result = await self._last_observation(request, result, cover)
        # The text an edit must match, kept so far (`tail.kept_for_edits`), goes with them.
        last, unkept = RecentWindow(messages=1, steps=0), replace(request, keep=frozenset())
        result = await self._oldest_turns(unkept, result, last)
        # Or in the room the cuts of the tail left (measured on Codex: 2K of 19K).
        result = with_cover(result, cover_of(notes, result), self.counter, hard, cfg.pin_first_user, request.task)
        # What ctxgate added goes next, to fit the budget (the engine refuses a plan over it:
        # `Compactor.fitted`), else the context limit itself, the line where what no level
        # removes is over the budget already.
        cuts = request.cuts.originals if request.cuts is not None else None
        fitted = shed(result, self.counter, hard, everything=True)
        if fitted.tokens_after > hard:
            fitted = shed(result, self.counter, self.limit, everything=True)
        restored = self._restored(fitted, cuts)
        error = self.restore.state.last_error if self.restore is not None else ""
        shown = "\n".join(map(readable_text, restored.compressed_messages))
        if error and error not in shown and restored.tokens_after <= hard:
            # The last failure's line out of view and no room for it: worth more than the
            # oldest turn of the tail (a step the agent took before it failed).
            aim = hard - self._error_room(restored.compressed_messages, names=False)
            trimmed = await self._oldest_turns(unkept, restored, last, aim)
            restored = self._restored(trimmed, cuts) if trimmed is not restored else restored
            shown = "\n".join(map(readable_text, restored.compressed_messages))
            if error not in shown:
                # Still no room: the notes become the one line naming their steps, and the
                # failure line takes the room they leave (each keeps what the agent needs most).
                restored = self._restored(self._notes_as_one_line(restored), cuts)
        restored = self._keeping_names(request, restored, lambda r: self._restored(r, cuts))
        return request, self._newest_only(request, restored)

    def _keeping_names(self, request: CompressionRequest, result: CompressionResult,
                       fitted: Callable[[CompressionResult], CompressionResult]) -> CompressionResult:
        """`fitted(result)`, unless it leaves out file names of the restored state that `fitted`
        of `result` with its compaction notes merged into one keeps (their text one reference
        away, every step still named: `ledger.merged`): a list of the files the agent works on
        is worth more than a note per earlier point."""
        out = fitted(result)
        lost = self._names_lost(out)
        if not lost:
            return out
        messages = result.compressed_messages
        notes = [i for i, m in enumerate(messages) if is_compaction_note(m)]
        if not notes or request.cuts is None or any(is_summary_note(messages[i]) for i in notes):
            return out
        one = merged([messages[i] for i in notes], self.counter, request.cuts.keep)
        folded = messages[:notes[0]] + [one] + [m for i, m in enumerate(messages) if i > notes[0] and i not in notes]
        tokens = self.counter.count_messages(folded) + notice_tokens(self.counter, folded)
        again = fitted(replace(result, compressed_messages=folded, tokens_after=tokens))
        return again if self._names_lost(again) < lost and again.tokens_after <= max(out.tokens_after, self.hard) \
            else out

    def _names_lost(self, result: CompressionResult) -> int:
        """The restored state's file names that nothing in `result` names."""
        if self.restore is None or not self.restore.state.current_files:
            return 0
        shown = "\n".join(map(readable_text, result.compressed_messages))
        return sum(f.path not in shown for f in self.restore.state.current_files)

    def _notes_as_one_line(self, result: CompressionResult) -> CompressionResult:
        """`result` with its compaction notes replaced by the one line naming their steps
        (`ledger.covering_note`), when that is shorter."""
        messages = result.compressed_messages
        notes = [i for i, m in enumerate(messages) if is_compaction_note(m)]
        cover = covering_note([messages[i] for i in notes])
        if not notes or cover is None:
            return result
        out = messages[:notes[0]] + [cover] + [m for i, m in enumerate(messages) if i > notes[0] and i not in notes]
        tokens = self.counter.count_messages(out) + notice_tokens(self.counter, out)
        return replace(result, compressed_messages=out, tokens_after=tokens) if tokens < result.tokens_after else result

    def _newest_only(self, request: CompressionRequest, result: CompressionResult) -> CompressionResult:
        """Still over the line the engine forwards under (the budget, or the context limit where
        the instructions and the task alone are over the budget): the instructions, the task and
        the newest units that fit, with one line counting what went before them (its reference
        gives it back) if that fits too, else none. What every fallback keeps, its notes
        included, is then more than the provider takes, and a request the engine must refuse
        costs the agent its turn: a request that drops the oldest turns and says less about them
        is one it can still work from (drop-oldest, with no note at all, served these turns)."""
        messages = result.compressed_messages
        head = leading_instructions(messages)
        task = client_task_index(messages, request.task) if self.config.pin_first_user else None
        pinned = list(range(head)) + ([task] if task is not None and task >= head else [])
        counter = self.counter
        line = self.hard if counter.count_messages([messages[i] for i in pinned]) <= self.hard else self.limit
        if result.tokens_after <= line:
            return result
        after = pinned[-1] + 1 if pinned else 0
        newest = [i for i in range(after, len(messages)) if not is_ctxgate_message(messages[i])]
        kept: list[int] = []
        for k in range(len(newest) - 1, -1, -1):  # the newest messages, as many as fit, whole and paired
            trial = [messages[i] for i in pinned + newest[k:]]
            if counter.count_messages(trial) > line:
                break
            if is_valid_sequence(trial) and not _answers_a_call(messages[newest[k]]):
                kept = newest[k:]
        if not kept:
            return result
        out = [messages[i] for i in pinned + kept]
        gone = [m for i, m in enumerate(messages) if i not in pinned and i not in kept and not is_ctxgate_message(m)]
        tokens = counter.count_messages(out) + notice_tokens(counter, out)
        if tokens > line or tokens >= result.tokens_after:
            return result
        if gone:
            ref = request.cuts.keep(render_span(gone)) if request.cuts is not None else None
            count = f"{SNIP_MARKER} {len(gone)} earlier messages were removed" + (f" (ref {ref})." if ref else ".")
            # The steps they and the notes among them named, as one range of tool names (every step
            # number stays covered), when that fits too; else the count alone.
            dropped = [i for i in range(len(messages)) if i not in pinned and i not in kept]
            entries = span_entries(read_conversation(messages, request.dialect, steps_before=request.steps_before,
                                                     steps_named=request.steps_named, task=request.task), dropped, None)
            ranges = "\n".join(e.text for e in folded_runs(entries, None, failures=False))
            forms = ([count + "\n" + ranges] if entries else []) + [count]
            at = len(pinned)
            for text in forms:
                noted = out[:at] + [plain_note(SNIP, text)] + out[at:]
                if counter.count_messages(noted) + notice_tokens(counter, noted) <= line:
                    out = noted
                    break
        tokens = counter.count_messages(out) + notice_tokens(counter, out)
        return replace(result, compressed_messages=out, tokens_after=tokens,
                       recovery_hints=[*result.recovery_hints, "over the budget with every fallback: the newest "
                                                               "turns alone kept"])

    def _error_room(self, messages: list[Message], names: bool = True) -> int:
        """What the restored state's block takes with the last error's line and, with `names`, the
        names of the files nothing but ctxgate's notes in `messages` names (and the notice its quote
        brings, when none is there yet): left free by the cuts of the newest outputs, which may take
        that line out of view (`_restored` puts it back). The middle of an output, kept by
        reference, is worth less than the names of the files the agent works on, which were shed
        for it (replayed on the bench's runs: files in view below the code before quoting)."""
        if self.restore is None:
            return 0
        state = self.restore.state
        sections = [error_section(state.last_error, SIZING_REF)] if state.last_error else []
        unnamed = self._unnamed(messages) if names else []
        sections += [names_section(unnamed)] if unnamed else []
        if not sections:
            return 0
        notice = 0 if any(is_quoted(m) for m in messages) else self.counter.count_structured(notice_message())
        return self.counter.count_structured(state_block(sections)) + notice

    def _cover_room(self, messages: list[Message], cover: Message | None) -> int:
        """Room for `cover`, the line naming the steps of the notes shed, with the failure's line or
        a file name out of view: it comes back after the cuts, and would take the state's room."""
        error = self.restore.state.last_error if self.restore is not None else ""
        out = (error and error not in "\n".join(map(readable_text, messages))) or self._unnamed(messages)
        return self.counter.count_structured(cover) if cover is not None and out else 0

    def _unnamed(self, messages: list[Message]) -> list[str]:
        """The restored state's file names that nothing but ctxgate's own messages names."""
        if self.restore is None or not self.restore.state.current_files:
            return []
        shown = "\n".join(readable_text(m) for m in messages if not is_ctxgate_message(m))
        return [f.path for f in self.restore.state.current_files if f.path not in shown]

    def _restored(self, result: CompressionResult, cuts: dict[str, str] | None) -> CompressionResult:
        """The restored state's block made again for what the fallbacks left, in the room they
        left under the budget: a cut after the chain may have taken out of view what the block
        did not repeat (the failure line in the middle of an output), and what was shed may fit
        again. The blocks of files' contents stay as they are. With expansion on (`cuts`: what
        the point kept by reference), the failure line names the output it is from by its
        reference, as the chain's block does."""
        if self.restore is None or result.tokens_after > self.hard:
            return result
        messages = [m for m in result.compressed_messages if kind_of(m) != RESTORE]
        before = self.counter.count_messages(messages) + notice_tokens(self.counter, messages)
        room = self.hard - before - (0 if any(is_quoted(m) for m in messages)
                                     else self.counter.count_structured(notice_message()))
        visible = [m for m in messages if not is_compaction_note(m)]
        state = [b for b in self.restore.blocks(self.counter, room, visible, room=0, cuts=cuts)
                 if kind_of(b) == RESTORE]
        at = restore_position(messages, self.config.pin_first_user)
        out = messages[:at] + state + messages[at:]
        tokens = self.counter.count_messages(out) + notice_tokens(self.counter, out)
        return result if tokens > self.hard else replace(result, compressed_messages=out, tokens_after=tokens)

    async def _turn_in_progress(self, request: CompressionRequest, result: CompressionResult) -> CompressionResult:
        """The recent window, with its older observations cut as far as Microcompact goes, is
        over the budget: keeping it verbatim would only forward a request the provider refuses.
        Only the protected tail is kept whole then. A summary asked for already is not asked for
        again over a wider span: the cheap levels go on from what it left, with its note kept."""
        cfg = self.config
        narrow = PROTECTED_TAIL
        again = replace(request, window=narrow)
        config = with_window(cfg, narrow)  # Snip keeps no more than the window either
        if not self.summaries():
            return await self.pipeline_of(config).compact(again)
        config = config.model_copy(update={"levels": [lv for lv in cfg.levels if lv != "autocompact"]})
        again = replace(again, messages=result.compressed_messages, anchored=True)
        return joined(result, await self.pipeline_of(config).compact(again))

    async def _last_observation(self, request: CompressionRequest, result: CompressionResult,
                                cover: Message | None = None) -> CompressionResult:
        """Still over: the last message, an observation, is cut head and tail. Towards the target,
        not only to the limit (the turn would land at it and the next turn compact again), but
        keeping what Microcompact keeps of any output: the newest output's head and tail are where
        its failure lines mostly are (measured: cut to the target alone, the last error line was
        in view a tenth less often). `cover`: the line naming the steps, which comes back after it."""
        cfg, hard = self.config, self.hard
        if result.tokens_after <= hard or "microcompact" not in cfg.levels:
            return result
        others = result.tokens_after - self.counter.count_structured(result.compressed_messages[-1])
        keep = cfg.microcompact.head_tokens + cfg.microcompact.tail_tokens
        room = self._error_room(result.compressed_messages) + self._cover_room(result.compressed_messages, cover)
        aim = min(hard - room, max(request.token_budget, others + keep))
        cutter = LastObservationCut(MicrocompactStrategy(cfg.microcompact, cfg.pin_first_user, hard))
        cut = None
        for _ in range(2):  # once more, lower by what the first cut landed over its aim (the notice, the separator)
            tried = await cutter.compress(replace(request, messages=result.compressed_messages,
                                                  token_budget=aim - (0 if cut is None else cut.tokens_after - aim)))
            if tried is None:
                break
            cut = self._as_forwarded(tried)
            if cut.tokens_after <= aim:
                break
        return result if cut is None else joined(result, cut)

    async def _tail(self, request: CompressionRequest, result: CompressionResult,
                    cover: Message | None = None) -> CompressionResult:
        """The protected tail alone is over the budget: its observations are cut oldest first,
        each to its tool's threshold or to what the budget leaves it, the newest last; the last
        message and the newest user message stay (`RecentWindowCut` with nothing protected)."""
        cfg = self.config
        if result.tokens_after <= self.hard or "microcompact" not in cfg.levels:
            return result
        cutter = RecentWindowCut(MicrocompactStrategy(cfg.microcompact, cfg.pin_first_user, self.hard), protect=None)
        aim = self.hard - self._error_room(result.compressed_messages) - self._cover_room(result.compressed_messages,
                                                                                           cover)
        cut = await cutter.compress(replace(request, messages=result.compressed_messages, token_budget=aim,
                                            window=PROTECTED_TAIL, anchored=True))
        return result if cut is None else joined(result, self._as_forwarded(cut))

    async def _oldest_turns(self, request: CompressionRequest, result: CompressionResult,
                            window: RecentWindow, budget: int | None = None) -> CompressionResult:
        """Still over `budget` (default: the budget), in a conversation too short or with turns
        too small for Snip's minimums (blocks of 5 in 10 messages): the oldest turns after the
        task go, under a note that only counts them, down to `window`."""
        cfg = self.config
        budget = self.hard if budget is None else budget
        if result.tokens_after <= budget or "snip" not in cfg.levels:
            return result
        last = SnipStrategy(cfg.snip.model_copy(update={"keep_recent": window.messages, "min_block": 1,
                                                        "min_messages": 1, "preview_chars": 0}), cfg.pin_first_user)
        cut = await last.compress(replace(request, messages=result.compressed_messages, token_budget=budget,
                                          window=window, anchored=True))
        if cut is not None:
            cut = self._as_forwarded(cut)
            if cut.tokens_after < result.tokens_after:
                result = joined(result, cut)
        return result

    def _as_forwarded(self, result: CompressionResult) -> CompressionResult:
        """A level's result counted as the chain counts its own: with the notice its quoted notes bring."""
        return replace(result, tokens_after=result.tokens_after + notice_tokens(self.counter,
                                                                                result.compressed_messages))


def _answers_a_call(message: Message) -> bool:
    """A user turn of Anthropic `tool_result` (or Responses `function_call_output`) blocks: it
    cannot open the kept messages without the call it answers."""
    content = message.get("content")
    return isinstance(content, list) and any(isinstance(b, dict) and b.get("type") in ("tool_result",
                                                                                       "function_call_output")
                                             for b in content)


def joined(first: CompressionResult, then: CompressionResult) -> CompressionResult:
    """`then`, which went on from `first`'s messages, with `first`'s steps and hints before its own."""
    return replace(then, steps=first.steps + then.steps, recovery_hints=first.recovery_hints + then.recovery_hints)


def shed(result: CompressionResult, counter: TokenCounter, limit: int, everything: bool = False) -> CompressionResult:
    """`result` without those of ctxgate's own messages it cannot afford under `limit`
    (`shed_own_messages`); as it is if it fits, or does not fit even without them."""
    if result.tokens_after <= limit:
        return result
    shed_messages = shed_own_messages(result.compressed_messages, counter, limit, everything)
    if shed_messages is None:
        return result
    shed_messages = named_once(result.compressed_messages, shed_messages, counter, limit)
    return replace(result, compressed_messages=shed_messages,
                   tokens_after=counter.count_messages(shed_messages) + notice_tokens(counter, shed_messages))
