"""Geography profiles: which hosts exist and the round trips between them, from real data.

The data are AWS inter-region RTTs (cloudping.co) and region locations, the router's own tables
(``router/data/``, read through :mod:`firstbyte.router.geo`), plus access-network
("last-mile") profiles and a few city coordinates in ``benchmarks/wan/data/`` (sources of all
four in ``data/SOURCES.md``). A profile names

- clients: placed at the AWS region nearest their city (great-circle distance), with a
  last-mile profile (``fiber``, ``wifi``, ``4g``, ...);
- regions (routers) and backends (inference servers), each at an AWS region.

The RTT between two hosts is the table's RTT between their regions (the mean of both
directions; a same-region pair gets the table's intra-region figure), plus each client's
last-mile RTT. A client's links also carry its last-mile loss (per direction) and bandwidth
(``up_mbit`` from it, ``down_mbit`` to it). Addresses: clients 192.0.2.10+, regions
198.51.100.10+, backends 203.0.113.10+, in profile order.

Profiles are TOML files or built-in names (:data:`BUILTIN`)::

    [[client]]
    name = "client-beijing"
    city = "Beijing"          # or: region = "ap-northeast-2", or: lat = 39.9, lon = 116.4
    last_mile = "fiber"
    [[region]]
    name = "region-us-west"
    aws = "us-west-1"
    [[backend]]
    name = "backend-us-west"
    aws = "us-west-1"
"""

from __future__ import annotations

import csv
import math
import tomllib
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from firstbyte.benchmarks.wan.delayline import NS_PER_MS, LinkParams
from firstbyte.benchmarks.wan.emulator import CLIENT_CONGESTION_CONTROL, Emulator, Host
from firstbyte.router.geo import known_regions, measured_rtt_table

DATA = Path(__file__).with_name("data")


@dataclass(frozen=True)
class Place:
    name: str
    country: str
    lat: float
    lon: float


@dataclass(frozen=True)
class LastMile:
    name: str
    rtt_ms: float
    loss_pct: float
    down_mbit: float
    up_mbit: float
    source: str


def _rows(name: str) -> list[dict[str, str]]:
    with (DATA / name).open(encoding="utf-8", newline="") as f:
        return list(csv.DictReader(f, delimiter="\t"))


@cache
def regions() -> dict[str, Place]:
    """AWS region code -> its location."""
    return {
        code: Place(r.city, r.country, r.point.lat, r.point.lon)
        for code, r in known_regions().items()
    }


@cache
def cities() -> dict[str, Place]:
    """Lower-case city name -> location (the shipped cities plus every region's city)."""
    out = {p.name.lower(): p for p in regions().values()}
    for r in _rows("cities.tsv"):
        out[r["city"].lower()] = Place(r["city"], r["country"], float(r["lat"]), float(r["lon"]))
    return out


@cache
def last_miles() -> dict[str, LastMile]:
    return {
        r["profile"]: LastMile(
            r["profile"],
            float(r["rtt_ms"]),
            float(r["loss_pct"]),
            float(r["down_mbit"]),
            float(r["up_mbit"]),
            r["source"],
        )
        for r in _rows("last_mile.tsv")
    }


@cache
def rtt_table() -> dict[str, dict[str, float]]:
    """``table[a][b]``: measured RTT in ms from region ``a`` to region ``b``."""
    table: dict[str, dict[str, float]] = {}
    for (a, b), rtt in measured_rtt_table().items():
        table.setdefault(a, {})[b] = rtt
    return table


def region_rtt_ms(a: str, b: str) -> float:
    """The RTT between AWS regions ``a`` and ``b``: the mean of the table's two directions."""
    table = rtt_table()
    for code in (a, b):
        if code not in table:
            raise ValueError(f"unknown AWS region {code!r} (known: {', '.join(sorted(table))})")
    return (table[a][b] + table[b][a]) / 2


def distance_km(lat1: float, lon1: float, lat2: float, lon2: float) -> float:
    """Great-circle distance (haversine, mean Earth radius)."""
    p1, p2 = math.radians(lat1), math.radians(lat2)
    dp, dl = p2 - p1, math.radians(lon2 - lon1)
    h = math.sin(dp / 2) ** 2 + math.cos(p1) * math.cos(p2) * math.sin(dl / 2) ** 2
    return 2 * 6371.0 * math.asin(math.sqrt(h))


def nearest_region(lat: float, lon: float) -> str:
    return min(regions().items(), key=lambda kv: distance_km(lat, lon, kv[1].lat, kv[1].lon))[0]


@dataclass(frozen=True)
class Site:
    """One host of a profile: its role, its AWS region and (clients only) its last mile."""

    name: str
    role: str  # "client", "region" or "backend"
    aws: str
    last_mile: LastMile | None = None


