"""The soak's per-phase table from made-up samples: which samples and canary lines fall in
each phase's window, and what start/peak/end mean."""

from __future__ import annotations

from firstbyte.benchmarks.scenarios.soak import PHASES, _phase_rows


def _line(t: float, ttft_ms: float | None, outcome: str = "ok") -> dict[str, object]:
    return {"t": t, "ttft_ms": ttft_ms, "outcome": outcome, "errors": []}


def test_each_phase_gets_its_windows_samples_and_canary() -> None:
    duration = 100.0
    # the router's (t, MB, fds) every second: RSS and fds rise with t, one spike at t = 50
    samples = [(float(t), 60.0 + t / 10 + (40 if t == 50 else 0), 20 + t) for t in range(101)]
    lines = [_line(float(t), 10.0 + t) for t in range(0, 100, 2)] + [_line(51.0, None, "failed")]
    failed_at = [1.0, 50.5, 99.0]
    rows = {row["label"]: row for row in _phase_rows(lines, samples, failed_at, duration)}
    assert list(rows) == ["baseline (no hostile phase)", *(p.name for p in PHASES),
                          "recovery (no hostile phase)"]
    base = rows["baseline (no hostile phase)"]
    assert base["window"] == "0-15 s"
    assert (base["rss_start_mb"], base["rss_peak_mb"], base["rss_end_mb"]) == (60.0, 61.5, 61.5)
    assert (base["fds_start"], base["fds_peak"], base["fds_end"]) == (20, 35, 35)
    assert base["canary_n"] == 8  # t = 0, 2, ..., 14
    assert base["canary_max_ms"] == 24.0
    assert base["good_failed_tries"] == 1
    assert base["canary_router_errors"] == 0
    pre_tls = rows["pre-TLS holders"]  # 50-60 s: the spike at 50 is its start and its peak
    assert pre_tls["rss_start_mb"] == pre_tls["rss_peak_mb"] == 105.0
    assert pre_tls["rss_end_mb"] == 66.0
    assert pre_tls["canary_router_errors"] == 1  # the request that never succeeded
    assert pre_tls["canary_n"] == 6  # 50, 52, ..., 58 and the failed one at 51
    assert pre_tls["canary_p50_ms"] == 64.0  # of the five that got a token
    assert pre_tls["good_failed_tries"] == 1
    assert rows["recovery (no hostile phase)"]["good_failed_tries"] == 1


def test_a_window_without_samples_is_empty_not_an_error() -> None:
    rows = _phase_rows([], [], [], 100.0)
    assert all(row["rss_peak_mb"] is None and row["canary_n"] == 0 for row in rows)
    assert all(row["canary_p50_ms"] is None for row in rows)


def test_start_and_end_are_the_state_when_the_window_opens_and_closes() -> None:
    """Start and end are the last samples at or before the window's edges: a sample after it
    (a later phase's load) is not its end, and a phase shorter than the sampler's gap (a busy
    event loop) still has a start, peak and end: its start's."""
    samples = [(0.0, 60.0, 20), (14.0, 61.0, 21), (16.0, 95.0, 160), (70.0, 90.0, 40),
               (90.0, 70.0, 30)]
    rows = {row["label"]: row for row in _phase_rows([], samples, [], 100.0)}
    base = rows["baseline (no hostile phase)"]  # 0-15 s; at 16 s the holders' load shows
    assert (base["rss_start_mb"], base["rss_peak_mb"], base["rss_end_mb"]) == (60.0, 61.0, 61.0)
    assert (base["fds_start"], base["fds_peak"], base["fds_end"]) == (20, 21, 21)
    flood = rows["QUIC Initial flood"]  # 80-85 s: no sample inside
    assert (flood["rss_start_mb"], flood["rss_peak_mb"], flood["rss_end_mb"]) == (90.0, 90.0, 90.0)
    assert (flood["fds_start"], flood["fds_peak"], flood["fds_end"]) == (40, 40, 40)
