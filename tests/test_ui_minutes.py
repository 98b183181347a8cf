"""The dashboard's last hour: a ring of 60 one-minute buckets, fed by the metrics counters."""
from __future__ import annotations

from ctxgate.proxy.admin.metrics import Metrics
from ctxgate.proxy.admin.minutes import MINUTES, MinuteRing


class _Clock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0  # a whole minute

    def __call__(self) -> float:
        return self.now


def test_each_minute_has_its_bucket_and_an_hour_old_one_is_reused() -> None:
    clock = _Clock()
    ring = MinuteRing(clock)
    ring.request(failed=False)
    clock.now += 59
    ring.request(failed=True)
    ring.tokens(1000, 400)
    clock.now += 1
    ring.compaction()
    hour = ring.last_hour()
    assert len(hour) == MINUTES and hour[-1]["start"] == 1_800_000_060 and hour[0]["start"] == 1_800_000_060 - 59 * 60
    assert hour[-2] == {"start": 1_800_000_000, "requests": 2, "errors": 1, "tokens_in": 1000, "tokens_out": 400,
                        "compactions": 0}
    assert hour[-1]["compactions"] == 1
    clock.now += 60 * MINUTES  # an hour later: the same slots, new minutes
    ring.request(failed=False)
    hour = ring.last_hour()
    assert sum(m["requests"] for m in hour) == 1 and sum(m["compactions"] for m in hour) == 0


def test_the_counters_feed_the_ring_and_prometheus_alike() -> None:
    metrics = Metrics()
    metrics.requests.labels("gpt-4o", "200").inc()
    metrics.requests.labels("gpt-4o", "429").inc()
    metrics.requests.labels("gpt-4o", "stream_error").inc()
    metrics.compactions.labels("snip").inc()
    metrics.turn_tokens(900, None)
    hour = metrics.minutes.last_hour()
    totals = {k: sum(m[k] for m in hour) for k in ("requests", "errors", "compactions", "tokens_in", "tokens_out")}
    assert totals == {"requests": 3, "errors": 2, "compactions": 1, "tokens_in": 900, "tokens_out": 0}
    text = metrics.exposition().decode()
    assert 'ctxgate_requests_total{model="gpt-4o",status="429"} 1.0' in text
    assert 'ctxgate_compactions_total{level="snip"} 1.0' in text
