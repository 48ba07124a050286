"""``firstbyte bench soak --quick``, real: a router, sims, good and hostile clients on loopback.

The run is the one the quick-run tests start (``quick_runs``); these check what the soak
promises: every key's tokens arrived exactly once and to that key only, the canary never saw an
error the router made, and the report has the errors per class, the canary over time, the
memory of every process and the conditions, and per phase the router's RSS and descriptors
and the canary's TTFT.
"""

from __future__ import annotations

from typing import Any

import msgspec

from firstbyte.benchmarks.scenarios._soak_good import KINDS
from firstbyte.benchmarks.scenarios._soak_hostile import ATTACKS
from firstbyte.benchmarks.scenarios.soak import PHASES
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
    _check_phases(results)
    markdown = (out / "summary.md").read_text()
    for section in ("phases:", "canary:", "memory:", "errors:", "hostile:"):
        assert section in markdown


def _check_phases(results: dict[str, Any]) -> None:
    """Per phase (and the quiet baseline and recovery): the router's RSS and descriptors at
    start, peak and end, the canary's TTFT; and what the world-changing phases did."""
    phases = {row["label"]: row for row in results["phases"]}
    assert set(phases) == {p.name for p in PHASES} | {
        "baseline (no hostile phase)", "recovery (no hostile phase)"}
    for row in phases.values():
        assert 0 < row["rss_start_mb"] <= row["rss_peak_mb"] >= row["rss_end_mb"] > 0, row
        assert 0 < row["fds_start"] <= row["fds_peak"] >= row["fds_end"] > 0, row
        if row["canary_n"]:
            assert 0 < row["canary_p50_ms"] <= row["canary_max_ms"], row
        assert row["canary_router_errors"] == 0, row
    assert sum(row["canary_n"] for row in phases.values()) > 0
    hostile: dict[str, dict[str, int]] = {}
    for row in results["hostile"]:
        hostile.setdefault(row["label"], {})[row["class"]] = row["count"]
    # a removed key's client token, after SIGHUP, is refused on every path that takes one
    revoked = hostile["revoked_tokens"]
    assert revoked["stream started before: 201"] == 1, revoked
    assert revoked["key refused after the reload: 401 invalid_api_key"] == 1, revoked
    for path in ("chat completion", "new stream", "stream read (SSE)", "stream read (?token=)",
                 "long-poll", "timings", "WebSocket"):
        assert revoked.get(f"{path}: 401 client_token_revoked") == 1, revoked
    # HTTP/3 still serves after early answers and after the Initial flood
    early = hostile["h3_early_answer"]
    assert sum(n for label, n in early.items() if label.startswith("/healthz after it: 200")) \
        == sum(n for label, n in early.items() if label.startswith("/healthz after it")) >= 1, early
    assert hostile["quic_flood"]["real client after the flood: 200"] == 1
    assert sum(hostile["quic_flood"].values()) > 1  # Initials were sent and counted
    # one sim was stopped for the blackhole phase (and continued: the run ended cleanly)
    blackholed = hostile["blackholed_backend"]
    assert any(cls.startswith("sim-2 stopped for") for cls in blackholed), blackholed
    assert any(cls.startswith("good clients' slowest first token") for cls in blackholed)


def test_soak_duration_must_be_positive() -> None:
    done = firstbyte("bench", "soak", "--duration-s", "0", timeout=30)
    assert done.returncode == 2
    assert "--duration-s: must be > 0 seconds" in done.stderr
    assert "Traceback" not in done.stderr
