"""Per-backend load, capacity, region saturation and ``Retry-After`` (sans-IO).

Load of a backend = the router's own count of requests in flight to it (exact and instant),
plus what the region's other router processes have in flight to it (``elsewhere``: with shared
state, from Redis at the last claim or refresh; 0 with one process), plus, if its metrics are
fresh, the traffic they show beyond ours: reported ``running + waiting`` (vLLM metric names)
minus the routers' in-flight count *when they were scraped*. A scrape is up to one interval
old; comparing it with our count of that moment (not of now) keeps a stale scrape from making
a backend look busier, or idler, than it is.

Capacity is learned from what the backend reports, with ``max_in_flight`` as a cap. Every
new request waits for the next scheduler step (~10-100 ms) before it runs, so a scrape sees
requests waiting even on a backend with free slots: about what arrived during one step. The
tracker subtracts the requests it sent in the last ``RECENT_S`` before the scrape; what is
left beyond ``max_waiting``, in two scrapes in a row, with the backend running no more at the
second than at the first, is a real queue, and then the number the backend runs is what it can
run (``max_num_seqs``, or fewer when its KV cache is the limit): its *slots*. A later scrape
showing more running raises them. Its limit is ``min(max_in_flight, slots + max_waiting)``;
until a queue was seen, the cap alone. A backend whose running count still grows is taking
requests in: what waits there is a ramp's arrivals (vLLM starts only as many prompts a step
as ``max_num_batched_tokens`` holds; several router processes each subtract only their own
recent requests), not a queue. A backend
is *saturated* when unhealthy, when its real queue is longer than ``max_waiting``, or when its
load reaches its limit; the region is saturated when every healthy backend is.

The expected queue wait of a new request is ``excess / limit * service time``, with the
service time an EWMA of observed request durations; the drain estimate behind
``Retry-After`` is the same wait for the least-loaded backend (integer seconds, at least 1).

The spill budget is :mod:`firstbyte.router.spill`.
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections import deque
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

from firstbyte.router.upstream_metrics import BackendMetrics

__all__ = ["RECENT_S", "TTFT_SAMPLES", "BackendLoad", "Ewma", "LoadTracker"]

RECENT_S = 0.25
"""Requests sent this recently may still be waiting for their first scheduler step (a step
with a long prefill takes ~100 ms); they are not a queue."""


TTFT_SAMPLES = 64
"""TTFTs kept per backend for its first-byte deadline (:meth:`LoadTracker.first_byte_timeout_s`)."""

TTFT_PERCENTILE = 0.95


class Ewma:
    """Exponentially weighted moving average; ``value`` is ``None`` before the first sample.
    (:meth:`add` is inlined in :meth:`LoadTracker.observe_ttft` and
    :meth:`LoadTracker.finished`, once a request each.)"""

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
    elsewhere: int = 0
    """In flight from the region's other router processes (shared state), as last seen."""
    healthy: bool = True
    metrics: BackendMetrics | None = None
    metrics_at: float | None = None
    in_flight_at_metrics: int = 0
    ttft_ms: Ewma = field(default_factory=Ewma)
    service_ms: Ewma = field(default_factory=lambda: Ewma(0.2, 1000.0))
    requests: int = 0
    slots: int | None = None
    """Requests it runs at once, learned from its metrics (None until it showed a queue)."""
    queued_scrapes: int = 0
    """Consecutive scrapes that showed a real queue (2 or more: it is real)."""
    running: int = 0
    """Requests it ran at the last scrape."""
    admitting: bool = False
    """It ran clearly more at the last scrape than at the one before: still taking requests
    in, so what waits is a ramp's arrivals, not a queue (see :attr:`queued`)."""
    queue: int = 0
    """Waiting requests at the last scrape beyond those we had just sent."""
    recent_starts: deque[float] = field(default_factory=deque)
    """When our requests to it started, for the last ``RECENT_S``."""
    ttft_recent: deque[float] = field(default_factory=lambda: deque(maxlen=TTFT_SAMPLES))
    """The last TTFTs (ms) of requests it served, for its first-byte deadline."""
    ttft_sorted: list[float] = field(default_factory=list)
    """The same samples in order, kept in step as they come (:func:`_add_ttft`): the
    deadline reads its percentile there instead of sorting them for every request."""
    consecutive_5xx: int = 0
    """5xx answers since its last first token (passive health)."""

    @property
    def limit(self) -> int:
        """Load at which it is saturated: learned slots plus the allowed queue, capped
        (inlined in :meth:`LoadTracker._saturated` and :meth:`LoadTracker.capacity`)."""
        if self.slots is None:
            return self.max_in_flight
        return max(1, min(self.max_in_flight, self.slots + self.max_waiting))

    @property
    def queued(self) -> bool:
        """A queue in two scrapes in a row, and the backend no longer runs more: full
        (inlined in :meth:`LoadTracker._saturated`)."""
        return self.queued_scrapes >= 2 and not self.admitting


