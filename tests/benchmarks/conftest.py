"""Shared fixtures of the benchmark tests."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from firstbyte.benchmarks.cli import discover_scenarios
from tests.apt import apt_lock
from tests.benchmarks.chromium import chromium_or_skip, install_chromium
from tests.cli import FIRSTBYTE

QUICK_AT_ONCE = 3
"""Quick scenario runs at the same time."""
QUICK_FIRST = ("tenancy", "browser", "routing", "router_workers", "soak", "router_overhead")
"""The quick runs that take longest, longest first (~125, ~90, ~40 and ~30 s each on two
cores beside the suite), started before the few-second ones. In name order tenancy started
ninth, ~80 s in, and ran on alone ~80 s after the others had ended."""
QUICK_ELSEWHERE = {
    "transports": "tests/benchmarks/test_transports.py::"
                  "test_quick_run_through_the_emulator_matches_round_trip_theory",
}
"""Scenarios whose ``--quick --json`` run a test makes anyway, under conditions of its own (the
machine alone), and checks with :func:`check_quick_report` too: not run again beside the
others (transports' was ~40 s of a slot here)."""
QUICK_WAIT_S = 420.0
"""How long a test waits for its scenario's quick run, queue included (below the tests'
``pytest.mark.timeout``)."""


class QuickRuns:
    """Every scenario's ``--quick --json`` run, :data:`QUICK_AT_ONCE` at a time, the longest
    (:data:`QUICK_FIRST`) first and then by name (these check that each scenario runs and
    writes valid output, not its numbers). All at once, eleven scenarios on two cores beside
    two more test workers made the first one waited for take over 180 s, and every timed test
    beside them slower."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.procs: dict[str, subprocess.Popen[str]] = {}
        self.done: dict[str, tuple[int, str, str]] = {}
        self._ended: dict[str, threading.Event] = {}
        self._slots = threading.Semaphore(QUICK_AT_ONCE)
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._launcher: threading.Thread | None = None

    def start(self) -> None:
        have_chromium, _ = install_chromium()
        names = [n for n in sorted(discover_scenarios(), key=_launch_order)
                 if (n != "browser" or have_chromium) and n not in QUICK_ELSEWHERE]
        self._ended = {name: threading.Event() for name in names}
        self._launcher = threading.Thread(target=self._launch, args=(names,), daemon=True)
        self._launcher.start()

    def _launch(self, names: list[str]) -> None:
        for name in names:
            self._slots.acquire()
            with self._lock:
                if self._stopping.is_set():
                    self._slots.release()
                    return
                args = ["bench", name, "--quick", "--out", str(self.root / name), "--json"]
                proc = subprocess.Popen(
                    [*FIRSTBYTE, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                    text=True,
                )
                self.procs[name] = proc
            threading.Thread(target=self._collect, args=(name, proc), daemon=True).start()

    def _collect(self, name: str, proc: subprocess.Popen[str]) -> None:
        try:
            stdout, stderr = proc.communicate()
            self.done[name] = (proc.returncode, stdout, stderr)
        finally:
            self._slots.release()
            self._ended[name].set()

    def result(self, name: str) -> tuple[int, str, str, Path]:
        if name == "browser":
            chromium_or_skip()  # installed before the runs started; here: fail or skip
        if not self._ended[name].wait(timeout=QUICK_WAIT_S):
            raise TimeoutError(f"bench {name} --quick did not end in {QUICK_WAIT_S} s")
        code, stdout, stderr = self.done[name]
        return code, stdout, stderr, self.root / name

    def stop(self) -> None:
        """End the runs no test waited for (``-k``) and start no more: SIGTERM first, so a
        scenario tears down its namespaces and helpers as it does for Ctrl-C; SIGKILL only
        if that hangs."""
        with self._lock:
            self._stopping.set()
            running = [proc for proc in self.procs.values() if proc.poll() is None]
        self._slots.release()  # a launcher waiting for a slot sees the stop
        for proc in running:
            proc.terminate()
        for proc in running:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def check_quick_report(scenario: str, code: int, stdout: str, stderr: str, out: Path) -> None:
    """What every scenario's ``--quick --out OUT --json`` run must give: exit 0, the same
    results printed and written, a summary and an HTML report that say it was quick."""
    assert code == 0, stderr[-3000:]
    printed = msgspec.json.decode(stdout)
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
    page = (out / "report.html").read_text()
    assert page.startswith("<!DOCTYPE html>")
    assert "This was a quick run (--quick)" in page
    assert written["conditions"]["command"].startswith(f"firstbyte bench {scenario}")


def _launch_order(name: str) -> tuple[int, str]:
    return (QUICK_FIRST.index(name) if name in QUICK_FIRST else len(QUICK_FIRST), name)


def nginx_installed() -> bool:
    return shutil.which("nginx") is not None or os.access("/usr/sbin/nginx", os.X_OK)


def ensure_nginx() -> None:
    """router_overhead's reference proxy: install ``nginx-light`` where apt can (CI runs as
    root on Debian/Ubuntu); elsewhere the scenario runs without it and says so."""
    if nginx_installed() or os.geteuid() != 0 or shutil.which("apt-get") is None:
        return
    env = os.environ | {"DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "nginx-light"]
    with apt_lock():
        for command in (install, ["apt-get", "update", "-q"], install):
            done = subprocess.run(command, env=env, capture_output=True, timeout=600,
                                  check=False)
            if command is install and done.returncode == 0:
                return


@pytest.fixture(scope="session")
def quick_runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[QuickRuns]:
    ensure_nginx()
    runs = QuickRuns(tmp_path_factory.mktemp("bench"))
    try:
        runs.start()
        yield runs
    finally:
        runs.stop()
