"""Weighted max-min fair shares of a budget among the flows asking for it (sans-IO, clock
passed in).

A *flow* is whoever competes for a budget: an API key for the region's capacity, a subject
(an app's end user) for its key's share. Each flow has requests in flight, requests waiting
for a slot (:mod:`firstbyte.router.fair_queue`) and, for a short while after it was refused
(:data:`ASK_WINDOW_S`), one more it is still asking for; a flow that had to wait for a slot
asks, for as long as it keeps starting requests within that window, for at least what it
held and waited for then (its clients come back: the slots it frees in a lull are kept for it,
not taken by a flow above its share). Its
*share* is the weighted max-min fair allocation of the budget (:func:`water_fill`): no flow
gets more than it asks for, and what one flow does not need is split among the others by
weight. The decision (:meth:`FairShare.decide`) admits a request when the flow stays within its
share, or when nothing is contended (work-conserving: a request the budget has room for is
never refused for fairness); it never refuses a flow below its share.

This is the core the admission stages (:mod:`firstbyte.router.tenancy`) and ``bench tenancy``
build on; it holds counts only and never touches a socket or a clock.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

__all__ = ["ASK_WINDOW_S", "Decision", "FairShare", "water_fill"]

K = TypeVar("K", bound=Hashable)

ASK_WINDOW_S = 2.0
"""A flow refused this recently still asks for one more request: its demand counts it, so a
slot that frees goes to it rather than to a flow already at its share (a client retries
within ``Retry-After``, 1 s, so two seconds cover one retry)."""

_EPSILON = 1e-9


def water_fill(
    budget: float, demands: Mapping[K, float], weights: Mapping[K, float] | None = None
) -> dict[K, float]:
    """The weighted max-min fair allocation of ``budget`` over ``demands``.

    Every flow gets ``min(demand, level * weight)`` for the one ``level`` at which the
    allocations add up to ``budget`` (or every demand is met, when the budget is larger).
    A missing weight is 1; weights must be positive. Exact up to float rounding."""
    weight = {k: (1.0 if weights is None else weights.get(k, 1.0)) for k in demands}
    alloc = {k: 0.0 for k in demands}
    left = max(0.0, budget)
    # Raise the water level flow by flow, in the order their demands are met.
    pending = sorted(
        (k for k, d in demands.items() if d > 0), key=lambda k: demands[k] / weight[k]
    )
    total_weight = sum(weight[k] for k in pending)
    for i, k in enumerate(pending):
        level = left / total_weight
        if demands[k] / weight[k] > level:  # no one left is met at this level: split it all
            for rest in pending[i:]:
                alloc[rest] = level * weight[rest]
            return alloc
        alloc[k] = float(demands[k])
        left -= demands[k]
        total_weight -= weight[k]
    return alloc


@dataclass(frozen=True, slots=True)
class Decision:
    """Whether a flow's new request is admitted, with what it was judged on."""

    admit: bool
    in_flight: int
    """The flow's requests in flight and waiting, before this one."""
    share: float
    """The flow's fair share of the budget, this request counted in its demand."""
    flows: int
    """Flows asking (in flight or refused recently), this one included."""


