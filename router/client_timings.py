"""Client-perceived latency: reports of opted-in clients aggregated into Prometheus histograms.

Sans-IO: :class:`ClientLatency` is given decoded reports, the reporting client's country and
the router's own upstream TTFT of each reported stream; it decides whether a report is
plausible, and renders two histogram families next to the router's server-side
``firstbyte_router_ttft_seconds``:

- ``firstbyte_client_ttft_seconds``: request start to first content chunk, as the client
  felt it (``first_token_ms``);
- ``firstbyte_client_network_seconds``: that TTFT minus the upstream's own time to first
  token for the same stream (joined by stream id, so only for streams this router still
  holds): connection setup, the request's and the first token's transit, and the router's
  queueing and routing. A record whose stream is not found is counted as ``unjoined`` and
  adds to the TTFT histogram only: one definition per histogram, never an estimate.

A key's records are accepted only for streams this router started for it (:class:`Served`):
each stream started for a key, by the region that served it, lets the key report one record
naming that region within ``SERVED_WINDOW_S``; a record with no such stream left is refused
(``not_served``). So a key cannot post more records than it had streams, nor name a region
that never served it.

Both are labelled ``region`` (this router's region or a configured peer: the region that
served), ``country`` (GeoIP of the reporting client's address: at most ``max_countries``
distinct values, each key bringing in at most ``max_countries_per_key`` of them, then
``other``; ``unknown`` when the database does not know it),
``transport``, ``http`` (``1.1``, ``2``, ``3``) and ``conn`` (``cold``, ``warm``, ``prewarmed``,
``0rtt``).
Every label takes a value from a fixed or bounded set, so the number of series is bounded
whatever clients send. Refused reports are counted by reason.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Iterable

from firstbyte.protocol.timings import (
    ORDER_SLACK_MS,
    TimingsRecord,
    TimingsReport,
    connection_kind,
    implausible,
)

from .hosting.prometheus import Histogram, family, labels, render_counter
from .metrics import SUM_SPEC, TTFT_BUCKETS_S

__all__ = [
    "NETWORK_BUCKETS_S",
    "REJECTION_REASONS",
    "SERVED_WINDOW_S",
    "ClientLatency",
    "CountryLabels",
    "Served",
]

NETWORK_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

REJECTION_REASONS = (
    "disabled", "rate_limited", "too_large", "malformed", "too_many_records",
    "unknown_transport", "unknown_http_version", "out_of_range", "unordered",
    "unknown_region", "faster_than_server", "not_served",
)
"""Every ``reason`` label of ``firstbyte_client_timings_rejected_total``."""

Series = tuple[str, str, str, str, str]
"""(region, country, transport, http, conn)."""


SERVED_WINDOW_S = 600.0
"""How long a served stream lets its key report it: the longest plausible record (ten
minutes, :data:`~firstbyte.protocol.timings.MAX_MS`); the SDK reports within seconds."""

_SLOT_S = 60.0
"""Served streams are counted per minute: a key costs at most ten counters per region."""


class Served:
    """Streams started per key and serving region, each good for one reported record.

    Sans-IO (``now`` passed in). Per (owner, region): a queue of ``[minute, count]`` over the
    last :data:`SERVED_WINDOW_S`, so memory is bounded by keys x regions, not by streams.
    """

    def __init__(self, window_s: float = SERVED_WINDOW_S) -> None:
        self.window_s = window_s
        self._slots: dict[tuple[bytes, str], deque[list[float]]] = {}

    def started(self, owner: bytes, region: str, now: float) -> None:
        """``owner`` had a stream served by ``region``."""
        slots = self._slots.get((owner, region))
        if slots is None:
            slots = self._slots[(owner, region)] = deque()
        minute = now - now % _SLOT_S
        if slots and slots[-1][0] == minute:
            slots[-1][1] += 1
        else:
            slots.append([minute, 1])

    def available(self, owner: bytes, region: str, now: float) -> int:
        """Records ``owner`` may still report for ``region``."""
        slots = self._expire(owner, region, now)
        return int(sum(count for _, count in slots)) if slots else 0

    def take(self, owner: bytes, region: str, count: int, now: float) -> None:
        """Spend ``count`` records (no more than :meth:`available`), oldest streams first."""
        slots = self._expire(owner, region, now)
        while count and slots:
            used = min(count, int(slots[0][1]))
            slots[0][1] -= used
            count -= used
            if not slots[0][1]:
                slots.popleft()

    def forget_old(self, now: float) -> None:
        """Drop keys whose streams are all past the window."""
        for key in list(self._slots):
            if not self._expire(*key, now):
                del self._slots[key]

    def _expire(self, owner: bytes, region: str, now: float) -> deque[list[float]] | None:
        slots = self._slots.get((owner, region))
        while slots and slots[0][0] + _SLOT_S <= now - self.window_s:
            slots.popleft()
        return slots


class CountryLabels:
    """The ``country`` label of a client: its ISO code for the first ``max_countries`` codes
    seen, ``other`` for later ones, ``unknown`` when there is no code. One key brings in at
    most ``max_per_key`` codes (0: no bound per key), so one tenant reporting from many
    countries cannot push the others' into ``other``."""

    def __init__(self, max_countries: int, max_per_key: int = 0) -> None:
        self.max_countries = max_countries
        self.max_per_key = max_per_key
        self.known: set[str] = set()
        self.brought: Counter[bytes] = Counter()
        """How many of :attr:`known` each key brought in."""

    def label(self, country: str | None, owner: bytes = b"") -> str:
        if not country:
            return "unknown"
        if country in self.known:
            return country
        if len(self.known) >= self.max_countries:
            return "other"
        if self.max_per_key and self.brought[owner] >= self.max_per_key:
            return "other"
        self.known.add(country)
        self.brought[owner] += 1
        return country


