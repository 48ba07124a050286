"""Choosing a region from the client's side (sans-IO: every method takes ``now``).

The SDK knows a list of regions (configured, or read from any router's
``GET /v1/edge/status``: its ``region``/``public_url`` and its ``peers``) and measures the
round trip to each (``AsyncClient.probe_regions``: the fastest of a few cheap requests on a
warm connection). The region with the lowest RTT EWMA is used by default, the second one is
the standby worth keeping a warm connection to. A router that would rather have served a
request from elsewhere says so with ``x-firstbyte-better-region`` (and ``-url``): when that
names a *configured* region (by its name, the name its router reported, or its URL's origin)
it is preferred for ``hint_ttl_s``. A hint never adds a region: where requests and API keys
go comes from the configuration only, not from a response header.

On a connect failure, 429 or 503 the region is set aside for its ``Retry-After`` (or an
exponential backoff) and the next region is tried; when every region is set aside,
:meth:`RegionSelector.wait_s` says how long until the first comes back.

RTTs are measured again and again (the client re-probes periodically), and two regions whose
RTTs differ by noise must not swap places at every probe: that would move the warm primary
and standby connections back and forth. So the primary and standby are *kept*
(:meth:`RegionSelector.keep`) and :meth:`RegionSelector.proposal` replaces a kept one only by
a region whose RTT is lower by at least ``max(switch_margin_ms, switch_ratio x its RTT)``
(2 ms or 10 %), or when the kept one is set aside. Kept regions rank first (after a hinted
one); until something is kept, the ranking is by RTT alone.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from firstbyte.protocol.edge import PublicEdgeStatus

__all__ = ["Region", "RegionSelector", "regions_from_status", "same_origin"]


@dataclass(frozen=True, slots=True)
class Region:
    name: str
    url: str
    """Base URL of the region's router (what ``AsyncClient(base_url=...)`` takes)."""


def regions_from_status(status: PublicEdgeStatus, url: str | None = None) -> list[Region]:
    """The regions a router's ``/v1/edge/status`` document names (itself first)."""
    out: list[Region] = []
    own = status.public_url or url
    if status.region and own:
        out.append(Region(status.region, own))
    for peer in status.peers:
        if peer.name and peer.url and all(r.name != peer.name for r in out):
            out.append(Region(peer.name, peer.url))
    return out


def same_origin(a: str, b: str) -> bool:
    """True when two URLs have the same scheme, host and port (paths such as ``/v1`` aside)."""
    default = {"http": 80, "https": 443}

    def key(url: str) -> tuple[str, str | None, int | None]:
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        return scheme, parts.hostname, parts.port or default.get(scheme)

    try:
        ka, kb = key(a), key(b)
    except ValueError:  # a malformed port in a header must not break a request
        return False
    return ka[1] is not None and ka == kb


@dataclass
class _State:
    region: Region
    rtt_ms: float | None = None
    unavailable_until: float = 0.0
    failures: int = 0
    hinted_until: float = 0.0
    label: str | None = None
    """The name the region's router gives itself (``region`` in ``/v1/edge/status``)."""