class FairShare(Generic[K]):
    """In-flight counts and recent refusals of flows; fair decisions over them."""

    # Slots: a key's subjects get one for each request in the usual case (made at its
    # start, dropped at its end), and every request reads and writes two.
    __slots__ = ("_asked_at", "_in_flight", "_peak", "_total", "_waiting", "ask_window_s")

    def __init__(self, ask_window_s: float = ASK_WINDOW_S) -> None:
        self.ask_window_s = ask_window_s
        self._in_flight: dict[K, int] = {}
        self._total = 0
        self._asked_at: dict[K, float] = {}
        self._waiting: dict[K, int] = {}
        self._peak: dict[K, tuple[float, float]] = {}
        """The most requests a flow held and waited for at once when one of them had to wait,
        and when it last waited or started one: its demand is at least that until it is
        quiet for the ask window."""

    def __len__(self) -> int:
        return len(self._in_flight)

    def active(self) -> bool:
        """Whether any flow has a request in flight or waiting, or was refused lately."""
        return bool(self._in_flight or self._asked_at or self._waiting or self._peak)

    def in_flight(self, flow: K) -> int:
        return self._in_flight.get(flow, 0)

    def has_room(self, budget: float) -> bool:
        """Nobody refused lately, waiting or keeping a demand, and ``budget`` has room for one
        more request besides those in flight: :meth:`decide` admits any flow's, whatever its
        weight (its first answer, without working out shares)."""
        return (not (self._asked_at or self._waiting or self._peak)
                and self._total + 1 <= budget + _EPSILON)

    def room_for(self, flow: K, budget: float) -> float | None:
        """:meth:`has_room`, and if so what of ``budget`` the other flows in flight leave to
        ``flow`` (its share: :meth:`decide` finds the same); None: no room. One call where
        asking both took four (it is asked at every request's fair gate)."""
        total = self._total
        if self._asked_at or self._waiting or self._peak or not total + 1 <= budget + _EPSILON:
            return None
        return budget - (total - self._in_flight.get(flow, 0))

    def total(self) -> int:
        return self._total

    def waiting(self, flow: K) -> int:
        return self._waiting.get(flow, 0)

    def wait(self, flow: K, now: float | None = None) -> None:
        """A request of ``flow`` waits for a slot from ``now``: it counts in the flow's demand
        at once, and the flow's demand stays at least what it asks now (in flight and
        waiting) while it keeps coming back: slots freed in its lulls are kept for it."""
        self._waiting[flow] = self._waiting.get(flow, 0) + 1
        if now is not None:
            asks = float(self.in_flight(flow) + self._waiting[flow])
            held = self._peak.get(flow)
            if held is not None and now - held[1] < self.ask_window_s:
                asks = max(asks, held[0])
            self._peak[flow] = (asks, now)

    def unwait(self, flow: K) -> None:
        """A request of ``flow`` stopped waiting (it got its slot, or gave up)."""
        left = self._waiting.get(flow, 0) - 1
        if left > 0:
            self._waiting[flow] = left
        else:
            self._waiting.pop(flow, None)

    def started(self, flow: K, now: float | None = None) -> None:
        """A request of ``flow`` was admitted at ``now`` (its demand is met: it asks no
        longer; a flow that waited keeps the demand it waited with, :meth:`wait`)."""
        self._in_flight[flow] = self._in_flight.get(flow, 0) + 1
        self._total += 1
        # Nobody refused or waiting lately (the usual case, twice a request: its key and its
        # subject): the two lookups below have nothing to find.
        if self._asked_at:
            self._asked_at.pop(flow, None)
        peak = self._peak.get(flow) if self._peak else None
        if now is not None and peak is not None and now - peak[1] < self.ask_window_s:
            self._peak[flow] = (peak[0], now)

    def finished(self, flow: K) -> None:
        """A request of ``flow`` ended (an idle flow is forgotten)."""
        held = self._in_flight.get(flow, 0)
        if held:
            self._total -= 1
        left = held - 1
        if left > 0:
            self._in_flight[flow] = left
        else:
            self._in_flight.pop(flow, None)

    def asked(self, flow: K, now: float) -> None:
        """A request of ``flow`` was refused at ``now``: it asks for one more for a while."""
        self._asked_at[flow] = now

    def demands(self, now: float, asking: K | None = None) -> dict[K, float]:
        """What each flow asks for: its requests in flight and waiting, one more if refused
        recently, at least what it asked when it last had to wait while it keeps coming back
        (``asking``: the flow deciding now, one more in any case)."""
        out: dict[K, float] = {k: float(n) for k, n in self._in_flight.items()}
        for flow, n in self._waiting.items():
            out[flow] = out.get(flow, 0.0) + n
        for flow, at in self._asked_at.items():
            if now - at < self.ask_window_s:
                out[flow] = out.get(flow, 0.0) + 1.0
        if asking is not None:
            out[asking] = float(self.in_flight(asking) + self.waiting(asking) + 1)
        for flow, (peak, at) in self._peak.items():
            if now - at < self.ask_window_s and peak > out.get(flow, 0.0):
                out[flow] = peak
        return out

    def shares(
        self, budget: float, now: float, weight_of: Callable[[K], float], asking: K | None = None
    ) -> dict[K, float]:
        """Every asking flow's fair share of ``budget`` (see :func:`water_fill`)."""
        demands = self.demands(now, asking)
        return water_fill(budget, demands, {k: weight_of(k) for k in demands})

    def decide(
        self,
        flow: K,
        budget: float,
        now: float,
        *,
        weight_of: Callable[[K], float],
        contended: bool,
    ) -> Decision:
        """Admit ``flow``'s new request if it stays within its share of ``budget``, counting
        the flow's waiting requests ahead of it.

        Over its share it is still admitted while the budget is not ``contended`` and no
        other flow is starved (refused recently and below its share): the slot is free and
        nobody else wants it. A refusal is not recorded here (call :meth:`asked`)."""
        mine = self.in_flight(flow) + self.waiting(flow)
        if not (self._asked_at or self._waiting):
            # Nobody refused lately or waiting, and room for this one besides what the flows
            # that waited keep (the common case: no sharing, O(flows that waited)); the flow
            # may take all that the others do not hold or keep.
            kept = self._kept(now)
            if self._total + 1 + kept <= budget + _EPSILON:
                flows = len(self._in_flight) + (flow not in self._in_flight)
                return Decision(True, mine, budget - (self._total - mine) - kept, flows)
        demands = self.demands(now, flow)
        total = sum(demands.values())
        if total <= budget + _EPSILON:  # expired asks left: still room for every demand
            return Decision(True, mine, budget - (total - demands[flow]), len(demands))
        shares = water_fill(budget, demands, {k: weight_of(k) for k in demands})
        share = shares[flow]
        within = mine + 1 <= share + _EPSILON
        admit = within
        if not within and not contended:
            admit = not any(
                k != flow and self.in_flight(k) + 1 <= shares.get(k, 0.0) + _EPSILON
                for k in (*self._asking(now), *self._waiting)
            )
        return Decision(admit, mine, share, len(shares))

    def forget_asks(self, now: float) -> None:
        """Drop refusals older than the ask window (housekeeping)."""
        for flow in [k for k, at in self._asked_at.items() if now - at >= self.ask_window_s]:
            del self._asked_at[flow]
        for flow in [k for k, (_, at) in self._peak.items() if now - at >= self.ask_window_s]:
            del self._peak[flow]

    def _kept(self, now: float) -> float:
        """What the flows that waited keep beyond what they hold (:meth:`wait`)."""
        window = self.ask_window_s
        return sum(max(0.0, peak - self.in_flight(k) - self.waiting(k))
                   for k, (peak, at) in self._peak.items() if now - at < window)

    def _asking(self, now: float) -> list[K]:
        """Flows refused within the ask window, or keeping the demand they waited with."""
        window = self.ask_window_s
        return [*(k for k, at in self._asked_at.items() if now - at < window),
                *(k for k, (_, at) in self._peak.items() if now - at < window)]
