"""Per-backend load, region saturation and ``Retry-After`` (sans-IO).

Load of a backend = the router's own count of requests in flight to it (exact and instant)
plus, if its metrics are fresh, the traffic they show beyond ours: reported ``running +
waiting`` (vLLM metric names) minus our in-flight count *when they were scraped*. A scrape is
up to one interval old; comparing it with our count of that moment (not of now) keeps a stale
scrape from making a backend look busier, or idler, than it is.

A backend is *saturated* when its load reaches ``max_in_flight`` or it reports more than
``max_waiting`` waiting requests; the region is saturated when every healthy backend is.
The expected queue wait of a new request is ``excess / max_in_flight * service time``, with
the service time an EWMA of observed request durations; the drain estimate behind
``Retry-After`` is the same wait for the least-loaded backend (integer seconds, at least 1).

The spill budget is :mod:`firstbyte.router.spill`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from firstbyte.router.upstream_metrics import BackendMetrics

__all__ = ["BackendLoad", "Ewma", "LoadTracker"]


class Ewma:
    """Exponentially weighted moving average; ``value`` is ``None`` before the first sample."""

    def __init__(self, alpha: float = 0.2, initial: float | None = None) -> None:
        self.alpha = alpha
        self.value = initial

    def add(self, sample: float) -> float:
        self.value = (
            sample if self.value is None else (self.alpha * sample + (1 - self.alpha) * self.value)
        )
        return self.value


@dataclass
class BackendLoad:
    name: str
    max_in_flight: int
    max_waiting: int = 0
    weight: float = 1.0
    in_flight: int = 0
    healthy: bool = True
    metrics: BackendMetrics | None = None
    metrics_at: float | None = None
    in_flight_at_metrics: int = 0
    ttft_ms: Ewma = field(default_factory=Ewma)
    service_ms: Ewma = field(default_factory=lambda: Ewma(0.2, 1000.0))
    requests: int = 0


class LoadTracker:
    """The load of this region's backends, from the router's counts and their metrics."""

    def __init__(self, backends: Iterable[BackendLoad], *, metrics_ttl_s: float = 5.0) -> None:
        self.backends: dict[str, BackendLoad] = {b.name: b for b in backends}
        self.metrics_ttl_s = metrics_ttl_s

    def __getitem__(self, name: str) -> BackendLoad:
        return self.backends[name]

    # --- inputs
    def started(self, name: str) -> None:
        b = self.backends[name]
        b.in_flight += 1
        b.requests += 1

    def finished(self, name: str, duration_ms: float | None = None) -> None:
        b = self.backends[name]
        b.in_flight = max(0, b.in_flight - 1)
        if duration_ms is not None:
            b.service_ms.add(duration_ms)

    def observe_ttft(self, name: str, ttft_ms: float) -> None:
        self.backends[name].ttft_ms.add(ttft_ms)

    def observe_metrics(self, name: str, metrics: BackendMetrics, now: float) -> None:
        b = self.backends[name]
        b.metrics, b.metrics_at, b.in_flight_at_metrics = metrics, now, b.in_flight

    def set_health(self, name: str, healthy: bool) -> None:
        self.backends[name].healthy = healthy

    # --- outputs
    def _fresh(self, b: BackendLoad, now: float) -> BackendMetrics | None:
        if b.metrics is None or b.metrics_at is None:
            return None
        return b.metrics if now - b.metrics_at <= self.metrics_ttl_s else None

    def load(self, name: str, now: float) -> int:
        b = self.backends[name]
        m = self._fresh(b, now)
        if m is None:
            return b.in_flight
        others = int((m.running or 0) + (m.waiting or 0)) - b.in_flight_at_metrics
        return b.in_flight + max(0, others)

    def saturated(self, name: str, now: float) -> bool:
        b = self.backends[name]
        if not b.healthy:
            return True
        m = self._fresh(b, now)
        if m is not None and m.waiting is not None and m.waiting > b.max_waiting:
            return True
        return self.load(name, now) >= b.max_in_flight

    def available(self, now: float) -> list[str]:
        """Healthy, unsaturated backends, in configuration order."""
        return [n for n in self.backends if not self.saturated(n, now)]

    def healthy(self) -> list[str]:
        return [n for n, b in self.backends.items() if b.healthy]

    def region_saturated(self, now: float) -> bool:
        return not self.available(now)

    def queue_wait_ms(self, now: float) -> float:
        """Expected wait before a new request starts on the best backend of this region."""
        waits = [self._wait_ms(n, now) for n in self.healthy()]
        return min(waits) if waits else math.inf

    def _wait_ms(self, name: str, now: float) -> float:
        b = self.backends[name]
        excess = self.load(name, now) + 1 - b.max_in_flight
        m = self._fresh(b, now)
        if m is not None and m.waiting:
            excess = max(excess, int(m.waiting) + 1 - b.max_waiting)
        if excess <= 0:
            return 0.0
        service = b.service_ms.value or 1000.0
        return excess / b.max_in_flight * service

    def retry_after_s(self, now: float) -> int:
        """``Retry-After`` for a rejected request: the drain estimate, whole seconds, >= 1."""
        wait = self.queue_wait_ms(now)
        if math.isinf(wait):
            return 5
        return max(1, math.ceil(wait / 1000.0))

    def in_flight(self) -> int:
        return sum(b.in_flight for b in self.backends.values())

    def capacity(self) -> int:
        return sum(b.max_in_flight for b in self.backends.values() if b.healthy)

    def ttft_ms(self) -> float | None:
        values = [b.ttft_ms.value for b in self.backends.values() if b.ttft_ms.value is not None]
        return min(values) if values else None

