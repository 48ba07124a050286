"""Shared fixtures of the benchmark tests."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from firstbyte.benchmarks.cli import discover_scenarios
from tests.benchmarks.chromium import chromium_or_skip, install_chromium
from tests.cli import FIRSTBYTE


class QuickRuns:
    """Every scenario's ``--quick --json`` run, started together so the file stays short
    (these check that each scenario runs and writes valid output, not its numbers)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.procs: dict[str, subprocess.Popen[str]] = {}
        self.done: dict[str, tuple[int, str, str]] = {}

    def start(self) -> None:
        have_chromium, _ = install_chromium()
        for name in sorted(discover_scenarios()):
            if name == "browser" and not have_chromium:
                continue
            args = ["bench", name, "--quick", "--out", str(self.root / name), "--json"]
            self.procs[name] = subprocess.Popen(
                [*FIRSTBYTE, *args],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )

    def result(self, name: str) -> tuple[int, str, str, Path]:
        if name == "browser":
            chromium_or_skip()  # installed before the runs started; here: fail or skip
        if name not in self.done:
            proc = self.procs[name]
            stdout, stderr = proc.communicate(timeout=150)
            self.done[name] = (proc.returncode, stdout, stderr)
        code, stdout, stderr = self.done[name]
        return code, stdout, stderr, self.root / name

    def stop(self) -> None:
        """End the runs no test waited for (``-k``): SIGTERM first, so a scenario tears down
        its namespaces and helpers as it does for Ctrl-C; SIGKILL only if that hangs."""
        running = [proc for proc in self.procs.values() if proc.poll() is None]
        for proc in running:
            proc.terminate()
        for proc in running:
            try:
                proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()


@pytest.fixture(scope="session")
def quick_runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[QuickRuns]:
    runs = QuickRuns(tmp_path_factory.mktemp("bench"))
    try:
        runs.start()
        yield runs
    finally:
        runs.stop()
