"""A benchmark stopped with SIGTERM (as a test harness or a service manager stops it) tears
down like Ctrl-C: its namespaces and every process it started are gone."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.benchmarks.procs import alive, descendants, namespaces_of
from tests.cli import FIRSTBYTE


@pytest.mark.netns
def test_sigterm_mid_benchmark_removes_its_namespaces_and_processes(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [*FIRSTBYTE, "bench", "transports", "--quick", "--out", str(tmp_path / "out")],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 90
        while not namespaces_of(proc.pid):
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the benchmark never built its world"
            time.sleep(0.2)
        time.sleep(3.0)  # mid-run: regions serving, clients or probes running
        started = descendants(proc.pid)
        assert started, "the benchmark should have helper processes"
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 130, stderr[-3000:]
        assert "Traceback" not in stderr, stderr[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert namespaces_of(proc.pid) == []
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in started) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = {pid for pid in started if alive(pid)}
    assert left == set(), "helper processes outlived the benchmark"
