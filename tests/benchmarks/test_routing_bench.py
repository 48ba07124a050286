"""The routing benchmark's quick run shows what each experiment is about (comparisons within
one run; the absolute targets, e.g. P99 within 500 ms, are the full benchmark's to report).

The loopback experiments run with the geography experiment skipped (``FIRSTBYTE_LOOPBACK=1``,
which the result must say); the geography experiment (nearest, central, wrong door) is checked
on the quick run of ``tests/benchmarks/test_bench_quick.py``, which goes through the emulator.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path

import pytest

from firstbyte.benchmarks.report import markdown_summary
from firstbyte.benchmarks.scenarios import routing
from firstbyte.benchmarks.scenarios._routing_geo import locations, profile
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