class ClientLatency:
    """The client timing histograms of one router process (see the module docstring)."""

    def __init__(
        self,
        regions: Iterable[str],
        *,
        max_countries: int,
        max_records: int,
        max_countries_per_key: int = 0,
    ) -> None:
        self.regions = frozenset(regions)
        """Accepted ``region`` values: this router's region and its peers."""
        self.max_records = max_records
        self.countries = CountryLabels(max_countries, max_countries_per_key)
        self.served = Served()
        """The streams each key may still report (:attr:`stream_started`)."""
        self.stream_started: Callable[[bytes, str, float], None] = self.served.started
        """``stream_started(owner, region, now)``: a stream of ``owner`` served by ``region``
        started here, one record it may report. :meth:`Served.started` itself, once a
        stream: a method passing it on was a Python call more."""
        self.ttft: dict[Series, Histogram] = {}
        self.network: dict[Series, Histogram] = {}
        self.records: Counter[str] = Counter()
        """Accepted records: ``joined`` (network time known) or ``unjoined``."""
        self.rejected: Counter[str] = Counter()

    def too_many(self, report: TimingsReport) -> bool:
        """More records than a report may hold (checked before any record is looked at)."""
        return len(report.records) > self.max_records

    def refusal(
        self,
        report: TimingsReport,
        server_ttft_ms: list[float | None],
        owner: bytes,
        now: float,
    ) -> tuple[str, int] | None:
        """Why ``owner``'s ``report`` is refused and the index of the first record at fault,
        or None to accept it. ``server_ttft_ms`` is the router's upstream TTFT of each
        record's stream (None when it is not known here)."""
        wanted: Counter[str] = Counter()
        for i, (record, server) in enumerate(zip(report.records, server_ttft_ms, strict=True)):
            reason = implausible(record)
            if reason is None and record.region not in self.regions:
                reason = "unknown_region"
            if reason is None and server is not None and (
                record.first_token_ms < server - ORDER_SLACK_MS
            ):
                reason = "faster_than_server"  # the client's TTFT contains the upstream's
            if reason is None:
                wanted[record.region] += 1
                if wanted[record.region] > self.served.available(owner, record.region, now):
                    reason = "not_served"  # more records than streams this key had there
            if reason is not None:
                return reason, i
        return None

    def reject(self, reason: str) -> None:
        self.rejected[reason] += 1

    def observe(
        self,
        report: TimingsReport,
        country: str | None,
        server_ttft_ms: list[float | None],
        owner: bytes,
        now: float,
    ) -> None:
        """Add ``owner``'s accepted report's records (``country``: the reporting client's),
        spending the streams they report."""
        label = self.countries.label(country, owner)
        for region, count in Counter(record.region for record in report.records).items():
            self.served.take(owner, region, count, now)
        for record, server in zip(report.records, server_ttft_ms, strict=True):
            series = _series(record, label)
            ttft_s = record.first_token_ms / 1000
            _histogram(self.ttft, series, TTFT_BUCKETS_S).observe(ttft_s)
            if server is None:
                self.records["unjoined"] += 1
                continue
            self.records["joined"] += 1
            network_s = max(0.0, record.first_token_ms - server) / 1000
            _histogram(self.network, series, NETWORK_BUCKETS_S).observe(network_s)

    def render(self) -> list[str]:
        """The families as Prometheus text lines (for ``/metrics``)."""
        lines = _render_family(
            "firstbyte_client_ttft_seconds",
            "Time to first token as opted-in clients felt it (request start to first content"
            " chunk), by serving region, client country, transport, HTTP version and"
            " connection (cold, warm, prewarmed, 0rtt).",
            self.ttft,
        )
        lines += _render_family(
            "firstbyte_client_network_seconds",
            "Client-felt TTFT minus the upstream's own TTFT for the same stream: connection"
            " setup, request and first-token transit, router queueing and routing.",
            self.network,
        )
        lines += render_counter(
            "firstbyte_client_timings_records_total",
            "Client timing records accepted; joined: the stream was found and network time"
            " observed.",
            [(labels(join=k), n) for k, n in sorted(self.records.items())],
        )
        lines += render_counter(
            "firstbyte_client_timings_rejected_total",
            "Client timing reports refused, by reason.",
            [(labels(reason=k), n) for k, n in sorted(self.rejected.items())],
        )
        return lines


def _series(record: TimingsRecord, country: str) -> Series:
    http = record.http_version.removeprefix("HTTP/")
    return (record.region, country, record.transport, http, connection_kind(record))


def _histogram(table: dict[Series, Histogram], series: Series,
               bounds: tuple[float, ...]) -> Histogram:
    histogram = table.get(series)
    if histogram is None:
        histogram = table[series] = Histogram(bounds)
    return histogram


def _render_family(name: str, help_text: str, table: dict[Series, Histogram]) -> list[str]:
    lines = family(name, "histogram", help_text)
    for (region, country, transport, http, conn), histogram in sorted(table.items()):
        text = labels(region=region, country=country, transport=transport, http=http, conn=conn)
        lines += histogram.samples(name, text, SUM_SPEC)
    return lines
