"""A part a benchmark starts that fails (here, its Redis server) ends the run with one line
naming the scenario, the part and the end of its log: never a traceback."""

from __future__ import annotations

import argparse
import os
import subprocess
from pathlib import Path
from typing import Any

import msgspec
import pytest

from firstbyte.benchmarks.errors import PartFailed
from firstbyte.cli import CLIError
from tests.cli import FIRSTBYTE


def test_a_part_that_does_not_start_is_one_line_naming_it(tmp_path: Path) -> None:
    server = tmp_path / "broken-server"
    server.write_text(
        "#!/bin/sh\necho 'starting' >&2\necho 'FATAL CONFIG FILE ERROR: bad directive' >&2\n"
        "exit 1\n"
    )
    server.chmod(0o755)
    done = subprocess.run(
        [*FIRSTBYTE, "bench", "router_workers", "--quick", "--out", str(tmp_path / "out")],
        env={**os.environ, "FIRSTBYTE_REDIS_SERVER": str(server)},
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 2, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr[-3000:]
    assert lines[0].startswith("firstbyte bench: error: router_workers: "), lines[0]
    assert "exited with 1" in lines[0], lines[0]
    assert "FATAL CONFIG FILE ERROR" in lines[0], lines[0]
    assert not (tmp_path / "out" / "results.json").exists()


def test_a_long_log_is_cut_to_its_last_lines() -> None:
    log = "\n".join(f"line {i} " + "x" * 200 for i in range(100)) + "\n\n"
    message = str(PartFailed("router did not become healthy", log))
    assert "\n" not in message
    assert message.startswith("router did not become healthy (its log ends: ...")
    assert message.endswith("line 99 " + "x" * 200 + ")")
    assert len(message) < 400
    assert str(PartFailed("sim did not become ready")) == "sim did not become ready"


def test_bench_all_skips_a_scenario_this_machine_cannot_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The WAN emulator's precision needs root and runs last (by name): without root, `bench
    all` ran every other scenario, then ended at it with no combined report. The others'
    report is written, the skip said in it and on stderr, and the exit is 1."""
    from firstbyte.benchmarks import cli

    def scenario(name: str, quick: bool) -> dict[str, Any]:
        if name == "wan":
            raise CLIError("wan: the WAN emulator needs root")
        return {"scenario": name, "quick": quick, "summary": {"p99_ttft_ms": 1.0}, "runs": []}

    monkeypatch.setattr(cli, "discover_scenarios", lambda: {"decode": "d", "wan": "w"})
    monkeypatch.setattr(cli, "run_scenario", scenario)
    args = argparse.Namespace(scenario="all", quick=True, out=str(tmp_path), json=False)
    assert cli.run(args) == 1
    err = capsys.readouterr().err
    assert "bench: skipped wan: wan: the WAN emulator needs root" in err
    combined = msgspec.json.decode((tmp_path / "results.json").read_bytes())
    assert list(combined["scenarios"]) == ["decode"]
    assert combined["skipped"] == {"wan": "wan: the WAN emulator needs root"}
    assert "Not run here" in (tmp_path / "report.html").read_text()
