from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import msgspec
import pytest

from firstbyte.benchmarks.cli import _out_dir
from firstbyte.benchmarks.compare import Status, compare, load_results, tracked_metrics
from firstbyte.cli import CLIError
from tests.cli import firstbyte


def result(p99_ttft: float, p95_itl: float = 20.0, mean_ttft: float = 50.0) -> dict[str, Any]:
    return {
        "scenario": "router_overhead",
        "summary": {"added_p99_ttft_ms": p99_ttft / 10, "ratio": 1.0},
        "runs": [
            {
                "label": "via router c=100",
                "transport": "sse",
                "p99_ttft_ms": p99_ttft,
                "p95_itl_ms": p95_itl,
                "mean_ttft_ms": mean_ttft,
                "p50_ttft_ms": mean_ttft,
            }
        ],
    }


def test_tracked_metrics_are_p95_p99_latencies() -> None:
    metrics = tracked_metrics(result(100.0))
    assert metrics == {
        "router_overhead/summary/added_p99_ttft_ms": 10.0,
        "router_overhead/via router c=100 sse/p99_ttft_ms": 100.0,
        "router_overhead/via router c=100 sse/p95_itl_ms": 20.0,
    }


def test_combined_file_keys_by_scenario() -> None:
    combined = {"scenario": "all", "scenarios": {"a": result(1.0), "b": result(2.0)}}
    assert "a/via router c=100 sse/p99_ttft_ms" in tracked_metrics(combined)
    assert tracked_metrics(combined)["b/via router c=100 sse/p99_ttft_ms"] == 2.0


def test_regression_over_ten_percent_is_flagged() -> None:
    comparison = compare(result(100.0), result(111.0))
    assert not comparison.ok
    regressed = {row.metric for row in comparison.regressions}
    assert regressed == {
        "router_overhead/via router c=100 sse/p99_ttft_ms",
        "router_overhead/summary/added_p99_ttft_ms",
    }
    assert "REGRESSED" in comparison.render()
    assert "+11.0%" in comparison.render()


def test_within_threshold_and_untracked_changes_pass() -> None:
    # p99 up 9%, mean (untracked) doubled, p95 ITL improved
    comparison = compare(result(100.0), result(109.0, p95_itl=10.0, mean_ttft=100.0))
    assert comparison.ok
    statuses = {row.metric.rsplit("/", 1)[1]: row.status for row in comparison.rows}
    assert statuses["p95_itl_ms"] is Status.IMPROVED
    assert statuses["p99_ttft_ms"] is Status.OK
    assert "mean_ttft_ms" not in statuses
    assert "no tracked P95/P99 metric regressed by more than 10%" in comparison.render()


def test_threshold_and_noise_floor_are_honoured() -> None:
    assert compare(result(100.0), result(111.0), threshold=0.2).ok
    # 5 ms -> 7 ms is +40% but under a 3 ms noise floor
    assert compare(result(5.0), result(7.0), min_delta_ms=3.0).ok
    assert not compare(result(5.0), result(7.0)).ok
    with pytest.raises(ValueError, match="threshold"):
        compare(result(1.0), result(1.0), threshold=0)


def test_new_and_missing_metrics_do_not_fail() -> None:
    base = result(100.0)
    new = result(100.0)
    new["runs"][0]["p99_e2el_ms"] = 900.0
    del new["runs"][0]["p95_itl_ms"]
    comparison = compare(base, new)
    assert comparison.ok
    statuses = {row.metric.rsplit("/", 1)[1]: row.status for row in comparison.rows}
    assert statuses["p99_e2el_ms"] is Status.NEW
    assert statuses["p95_itl_ms"] is Status.MISSING


def test_load_results_rejects_non_results() -> None:
    with pytest.raises(ValueError, match="not valid JSON"):
        load_results(b"{nope")
    with pytest.raises(ValueError, match="not a firstbyte benchmark result"):
        load_results(b"[1, 2]")


def write(path: Path, data: dict[str, Any]) -> Path:
    path.write_bytes(msgspec.json.encode(data))
    return path


def bench(*args: str) -> subprocess.CompletedProcess[str]:
    return firstbyte("bench", *args)


