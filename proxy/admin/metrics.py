"""Counters a metrics endpoint reads: token-count calibration, estimates, compactions,
connections; and who may read them.

Prometheus collectors live in a registry of their own per app, so two apps in one process
(tests) do not collide.
"""
from __future__ import annotations

import gc
import hmac
import logging
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping, Protocol

from multidict import CIMultiDict
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.gc_collector import GCCollector
from prometheus_client.registry import Collector

from ..config import Config
from ..errors import ErrorKind, GatewayError
from ..tenancy import resolve_caller
from .minutes import MinuteRing

log = logging.getLogger("ctxgate.calibration")


@dataclass
class CalibrationFigures:
    samples: int = 0
    sum_diff: int = 0
    sum_abs_diff: int = 0
    last_ours: int = 0
    last_upstream: int = 0

    @property
    def mean_diff(self) -> float:
        return self.sum_diff / self.samples if self.samples else 0.0


class _FedCounter:
    """A labelled Counter whose every increment also reaches `feed` (with its labels), so the
    per-minute ring is written at the very places the counters are."""

    def __init__(self, counter: Counter, feed: Callable[[tuple[str, ...], float], None]) -> None:
        self._counter = counter
        self._feed = feed

    def labels(self, *values: str) -> _FedChild:
        return _FedChild(self._counter.labels(*values), values, self._feed)


class _FedChild:
    def __init__(self, child: Counter, values: tuple[str, ...], feed: Callable[[tuple[str, ...], float], None]) -> None:
        self._child, self._values, self._feed = child, values, feed

    def inc(self, amount: float = 1) -> None:
        self._child.inc(amount)
        self._feed(self._values, amount)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.minutes = MinuteRing()
        """The last hour per minute, for the dashboard (`/v1/ctx/dashboard/metrics`)."""
        self.requests = _FedCounter(Counter("ctxgate_requests", "Chat requests by outcome", ["model", "status"],
                                            registry=self.registry),
                                    lambda labels, _: self.minutes.request(failed=labels[1] != "200"))
        self.estimated = Counter("ctxgate_token_estimates", "Requests counted with the bytes / 3 estimate (no "
                                 "known tokenizer)", ["model"], registry=self.registry)
        self.compactions = _FedCounter(Counter("ctxgate_compactions", "Compaction steps by level", ["level"],
                                               registry=self.registry), lambda _, n: self.minutes.compaction())
        self.tokens_saved = Counter("ctxgate_tokens_saved", "Tokens removed by compaction", ["level"],
                                    registry=self.registry)
        self.note_merges = Counter("ctxgate_compaction_note_merges", "Compaction points that merged the earlier "
                                   "points' notes (over their cap) instead of adding theirs after them",
                                   registry=self.registry)
        self.summaries_wasted = Counter("ctxgate_summaries_wasted", "Summaries paid for whose note was never sent, "
                                        "by why (stale: a background summary whose span the history no longer "
                                        "has; superseded: one that finished after the session compacted "
                                        "otherwise; unused: one its compaction point did not keep)", ["reason"],
                                        registry=self.registry)
        self.summary_tokens_wasted = Counter("ctxgate_summary_tokens_wasted", "Tokens (prompt and reply, ctxgate's "
                                             "count) of the summaries in ctxgate_summaries_wasted", ["reason"],
                                             registry=self.registry)
        self.calibration_diff = Histogram("ctxgate_calibration_diff_tokens", "upstream prompt_tokens minus ctxgate's "
                                          "count", ["model"],
                                          buckets=(-1000, -100, -20, -5, -1, 0, 1, 5, 20, 100, 1000),
                                          registry=self.registry)
        self.overhead = Histogram("ctxgate_overhead_ms", "Time spent in ctxgate per request, upstream excluded",
                                  buckets=(0.5, 1, 2, 5, 10, 20, 50, 100, 500), registry=self.registry)
        self.wal_damage = Counter("ctxgate_wal_damage", "WAL lines found torn (crash mid-write) or damaged (checksum)",
                                  ["kind"], registry=self.registry)
        self.idempotent_replays = Counter("ctxgate_idempotent_replays", "Requests answered from a stored reply "
                                          "(Idempotency-Key)", registry=self.registry)
        self.expansions = Counter("ctxgate_expansions", "Expansion tool calls the gateway answered, by outcome "
                                  "(served, missing, repeated, invalid, no_room, limit)", ["outcome"],
                                  registry=self.registry)
        self.expansion_tokens = Counter("ctxgate_expansion_tokens", "Tokens of originals given back by expansion",
                                        registry=self.registry)
        self.message_counts = Counter("ctxgate_message_counts", "Messages of a turn with no count in this process's "
                                      "history cache, by where their count came from (counted here, or shared: "
                                      "read from the counts another replica left in Redis)", ["source"],
                                      registry=self.registry)
        self.counts_beside_upstream = Counter(
            "ctxgate_counts_beside_upstream", "Turns forwarded before their count was done (a new conversation "
            "whose bytes bound it far below the trigger), counted beside the upstream call", registry=self.registry)
        # The collector's work per generation, and what it never walks (proxy/gc_policy.py).
        GCCollector(registry=self.registry)
        Gauge("ctxgate_gc_frozen_objects", "Objects the garbage collector never walks: those the process made "
              "before it served (frozen at start; 0 with CTXGATE_GC=python)",
              registry=self.registry).set_function(gc.get_freeze_count)
        self.calibration: dict[str, CalibrationFigures] = {}

    def summary_wasted(self, reason: str, calls: int, tokens: int) -> None:
        self.summaries_wasted.labels(reason).inc(calls)
        self.summary_tokens_wasted.labels(reason).inc(tokens)

    def expanded(self, outcome: str, tokens: int) -> None:
        self.expansions.labels(outcome).inc()
        self.expansion_tokens.inc(tokens)

    def calibrate(self, model: str, ours: int, upstream: int) -> None:
        fig = self.calibration.setdefault(model, CalibrationFigures())
        diff = upstream - ours
        fig.samples += 1
        fig.sum_diff += diff
        fig.sum_abs_diff += abs(diff)
        fig.last_ours, fig.last_upstream = ours, upstream
        self.calibration_diff.labels(model).observe(diff)
        if diff:
            # Every turn, so DEBUG: a difference is normal (tools, provider-side framing); the
            # figures are in /metrics (ctxgate_calibration_diff_tokens) for trends.
            log.debug("token count calibration %s: ours %d, upstream %d (%+d)", model, ours, upstream, diff)

    def turn_tokens(self, tokens_in: int | None, tokens_out: int | None) -> None:
        """An answered turn: what its client sent and what was forwarded, for the per-minute ring."""
        self.minutes.tokens(tokens_in or 0, tokens_out or 0)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def watch_connections(self, figures: ConnectionFigures) -> None:
        self.registry.register(_ConnectionCollector(figures))


