"""The WAN emulator's sans-IO core: when does each packet leave, and does it leave at all.

No sockets, no clock: every call takes ``now_ns`` (any monotonic nanosecond clock) and the
answers are release times on the same clock. The forwarder (``forwarder.py``) feeds it the
packets it reads from the TUN devices and writes out what :meth:`DelayLine.pop_due` returns.

Per direction of each host pair (a :class:`Link`) it models, in this order:

1. loss: each packet is dropped with probability ``loss_pct / 100`` (a seeded PRNG, so a run
   is reproducible for a given seed and packet sequence);
2. rate limit: a serialising link of ``rate_bps`` bits/s; a packet departs when the link has
   sent every earlier packet, then takes ``8 * size / rate_bps`` seconds to send. A packet
   that would wait in the queue longer than ``queue_limit_ns`` is dropped (drop-tail);
3. propagation: ``delay_ns`` plus jitter drawn uniformly from ``[-jitter_ns, +jitter_ns]``
   (clamped so it never goes below zero delay), then raised to the previous packet's release
   time on the link so jitter never reorders packets (like a FIFO path, unlike netem's default).
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass, field
from enum import Enum

NS_PER_S = 1_000_000_000
NS_PER_MS = 1_000_000


@dataclass(frozen=True)
class LinkParams:
    """One direction of a host pair. ``delay_ns`` is the one-way delay (RTT/2)."""

    delay_ns: int
    jitter_ns: int = 0
    loss_pct: float = 0.0
    rate_bps: float | None = None
    queue_limit_ns: int = 200 * NS_PER_MS

    def __post_init__(self) -> None:
        if self.delay_ns < 0:
            raise ValueError(f"delay_ns must be >= 0, got {self.delay_ns}")
        if self.jitter_ns < 0:
            raise ValueError(f"jitter_ns must be >= 0, got {self.jitter_ns}")
        if not 0.0 <= self.loss_pct <= 100.0:
            raise ValueError(f"loss_pct must be within 0..100, got {self.loss_pct}")
        if self.rate_bps is not None and self.rate_bps <= 0:
            raise ValueError(f"rate_bps must be > 0 or None, got {self.rate_bps}")
        if self.queue_limit_ns < 0:
            raise ValueError(f"queue_limit_ns must be >= 0, got {self.queue_limit_ns}")


class Verdict(Enum):
    """What happened to a packet offered to a link."""

    SCHEDULED = "scheduled"
    LOST = "lost"
    QUEUE_FULL = "queue_full"


@dataclass
class Link:
    """The state of one direction of one host pair: a lossy, rate-limited FIFO delay."""

    params: LinkParams
    rng: random.Random
    busy_until_ns: int = 0
    last_release_ns: int = 0
    counts: dict[Verdict, int] = field(default_factory=lambda: {v: 0 for v in Verdict})

    def offer(self, size: int, now_ns: int) -> tuple[Verdict, int]:
        """Offer a packet of ``size`` bytes that arrived at ``now_ns``.

        Returns the verdict and, when scheduled, the release time (>= ``now_ns`` and >= every
        earlier release time on this link); the release time is 0 for dropped packets.
        """
        p = self.params
        if p.loss_pct > 0.0 and self.rng.random() * 100.0 < p.loss_pct:
            self.counts[Verdict.LOST] += 1
            return Verdict.LOST, 0
        depart = now_ns
        if p.rate_bps is not None:
            start = max(now_ns, self.busy_until_ns)
            if start - now_ns > p.queue_limit_ns:
                self.counts[Verdict.QUEUE_FULL] += 1
                return Verdict.QUEUE_FULL, 0
            depart = start + int(size * 8 * NS_PER_S / p.rate_bps)
            self.busy_until_ns = depart
        delay = p.delay_ns
        if p.jitter_ns:
            delay = max(0, delay + self.rng.randint(-p.jitter_ns, p.jitter_ns))
        release = max(depart + delay, self.last_release_ns)
        self.last_release_ns = release
        self.counts[Verdict.SCHEDULED] += 1
        return Verdict.SCHEDULED, release


class DelayLine:
    """All links of an emulated network and the packets in flight on them.

    Hosts are small integers (the forwarder's index of TUN devices). A pair without a link
    configured is unroutable: its packets are dropped and counted in ``unroutable``.
    """

    def __init__(self, links: dict[tuple[int, int], LinkParams], seed: int = 0) -> None:
        # A string seed is hashed deterministically by random.Random (unlike hash()).
        self.links: dict[tuple[int, int], Link] = {
            key: Link(params, random.Random(f"{seed}:{key[0]}:{key[1]}"))
            for key, params in links.items()
        }
        self.unroutable = 0
        self._heap: list[tuple[int, int, int, bytes]] = []
        self._seq = 0

    def push(self, packet: bytes, src: int, dst: int, now_ns: int) -> Verdict | None:
        """Offer ``packet`` from host ``src`` to host ``dst``; None when the pair is unknown."""
        link = self.links.get((src, dst))
        if link is None:
            self.unroutable += 1
            return None
        verdict, release = link.offer(len(packet), now_ns)
        if verdict is Verdict.SCHEDULED:
            # seq breaks ties in arrival order, so equal release times keep FIFO order.
            self._seq += 1
            heapq.heappush(self._heap, (release, self._seq, dst, packet))
        return verdict

    def next_deadline(self) -> int | None:
        """The earliest release time of a packet in flight, or None when none is."""
        return self._heap[0][0] if self._heap else None

    def pop_due(self, now_ns: int) -> list[tuple[int, bytes, int]]:
        """Remove and return ``(dst, packet, release_ns)`` for every packet due at ``now_ns``,
        in release order."""
        out: list[tuple[int, bytes, int]] = []
        heap = self._heap
        while heap and heap[0][0] <= now_ns:
            release, _, dst, packet = heapq.heappop(heap)
            out.append((dst, packet, release))
        return out

    def in_flight(self) -> int:
        return len(self._heap)
