"""One turn, for every door: count, compact, inject, forward, settle.

A door hands the engine a `TurnInput` (its request in the neutral conversation model)
and a `Wire` (its format). The engine then:

1. counts the conversation with the model's tokenizer (cached per message fingerprint);
2. in one session transaction: takes the session's memory block, plans the compaction
   (stored records, the chain when over the trigger, the loop guard), and logs the turn
   to the WAL before anything is forwarded (a new conversation far below the trigger is
   counted and logged beside its upstream call instead, `count_beside.py`);
3. forwards through the door's `Wire`, compacting once more if the upstream says the
   prompt is too long (the loop guard decides whether that may happen);
4. settles the reply: metrics, the provider's count as calibration, the WAL's RESPONSE
   and TOOL_CALL events, the loop guard reset.

Errors are `GatewayError`s; each door renders them in its own wire shape.
"""
from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from ctxgate.memory.short_term import BufferScope
from ctxgate.pipeline.depth import prices_of
from ctxgate.pipeline.history_index import HistoryIndex
from ctxgate.pipeline.provenance import message_spans
from ctxgate.pipeline.turns import kept_characters
from ctxgate.redis_backend import UNAVAILABLE
from ..errors import GatewayError, context_exhausted
from ..tenancy import Caller
from ..upstream.errors import ContextTooLong, UpstreamError
from ..upstream.forwarders import Reply
from ..upstream.routing import Route
from .expansion import (Expansion, ExpandingWire, expansion_room, tool_definition, tool_tokens,
                        without_exchanges)
from .count_beside import before_headers, beside_upstream, count_beside, may_compact
from .turn_budget import (Plan, Turn, budget_of, count_offset_key, measured_calibration,
                          watermark)
from .off_loop import count_off_loop, index_inline
from .session import Transaction
from .summary_reuse import reusing_summaries
from .prepared import PreparedTurn, TurnInput
from .memory_turn import block_tokens, session_block
from .state import SessionState
from .preview import preview
from .provider_count import ProviderCounts
from .wire import ReplyFacts, Wire, upstream_key

if TYPE_CHECKING:
    from ..gateway import Gateway

log = logging.getLogger("ctxgate.turn")
HOPELESS_MARGIN = 2
"""A request is refused from its lengths alone only when its floor is over this many times
every limit it may go to: the exact check (in the compactor) handles anything closer, with
the calibration that can move a limit."""


_AFTER_WRITE: set["asyncio.Task[None]"] = set()


async def _once_written(work: Callable[[], Awaitable[None]]) -> None:
    """`work()` once the request is written: started just before the send, this task's first
    step runs where the send first yields, and its second after aiohttp's task that writes the
    body has run (as a turn counted beside its call starts its count, `count_beside`), when the
    send yields first on a connection already open."""
    await asyncio.sleep(0)
    await work()


