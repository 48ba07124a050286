"""tests/machine.py: a test in ``alone()`` waits for the other workers' running tests, and
their next tests wait for it. Two processes stand in for two workers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.machine import LOCKS_ENV

ROOT = Path(__file__).resolve().parents[1]

WORKER = """
import sys, time
from tests import machine
machine.enter_test()
print("in", flush=True)
time.sleep(1.0)
left = time.monotonic()
machine.leave_test()
machine.enter_test()
entered = time.monotonic()
machine.leave_test()
print(left, entered, flush=True)
"""

ALONE = """
import json, time
from tests import machine
machine.enter_test()
asked = time.monotonic()
with machine.alone():
    start = time.monotonic()
    time.sleep(1.0)
    end = time.monotonic()
machine.leave_test()
print(json.dumps([asked, start, end]), flush=True)
"""


def _spawn(code: str, folder: Path) -> subprocess.Popen[str]:
    env = {"PATH": "/usr/bin:/bin", LOCKS_ENV: str(folder), "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT
    )


def test_alone_waits_for_the_running_test_and_holds_back_the_next(tmp_path: Path) -> None:
    worker = _spawn(WORKER, tmp_path)
    assert worker.stdout is not None
    assert worker.stdout.readline().strip() == "in"
    alone = _spawn(ALONE, tmp_path)
    out, _ = alone.communicate(timeout=30)
    asked, start, end = json.loads(out)
    left, entered = map(float, worker.communicate(timeout=30)[0].split())
    assert asked < left <= start, (asked, left, start)  # it waited for the running test
    assert end <= entered, (end, entered)  # and the next test waited for it
    assert alone.returncode == worker.returncode == 0


def test_without_the_variable_alone_does_nothing() -> None:
    code = (
        "import time\nfrom tests import machine\nt = time.monotonic()\n"
        "with machine.alone():\n    pass\nprint(time.monotonic() - t)"
    )
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=30
    )
    assert done.returncode == 0, done.stderr
    assert float(done.stdout) < 0.5


def test_steadiest_measures_again_at_most_twice_and_returns_the_last() -> None:
    from tests.machine import ATTEMPTS, steadiest

    readings = iter([5.0, 0.5, 9.0])
    assert steadiest(lambda: next(readings), lambda x: x < 1.0) == 0.5  # the second was fine
    calls: list[int] = []
    last = steadiest(lambda: calls.append(1) or len(calls), lambda x: False)
    assert last == len(calls) == ATTEMPTS  # never fine: the last, for the caller to assert
