"""CI-quick runs of every benchmark scenario through the real ``firstbyte bench`` command."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from benchmarks.cli import discover_scenarios

MAIN = "import sys; from client_sdk.cli import main; sys.exit(main())"
SCENARIOS = sorted(discover_scenarios())


def firstbyte(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", MAIN, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_the_scenarios_of_this_task_are_discovered() -> None:
    assert {"decode", "router_overhead"} <= set(SCENARIOS)


def test_help_lists_every_scenario() -> None:
    done = firstbyte("bench", "--help", timeout=30)
    assert done.returncode == 0
    for name in SCENARIOS:
        assert name in done.stdout
    assert "compare" in done.stdout


def test_unknown_scenario_is_a_clear_error() -> None:
    done = firstbyte("bench", "no-such-scenario", timeout=30)
    assert done.returncode == 2
    assert "invalid choice: 'no-such-scenario'" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_quick_run_writes_valid_report(scenario: str, tmp_path: Path) -> None:
    out = tmp_path / scenario
    done = firstbyte("bench", scenario, "--quick", "--out", str(out), "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    printed = msgspec.json.decode(done.stdout)
    written = msgspec.json.decode((out / "results.json").read_bytes())
    assert printed == written
    assert written["scenario"] == scenario
    assert written["quick"] is True
    assert "TTFT" in written["metric_definitions"]
    meta = {"scenario", "quick", "date", "host", "metric_definitions"}
    assert set(written) - meta, "a scenario must report something"
    summary = (out / "summary.md").read_text()
    assert summary.startswith(f"# Benchmark: {scenario}")
    assert "| result | value |" in summary or "| run |" in summary
    for png in out.glob("*.png"):
        assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_decode_beats_openai_sdk_by_target(tmp_path: Path) -> None:
    done = firstbyte("bench", "decode", "--quick", "--out", str(tmp_path), "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    results = msgspec.json.decode(done.stdout)
    assert all(run["events_ok"] for run in results["runs"])
    # measured ~28x on this machine; both sides run interleaved in one process
    assert results["summary"]["core_vs_openai_ratio"] >= 10