class TurnEngine:
    def __init__(self, gw: "Gateway") -> None:
        self.gw = gw
        self.provider_counts = ProviderCounts(gw)

    def refuse_hopeless(self, caller: Caller, route: Route, messages: list[dict[str, Any]]) -> None:
        """A request whose instructions and task alone are far over every model it may go to
        (its own and its context-window fallbacks), known from string lengths: refused with
        CONTEXT_EXHAUSTED before any work in proportion to its size (fingerprints, session,
        counting), which for a body of tens of megabytes would stall every other request."""
        characters = kept_characters(messages)
        if characters <= HOPELESS_MARGIN * (caller.budget or route.max_input_tokens):
            return  # a token covers at least a character: nothing to judge from lengths
        gw = self.gw
        names = (route.model_name, *gw.router.fallbacks.context_window_for(route.model_name))
        floors = []
        for candidate in [route] + [gw.router.resolve(name) for name in names[1:]]:
            limit = caller.budget or candidate.max_input_tokens
            counter = gw.tokenizers.for_model(candidate.model_name, candidate.upstream_model, counting=False)
            floor = counter.least(characters)
            if floor <= HOPELESS_MARGIN * limit:
                return
            floors.append(f"{candidate.model_name}: {limit}")
        raise context_exhausted(f"the system prompt and the task alone are {characters} characters, at least "
                                f"{floor} tokens, far over the context limit ({', '.join(floors)}): no compaction "
                                "can make this request fit")

    async def prepare(self, caller: Caller, route: Route, session_id: str, request: TurnInput, wire: Wire,
                      headers: dict[str, str], started: float) -> PreparedTurn:
        gw = self.gw
        messages = request.messages
        counter = gw.tokenizers.for_model(route.model_name, route.upstream_model)
        known = request.known or gw.histories.match(caller.tenant, session_id, messages)
        bound = request.count_bound
        work = request.body_bytes if request.fresh_bytes is None or not known.length else request.fresh_bytes
        def indexed() -> HistoryIndex:
            return (known.index or HistoryIndex.build([], counter)).extend(messages, known.length, counter, count=False)

        async def fingerprinted() -> HistoryIndex:
            return indexed() if index_inline(len(messages) - known.length, work) else \
                await gw.heavy.run(caller.tenant, caller.tenant_config.heavy_concurrency, work, indexed)

        # A new conversation the bytes bound far below the trigger is fingerprinted and counted
        # beside the upstream call (`late`): nothing of it is counted yet, unless another
        # replica left its counts in Redis, which takes its fingerprints to look up. Not while
        # the tenant's log fails: logged first, the turn is refused with nothing forwarded.
        beside = not gw.journal.failing(caller.tenant)
        late = beside and not known.length and gw.shared_counts is None and beside_upstream(0, bound, counter)
        index = HistoryIndex.build([], counter) if late else await fingerprinted()
        mine = len(index.cumulative_tokens) - 1
        if mine == 0 and messages and gw.shared_counts is not None:
            index = await self._shared_counts(caller.tenant, session_id, index)
        counted = len(index.cumulative_tokens) - 1
        gw.metrics.message_counts.labels("shared").inc(counted - mine)
        gw.metrics.message_counts.labels("counted").inc(len(messages) - counted)
        late = late or (beside and beside_upstream(counted, bound, counter))
        if late:
            pass  # counted once forwarded (`count_beside`), or in the transaction when it may compact
        elif counted == 0:
            # In a thread when large: the event loop serves other requests meanwhile.
            index = await count_off_loop(index, messages, counter, request.body_bytes)
        else:
            index = index.counted(messages, counter)
        config = gw.pipeline_config(caller.profile, caller.tenant)
        if caller.expand is not None and caller.expand != config.expand.enabled:
            config = config.model_copy(update={"expand": config.expand.model_copy(update={"enabled": caller.expand})})
        summarizer = config.autocompact.model or route.model_name
        turn = Turn(messages=messages, fingerprints=index.fingerprints, tools=request.tools, counter=counter,
                    config=config, max_input_tokens=caller.budget or route.max_input_tokens,
                    prices=prices_of(config, route.prices),
                    summarize=reusing_summaries(gw.compactor.content, caller.tenant, session_id, summarizer,
                                                config.expand, gw.summarizer.complete), index=index)
        headers["X-Ctx-Tokenizer"] = counter.name
        if not late:
            self._counted(caller, session_id, request, turn, headers)
        memory = gw.memory if gw.memory is not None and gw.memory.enabled(caller.profile) else None
        scope = request.memory_scope if memory is not None else None
        offset_key = count_offset_key(route.model_name, turn.tools)
        # The expansion tool goes only to a request that carries tools of its own: one sent
        # without (Qwen Code's own summarisation request) is answered with text, as asked.
        offered = tool_tokens(config.expand, counter, request.tools) \
            if config.expand.enabled and request.tools and isinstance(wire, ExpandingWire) else 0
        plan: Plan | None = None
        block = ""
        compacted = False
        async with gw.sessions.transaction(caller.tenant, session_id) as tx:
            state = tx.state
            state.profile = caller.profile
            if state.count_offset_key == offset_key:
                turn.count_offset, turn.count_scale = state.count_offset, state.count_scale
            if memory is not None and scope is not None:
                state.note_user(scope.user)
                block = await session_block(memory, gw.memory_blocks, state, scope, turn)
                turn.reserved_tokens = block_tokens(block, counter)
            if late and may_compact(state, turn, bound):  # counted before anything else
                if len(index) != len(messages):
                    index = await fingerprinted()
                    turn.fingerprints = index.fingerprints
                turn.index = await count_off_loop(index, messages, counter, request.body_bytes)
                late = False
                self._counted(caller, session_id, request, turn, headers)
            try:
                if not late:
                    plan = await self._plan(wire, caller, route, turn, state, offset_key, headers, tx, offered)
                else:  # nothing to plan; logged once counted (`count_beside`)
                    plan = Plan(messages=messages, tokens_out=None)
            finally:
                guard_set = state.has_attempted_reactive_compact
                state.turns += 1
                number = state.turns  # the turn's: its log lines and its RESPONSE carry it
                compacted = bool(state.records)
        prepared = PreparedTurn(caller, session_id, route, turn, offset_key, plan, block, guard_set, started, headers,
                                levels=list(plan.levels), keep=self._keeping(caller, request))
        if memory is not None and scope is not None:
            dialect = state.dialect or None  # None: detected from the messages
            buffer = BufferScope(scope.user, scope.project, caller.profile, summarizer, wire.name, state.turns)
            # The turn's fingerprints when the capture starts: a late turn takes them once forwarded.
            prepared.capture = lambda: memory.observe((caller.tenant, session_id), buffer, messages,
                                                      turn.fingerprints, counter.head,
                                                      lambda unseen: message_spans(messages, unseen, dialect))
        if offered and compacted:
            # Offered from the first compaction on, the same bytes every turn: the prompt cache holds.
            prepared.expansion = Expansion(config.expand, gw.compactor.content, caller.tenant, session_id, counter,
                                           on_answer=gw.metrics.expanded,
                                           room=expansion_room(turn, state, plan))
        if late:
            prepared.counting = count_beside(gw, caller.tenant, session_id, turn, number, plan, request.body_bytes,
                                             index, fingerprinted,
                                             headers, lambda: self._counted(caller, session_id, request, turn, headers))
        return prepared

    async def _plan(self, wire: Wire, caller: Caller, route: Route, turn: Turn, state: SessionState,
                    offset_key: str, headers: dict[str, str], tx: Transaction, offered: int) -> Plan:
        """A counted turn planned, and logged before anything is forwarded (also when planning
        fails). `offered`: the tokens of the expansion tool, offered from the session's first
        compaction on (0: not to this request): counted with what is forwarded."""
        gw = self.gw
        plan: Plan | None = None
        tx.write_log = lambda s: gw.journal.log_request(s, turn, plan.tokens_out if plan else None,
                                                        budget_of(s, turn))
        tokens_in = turn.tokens_in()
        if state.count_offset_key != offset_key and tokens_in + turn.reserved_tokens > watermark(turn, state):
            await self.provider_counts.calibrate(wire, route, turn, state, offset_key, headers,
                                                 upstream_key(caller, route))
        reserved = offered if state.records else 0
        turn.reserved_tokens += reserved
        plan = await gw.compactor.prepare(state, turn)
        if offered and not reserved and state.records:
            # The session's first compaction point: the tool goes out with this very request.
            plan = await gw.compactor.with_room(state, turn, plan, offered)
        if not turn.tools and state.expanded:
            kept = without_exchanges(plan.messages, state.expanded)
            if plan.tokens_out is not None:
                plan.tokens_out -= turn.counter.count_messages(plan.messages) - turn.counter.count_messages(kept)
            plan.messages = kept
        return plan

    def _counted(self, caller: Caller, session_id: str, request: TurnInput, turn: Turn,
                 headers: dict[str, str]) -> None:
        """The turn's count is known: reported, and its index kept for the session's next turn."""
        assert turn.index is not None
        headers["X-Ctx-Tokens-In"] = str(turn.tokens_in())
        self.gw.histories.remember(caller.tenant, session_id, request.messages, turn.index, request.body_bytes,
                                   request.door_state)
        if self.gw.shared_counts is not None:
            self.gw.shared_counts.keep_later(caller.tenant, session_id, turn.index)

    def _keeping(self, caller: Caller, request: TurnInput) -> "Callable[[], Awaitable[None]] | None":
        """The door's keeping of the body (`TurnInput.keep`), in a thread when the body is large
        (`HeavyWork`: its scans for the kept fields and cuts grow with its bytes)."""
        if request.keep is None:
            return None

        async def keep() -> None:
            try:
                await self.gw.heavy.run(caller.tenant, caller.tenant_config.heavy_concurrency, request.body_bytes,
                                        request.kept, items=len(request.messages))
            except Exception as e:  # work for a later request: this one goes on without it
                log.error("the body could not be kept for the next request: %r", e)
        return keep

    async def _shared_counts(self, tenant: str, session_id: str, index: HistoryIndex) -> HistoryIndex:
        """`index` with the counts another replica left for this history (see shared_counts.py);
        unchanged when there are none, or Redis cannot say (the turn then counts them itself)."""
        assert self.gw.shared_counts is not None
        try:
            return index.with_counts(await self.gw.shared_counts.known(tenant, session_id, index))
        except UNAVAILABLE as e:
            log.warning("session %s: shared token counts unavailable (%s): counting the history here", session_id, e)
            return index

    async def preview(self, caller: Caller, route: Route, session_id: str, request: TurnInput, wire: Wire,
                      headers: dict[str, str]) -> int:
        """How many tokens the upstream would be sent for this conversation now (`preview.py`)."""
        counted = await preview(self.gw, self.provider_counts, caller, route, session_id, request.messages,
                                request.tools, request.memory_scope is not None, wire, headers)
        keep = self._keeping(caller, request)
        if keep is not None:
            await keep()
        return counted

    async def forward(self, prepared: PreparedTurn, wire: Wire, stream: bool) -> Reply:
        """Send the planned request; when the upstream says it is too long, compact once
        more (or degrade, or give up, as the loop guard says) and send again."""
        try:
            return await self._forward(prepared, wire, stream)
        except GatewayError:
            try:
                if prepared.counting is not None:
                    # Logged before its error is answered, as before a reply; and before a fallback
                    # model's attempt plans the session and reports its own count.
                    await asyncio.shield(prepared.counting)
            finally:
                prepared.captured()
            raise
        except BaseException:
            prepared.captured()
            raise

    async def _forward(self, prepared: PreparedTurn, wire: Wire, stream: bool) -> Reply:
        gw, route = self.gw, prepared.route
        caller = prepared.caller
        api_key = upstream_key(caller, route)
        degraded = prepared.plan.degraded
        while True:
            payload = wire.payload(prepared.forwarded(), route)
            if prepared.expansion is not None and isinstance(wire, ExpandingWire):
                payload = wire.with_tool(payload, tool_definition(prepared.expansion.config))
            prepared.payload = payload
            if prepared.keep is not None:
                written = asyncio.ensure_future(_once_written(prepared.keep))
                _AFTER_WRITE.add(written)  # held until done: the loop keeps only a weak reference
                written.add_done_callback(_AFTER_WRITE.discard)
                prepared.keep = None
            try:
                reply = await wire.send(route, payload, stream=stream, api_key=api_key)
                break
            except ContextTooLong as e:
                if prepared.counting is not None:  # compacting needs the count: wait for it
                    await prepared.counting
                plan = prepared.plan
                async with gw.sessions.transaction(caller.tenant, prepared.session_id) as tx:
                    tx.write_log = lambda s: gw.journal.log_request(s, prepared.turn, plan.tokens_out,
                                                                    budget_of(s, prepared.turn))
                    try:
                        plan, degraded = await gw.compactor.reactive(tx.state, prepared.turn, plan,
                                                                     e.body["error"]["message"], degraded)
                    finally:
                        prepared.guard_set = tx.state.has_attempted_reactive_compact
                prepared.plan = plan
                prepared.levels += [lv for lv in plan.levels if lv not in prepared.levels]
            except UpstreamError as e:  # the upstream's own status and error object
                raise e.to_api_error() from None
        prepared.upstream_ms += reply.upstream_ms
        if stream and prepared.counting is not None:
            await before_headers(prepared.counting, reply)
        if prepared.plan.tokens_out is not None:
            prepared.headers["X-Ctx-Tokens-Out"] = str(prepared.plan.tokens_out)
        prepared.headers["X-Ctx-Levels"] = ",".join(prepared.levels) or "none"
        return reply

    async def settle(self, prepared: PreparedTurn, wire: Wire, status: int, facts: ReplyFacts) -> None:
        """The upstream call completed: calibrate, log it, reset the loop guard."""
        gw = self.gw
        gw.metrics.requests.labels(prepared.route.model_name, "200").inc()
        gw.metrics.overhead.observe(prepared.overhead_ms())
        if prepared.counting is not None:  # its messages are logged before its reply is
            await prepared.counting
        turn = prepared.turn
        tokens_in = turn.tokens_in()
        gw.metrics.turn_tokens(tokens_in, prepared.plan.tokens_out)
        calibration = None
        expanded = prepared.expansion is not None and prepared.expansion.rounds > 0
        if facts.prompt_tokens is not None and prepared.plan.tokens_out is not None and not expanded:
            # After an expansion the provider counted the follow-up, not what ctxgate planned.
            gw.metrics.calibrate(prepared.route.model_name, prepared.plan.tokens_out, facts.prompt_tokens)
            calibration = measured_calibration(prepared.turn, prepared.plan.tokens_out, facts.prompt_tokens)
        caller = prepared.caller
        try:
            async with gw.sessions.transaction(caller.tenant, prepared.session_id) as tx:
                expansions = prepared.expansion.served if prepared.expansion is not None else None
                state = tx.state
                state.answered_turns += 1
                state.has_attempted_reactive_compact = False  # a complete reply: compaction may run again
                exchange = None
                if prepared.expansion is not None and prepared.expansion.exchange and turn.messages:
                    exchange = state.add_expanded(len(turn.messages), turn.prefix_hashes[-1],
                                                  prepared.expansion.exchange)
                tx.write_log = lambda s: gw.journal.log_reply(s, status, facts.prompt_tokens, facts.tool_calls,
                                                              tokens_in, prepared.plan.tokens_out,
                                                              prepared.route.model_name, expansions, exchange)
                if calibration is not None:
                    state.count_offset, state.count_scale = calibration
                    state.count_offset_key = prepared.offset_key
            if gw.journal.due(state):
                prepared.checkpoint = lambda: gw.sessions.checkpoint_later(caller.tenant, prepared.session_id)
        except GatewayError as e:  # the reply exists and the turn is logged: answer it rather than lose it
            log.error("session %s: the reply could not be logged: %s", prepared.session_id, e.message)
        try:
            await wire.settled(caller.tenant, facts)
        except Exception as e:  # the same: a reply the upstream was paid for reaches the client
            log.error("session %s: the reply could not be kept by its door: %s", prepared.session_id, e)

