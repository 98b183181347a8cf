"""Counters a metrics endpoint reads: token-count calibration, estimates, compactions.

Prometheus collectors live in a registry of their own per app, so two apps in one process
(tests) do not collide.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

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


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("ctxgate_requests", "Chat requests by outcome", ["model", "status"],
                                registry=self.registry)
        self.estimated = Counter("ctxgate_token_estimates", "Requests counted with the conservative estimate (no "
                                 "known tokenizer)", ["model"], registry=self.registry)
        self.compactions = Counter("ctxgate_compactions", "Compaction steps by level", ["level"],
                                   registry=self.registry)
        self.tokens_saved = Counter("ctxgate_tokens_saved", "Tokens removed by compaction", ["level"],
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
        self.calibration: dict[str, CalibrationFigures] = {}

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

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