def test_cli_compare_exit_codes(tmp_path: Path) -> None:
    base = write(tmp_path / "base.json", result(100.0))
    same = write(tmp_path / "same.json", result(105.0))
    worse = write(tmp_path / "worse.json", result(130.0))
    out = ["--out", str(tmp_path / "cmp")]
    ok = bench("compare", str(base), str(same), *out)
    assert ok.returncode == 0, ok.stderr
    assert "p99_ttft_ms" not in ok.stdout  # unchanged rows are only counted...
    assert "3 within the threshold not shown" in ok.stdout
    every = bench("compare", str(base), str(same), "--all", *out)
    assert "p99_ttft_ms" in every.stdout  # ...unless asked for
    bad = bench("compare", str(base), str(worse), *out)
    assert bad.returncode == 1
    assert "REGRESSED" in bad.stdout
    assert "+30.0%" in bad.stdout
    # the same comparison as a page: what moved first, both values and the noise floor
    page = (tmp_path / "cmp" / "report.html").read_text()
    moved = page.index("Moved beyond the threshold")
    within = page.index("Within the threshold")
    regressed = page.index("router_overhead/via router c=100 sse/p99_ttft_ms")
    assert moved < regressed < within
    assert "<td>100.0</td><td>130.0</td><td>+30.0%</td><td>10.00</td>" in page
    assert "2 tracked P95/P99 latencies regressed by more than 10%." in page
    relaxed = bench("compare", str(base), str(worse), "--threshold", "0.5", *out)
    assert relaxed.returncode == 0


def test_cli_compare_bad_input_is_a_clear_error(tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.json"
    garbage.write_text("not json")
    missing = bench("compare", str(tmp_path / "nope.json"), str(garbage))
    assert missing.returncode == 2
    assert "cannot read" in missing.stderr
    assert "Traceback" not in missing.stderr
    bad = bench("compare", str(garbage), str(garbage))
    assert bad.returncode == 2
    assert "not valid JSON" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_single_scenario_against_combined_baseline_compares_that_scenario() -> None:
    other = result(50.0)
    other["scenario"] = "decode"
    combined = {"scenario": "all", "scenarios": {"router_overhead": result(100.0), "decode": other}}
    comparison = compare(combined, result(130.0))
    assert not comparison.ok
    assert comparison.skipped == ["decode"]
    assert all(row.metric.startswith("router_overhead/") for row in comparison.rows)
    assert "not in both files: decode" in comparison.render()


def test_a_negative_baseline_moves_by_its_size() -> None:
    """An added latency may be negative (the router faster than direct): -2.7 to -2.6 ms is
    3.7% worse, within 10%; to +5 ms it regressed; to -50 ms it improved."""
    def added(value: float) -> dict[str, Any]:
        return {"scenario": "router_overhead", "summary": {"c100_added_p99_ttft_ms": value}}

    statuses = [compare(added(-2.7), added(n)).rows[0].status for n in (-2.6, 5.0, -50.0)]
    assert statuses == [Status.OK, Status.REGRESSED, Status.IMPROVED]
    with pytest.raises(ValueError, match="min_delta_ms must be 0 or more, not nan"):
        compare(added(1.0), added(9.0), min_delta_ms=float("nan"))  # nan: the gate off


def test_files_that_share_no_metric_fail_the_gate(tmp_path: Path) -> None:
    """A loopback run against the emulated baseline: every row new or missing. It passed,
    'no tracked metric regressed', having compared nothing."""
    base = result(100.0)
    new = result(100.0)
    new["runs"][0]["label"] = "loopback"
    del base["summary"], new["summary"]
    comparison = compare(base, new)
    assert not comparison.compared
    assert not comparison.ok
    assert "nothing was compared" in comparison.render()
    done = bench("compare", str(write(tmp_path / "base.json", base)),
                 str(write(tmp_path / "new.json", new)), "--out", str(tmp_path / "cmp"))
    assert done.returncode == 2, done
    assert "no tracked P95/P99 metric is in both files (2 only in the baseline, 2 only in" \
           " the new run): nothing was compared" in done.stderr
    assert "Nothing was compared" in (tmp_path / "cmp" / "report.html").read_text()


def test_an_out_folder_that_takes_no_file_is_refused_before_the_run(tmp_path: Path) -> None:
    """A folder that exists but takes no file (read-only, immutable) was found only when the
    results were written, minutes later, as a traceback. Made here by putting a folder where
    the check's file goes, which fails for root too."""
    (tmp_path / f".firstbyte-write-check-{os.getpid()}").mkdir()
    with pytest.raises(CLIError, match=f"^cannot write in --out {tmp_path}: "):
        _out_dir(str(tmp_path))
    assert _out_dir(str(tmp_path / "new")) == tmp_path / "new"  # made, and it takes files
