"""``bench router_overhead`` judges the CPU target (the default router at most 2x the byte
pipe's CPU per chunk) from two readings of the same router in the same run: a level whose
two readings straddle the limit says so instead of calling it met or not."""

from __future__ import annotations

import pytest

from firstbyte.benchmarks.scenarios.router_overhead import _cpu_verdict, _versus_pipe


@pytest.mark.parametrize(("default", "again", "expected"), [
    (1.97, 1.85, "met"),  # 500 streams, 2026-12-04 08:20
    (2.0, 1.64, "met"),  # at the limit is within it
    (2.09, 2.31, "NOT MET"),  # 100 streams, the same run
    (2.11, 2.21, "NOT MET"),
    (1.97, 2.02, "inconclusive"),  # 100 streams, 2026-12-04 earlier: the limit between them
    (2.01, 1.99, "inconclusive"),
])
def test_a_level_is_judged_from_both_readings(default: float, again: float,
                                              expected: str) -> None:
    assert _cpu_verdict(default, again) == expected


def _summary(**per_chunk: float) -> dict[str, float]:
    return {f"{key}_cpu_us_per_chunk": value for key, value in per_chunk.items()}


def test_the_summary_has_each_level_and_the_whole_target() -> None:
    summary = _summary(c100_python_pipe=24.3, c100_auto=50.8, c100_auto_aa=56.1,
                       c500_python_pipe=23.6, c500_auto=46.6, c500_auto_aa=43.7)
    _versus_pipe(summary, [1, 100, 500])
    assert summary["c100_auto_cpu_vs_pipe"] == pytest.approx(50.8 / 24.3)
    assert summary["c100_cpu_vs_pipe_target"] == "NOT MET"
    assert summary["c500_cpu_vs_pipe_target"] == "met"
    assert "c1_cpu_vs_pipe_target" not in summary  # no A/A router at 1 stream
    assert summary["cpu_vs_pipe_target"] == "NOT MET"
    summary = _summary(c100_python_pipe=24.3, c100_auto=47.0, c100_auto_aa=48.0,
                       c500_python_pipe=23.6, c500_auto=46.6, c500_auto_aa=48.0)
    _versus_pipe(summary, [100, 500])
    assert (summary["c100_cpu_vs_pipe_target"], summary["c500_cpu_vs_pipe_target"]) == (
        "met", "inconclusive")
    assert summary["cpu_vs_pipe_target"] == "inconclusive"


def test_no_target_without_the_pipe() -> None:
    summary = _summary(c100_python_pipe=0.0, c100_auto=50.8, c100_auto_aa=56.1)
    _versus_pipe(summary, [100])  # a quick phase may take less than one CPU tick
    assert "cpu_vs_pipe_target" not in summary
