"""``bench router_overhead``'s mid-stream CPU per chunk counts only the window where every
stream is under way and none has ended: a request's work at either end stays out of it."""

from __future__ import annotations

import pytest

from firstbyte.benchmarks.scenarios._mid_stream import EDGE_S, _Round
from firstbyte.benchmarks.scenarios.router_overhead import PIPE_TARGET, _mid_stream_costs


def _round(firsts: list[float], ends: list[float]) -> _Round:
    """Samples every 0.1 s over 0-5 s: 1,000 chunks and 10 ms of CPU a second, but 1 s of CPU
    in the first and the last 0.5 s (the requests' work at the start and the end)."""
    record = _Round(firsts=firsts, ends=ends)
    cpu = 0.0
    for i in range(51):
        t = i / 10
        if i:
            cpu += 0.2 if t <= 0.5 or t > 4.5 else 0.001
        record.samples.append((t, i * 100, cpu))
    return record


def test_the_window_starts_after_the_last_first_chunk_and_ends_before_the_first_end() -> None:
    window = _round([0.2, 0.45 - EDGE_S], [4.55 + EDGE_S, 4.9]).window()
    assert window is not None
    seconds, chunks, cpu = window
    # from the first sample at or after 0.45 s to the last at or before 4.55 s
    assert seconds == pytest.approx(4.0)
    assert chunks == round(seconds * 1000)
    assert cpu == pytest.approx(seconds * 0.01)  # none of the ends' CPU


@pytest.mark.parametrize(("firsts", "ends", "failed"), [
    ([0.2, 0.4], [0.9, 4.9], []),  # a stream ended before the window could open
    ([0.2, 0.4], [4.9], []),  # a stream never ended
    ([0.2, 0.4], [4.6, 4.9], ["ReadError: reset"]),  # a stream failed
])
def test_a_round_without_a_clean_window_is_not_counted(
    firsts: list[float], ends: list[float], failed: list[str]
) -> None:
    record = _round(firsts, ends)
    record.failed = failed
    assert record.window() is None


def test_the_costs_give_the_ratio_and_the_rest_per_stream() -> None:
    steady = {
        PIPE_TARGET: {"cpu_us_per_chunk": 12.0, "rounds_counted": 4, "errors": []},
        "router/auto": {"cpu_us_per_chunk": 18.0, "rounds_counted": 4, "errors": []},
    }
    level = {
        PIPE_TARGET: {"completed": 100, "total_output_tokens": 5000,
                      "cpu_ms_per_stream": {PIPE_TARGET: 0.7}},
        "router/auto": {"completed": 100, "total_output_tokens": 5000,
                        "cpu_ms_per_stream": {"router/auto": 1.9}},
    }
    out = _mid_stream_costs(steady, level, 100)
    assert out["mid_stream_auto_cpu_vs_pipe"] == pytest.approx(1.5)
    assert "mid_stream_python_pipe_cpu_vs_pipe" not in out
    # 50 chunks a stream: 0.9 ms of the router's 1.9 is its chunks', the rest its request's
    assert out["mid_stream_auto_rest_ms_per_stream"] == pytest.approx(1.0)
    assert out["mid_stream_python_pipe_rest_ms_per_stream"] == pytest.approx(0.1)
