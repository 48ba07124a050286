from __future__ import annotations

import ipaddress
import statistics
from pathlib import Path

import pytest

from firstbyte.router.geo import (
    FIBRE_MS_PER_KM,
    INTRA_REGION_RTT_MS,
    ROUTE_INFLATION,
    GeoLocator,
    GeoPoint,
    TrustedProxies,
    client_address,
    estimate_rtt_ms,
    great_circle_km,
    known_regions,
    measured_rtt_table,
)
from tests.router.geo_fixtures import (
    FRANKFURT_CLIENT,
    TOKYO_CLIENT,
    UNKNOWN_CLIENT,
    VIRGINIA_CLIENT,
    write_city_mmdb,
)

ip = ipaddress.ip_address


def test_great_circle_known_distance() -> None:
    # Tokyo - Frankfurt is about 9,350 km.
    regions = known_regions()
    d = great_circle_km(regions["ap-northeast-1"].point, regions["eu-central-1"].point)
    assert 9200 < d < 9500


def test_rtt_fit_matches_shipped_table() -> None:
    """Refit the route inflation from the shipped table: the constant must agree with the data."""
    regions = known_regions()
    pairs = [
        (great_circle_km(regions[a].point, regions[b].point), rtt)
        for (a, b), rtt in measured_rtt_table().items()
        if a != b
    ]
    assert len(pairs) == 420
    slope = sum(d * (y - INTRA_REGION_RTT_MS) for d, y in pairs) / sum(d * d for d, _ in pairs)
    assert slope / FIBRE_MS_PER_KM == pytest.approx(ROUTE_INFLATION, abs=0.01)
    errors = [
        abs(estimate_rtt_ms(regions[a].point, regions[b].point) - y) / y
        for (a, b), y in measured_rtt_table().items()
        if a != b
    ]
    assert statistics.median(errors) < 0.2
    intra = [y for (a, b), y in measured_rtt_table().items() if a == b]
    assert statistics.median(intra) == INTRA_REGION_RTT_MS


def test_estimate_tokyo_frankfurt_close_to_measured() -> None:
    regions = known_regions()
    est = estimate_rtt_ms(regions["ap-northeast-1"].point, regions["eu-central-1"].point)
    measured = measured_rtt_table()[("ap-northeast-1", "eu-central-1")]
    assert abs(est - measured) / measured < 0.35


def test_geopoint_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="latitude"):
        GeoPoint(91.0, 0.0)


TRUSTED = TrustedProxies(["127.0.0.1/32", "10.0.0.0/8"])


def test_untrusted_peer_headers_ignored() -> None:
    got = client_address("198.51.100.7", {"x-forwarded-for": TOKYO_CLIENT}, TRUSTED)
    assert got == ip("198.51.100.7")


def test_trusted_peer_uses_rightmost_untrusted_hop() -> None:
    # The client prepended a fake address; the trusted chain is 10.1.1.1 (inner proxy).
    headers = [("X-Forwarded-For", f"{FRANKFURT_CLIENT}, {TOKYO_CLIENT}, 10.1.1.1")]
    assert client_address("127.0.0.1", headers, TRUSTED) == ip(TOKYO_CLIENT)


def test_trusted_peer_multiple_xff_headers_concatenate() -> None:
    headers = [("x-forwarded-for", VIRGINIA_CLIENT), ("x-forwarded-for", "10.2.2.2")]
    assert client_address("127.0.0.1", headers, TRUSTED) == ip(VIRGINIA_CLIENT)


def test_forwarded_header_handles_ports_and_v6() -> None:
    headers = [
        ("x-forwarded-for", VIRGINIA_CLIENT),
        ("forwarded", 'for="[2001:db8::1]:4711";proto=https, for=10.0.0.9:80'),
    ]
    trusted = TrustedProxies(["127.0.0.1/32", "10.0.0.0/8"], "forwarded")
    assert client_address("127.0.0.1", headers, trusted) == ip("2001:db8::1")


def test_only_the_configured_forwarding_header_is_believed() -> None:
    # The proxy sets X-Forwarded-For; a Forwarded header it passed through is the client's own.
    headers = [
        ("forwarded", f"for={TOKYO_CLIENT}"),
        ("x-forwarded-for", VIRGINIA_CLIENT),
    ]
    assert client_address("127.0.0.1", headers, TRUSTED) == ip(VIRGINIA_CLIENT)
    only_forwarded = TrustedProxies(["127.0.0.1/32"], "forwarded")
    assert client_address("127.0.0.1", headers, only_forwarded) == ip(TOKYO_CLIENT)
    assert client_address("127.0.0.1", {"forwarded": f"for={TOKYO_CLIENT}"}, TRUSTED) == ip(
        "127.0.0.1"
    )
    with pytest.raises(ValueError, match="forwarding header"):
        TrustedProxies([], "x-real-ip")


def test_garbage_hop_stops_the_walk() -> None:
    headers = {"x-forwarded-for": f"{TOKYO_CLIENT}, not-an-ip, 10.0.0.5"}
    assert client_address("127.0.0.1", headers, TRUSTED) == ip("10.0.0.5")


def test_all_trusted_chain_gives_leftmost() -> None:
    assert client_address("127.0.0.1", {"x-forwarded-for": "10.0.0.1"}, TRUSTED) == ip("10.0.0.1")


def test_no_peer_and_mapped_v6() -> None:
    assert client_address(None, {}, TRUSTED) is None
    assert client_address("::ffff:198.51.100.20", {}, TRUSTED) == ip(FRANKFURT_CLIENT)


def test_mmdb_lookup(tmp_path: Path) -> None:
    locator = GeoLocator(str(write_city_mmdb(tmp_path / "cities.mmdb")))
    try:
        tokyo = locator.locate(ip(TOKYO_CLIENT))
        assert tokyo is not None
        assert tokyo.city == "Tokyo"
        assert tokyo.country == "JP"
        frankfurt = locator.locate(ip(FRANKFURT_CLIENT))
        assert frankfurt is not None
        assert frankfurt.point.lon == pytest.approx(8.68)
        assert locator.locate(ip(UNKNOWN_CLIENT)) is None
        assert locator.locate(ip("127.0.0.1")) is None
        assert locator.locate(None) is None
    finally:
        locator.close()
