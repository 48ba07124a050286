"""The routing benchmark's quick run meets its targets (loopback; generous bounds)."""

from __future__ import annotations

from benchmarks.scenarios import routing


def test_quick_routing_run_meets_targets() -> None:
    result = routing.run(quick=True)
    s = result["summary"]
    assert s["failed_with_fallback"] == 0
    assert s["p99_ttft_ms_with_fallback"] < s["p99_ttft_ms_without_fallback"]
    assert s["p99_ttft_ms_with_fallback"] <= 500
    assert s["cache_hit_ratio_prefix"] > s["cache_hit_ratio_round_robin"]
    assert s["cache_hit_ratio_prefix"] >= 0.9
    assert s["max_min_load_prefix"] <= 1.5
    served = result["fallback"]["with_fallback"]["served_by"]
    assert served.get("frankfurt", 0) > 0  # the overflow really went to the peer
