"""Shared fixtures of the benchmark tests."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from firstbyte.benchmarks.cli import discover_scenarios
from tests.apt import apt_lock
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
            stdout, stderr = proc.communicate(timeout=300)  # all run at once on two cores
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
