"""A helper whose parent is SIGKILLed ends by itself, even when its own main thread is stuck."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from tests.benchmarks.procs import alive

# The middle process starts the helper, prints its pid and waits forever; the helper arms the
# watchdog and then blocks its main thread (as a stuck event loop would).
HELPER = (
    "import time; from firstbyte.benchmarks._parent import exit_with_parent; "
    "exit_with_parent(); print('armed', flush=True); time.sleep(600)"
)
MIDDLE = (
    "import subprocess, sys, time; "
    f"p = subprocess.Popen([sys.executable, '-c', {HELPER!r}], stdout=subprocess.PIPE, text=True); "
    "assert p.stdout.readline().strip() == 'armed'; print(p.pid, flush=True); time.sleep(600)"
)


def test_helper_exits_when_its_parent_is_killed() -> None:
    middle = subprocess.Popen([sys.executable, "-c", MIDDLE], stdout=subprocess.PIPE, text=True)
    helper = 0
    try:
        assert middle.stdout is not None
        helper = int(middle.stdout.readline())
        time.sleep(0.5)
        assert alive(helper), "the helper should run while its parent does"
        middle.send_signal(signal.SIGKILL)
        middle.wait(timeout=10)
        deadline = time.monotonic() + 5
        while alive(helper) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(helper), "the helper outlived its parent by 5 s"
    finally:
        if middle.poll() is None:
            middle.kill()
            middle.wait()
        if helper and alive(helper):
            os.kill(helper, signal.SIGKILL)
