"""Where a client is, and how far (in milliseconds) it is from each region.

Three pieces, each usable alone:

- :func:`client_address`: the client's IP address from the connection's peer address, or from
  ``X-Forwarded-For`` / ``Forwarded`` only when the direct peer is a trusted proxy (walking
  the list from the right and skipping trusted proxies, so a client cannot spoof its address
  by prepending entries).
- :class:`GeoLocator`: a GeoIP2/GeoLite2 *City* database lookup (``geoip2``); an address that
  is private, malformed or not in the database gives ``None`` ("treat as local").
- :func:`estimate_rtt_ms`: round-trip time from great-circle distance. Light in fibre covers
  ~200 km per ms (2/3 c), so a perfect path costs 0.01 ms of RTT per km; real routes are
  longer. Fitted by least squares with the intercept pinned at the median intra-region RTT
  (2 ms) against the 420 inter-region pairs of ``data/aws_rtt_ms.tsv`` (cloudping.co):
  ``RTT = 2 ms + 0.01 ms/km * 1.71 * distance`` (route inflation 1.71; median relative error
  16%, 90th percentile 36%). ``tests/router/test_geo.py`` recomputes the fit from the shipped
  table, so the constants cannot drift from the data.

The region table (``data/regions.tsv``) and the RTT table ship with the package as facts.
"""

from __future__ import annotations

import csv
import ipaddress
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

__all__ = [
    "FIBRE_MS_PER_KM",
    "INTRA_REGION_RTT_MS",
    "ROUTE_INFLATION",
    "GeoLocator",
    "GeoPoint",
    "KnownRegion",
    "Location",
    "TrustedProxies",
    "client_address",
    "estimate_rtt_ms",
    "great_circle_km",
    "known_regions",
    "measured_rtt_table",
]

EARTH_RADIUS_KM = 6371.0088
FIBRE_MS_PER_KM = 0.01
"""Round-trip milliseconds per km of fibre at 2/3 c (200 km/ms one way)."""
ROUTE_INFLATION = 1.71
"""Real routes vs the great circle, fitted against ``data/aws_rtt_ms.tsv``."""
INTRA_REGION_RTT_MS = 2.0
"""Median same-region RTT in ``data/aws_rtt_ms.tsv``; the intercept of the fit."""


@dataclass(frozen=True, slots=True)
class GeoPoint:
    """A latitude/longitude in degrees."""

    lat: float
    lon: float

    def __post_init__(self) -> None:
        if not (-90.0 <= self.lat <= 90.0 and -180.0 <= self.lon <= 180.0):
            raise ValueError(f"not a latitude/longitude: {self.lat}, {self.lon}")


@dataclass(frozen=True, slots=True)
class Location:
    """Where a client address is, as far as the GeoIP database knows."""

    point: GeoPoint
    city: str | None = None
    country: str | None = None


@dataclass(frozen=True, slots=True)
class KnownRegion:
    code: str
    city: str
    country: str
    point: GeoPoint


def great_circle_km(a: GeoPoint, b: GeoPoint) -> float:
    """Haversine distance in km."""
    la1, lo1, la2, lo2 = map(math.radians, (a.lat, a.lon, b.lat, b.lon))
    h = math.sin((la2 - la1) / 2) ** 2 + math.cos(la1) * math.cos(la2) * math.sin(
        (lo2 - lo1) / 2
    ) ** 2
    return 2 * EARTH_RADIUS_KM * math.asin(min(1.0, math.sqrt(h)))


def estimate_rtt_ms(a: GeoPoint, b: GeoPoint) -> float:
    """Expected RTT between two points (see the module docstring for the fit)."""
    return INTRA_REGION_RTT_MS + FIBRE_MS_PER_KM * ROUTE_INFLATION * great_circle_km(a, b)


def _data_rows(name: str) -> list[list[str]]:
    text = resources.files("firstbyte.router").joinpath("data", name).read_text(encoding="utf-8")
    return [row for row in csv.reader(text.splitlines(), delimiter="\t") if row]


@cache
def known_regions() -> dict[str, KnownRegion]:
    """The cloud regions of ``data/regions.tsv`` by code (e.g. ``ap-northeast-1``)."""
    rows = _data_rows("regions.tsv")
    header = rows[0]
    out: dict[str, KnownRegion] = {}
    for row in rows[1:]:
        rec = dict(zip(header, row, strict=True))
        out[rec["code"]] = KnownRegion(
            rec["code"], rec["city"], rec["country"],
            GeoPoint(float(rec["lat"]), float(rec["lon"])),
        )
    return out


