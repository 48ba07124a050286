from __future__ import annotations

import httpx
import msgspec
import pytest

from firstbyte.benchmarks.cluster import RegionSpec, running_regions, wait_for_peers
from firstbyte.client_sdk.regions import Region, RegionSelector, regions_from_status
from firstbyte.protocol.edge import PublicEdgeStatus

TOKYO = Region("tokyo", "https://tokyo.example")
FRA = Region("frankfurt", "https://fra.example")
IAD = Region("virginia", "https://iad.example")


def test_lowest_rtt_wins_and_second_is_standby() -> None:
    s = RegionSelector([TOKYO, FRA, IAD])
    assert s.choose(0.0) == TOKYO  # nothing measured: configured order
    s.observe_rtt("tokyo", 220.0)
    s.observe_rtt("frankfurt", 12.0)
    s.observe_rtt("virginia", 90.0)
    assert s.choose(0.0) == FRA
    assert s.standby(0.0) == IAD
    s.observe_rtt("frankfurt", 400.0)  # EWMA: one bad sample moves it, not all the way
    assert s.rtt_ms("frankfurt") == pytest.approx(0.3 * 400 + 0.7 * 12)
    assert s.choose(0.0) == IAD


def test_failover_honours_retry_after_then_recovers() -> None:
    s = RegionSelector([TOKYO, FRA])
    s.observe_rtt("tokyo", 5.0)
    s.observe_rtt("frankfurt", 50.0)
    s.failed("tokyo", now=100.0, retry_after_s=3)
    assert s.failover("tokyo", 100.0) == FRA
    assert s.choose(101.0) == FRA
    assert s.choose(103.0) == TOKYO  # Retry-After elapsed
    s.failed("frankfurt", 200.0, 2)
    s.failed("tokyo", 200.0, 5)
    assert s.choose(200.5) is None
    assert s.wait_s(200.5) == pytest.approx(1.5)


def test_backoff_without_retry_after_grows_and_resets() -> None:
    s = RegionSelector([TOKYO], backoff_s=1.0)
    s.failed("tokyo", 0.0)
    assert s.wait_s(0.0) == 1.0
    s.failed("tokyo", 1.0)
    assert s.wait_s(1.0) == 2.0
    s.succeeded("tokyo")
    assert s.wait_s(1.0) == 0.0


def test_better_region_hint_prefers_a_configured_region_for_a_while() -> None:
    s = RegionSelector([FRA, TOKYO], hint_ttl_s=60)
    s.observe_rtt("frankfurt", 5.0)
    s.observe_rtt("tokyo", 200.0)
    assert s.hint("tokyo", None, now=0.0) == TOKYO
    assert s.choose(1.0) == TOKYO
    assert s.standby(1.0) == FRA
    assert s.choose(61.0) == FRA  # the hint expired: back to the RTT order
    with pytest.raises(ValueError, match="at least one"):
        RegionSelector([])


def test_a_hint_naming_an_unconfigured_region_or_url_is_ignored() -> None:
    s = RegionSelector([FRA], hint_ttl_s=60)
    assert s.hint("tokyo", "https://tokyo.example", now=0.0) is None
    assert s.hint("tokyo", None, now=0.0) is None
    # Same host, other scheme or port: another origin, not ours.
    assert s.hint("x", "http://fra.example", 0.0) is None
    assert s.hint("x", "https://fra.example:8443", 0.0) is None
    assert s.hint("x", "https://fra.example:bad", 0.0) is None
    assert s.regions == [FRA]


def test_a_hint_matches_by_url_origin_or_by_the_routers_own_name() -> None:
    by_url = [Region("https://fra.example/v1", "https://fra.example/v1"),
              Region("https://tokyo.example:8443/v1", "https://tokyo.example:8443/v1")]
    s = RegionSelector(by_url)
    s.observe_rtt(by_url[0].name, 5.0)
    s.observe_rtt(by_url[1].name, 90.0)
    # The router's URL has no /v1 and may spell the default port: same origin.
    assert s.hint("ap-northeast-1", "https://tokyo.example:8443", 0.0) == by_url[1]
    assert s.choose(1.0) == by_url[1]
    assert s.hint("x", "https://FRA.example:443/", 0.0) == by_url[0]  # host names ignore case
    s = RegionSelector(by_url)
    assert s.unlabelled()
    s.learn_label(by_url[1].name, "tokyo")
    assert s.label(by_url[1].name) == "tokyo"
    assert s.hint("tokyo", "http://10.0.0.7:8080", 0.0) == by_url[1]  # the name, not the URL
    assert s.unlabelled()  # frankfurt's router name is still unknown
    s.learn_label(by_url[0].name, "frankfurt")
    assert not s.unlabelled()
    assert "tokyo" in repr(s)


async def test_regions_from_a_routers_edge_status() -> None:
    specs = [RegionSpec("tokyo", 35.68, 139.69, backends=1), RegionSpec("frankfurt", 50.11, 8.68, backends=1)]
    async with running_regions(specs) as regions:
        await wait_for_peers(regions)
        async with httpx.AsyncClient() as client:
            body = (await client.get(f"{regions['tokyo'].url}/v1/edge/status")).content
    got = regions_from_status(msgspec.json.decode(body, type=PublicEdgeStatus))
    assert got == [Region("tokyo", regions["tokyo"].url), Region("frankfurt", regions["frankfurt"].url)]
    status = msgspec.json.decode(body)
    assert status["peers"] == [{"name": "frankfurt", "url": regions["frankfurt"].url, "up": True}]


def test_aside_s_is_the_time_left_of_a_set_aside() -> None:
    selector = RegionSelector([Region("a", "https://a.example/v1")])
    assert selector.aside_s("a", 100.0) == 0.0
    selector.failed("a", 100.0, 30.0)
    assert selector.aside_s("a", 110.0) == 20.0
    assert selector.aside_s("a", 131.0) == 0.0
