"""Choosing the region that will answer first (sans-IO).

For each candidate region R the expected time to first token, seen from the client, is

    rtt(client, R) + queue_wait(R) + prefill(R) [+ forward_overhead if R is not this region]

- ``rtt``: from great-circle distance (:func:`firstbyte.router.geo.estimate_rtt_ms`). A client whose
  address is unknown counts as being at this region; for such clients a peer's RTT is the
  measured router-to-router RTT (EWMA of status polls) when there is one.
- ``queue_wait``: this region's own estimate (:class:`firstbyte.router.backpressure.LoadTracker`); a
  peer's is what it publishes in ``/v1/edge/status``.
- ``prefill``: uncached prompt tokens * ``prefill_ms_per_1k_tokens``; the warm prefix the
  request starts with counts as cached in a region that publishes it as warm.

The router assumes it is the client's entry point and that the path client -> this router ->
R costs about rtt(client, R) (true when the entry router is near the client: GeoDNS or
anycast). When another region wins by more than ``forward_margin_ms`` the request is forwarded
there; the response then says ``x-firstbyte-better-region`` so the SDK can go directly.

Only healthy, unsaturated regions with fresh state that serve the request's model are
candidates (the caller passes those, with their figures for that model). A region that does not
serve the model (``here.serves`` false) forwards the request to the candidate expected to answer
first: not a spill (this region is not full), and no ``better_region`` hint, which would move
the client's other models too. A request that was already forwarded by a peer is never
forwarded again. Leaving a *saturated* region is a spill and
needs a slot of the spill budget; with no candidate or no slot the answer is a rejection
(429 with ``Retry-After``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum

import msgspec

from firstbyte.router.geo import GeoPoint, Location, estimate_rtt_ms

__all__ = ["RegionCandidate", "RegionDecision", "RegionModel", "Verdict", "choose_region"]


class Verdict(Enum):
    LOCAL = "local"
    FORWARD = "forward"
    """Another region is expected to answer first (not a spill: this region has room)."""
    SPILL = "spill"
    """This region is saturated; another region has room."""
    REJECT = "reject"


@dataclass(frozen=True, slots=True)
class RegionCandidate:
    """One region as the chooser sees it."""

    name: str
    point: GeoPoint | None
    healthy: bool
    saturated: bool
    queue_wait_ms: float
    warm_prefixes: frozenset[str] = frozenset()
    measured_rtt_ms: float | None = None
    """Router-to-router RTT measured by status polls (peers only)."""
    public_url: str | None = None
    serves: bool = True
    """Some backend of the region serves the request's model (always true of a peer passed
    to :func:`choose_region`)."""


# A msgspec Struct, not a frozen dataclass: made once or twice a request, and a frozen
# dataclass's __init__ is a Python call setting each field through object.__setattr__.
class RegionDecision(msgspec.Struct, frozen=True):
    verdict: Verdict
    region: str
    """The region to serve from (this one for LOCAL and REJECT)."""
    expected_ms: Mapping[str, float] = msgspec.field(default_factory=dict)
    better_region: str | None = None
    """A region the client should use directly next time, if not the one it reached."""


@dataclass(frozen=True, slots=True)
class RegionModel:
    prefill_ms_per_1k_tokens: float = 16.0
    forward_overhead_ms: float = 5.0
    forward_margin_ms: float = 20.0

    def rtt_ms(self, client: GeoPoint | None, here: RegionCandidate, r: RegionCandidate) -> float:
        if client is None:
            if r.name == here.name:
                return 0.0
            if r.measured_rtt_ms is not None:
                return r.measured_rtt_ms
            client = here.point
        if client is None or r.point is None:
            return 0.0 if r.name == here.name else math.inf
        return estimate_rtt_ms(client, r.point)

    def prefill_ms(
        self, prompt_tokens: int, prefix: str | None, prefix_tokens: int, r: RegionCandidate
    ) -> float:
        cached = prefix_tokens if prefix is not None and prefix in r.warm_prefixes else 0
        return max(0, prompt_tokens - cached) * self.prefill_ms_per_1k_tokens / 1000.0

    def expected_ms(
        self,
        client: GeoPoint | None,
        here: RegionCandidate,
        r: RegionCandidate,
        prompt_tokens: int,
        prefix: str | None,
        prefix_tokens: int,
    ) -> float:
        cost = self.rtt_ms(client, here, r) + r.queue_wait_ms
        cost += self.prefill_ms(prompt_tokens, prefix, prefix_tokens, r)
        if r.name != here.name:
            cost += self.forward_overhead_ms
        return cost


def choose_region(
    model: RegionModel,
    here: RegionCandidate,
    peers: Mapping[str, RegionCandidate],
    *,
    client: Location | None,
    prompt_tokens: int = 0,
    prefix: str | None = None,
    prefix_tokens: int = 0,
    forwarded: bool = False,
    spill_slot: bool = True,
) -> RegionDecision:
    """Decide where a request is served.

    ``prefix`` is the hash of the warm prefix the prompt starts with (if any) and
    ``prefix_tokens`` its length; ``spill_slot`` says whether the spill budget has room.
    """
    point = client.point if client is not None else None
    local_ok = here.healthy and not here.saturated
    if forwarded:
        verdict = Verdict.LOCAL if local_ok else Verdict.REJECT
        return RegionDecision(verdict, here.name)
    expected: dict[str, float] = {}
    for r in (here, *peers.values()) if here.serves else peers.values():
        expected[r.name] = model.expected_ms(point, here, r, prompt_tokens, prefix, prefix_tokens)
    candidates = [p for p in peers.values() if p.healthy and not p.saturated]
    best_peer = min(candidates, key=lambda p: expected[p.name], default=None)
    if not here.serves:
        if best_peer is None:
            return RegionDecision(Verdict.REJECT, here.name, expected, None)
        return RegionDecision(Verdict.FORWARD, best_peer.name, expected, None)
    better = _better_direct(model, point, here, candidates, expected, local_ok)
    if local_ok:
        if best_peer is not None and (
            expected[best_peer.name] + model.forward_margin_ms < expected[here.name]
        ):
            return RegionDecision(Verdict.FORWARD, best_peer.name, expected, best_peer.name)
        return RegionDecision(Verdict.LOCAL, here.name, expected, better)
    if best_peer is None or not spill_slot:
        return RegionDecision(Verdict.REJECT, here.name, expected, None)
    return RegionDecision(Verdict.SPILL, best_peer.name, expected, None)


def _better_direct(
    model: RegionModel,
    point: GeoPoint | None,
    here: RegionCandidate,
    candidates: list[RegionCandidate],
    expected: Mapping[str, float],
    local_ok: bool,
) -> str | None:
    # Only a client we can locate gets a hint: for unknown clients "nearest" means nothing.
    if point is None or not candidates or not local_ok:
        return None
    best = min(candidates, key=lambda p: expected[p.name] - model.forward_overhead_ms)
    if (
        expected[best.name] - model.forward_overhead_ms + model.forward_margin_ms
        < expected[here.name]
    ):
        return best.name
    return None
