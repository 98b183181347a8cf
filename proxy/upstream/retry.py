"""When an upstream call is tried again, and how long ctxgate waits before it does.

The policy comes from LiteLLM's own config keys (`routing.retry_policy` reads them). An
attempt is repeated only while nothing of its reply has reached the client: a forwarder
runs the call through `Retrier.run` up to the moment it hands back a `Reply`, so an error
status or a connection failure is retried, and anything after the first relayed byte is
not. What is retried: 429, 500, 502, 503, 504, a refused or broken connection, a timeout;
never a 4xx the request itself caused, nor a context-too-long error (compaction answers that).
"""
from __future__ import annotations

import asyncio
import email.utils
import logging
import random
import time
from dataclasses import dataclass
from typing import Awaitable, Callable, Mapping, TypeVar

from prometheus_client import CollectorRegistry, Counter

from ..errors import ErrorKind, GatewayError
from .errors import BAD_REPLY, ContextTooLong, UpstreamError

log = logging.getLogger("ctxgate.retry")
T = TypeVar("T")

RETRIED_STATUSES = frozenset({429, 500, 502, 503, 504, 529})  # 529: Anthropic overloaded
MAX_WAIT_S = 60.0
"""No upstream's `Retry-After` makes ctxgate wait longer than this (nor longer than the timeout)."""
BACKOFF_BASE_S = 0.5


@dataclass(frozen=True)
class RetryPolicy:
    num_retries: int = 0
    """Attempts after the first; none unless the config asks (an SDK retries on its own too)."""
    min_wait_s: float = 0.0
    """LiteLLM's `retry_after`: the least time between two attempts."""
    timeout_s: float = 600.0
    """One attempt's limit: the whole reply, or until a stream starts and then between its chunks."""

    def wait_s(self, retry: int, headers: Mapping[str, str]) -> float:
        """Before retry number `retry` (0-based): what the upstream asked for, else a jittered
        exponential backoff; at least `min_wait_s`, at most `MAX_WAIT_S` and the timeout."""
        asked = asked_wait_s(headers)
        wait = asked if asked is not None else random.uniform(0, BACKOFF_BASE_S * 2 ** min(retry, 16))
        return min(max(wait, self.min_wait_s), MAX_WAIT_S, self.timeout_s)


def asked_wait_s(headers: Mapping[str, str]) -> float | None:
    """`retry-after-ms` (OpenAI's), else `Retry-After` in seconds or as an HTTP date."""
    lowered = {k.lower(): v for k, v in headers.items()}
    try:
        if "retry-after-ms" in lowered:
            return max(0.0, float(lowered["retry-after-ms"]) / 1000)
        value = lowered.get("retry-after")
        if value is None:
            return None
        try:
            return max(0.0, float(value))
        except ValueError:
            when = email.utils.parsedate_to_datetime(value)
            return max(0.0, when.timestamp() - time.time())
    except (ValueError, TypeError, OverflowError):
        return None


def retry_reason(error: Exception) -> str | None:
    """Why `error` is worth another attempt (the metric's `reason`), or None when it is not."""

    if isinstance(error, ContextTooLong):
        return None
    if isinstance(error, GatewayError) and error.code == BAD_REPLY:
        return None  # a reply came (and may be billed): as on the direct path, it is answered, not repeated
    if isinstance(error, UpstreamError):
        return str(error.status) if error.status in RETRIED_STATUSES else None
    if isinstance(error, GatewayError):
        if error.kind is ErrorKind.TIMEOUT:
            return "timeout"
        if error.kind is ErrorKind.UPSTREAM_UNREACHABLE:
            return "connection"
    return None


def _headers_of(error: Exception) -> Mapping[str, str]:
    headers = getattr(error, "headers", None)
    return headers if isinstance(headers, Mapping) else {}


class Retrier:
    """Runs one upstream call under a route's `RetryPolicy`, counting each retry in `registry`
    (the gateway's metrics) as `ctxgate_upstream_retries_total{model,reason}`, and each turn
    moved to a fallback model as `ctxgate_upstream_fallbacks_total{model,fallback,reason}`."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._retries = Counter("ctxgate_upstream_retries", "Upstream calls tried again, by why (an HTTP status, "
                                "connection, timeout)", ["model", "reason"], registry=registry)
        self._fallbacks = Counter("ctxgate_upstream_fallbacks", "Turns moved to a fallback model group, by why (an "
                                  "HTTP status, connection, timeout, context_window)", ["model", "fallback", "reason"],
                                  registry=registry)

    def fell_back(self, model: str, fallback: str, reason: str) -> None:
        self._fallbacks.labels(model, fallback, reason).inc()

    async def run(self, policy: RetryPolicy, model: str, attempt: Callable[[], Awaitable[T]]) -> T:
        retry = 0
        while True:
            try:
                return await attempt()
            except Exception as e:
                reason = retry_reason(e)
                if reason is None or retry >= policy.num_retries:
                    raise
                wait = policy.wait_s(retry, _headers_of(e))
                log.warning("upstream for %s failed (%s); retry %d of %d in %.2f s", model, reason, retry + 1,
                            policy.num_retries, wait)
                self._retries.labels(model, reason).inc()
                retry += 1
                await asyncio.sleep(wait)
