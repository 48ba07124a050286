"""``firstbyte bench soak --quick``, real: a router, sims, good and hostile clients on loopback.

The run is the one the quick-run tests start (``quick_runs``); these check what the soak
promises: every key's tokens arrived exactly once and to that key only, the canary never saw an
error the router made, and the report has the errors per class, the canary over time, the
memory of every process and the conditions.
"""

from __future__ import annotations

import msgspec

from firstbyte.benchmarks.scenarios._soak_good import KINDS
from firstbyte.benchmarks.scenarios._soak_hostile import ATTACKS
from tests.benchmarks.conftest import QuickRuns
from tests.cli import firstbyte


def test_soak_keeps_every_key_s_tokens_and_the_canary(quick_runs: QuickRuns) -> None:
    code, stdout, stderr, out = quick_runs.result("soak")
    assert code == 0, stderr[-3000:]
    results = msgspec.json.decode(stdout)
    summary = results["summary"]
    assert results["failed_checks"] == []
    assert summary["passed"] is True
    # integrity: every stream judged, none lost, repeated, foreign or corrupt
    assert summary["integrity_violations"] == 0, results["integrity"]["examples"]
    assert summary["streams_judged"] >= summary["good_requests"] > 0
    assert {row["label"] for row in results["runs"]} == set(KINDS)
    for row in results["runs"]:
        assert row["violations"] == 0
        assert row["ok"] + row["retried_ok"] + row["gave_up"] == row["requests"] > 0
    # the canary ran all along, and the router made none of its errors
    assert summary["canary_requests"] > 0
    assert summary["canary_router_errors"] == 0
    assert sum(row["requests"] for row in results["canary"]) == summary["canary_requests"]
    # memory of the router and every sim, sampled all along
    memory = {row["label"]: row for row in results["memory"]}
    assert set(memory) == {"router", "sim-0", "sim-1", "sim-2"}
    assert memory["router"]["samples"] >= 10
    assert 0 < memory["router"]["rss_min_mb"] <= memory["router"]["rss_max_mb"]
    assert summary["sim_kills"] == 1  # sim-0 killed and started again, sampled after too
    # every hostile client kind ran and its treatment is reported by class
    assert {row["label"] for row in results["hostile"]} == set(ATTACKS)
    assert "duration_s" in results["conditions"]
    markdown = (out / "summary.md").read_text()
    for section in ("canary:", "memory:", "errors:", "hostile:"):
        assert section in markdown


def test_soak_duration_must_be_positive() -> None:
    done = firstbyte("bench", "soak", "--duration-s", "0", timeout=30)
    assert done.returncode == 2
    assert "--duration-s: must be > 0 seconds" in done.stderr
    assert "Traceback" not in done.stderr