class LoadTracker:
    """The load of this region's backends, from the router's counts and their metrics."""

    def __init__(self, backends: Iterable[BackendLoad], *, metrics_ttl_s: float = 5.0) -> None:
        self.backends: dict[str, BackendLoad] = {b.name: b for b in backends}
        self.metrics_ttl_s = metrics_ttl_s

    def __getitem__(self, name: str) -> BackendLoad:
        return self.backends[name]

    # --- inputs
    def started(self, name: str, now: float | None = None, *, probe: bool = False) -> None:
        """A request to ``name`` starts (a warmup ``probe`` is load, not a request served)."""
        b = self.backends[name]
        b.in_flight += 1
        if not probe:
            b.requests += 1
        if now is not None:
            times = b.recent_starts
            times.append(now)
            cutoff = now - RECENT_S
            # _forget_before inlined (a call a request); it stops at ``now`` at the latest
            while times[0] < cutoff:
                times.popleft()

    def unstarted(self, name: str) -> None:
        """Undo :meth:`started` for a request that did not go after all (its backend turned
        out full region-wide)."""
        b = self.backends[name]
        b.in_flight = max(0, b.in_flight - 1)
        b.requests = max(0, b.requests - 1)
        if b.recent_starts:
            b.recent_starts.pop()

    def observe_elsewhere(self, name: str, in_flight: int) -> None:
        """The other router processes have ``in_flight`` requests on ``name`` (shared state)."""
        self.backends[name].elsewhere = in_flight

    def finished(self, name: str, duration_ms: float | None = None) -> None:
        b = self.backends[name]
        b.in_flight = max(0, b.in_flight - 1)
        if duration_ms is not None:
            ewma = b.service_ms  # Ewma.add inlined: a call a request
            value = ewma.value
            ewma.value = (
                duration_ms if value is None
                else ewma.alpha * duration_ms + (1 - ewma.alpha) * value
            )

    def observe_ttft(self, name: str, ttft_ms: float, upstream_ms: float | None = None) -> None:
        """A first token from ``name``, ``ttft_ms`` after the request arrived and
        ``upstream_ms`` after it was sent there (this attempt): it serves, its run of 5xx
        ends."""
        b = self.backends[name]
        # Ewma.add and _add_ttft inlined: two calls a request.
        ewma = b.ttft_ms
        value = ewma.value
        ewma.value = (
            ttft_ms if value is None else ewma.alpha * ttft_ms + (1 - ewma.alpha) * value
        )
        sample = ttft_ms if upstream_ms is None else upstream_ms
        recent, ordered = b.ttft_recent, b.ttft_sorted
        if len(recent) == recent.maxlen:
            del ordered[bisect_left(ordered, recent[0])]
        recent.append(sample)
        insort(ordered, sample)
        b.consecutive_5xx = 0

    def observe_probe(self, name: str, ttft_ms: float) -> None:
        """A warmup probe (one token) answered in ``ttft_ms``: a TTFT sample for the
        first-byte deadline only (it says nothing of what users wait)."""
        _add_ttft(self.backends[name], ttft_ms)

    def observe_5xx(self, name: str) -> int:
        """A 5xx answer from ``name``; returns how many in a row it has given."""
        b = self.backends[name]
        b.consecutive_5xx += 1
        return b.consecutive_5xx

    def first_byte_timeout_s(
        self, name: str, *, multiple: float, min_s: float, max_s: float
    ) -> float:
        """How long a request may wait for the first byte of ``name``'s answer: ``multiple``
        times its recent high TTFT (the region's when it has served nothing yet), within
        ``[min_s, max_s]``; ``max_s`` when no TTFT was seen at all. A TTFT bounds the first
        byte from above (the head comes before the first token), so a backend past it is not
        merely slow."""
        b = self.backends[name]
        ordered = b.ttft_sorted
        if not b.ttft_recent or len(ordered) != len(b.ttft_recent):
            # Nothing served yet (the region's samples), or samples not added in step.
            samples = b.ttft_recent or [t for b in self.backends.values() for t in b.ttft_recent]
            if not samples:
                return max_s
            ordered = sorted(samples)
        high_ms = ordered[int(TTFT_PERCENTILE * (len(ordered) - 1))]
        return min(max_s, max(min_s, multiple * high_ms / 1000.0))

    def observe_metrics(self, name: str, metrics: BackendMetrics, now: float) -> None:
        b = self.backends[name]
        b.metrics, b.metrics_at = metrics, now
        b.in_flight_at_metrics = b.in_flight + b.elsewhere
        running = int(metrics.running or 0)
        # "Clearly": a full backend's count moves by a few as sequences end and others start.
        b.admitting = running > b.running + max(2, b.running // 20)
        b.running = running
        _forget_before(b.recent_starts, now - RECENT_S)
        b.queue = max(0, int(metrics.waiting or 0) - len(b.recent_starts))
        if b.queue > b.max_waiting:
            b.queued_scrapes += 1
            if b.queued:  # a queue that outlived a scheduler step: it runs all it can
                b.slots = running
        else:
            b.queued_scrapes = 0
            if b.slots is not None and running > b.slots:
                b.slots = running  # it ran more than we thought it could: it has room

    def set_health(self, name: str, healthy: bool) -> None:
        self.backends[name].healthy = healthy

    # --- outputs
    def _fresh(self, b: BackendLoad, now: float) -> BackendMetrics | None:
        if b.metrics is None or b.metrics_at is None:
            return None
        return b.metrics if now - b.metrics_at <= self.metrics_ttl_s else None

    def load(self, name: str, now: float) -> int:
        b = self.backends[name]
        ours = b.in_flight + b.elsewhere
        m = b.metrics  # _fresh inlined: asked of a request's every candidate backend
        if m is None or b.metrics_at is None or now - b.metrics_at > self.metrics_ttl_s:
            return ours
        others = int((m.running or 0) + (m.waiting or 0)) - b.in_flight_at_metrics
        return ours + max(0, others)

    def saturated(self, name: str, now: float) -> bool:
        return self._saturated(self.backends[name], now)

    def _saturated(self, b: BackendLoad, now: float) -> bool:
        # :meth:`_fresh`, :meth:`load` and the properties ``limit`` and ``queued`` inlined:
        # asked of every backend three times a request (the fair gate, the region's room,
        # the backend's choice), and a property is a Python call.
        if not b.healthy:
            return True
        ours = b.in_flight + b.elsewhere
        slots = b.slots
        limit = (
            b.max_in_flight if slots is None
            else max(1, min(b.max_in_flight, slots + b.max_waiting))
        )
        m = b.metrics
        if m is None or b.metrics_at is None or now - b.metrics_at > self.metrics_ttl_s:
            return ours >= limit
        if b.queued_scrapes >= 2 and not b.admitting and b.queue > b.max_waiting:
            return True  # its queue is longer than allowed, whatever it runs
        others = int((m.running or 0) + (m.waiting or 0)) - b.in_flight_at_metrics
        return ours + max(0, others) >= limit

    def available(self, now: float, among: Collection[str] | None = None) -> list[str]:
        """Healthy, unsaturated backends (of ``among``: those serving a request's model), in
        configuration order."""
        saturated = self._saturated
        out: list[str] = []
        for n, b in self.backends.items():  # a loop, not a listcomp: a listcomp is a call
            if (among is None or n in among) and not saturated(b, now):
                out.append(n)
        return out

    def room(self, now: float, among: Collection[str] | None = None) -> tuple[list[str], int]:
        """:meth:`available` and :meth:`capacity` (of ``among``) in one loop over the
        backends: a placement asks both (:meth:`~firstbyte.router.state.RouterState.room`)."""
        saturated = self._saturated
        out: list[str] = []
        total = 0
        for n, b in self.backends.items():
            # An unhealthy backend is saturated, and no part of the capacity.
            if b.healthy and (among is None or n in among):
                slots = b.slots  # BackendLoad.limit inlined
                total += (
                    b.max_in_flight if slots is None
                    else max(1, min(b.max_in_flight, slots + b.max_waiting))
                )
                if not saturated(b, now):
                    out.append(n)
        return out, total

    # The aggregates below are asked several times a request (admission, the fair gate,
    # routing): one loop each over the backends, no helper lists, generators or
    # comprehensions (a Python call, which each of them is, costs ~2k instructions, more
    # than a region's backends take to sum).
    def healthy(self, among: Collection[str] | None = None) -> list[str]:
        out: list[str] = []
        for n, b in self.backends.items():
            if b.healthy and (among is None or n in among):
                out.append(n)
        return out

    def region_saturated(self, now: float, among: Collection[str] | None = None) -> bool:
        saturated = self._saturated
        for n, b in self.backends.items():
            if (among is None or n in among) and not saturated(b, now):
                return False
        return True

    def queue_wait_ms(self, now: float, among: Collection[str] | None = None) -> float:
        """Expected wait before a new request starts on the best backend of this region (of
        ``among``)."""
        waits = [self._wait_ms(n, now) for n in self.healthy(among)]
        return min(waits) if waits else math.inf

    def _wait_ms(self, name: str, now: float) -> float:
        b = self.backends[name]
        excess = self.load(name, now) + 1 - b.limit
        if self._fresh(b, now) is not None and b.queued:
            excess = max(excess, b.queue + 1 - b.max_waiting)
        if excess <= 0:
            return 0.0
        service = b.service_ms.value or 1000.0
        return excess / b.limit * service

    def retry_after_s(self, now: float, among: Collection[str] | None = None) -> int:
        """``Retry-After`` for a rejected request: the drain estimate (of ``among``), whole
        seconds, >= 1."""
        wait = self.queue_wait_ms(now, among)
        if math.isinf(wait):
            return 5
        return max(1, math.ceil(wait / 1000.0))

    def in_flight(self, among: Collection[str] | None = None) -> int:
        total = 0
        for n, b in self.backends.items():
            if among is None or n in among:
                total += b.in_flight
        return total

    def capacity(self, among: Collection[str] | None = None) -> int:
        total = 0
        for n, b in self.backends.items():
            if b.healthy and (among is None or n in among):
                slots = b.slots  # BackendLoad.limit inlined
                total += (
                    b.max_in_flight if slots is None
                    else max(1, min(b.max_in_flight, slots + b.max_waiting))
                )
        return total

    def ttft_ms(self) -> float | None:
        values = [b.ttft_ms.value for b in self.backends.values() if b.ttft_ms.value is not None]
        return min(values) if values else None


def _add_ttft(b: BackendLoad, sample: float) -> None:
    """Add ``sample`` to ``b``'s recent TTFTs and to their sorted copy, the oldest leaving
    both when they are full (two binary searches and a move of at most
    :data:`TTFT_SAMPLES` pointers, where sorting them cost ~20k instructions a request)."""
    recent, ordered = b.ttft_recent, b.ttft_sorted
    if len(recent) == recent.maxlen:
        del ordered[bisect_left(ordered, recent[0])]
    recent.append(sample)
    insort(ordered, sample)


def _forget_before(times: deque[float], cutoff: float) -> None:
    while times and times[0] < cutoff:
        times.popleft()
