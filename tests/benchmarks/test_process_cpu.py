"""The benchmarks' CPU time of another process: every thread, exited ones too, finer than
the 10 ms clock ticks of ``/proc/PID/stat``."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from firstbyte.benchmarks.conditions import child_pids, process_cpu_seconds

# Spins 25 ms of CPU in a thread that then exits, then 25 ms in the main thread, then says
# so and waits for stdin to close.
_BUSY = """
import sys, threading, time
def spin(s):
    t = time.thread_time()
    while time.thread_time() - t < s:
        pass
worker = threading.Thread(target=spin, args=(0.025,))
worker.start()
worker.join()
spin(0.025)
print("spun", time.process_time(), flush=True)
sys.stdin.read()
"""


def test_counts_every_thread_exited_ones_too_below_a_tick() -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", _BUSY], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None
        word, own = child.stdout.readline().split()
        assert word == "spun"
        measured = process_cpu_seconds(child.pid)
        # At least the 50 ms spun; the child's own clock read a moment before is the floor,
        # and what it did after (print, read) is well under a millisecond.
        assert measured >= float(own) >= 0.05
        assert measured - float(own) < 0.005
        # Ticks would give a multiple of 10 ms; the clock gives nanoseconds.
        assert abs(measured * 100 - round(measured * 100)) > 1e-6
        again = process_cpu_seconds(child.pid)
        assert 0 <= again - measured < 0.005  # idle: reading it twice barely moves
    finally:
        child.communicate("")
    assert process_cpu_seconds(child.pid) == 0.0  # gone and reaped


def test_child_pids_are_the_live_children() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 5
        while child.pid not in child_pids(os.getpid()) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert child.pid in child_pids(os.getpid())
    finally:
        child.communicate(b"")
    assert child.pid not in child_pids(os.getpid())
    assert child_pids(2**22 + 1) == []  # no such process