class RegionSelector:
    """Ranks regions by measured RTT; sets failing ones aside (see the module docstring)."""

    def __init__(
        self,
        regions: Iterable[Region],
        *,
        alpha: float = 0.3,
        backoff_s: float = 1.0,
        max_backoff_s: float = 60.0,
        hint_ttl_s: float = 300.0,
        switch_margin_ms: float = 2.0,
        switch_ratio: float = 0.10,
    ) -> None:
        self._states = {r.name: _State(r) for r in regions}
        if not self._states:
            raise ValueError("a RegionSelector needs at least one region")
        self.alpha = alpha
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.hint_ttl_s = hint_ttl_s
        self.switch_margin_ms = switch_margin_ms
        self.switch_ratio = switch_ratio
        self._kept: list[str] = []
        """Primary and standby (names), as last given to :meth:`keep`."""
        self.switches = 0
        """How many times :meth:`keep` changed the primary (after the first choice)."""

    @property
    def regions(self) -> list[Region]:
        return [s.region for s in self._states.values()]

    def add(self, region: Region) -> None:
        self._states.setdefault(region.name, _State(region))

    def rtt_ms(self, name: str) -> float | None:
        return self._states[name].rtt_ms

    # --- inputs
    def observe_rtt(self, name: str, rtt_ms: float) -> None:
        """A round-trip measurement to ``name`` (probe, or time to first byte minus server time)."""
        state = self._states[name]
        state.rtt_ms = rtt_ms if state.rtt_ms is None else (
            self.alpha * rtt_ms + (1 - self.alpha) * state.rtt_ms
        )

    def succeeded(self, name: str) -> None:
        state = self._states[name]
        state.failures, state.unavailable_until = 0, 0.0

    def failed(self, name: str, now: float, retry_after_s: float | None = None) -> None:
        """Connect failure, 429 or 503: set aside for ``Retry-After`` or a growing backoff."""
        state = self._states[name]
        state.failures += 1
        if retry_after_s is None:
            retry_after_s = min(self.max_backoff_s, self.backoff_s * 2 ** (state.failures - 1))
        state.unavailable_until = max(state.unavailable_until, now + max(0.0, retry_after_s))

    def learn_label(self, name: str, label: str) -> None:
        """The router at region ``name`` calls itself ``label`` (hints use router names)."""
        self._states[name].label = label

    def label(self, name: str) -> str | None:
        return self._states[name].label

    def unlabelled(self) -> bool:
        """True while some region's router name is unknown (a probe would learn it)."""
        return any(s.label is None for s in self._states.values())

    def match(self, name: str, url: str | None) -> Region | None:
        """The configured region a router's ``name`` / ``url`` refers to, if any."""
        for s in self._states.values():
            if name in (s.region.name, s.label):
                return s.region
        if url:
            for s in self._states.values():
                if same_origin(s.region.url, url):
                    return s.region
        return None

    def hint(self, name: str, url: str | None, now: float) -> Region | None:
        """A router said ``x-firstbyte-better-region: name`` (``-url``): prefer it for a while.

        Only a configured region can be preferred (matched as :meth:`match` says); a hint
        naming anything else is ignored and returns None. Returns the preferred region.
        """
        region = self.match(name, url)
        if region is not None:
            self._states[region.name].hinted_until = now + self.hint_ttl_s
        return region

    def keep(self, regions: Sequence[Region]) -> None:
        """Make ``regions`` (primary, then standby) the kept ones: they rank first (after a
        hinted region) until the next :meth:`keep`. The caller warms them before calling this
        (see :meth:`proposal`)."""
        names = [r.name for r in regions]
        for name in names:
            if name not in self._states:
                raise KeyError(f"not a configured region: {name!r}")
        if self._kept and names and names[0] != self._kept[0]:
            self.switches += 1
        self._kept = names

    # --- outputs
    def available(self, name: str, now: float) -> bool:
        return self._states[name].unavailable_until <= now

    def aside_s(self, name: str, now: float) -> float:
        """Seconds until ``name`` is available again (0: it is)."""
        return max(0.0, self._states[name].unavailable_until - now)

    def beats(self, challenger: str, incumbent: str) -> bool:
        """True when ``challenger``'s RTT is lower than ``incumbent``'s by the switch margin,
        ``max(switch_margin_ms, switch_ratio x incumbent's RTT)``: more than noise."""
        a, b = self._states[challenger].rtt_ms, self._states[incumbent].rtt_ms
        if a is None:
            return False
        if b is None:
            return True
        return a < b - max(self.switch_margin_ms, self.switch_ratio * b)

    def proposal(self, now: float) -> list[Region]:
        """The primary and standby to keep next (up to two available regions), by RTT with
        hysteresis: each kept one stays in its place unless it is set aside or the fastest
        region not yet placed :meth:`beats` it. Pure: the caller warms connections to these,
        then calls :meth:`keep`."""
        candidates = self._by_rtt(now)
        chosen: list[str] = []
        for slot in range(2):
            rest = [s.region.name for s in candidates if s.region.name not in chosen]
            if not rest:
                break
            incumbent = self._kept[slot] if slot < len(self._kept) else None
            if incumbent in rest and not self.beats(rest[0], incumbent):
                chosen.append(incumbent)
            else:
                chosen.append(rest[0])
        return [self._states[name].region for name in chosen]

    def ranked(self, now: float) -> list[Region]:
        """Available regions, best first: hinted, then the kept primary and standby, then by
        RTT (unmeasured last, in the configured order)."""
        kept = {name: i for i, name in enumerate(self._kept)}

        def key(s: _State) -> tuple[int, int]:
            return (0 if s.hinted_until > now else 1, kept.get(s.region.name, len(kept)))

        # A stable sort: within the same (hinted, kept) place the RTT order stays.
        return [s.region for s in sorted(self._by_rtt(now), key=key)]

    def _by_rtt(self, now: float) -> list[_State]:
        """Available regions by RTT; unmeasured ones last, in the configured order."""
        order = {name: i for i, name in enumerate(self._states)}
        return sorted(
            (s for s in self._states.values() if s.unavailable_until <= now),
            key=lambda s: (s.rtt_ms if s.rtt_ms is not None else float("inf"),
                           order[s.region.name]),
        )

    def choose(self, now: float) -> Region | None:
        """The region to send the next request to; ``None`` if all are set aside."""
        ranked = self.ranked(now)
        return ranked[0] if ranked else None

    def standby(self, now: float) -> Region | None:
        """The second-best region: keep a prewarmed connection to it for fast failover."""
        ranked = self.ranked(now)
        return ranked[1] if len(ranked) > 1 else None

    def failover(self, failed: str, now: float) -> Region | None:
        """After ``failed`` failed (and :meth:`failed` was called): the next region to try."""
        return next((r for r in self.ranked(now) if r.name != failed), None)

    def wait_s(self, now: float) -> float:
        """Seconds until some region is available again (0 if one is)."""
        return max(0.0, min(s.unavailable_until for s in self._states.values()) - now)

    def __repr__(self) -> str:
        parts: Sequence[str] = [
            f"{s.region.name}{f' ({s.label})' if s.label and s.label != s.region.name else ''}"
            f"={'?' if s.rtt_ms is None else f'{s.rtt_ms:.1f}ms'}"
            for s in self._states.values()
        ]
        return f"<RegionSelector [{', '.join(parts)}]>"
