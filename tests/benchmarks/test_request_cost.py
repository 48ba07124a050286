"""``python -m firstbyte.benchmarks.request_cost``: a short run relays the long streams, ends
short requests beside them and reports a cost for each window with them; bad arguments are
one usage line. How much a request costs is the full run's to say: on this shared machine a
CI run's windows are too short and too noisy to judge it."""

from __future__ import annotations

import json
import subprocess
import sys


def _run(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "firstbyte.benchmarks.request_cost", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_a_short_run_measures_the_relay_and_the_requests_beside_it() -> None:
    # Windows of a second: /proc counts CPU in 10 ms ticks, and two half-second windows of
    # 20 streams relaying once read no tick at all under the suite's load.
    done = _run("--streams", "20", "--workers", "3", "--rounds", "2", "--window-s", "1",
                timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["errors"] == []
    assert (result["streams"], result["workers"], result["tokens"]) == (20, 3, 2)
    # Both windows with requests ended some, between windows without them.
    assert result["requests"] > 0
    assert len(result["request_ms_windows"]) == 2
    windows = result["request_ms_windows"]
    assert min(windows) <= result["request_ms"] <= max(windows)  # their median
    # The quiet windows relayed the long streams' chunks at some CPU cost.
    assert result["relay_us_per_chunk"] > 0


def test_bad_arguments_are_one_usage_line() -> None:
    for args, message in (
        (("--rounds", "0"), "--rounds must be at least 1"),
        (("--window-s", "-1"), "--window-s must be positive"),
        (("--streams", "many"), "invalid int value"),
    ):
        done = _run(*args, timeout=30)
        assert done.returncode == 2, args
        assert message in done.stderr
        assert "Traceback" not in done.stderr