@dataclass(frozen=True)
class Profile:
    name: str
    sites: list[Site] = field(default_factory=list)

    def hosts(self) -> list[Host]:
        prefixes = {"client": "192.0.2", "region": "198.51.100", "backend": "203.0.113"}
        counts = dict.fromkeys(prefixes, 0)
        out = []
        for site in self.sites:
            out.append(Host(
                site.name, f"{prefixes[site.role]}.{10 + counts[site.role]}",
                CLIENT_CONGESTION_CONTROL if site.role == "client" else None,
            ))
            counts[site.role] += 1
        return out

    def rtt_ms(self, a: Site, b: Site) -> float:
        extra = sum(s.last_mile.rtt_ms for s in (a, b) if s.last_mile is not None)
        return region_rtt_ms(a.aws, b.aws) + extra

    def link_params(self, queue_limit_ms: float = 200.0) -> dict[tuple[str, str], LinkParams]:
        """Both directions of every pair: delay RTT/2, the clients' last-mile loss and rates."""
        links = {}
        for a in self.sites:
            for b in self.sites:
                if a is b:
                    continue
                loss = sum(s.last_mile.loss_pct for s in (a, b) if s.last_mile is not None)
                rates = [
                    x
                    for x in (
                        a.last_mile.up_mbit if a.last_mile else None,
                        b.last_mile.down_mbit if b.last_mile else None,
                    )
                    if x is not None
                ]
                links[(a.name, b.name)] = LinkParams(
                    delay_ns=round(self.rtt_ms(a, b) * NS_PER_MS / 2),
                    loss_pct=min(100.0, loss),
                    rate_bps=min(rates) * 1e6 if rates else None,
                    queue_limit_ns=round(queue_limit_ms * NS_PER_MS),
                )
        return links

    def emulator(self, *, seed: int = 0) -> Emulator:
        """An :class:`Emulator` for this profile (not started)."""
        return Emulator(self.hosts(), links=self.link_params(), seed=seed)

    def describe(self) -> list[dict[str, Any]]:
        """One row per host: name, role, address, AWS region, last mile."""
        return [
            {
                "name": s.name,
                "role": s.role,
                "ip": h.ip,
                "aws": s.aws,
                "last_mile": s.last_mile.name if s.last_mile else None,
            }
            for s, h in zip(self.sites, self.hosts(), strict=True)
        ]


def _locate(entry: dict[str, Any], where: str) -> str:
    if "aws" in entry or "region" in entry:
        code = str(entry.get("aws", entry.get("region")))
        if code not in regions():
            raise ValueError(f"{where}: unknown AWS region {code!r}")
        return code
    if "city" in entry:
        place = cities().get(str(entry["city"]).lower())
        if place is None:
            known = ", ".join(sorted(p.name for p in cities().values()))
            raise ValueError(f"{where}: unknown city {entry['city']!r} (known: {known})")
        return nearest_region(place.lat, place.lon)
    if "lat" in entry and "lon" in entry:
        return nearest_region(float(entry["lat"]), float(entry["lon"]))
    raise ValueError(f"{where}: give one of aws/region, city, or lat and lon")


def profile_from_dict(data: dict[str, Any], name: str) -> Profile:
    """Build a profile from parsed TOML; raise ValueError naming the bad entry."""
    sites: list[Site] = []
    unknown = set(data) - {"name", "client", "region", "backend"}
    if unknown:
        raise ValueError(f"profile {name}: unknown keys {sorted(unknown)}")
    for role in ("client", "region", "backend"):
        entries = data.get(role, [])
        if not isinstance(entries, list):
            raise ValueError(f"profile {name}: [[{role}]] must be an array of tables")
        for i, entry in enumerate(entries):
            where = f"profile {name}: {role} #{i + 1}"
            if not isinstance(entry, dict) or "name" not in entry:
                raise ValueError(f"{where}: needs a name")
            last_mile = None
            if role == "client":
                lm = str(entry.get("last_mile", "fiber"))
                if lm not in last_miles():
                    raise ValueError(
                        f"{where}: unknown last_mile {lm!r} (known: {', '.join(last_miles())})"
                    )
                last_mile = last_miles()[lm]
            sites.append(Site(str(entry["name"]), role, _locate(entry, where), last_mile))
    if len(sites) < 2:
        raise ValueError(f"profile {name}: needs at least two hosts")
    names = [s.name for s in sites]
    if len(set(names)) != len(names):
        raise ValueError(f"profile {name}: duplicate host names")
    return Profile(str(data.get("name", name)), sites)


BUILTIN: dict[str, dict[str, Any]] = {
    # Beijing to Los Angeles, the DESIGN's 150 ms example (Beijing sits nearest Seoul's region).
    "transpacific": {
        "client": [{"name": "client-beijing", "city": "Beijing", "last_mile": "fiber"}],
        "region": [
            {"name": "region-us-west", "aws": "us-west-1"},
            {"name": "region-ap-northeast", "aws": "ap-northeast-2"},
        ],
    },
    "world": {
        "client": [
            {"name": "client-tokyo", "city": "Tokyo", "last_mile": "fiber"},
            {"name": "client-london", "city": "London", "last_mile": "wifi"},
            {"name": "client-new-york", "city": "New York", "last_mile": "4g"},
            {"name": "client-sydney", "city": "Sydney", "last_mile": "wifi-good"},
        ],
        "region": [
            {"name": "region-us-east", "aws": "us-east-1"},
            {"name": "region-eu-central", "aws": "eu-central-1"},
            {"name": "region-ap-northeast", "aws": "ap-northeast-1"},
        ],
    },
}


def load_profile(spec: str) -> Profile:
    """A built-in profile by name, or a TOML file by path; ValueError with the reason if not."""
    if spec in BUILTIN:
        return profile_from_dict(BUILTIN[spec], spec)
    path = Path(spec)
    if not path.is_file():
        raise ValueError(
            f"no profile {spec!r}: not a built-in ({', '.join(BUILTIN)}) and not a file"
        )
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"cannot read profile {spec}: {exc}") from None
    return profile_from_dict(data, path.stem)