@cache
def measured_rtt_table() -> dict[tuple[str, str], float]:
    """``data/aws_rtt_ms.tsv`` as ``{(from, to): rtt_ms}``."""
    rows = _data_rows("aws_rtt_ms.tsv")
    targets = rows[0][1:]
    return {
        (row[0], to): float(value)
        for row in rows[1:]
        for to, value in zip(targets, row[1:], strict=True)
    }


# --- the client's address ---------------------------------------------------------------

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


class TrustedProxies:
    """A set of networks whose forwarding header is believed, and which header that is.

    Only ``header`` (``x-forwarded-for`` or ``forwarded``, the one the proxies set) is read:
    a proxy passes the other one through from the client untouched, so believing it would
    let any client name its own address.
    """

    def __init__(self, cidrs: Iterable[str] = (), header: str = "x-forwarded-for") -> None:
        if header not in ("x-forwarded-for", "forwarded"):
            raise ValueError(f"forwarding header must be x-forwarded-for or forwarded: {header}")
        self.header = header
        self.networks: tuple[IPNetwork, ...] = tuple(
            ipaddress.ip_network(c, strict=False) for c in cidrs
        )

    def __contains__(self, address: object) -> bool:
        if not isinstance(address, ipaddress.IPv4Address | ipaddress.IPv6Address):
            return False
        return any(address in net for net in self.networks)

    def __bool__(self) -> bool:
        return bool(self.networks)


def _parse_ip(text: str) -> IPAddress | None:
    text = text.strip().strip('"')
    if text.startswith("["):  # Forwarded: for="[2001:db8::1]:4711"
        text = text[1 : text.find("]")] if "]" in text else text[1:]
    elif text.count(":") == 1:  # IPv4 with a port
        text = text.split(":", 1)[0]
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def _forwarded_chain(headers: Sequence[tuple[str, str]], header: str) -> list[str]:
    """The hop addresses in ``header`` (every line of it), leftmost (original client) first."""
    values = [v for k, v in headers if k.lower() == header]
    if header == "x-forwarded-for":
        return [part for value in values for part in value.split(",")]
    chain: list[str] = []
    for value in values:
        for element in value.split(","):
            for pair in element.split(";"):
                key, _, val = pair.strip().partition("=")
                if key.lower() == "for":
                    chain.append(val)
    return chain


def client_address(
    peer: str | None,
    headers: Sequence[tuple[str, str]] | Mapping[str, str],
    trusted: TrustedProxies,
) -> IPAddress | None:
    """The address to locate: the direct peer unless it is a trusted proxy.

    Behind a trusted proxy, walk ``trusted.header`` from the right, skipping trusted proxies;
    the first untrusted hop is the client. An unparseable hop stops the walk at the last good
    address (never trusting what is left of garbage).
    """
    address = _parse_ip(peer) if peer else None
    if address is None or address not in trusted:
        return address
    pairs = list(headers.items()) if isinstance(headers, Mapping) else list(headers)
    chain = _forwarded_chain(pairs, trusted.header)
    if not chain:
        return address
    for hop in reversed(chain):
        parsed = _parse_ip(hop)
        if parsed is None:
            return address
        address = parsed
        if address not in trusted:
            return address
    return address


# --- GeoIP ------------------------------------------------------------------------------


class GeoLocator:
    """City lookups in a MaxMind DB file (GeoIP2/GeoLite2 City or anything shaped like it)."""

    def __init__(self, path: str) -> None:
        import geoip2.database  # the router extra; the SDK never imports this module

        self._reader: Any = geoip2.database.Reader(path)

    def locate(self, address: IPAddress | None) -> Location | None:
        """The address's location, or ``None`` when it is unknown (then it counts as local)."""
        if address is None or (not address.is_global and not _is_documentation(address)):
            return None
        import geoip2.errors

        try:
            rec = self._reader.city(str(address))
        except (geoip2.errors.AddressNotFoundError, ValueError):
            return None
        lat, lon = rec.location.latitude, rec.location.longitude
        if lat is None or lon is None:
            return None
        return Location(GeoPoint(float(lat), float(lon)), rec.city.name, rec.country.iso_code)

    def close(self) -> None:
        self._reader.close()


_DOC_NETS = tuple(
    ipaddress.ip_network(n)
    for n in ("192.0.2.0/24", "198.51.100.0/24", "203.0.113.0/24", "2001:db8::/32")
)


def _is_documentation(address: IPAddress) -> bool:
    # The documentation ranges are what the WAN emulator and the tests use for "real" hosts.
    return any(address in net for net in _DOC_NETS)
