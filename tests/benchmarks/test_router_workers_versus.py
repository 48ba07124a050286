"""``bench router_workers``' Redis-vs-memory figures read each Redis phase against both memory
phases of its round, so a machine whose load drifts through a round does not move them."""

from __future__ import annotations

from typing import Any

import pytest

from firstbyte.benchmarks.scenarios.router_workers import _versus

REDIS_RATIO = 1.10
REDIS_ADDED_MS = 5.0


def _row(cpu: float, ttft: float) -> dict[str, Any]:
    return {"p50_ttft_ms": ttft, "p99_ttft_ms": ttft * 2, "mean_ttft_ms": ttft,
            "outside_sim_mean_ms": 1.0, "router_start_mean_ms": 0.5, "router_start_p99_ms": 2.0,
            "p50_head_ms": 1.0, "router_cpu_us_per_chunk": cpu, "errors": 0}


def _rounds(drifts: list[float]) -> tuple[list[dict[str, Any]], ...]:
    """Rounds measured as the benchmark orders them (memory, Redis, memory again; every other
    round reversed), the machine's load growing by ``drift`` µs of CPU per chunk (and ms of
    TTFT) each phase of a round; Redis costs REDIS_RATIO of memory's CPU and REDIS_ADDED_MS."""
    memory, redis, again = [], [], []
    for i, drift in enumerate(drifts):
        at = [30.0 + drift * k for k in range(3)]  # the machine during the round's 3 phases
        first, last = (at[0], at[2]) if i % 2 == 0 else (at[2], at[0])
        memory.append(_row(first, 100.0 + first))
        redis.append(_row(at[1] * REDIS_RATIO, 100.0 + at[1] + REDIS_ADDED_MS))
        again.append(_row(last, 100.0 + last))
    return redis, memory, again


def test_a_drift_through_each_round_leaves_the_redis_figures_as_they_are() -> None:
    # Steady within a round, different from round to round (a shared machine's neighbours).
    redis, memory, again = _rounds([0.0, 6.0, -4.0, 8.0, 1.0, 3.0])
    versus = _versus(redis, memory, again)
    assert versus["cpu_ratio"] == pytest.approx(REDIS_RATIO, abs=0.001)
    assert versus["added_p50_ttft_ms"] == pytest.approx(REDIS_ADDED_MS, abs=0.05)
    assert versus["p50_ttft_deltas_ms"] == [REDIS_ADDED_MS] * 6
    # The A/A still shows the drift: it is what the verdict reads as the run's noise.
    assert versus["aa_p50_ttft_deltas_ms"] == [0.0, -12.0, -8.0, -16.0, 2.0, -6.0]
    assert versus["target"] == "inconclusive"  # the A/A's CPU strays past the 15% margin


def test_no_drift_reads_the_same_as_against_one_memory_phase() -> None:
    redis, memory, again = _rounds([0.0] * 4)
    versus = _versus(redis, memory, again)
    assert versus["cpu_ratio"] == pytest.approx(REDIS_RATIO, abs=0.001)
    assert versus["aa_cpu_ratio"] == 1.0
    assert versus["added_p50_ttft_ms"] == REDIS_ADDED_MS
    assert versus["target"] == "met"
