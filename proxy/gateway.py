"""Everything one running ctxgate holds: config, routes, tokenizers, state, forwarders."""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any


from ctxgate.pipeline.config import PROFILE_DEFAULTS, PipelineConfig
from ctxgate.pipeline.tokens import TokenizerRegistry, TokenizerRule
from .engine.compaction import Compactor
from .engine.content_store import open_content_store
from .config import Config
from .upstream.demo import DemoForwarder
from .errors import GatewayError
from .engine.idempotency import IdempotencyStore, open_idempotency_store
from .engine.history import HistoryCache
from .engine.shared_counts import SharedCounts, open_shared_counts
from .engine.journal import Journal
from .engine.memory_turn import BlockRefresher, open_memory_store, open_short_term
from ctxgate.memory.manager import MemoryManager
from .admin.metrics import Metrics
from .upstream.routing import Route, Router
from .engine.speculative import Speculator
from .engine.quiet import QUIET
from .engine.session import Sessions
from .engine.open_store import open_store
from .engine.state import SessionState
from .upstream.forwarders import DirectForwarder, Forwarder, LitellmForwarder
from .heavy import HeavyWork
from .resent import ResentBodies
from .large_json import JsonParser
from .upstream.retry import Retrier
from .upstream.summarizer import Summarizer

log = logging.getLogger("ctxgate")