class ConnectionFigures(Protocol):
    """What the connection guard counts (proxy/connections.py)."""
    open: int
    overflow_open: int
    max_connections: int
    refusals: dict[str, int]
    rejections: dict[str, int]


class _ConnectionCollector(Collector):
    """Read at scrape time from the guard's plain counters, which the accept path updates cheaply."""

    def __init__(self, figures: ConnectionFigures) -> None:
        self._figures = figures

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        f = self._figures
        yield GaugeMetricFamily("ctxgate_connections_open", "Client connections open (under the cap)", f.open)
        yield GaugeMetricFamily("ctxgate_connections_overflow_open", "Connections open past the cap (health "
                                "checks and 503s)", f.overflow_open)
        yield GaugeMetricFamily("ctxgate_connections_max", "The cap on client connections", f.max_connections)
        refused = CounterMetricFamily("ctxgate_connections_refused", "Connections refused or closed early, by "
                                      "reason (over_cap, reset, header_timeout, body_timeout)", labels=["reason"])
        for reason, n in sorted(f.refusals.items()):
            refused.add_metric([reason], n)
        yield refused
        rejected = CounterMetricFamily("ctxgate_http_rejections", "Requests the HTTP parser refused, by kind",
                                       labels=["kind"])
        for kind, n in sorted(f.rejections.items()):
            rejected.add_metric([kind], n)
        yield rejected


def presented_key(headers: Mapping[str, str]) -> str | None:
    auth = headers.get("Authorization", "")
    key = auth[7:] if auth[:7].lower() == "bearer " else headers.get("x-api-key", "")
    return key.strip() or None


def authorize_metrics(config: Config, headers: Mapping[str, str]) -> None:
    """/metrics holds the whole gateway's series (every tenant's traffic, the models, the
    connections) and none per tenant, so it follows the dashboard's rule for such figures: the
    admin key reads it and a tenant key gets a 403 (docs/dashboard.md, Metrics). It asks for a
    key with `metrics_auth: auto` whenever the config has one, with `key` always, with `open`
    never. A missing or unknown key is a 401."""
    settings = config.ctxgate
    tenant_keys = any(t.api_keys for t in settings.tenants.values())
    if settings.metrics_auth == "open" or (settings.metrics_auth == "auto" and not tenant_keys
                                           and settings.admin_key is None):
        return
    key = presented_key(headers)
    if settings.admin_key is not None and key is not None and hmac.compare_digest(key.encode(),
                                                                                  settings.admin_key.encode()):
        return
    if tenant_keys and key is not None:
        # Only the key: a per-request override header has no meaning here and must not be refused.
        tenant = resolve_caller(config, CIMultiDict((k, v) for k, v in headers.items()
                                                    if k.lower() in ("authorization", "x-api-key"))).tenant
        unset = "" if settings.admin_key is not None else (" (this gateway has none: set ctxgate.admin_key, or "
                                                           "ctxgate.metrics_auth: open to show them to anyone)")
        raise GatewayError(ErrorKind.PERMISSION, f"/metrics shows the whole gateway's series, which need the admin "
                           f"key{unset}; tenant {tenant!r} sees its own sessions on the dashboard",
                           code="admin_only")
    raise GatewayError(ErrorKind.AUTHENTICATION, "/metrics needs the admin key (ctxgate.admin_key)",
                       code="invalid_api_key")
