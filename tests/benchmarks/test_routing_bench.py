"""The routing benchmark's quick run shows what each experiment is about (comparisons within
one run; the absolute targets, e.g. P99 within 500 ms, are the full benchmark's to report).

The loopback experiments run with the geography experiment skipped (``FIRSTBYTE_LOOPBACK=1``,
which the result must say); the geography experiment (nearest, central, wrong door) runs on its
own in the netns test.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path

import pytest

from firstbyte.benchmarks.report import markdown_summary
from firstbyte.benchmarks.scenarios import routing
from firstbyte.benchmarks.scenarios._routing_geo import geography, locations, profile
from firstbyte.benchmarks.world import Peering, World, WorldError, write_geoip_db
from firstbyte.router.geo import GeoLocator


def test_quick_routing_run_shows_fallback_affinity_and_warmup(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FIRSTBYTE_LOOPBACK", "1")
    result = routing.run(quick=True)
    s = result["summary"]
    assert s["failed_with_fallback"] == 0
    # Which region served is behaviour; how much faster that made the tail is the benchmark's
    # number (a quick run on a loaded machine can put either P99 first).
    without = result["fallback"]["without_fallback"]
    assert without["served_by"] == {"tokyo": without["completed"]}
    assert s["p99_ttft_ms_with_fallback"] > 0
    assert s["cache_hit_ratio_prefix"] > s["cache_hit_ratio_round_robin"]
    assert s["cache_hit_ratio_prefix"] >= 0.9
    assert s["max_min_load_prefix"] <= 1.5
    served = result["fallback"]["with_fallback"]["served_by"]
    assert served.get("frankfurt", 0) > 0  # the overflow really went to the peer

    # Warm vs cold prefix: warmed, every first request finds the system prompt cached;
    # cold, the first one per backend (at least) pays for its prefill.
    warm, cold = result["prefix_warmup"]["warm"], result["prefix_warmup"]["cold"]
    assert warm["failed"] == cold["failed"] == 0
    assert warm["prefix_misses"] == 0
    assert cold["prefix_misses"] >= result["prefix_warmup"]["backends"]
    assert warm["mean_cached_tokens"] > cold["mean_cached_tokens"]
    assert warm["mean_cached_tokens"] >= 0.9 * warm["mean_prompt_tokens"]
    assert 2000 <= warm["mean_prompt_tokens"] <= 4000
    assert cold["p50_ttft_ms_prefix_misses"] > warm["p50_ttft_ms"]
    assert s["prefix_misses_warm"] == 0
    assert s["mean_cached_tokens_warm_prefix"] > 0

    # Two models: B (tokyo only) asked of frankfurt is served by tokyo, nothing misrouted.
    assert s["misrouted_two_models"] == 0
    rows = {row["label"]: row for row in result["two_models_rows"]}
    assert rows["b_via_frankfurt"]["served_by"] == f"tokyo:{rows['b_via_frankfurt']['requests']}"
    assert rows["a_frankfurt_alone"]["errors"] == 0

    # The skipped experiment says so, in the summary and in the report.
    assert s["geography"].startswith("SKIPPED")
    assert result["runs"] == []
    assert "geography experiment SKIPPED" in markdown_summary(result)


def test_peered_world_geoip_database_places_each_client_in_its_city(tmp_path: Path) -> None:
    """The .mmdb a peered world writes is read by the router's own GeoIP reader: each client
    address at its city, any other address unknown."""
    prof = profile()
    places = locations(prof)
    hosts = {h.name: h.ip for h in prof.hosts()}
    clients = [s.name for s in prof.sites if s.role == "client"]
    path = write_geoip_db(tmp_path / "world.mmdb", {hosts[c]: places[c] for c in clients})
    locator = GeoLocator(str(path))
    try:
        tokyo = locator.locate(ipaddress.ip_address(hosts["client-tokyo"]))
        assert tokyo is not None
        assert (tokyo.city, tokyo.country) == ("Tokyo", "JP")
        assert tokyo.point.lat == pytest.approx(places["client-tokyo"].lat)
        sao_paulo = locator.locate(ipaddress.ip_address(hosts["client-sao-paulo"]))
        assert sao_paulo is not None
        assert sao_paulo.point.lon == pytest.approx(places["client-sao-paulo"].lon)
        assert locator.locate(ipaddress.ip_address(hosts["region-us-east"])) is None
    finally:
        locator.close()
    # Regions are placed at their AWS region (what each router and its peers are told).
    assert places["region-ap-northeast"].name == "Tokyo"


def test_peering_needs_the_emulator_and_every_region_placed() -> None:
    prof = profile()
    with pytest.raises(WorldError, match="needs the WAN emulator"):
        World(regions=["region-us-east"], clients=["client-tokyo"], emulator=None,
              peering=Peering(locations(prof)))
    with pytest.raises(WorldError, match="no location for region"):
        World(regions=["region-us-east"], clients=["client-tokyo"], emulator=prof.emulator(),
              peering=Peering({}))


@pytest.mark.netns
async def test_quick_geography_nearest_central_and_wrong_door() -> None:
    """Nearest beats central; a client entering through the wrong region (peered routers,
    no probe) is forwarded and hinted once, then served by its nearest region directly."""
    geo = await geography(quick=True)
    assert "skipped" not in geo
    s = geo["summary"]
    assert s["geo_failed_nearest"] == s["geo_failed_central"] == 0
    assert s["geo_sdk_chose_nearest"]  # the SDK's RTT probe found each client's nearest region
    assert isinstance(s["geo_p99_within_budget_nearest"], bool)
    assert s["geo_p50_ttft_ms_nearest"] < s["geo_p50_ttft_ms_central"]
    rows = {row["client"]: row for row in geo["clients"]}
    assert set(rows) == {"tokyo", "london", "new-york", "sydney", "sao-paulo"}
    for row in rows.values():
        assert row["p50_ttft_ms_nearest"] >= row["rtt_nearest_ms"]  # a round trip at least
        assert row["p50_ttft_ms_central"] >= row["rtt_central_ms"]
        assert row["served_by_central"] == f"us-east-1:{geo['repeat']}"
        if row["rtt_central_ms"] - row["rtt_nearest_ms"] > 50:
            # Far from us-east-1: the nearest region saves most of the RTT difference.
            saved = row["p50_ttft_ms_central"] - row["p50_ttft_ms_nearest"]
            assert saved > 0.5 * (row["rtt_central_ms"] - row["rtt_nearest_ms"])
    assert rows["tokyo"]["served_by_nearest"].startswith("ap-northeast-1:")

    # Wrong door: every client enters through us-east-1 (no probe).
    assert s["geo_wrong_door_failed"] == 0
    door = {row["client"]: row for row in geo["wrong_door"]}
    assert set(door) == set(rows)
    for place, row in door.items():
        nearest = rows[place]["nearest_region"]
        assert row["failed_requests"] == 0, row
        # After the first request every request is served by the nearest region.
        assert row["moved"], row
        assert row["served_after"] == f"{nearest}:{geo['repeat'] - 1}", row
        if nearest == "us-east-1":  # the right door: served there, no hint
            assert row["first_served_by"] == "us-east-1", row
            assert not row["forwarded"], row
            assert row["hinted_to"] is None, row
        else:
            # us-east-1 knew (GeoIP) where the client is: forwarded and hinted.
            assert row["forwarded"], row
            assert row["first_served_by"] == nearest, row
            assert row["hinted_to"] == nearest, row
            # The forwarded request crossed one more region pair than the direct ones.
            assert row["first_ttft_ms"] > row["p50_ttft_ms_after"], row
            assert row["p50_ttft_ms_after"] < rows[place]["p50_ttft_ms_central"], row
    assert s["geo_wrong_door_forwarded"] == s["geo_wrong_door_hinted"] == 3
    assert s["geo_wrong_door_moved_to_nearest"]

    assert len(geo["runs"]) == 15
    assert all(run["ttfts_ms"] for run in geo["runs"])