@dataclass
class Gateway:
    config: Config
    data_dir: Path
    router: Router
    tokenizers: TokenizerRegistry
    sessions: Sessions
    metrics: Metrics
    direct: DirectForwarder
    via_litellm: LitellmForwarder
    retrier: Retrier
    journal: Journal
    idempotency: IdempotencyStore
    memory: MemoryManager | None = None
    memory_blocks: BlockRefresher = field(default_factory=BlockRefresher)
    demo: DemoForwarder = field(default_factory=DemoForwarder)
    compactor: Compactor = field(default_factory=Compactor)
    speculator: Speculator | None = None
    histories: HistoryCache = field(default_factory=HistoryCache)
    shared_counts: SharedCounts | None = None
    """The sessions' token counts in Redis, for a turn this process has not seen the history of."""
    json_parser: JsonParser = field(default_factory=JsonParser)
    resent: ResentBodies = field(default_factory=ResentBodies)
    """The last bodies' bytes up to their history's end: a steady turn parses only its tail."""
    heavy: HeavyWork = field(default_factory=HeavyWork)
    """Large requests' CPU work, off the event loop, a few at a time per tenant."""
    summarizer: Summarizer = field(init=False)
    """ctxgate's own LLM calls (Autocompact, memory's consolidation); set by `build`."""

    @classmethod
    def build(cls, config: Config, data_dir: str | None = None, forwarding: str | None = None) -> "Gateway":
        metrics = Metrics()
        tokenizers = TokenizerRegistry(
            [TokenizerRule(pattern=r.pattern, tokenizer=r.tokenizer) for r in config.ctxgate.tokenizers],
            on_estimate=lambda model: metrics.estimated.labels(model).inc())
        tokenizers.validate()
        s = config.ctxgate
        root = Path(data_dir or s.data_dir)
        retrier = Retrier(metrics.registry)
        journal = Journal(root, s.wal, watch_external=s.state == "memory",
                          on_damage=lambda kind: metrics.wal_damage.labels(kind).inc(), state=s.state)
        gw = cls(config=config, data_dir=root, router=Router(config, forwarding),
                 tokenizers=tokenizers, metrics=metrics,
                 sessions=Sessions(open_store(s.state, s.max_memory_sessions, s.session_idle_ttl_s), journal),
                 direct=DirectForwarder(s.connect_timeout_s, retrier),
                 via_litellm=LitellmForwarder(retrier), retrier=retrier, journal=journal,
                 idempotency=open_idempotency_store(s.state, root, s.wal.idempotency_ttl_s,
                                                    s.wal.idempotency_max_per_tenant))
        gw.summarizer = summarizer = Summarizer(gw.router, tokenizers, gw.forwarder_for)
        gw.memory = MemoryManager(open_memory_store(s.memory, s.state, root, gw._embed if s.memory.embedding_model
                                                    else None), s.memory, summarizer.complete, gw._log_dream,
                                  short_term=open_short_term(s.state), measure=summarizer.room,
                                  sharing=lambda tenant: t.share_captured if (t := s.tenants.get(tenant)) else None,
                                  pauser=QUIET.pauser)
        content = open_content_store(s.state, root)
        gw.shared_counts = open_shared_counts(s.state)
        gw.speculator = Speculator(gw.sessions, on_done=gw._checkpoint_speculative, content=content,
                                   on_waste=gw.metrics.summary_wasted)
        gw.compactor = Compactor(on_step=gw._count_step, speculator=gw.speculator, content=content,
                                 on_merge=gw.metrics.note_merges.inc, on_waste=gw.metrics.summary_wasted)
        gw.data_dir.mkdir(parents=True, exist_ok=True)
        for name in gw.router.model_names():
            try:
                route = gw.router.resolve(name)
            except GatewayError:  # a pattern no concrete name stands for
                continue
            tokenizers.preload(route.model_name, route.upstream_model)
        return gw

    async def recover_recent(self) -> int:
        """At start: the sessions whose logs were written last are rebuilt before they are asked
        for (and their logs checked); the rest wait for their first request."""
        limit = self.config.ctxgate.wal.recover_on_start
        logs = await asyncio.to_thread(self.journal.writer.sessions) if limit else []
        by_recency = sorted(logs, key=lambda info: info.written_at, reverse=True)[:limit]
        recovered = 0
        for info in by_recency:
            recovered += await self.sessions.recover(info.tenant, info.session)
        if recovered:
            log.info("recovered %d sessions from the WAL at start (of %d logs)", recovered, len(logs))
        return recovered

    async def housekeeping(self, every_s: float = 60.0) -> None:
        """Runs for the life of the server: sessions idle past the memory idle timeout end
        (auto-dream trigger B), and WAL archives past their retention go, even for sessions
        that never write again."""
        try:
            await self.recover_recent()
        except Exception as e:  # each session is still rebuilt on its first request
            log.warning("recovery at start stopped: %s", e)
        while True:
            try:
                if self.memory is not None:
                    await self.memory.sweep()
                removed = await asyncio.to_thread(self.journal.prune_archives)
                if removed:
                    log.info("removed %d WAL archive segments past their retention", len(removed))
                if gone := await self.compactor.content.prune(self._content_ttl()):
                    log.info("removed %d expansion originals past their age", gone)
            except Exception as e:  # housekeeping must outlive a bad minute (a store briefly down)
                log.warning("housekeeping: %s", e)
            await asyncio.sleep(every_s)

    async def _embed(self, texts: list[str]) -> list[list[float]]:
        """Embeddings for the vector memory store, through litellm and the configured model's route."""
        import litellm

        route = self.router.resolve(self.config.ctxgate.memory.embedding_model or "")
        reply = await litellm.aembedding(model=route.litellm_params["model"], input=texts, api_base=route.api_base,
                                         api_key=route.api_key)
        return [list(item["embedding"]) for item in reply.data]

    async def _log_dream(self, key: tuple[str, str], event: dict[str, Any]) -> None:
        async with self.sessions.transaction(*key) as tx:
            tx.write_log = lambda state: self.journal.log_dream(state, event)

    async def _checkpoint_speculative(self, state: SessionState) -> None:
        await self.journal.checkpoint(state, "speculative")

    def _count_step(self, entry: dict[str, Any]) -> None:
        self.metrics.compactions.labels(entry["level"]).inc()
        self.metrics.tokens_saved.labels(entry["level"]).inc(max(0, entry["tokens_before"] - entry["tokens_after"]))

    def forwarder_for(self, route: Route) -> Forwarder:
        if route.demo:
            return self.demo
        return self.direct if route.direct else self.via_litellm

    @lru_cache(maxsize=256)
    def pipeline_config(self, profile: str, tenant: str) -> PipelineConfig:
        return self.config.pipeline_config(profile, tenant)

    def _content_ttl(self) -> float:
        """The longest age any profile or tenant keeps expansion originals for."""
        tenants = [None, *self.config.ctxgate.tenants]
        return max(self.config.pipeline_config(profile, tenant).expand.store_ttl_s
                   for profile in PROFILE_DEFAULTS for tenant in tenants)

    def __hash__(self) -> int:  # lru_cache on a method needs a hashable self
        return id(self)

    async def close(self) -> None:
        if self.speculator is not None:
            await self.speculator.close()
        if self.memory is not None:
            await self.memory.close()  # buffered memory is consolidated (or written raw) before the state goes
        await self.direct.close()
        await self.sessions.close()
        await self.compactor.content.close()
        if self.shared_counts is not None:
            await self.shared_counts.close()
        close_idempotency = getattr(self.idempotency, "close", None)
        if close_idempotency is not None:
            await close_idempotency()
        self.journal.close()
        self.json_parser.close()
