from __future__ import annotations

import httpx
import pytest

from client_sdk.regions import Region, RegionSelector, regions_from_status
from router.cluster import RegionSpec, running_regions, wait_for_peers

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


def test_better_region_hint_is_preferred_and_can_add_a_region() -> None:
    s = RegionSelector([FRA], hint_ttl_s=60)
    s.observe_rtt("frankfurt", 5.0)
    s.hint("tokyo", "https://tokyo.example", now=0.0)
    assert s.choose(1.0) == TOKYO
    assert s.choose(61.0) == FRA  # the hint expired; unmeasured Tokyo ranks after
    s.hint("nowhere", None, 0.0)
    assert [r.name for r in s.regions] == ["frankfurt", "tokyo"]
    with pytest.raises(ValueError, match="at least one"):
        RegionSelector([])


async def test_regions_from_a_routers_edge_status() -> None:
    specs = [RegionSpec("tokyo", 35.68, 139.69, backends=1), RegionSpec("frankfurt", 50.11, 8.68, backends=1)]
    async with running_regions(specs) as regions:
        await wait_for_peers(regions)
        async with httpx.AsyncClient() as client:
            status = (await client.get(f"{regions['tokyo'].url}/v1/edge/status")).json()
    got = regions_from_status(status)
    assert got == [Region("tokyo", regions["tokyo"].url), Region("frankfurt", regions["frankfurt"].url)]
    assert status["peers"] == [{"name": "frankfurt", "url": regions["frankfurt"].url, "up": True}]
