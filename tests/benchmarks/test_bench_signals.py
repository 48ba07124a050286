"""A benchmark stopped with SIGTERM (as a test harness or a service manager stops it) tears
down like Ctrl-C: its namespaces and every process it started are gone."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.cli import FIRSTBYTE


def namespaces_of(pid: int) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    return [line.split()[0] for line in out.stdout.splitlines() if line.startswith(f"fb-{pid}-")]


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (children, their children, ...)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z":
                parents[int(entry)] = int(fields[1])
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def alive(pids: set[int]) -> set[int]:
    left = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    left.add(pid)
        except OSError:
            pass
    return left


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
    while alive(started) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert alive(started) == set(), "helper processes outlived the benchmark"
