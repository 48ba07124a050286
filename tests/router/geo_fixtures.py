"""A real GeoIP2-City-shaped ``.mmdb`` for tests, written with ``mmdb-writer``.

The documentation ranges stand in for clients in three cities:
192.0.2.0/25 -> Tokyo, 198.51.100.0/25 -> Frankfurt, 203.0.113.0/25 -> Ashburn (N. Virginia).
The upper halves of those /24s are deliberately absent (unknown addresses).
"""

from __future__ import annotations

from pathlib import Path

from firstbyte.benchmarks.wan.geo import Place
from firstbyte.benchmarks.world import write_geoip_db

CITIES: dict[str, tuple[str, str, str, float, float]] = {
    # network: (city, country, nearest region code, lat, lon)
    "192.0.2.0/25": ("Tokyo", "JP", "ap-northeast-1", 35.68, 139.69),
    "198.51.100.0/25": ("Frankfurt", "DE", "eu-central-1", 50.11, 8.68),
    "203.0.113.0/25": ("Ashburn", "US", "us-east-1", 39.04, -77.49),
}

TOKYO_CLIENT = "192.0.2.10"
FRANKFURT_CLIENT = "198.51.100.20"
VIRGINIA_CLIENT = "203.0.113.30"
UNKNOWN_CLIENT = "192.0.2.200"


def write_city_mmdb(path: Path) -> Path:
    """Write the test database to ``path`` and return it."""
    return write_geoip_db(path, {network: Place(city, country, lat, lon)
                                 for network, (city, country, _, lat, lon) in CITIES.items()})
