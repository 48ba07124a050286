"""Helper processes of a benchmark world end with their parent, and are stopped in one way.

The world starts its helpers in their own session (so a terminal's Ctrl-C reaches only the
parent, which then tears everything down in order); the price is that a parent killed with
SIGKILL would leave them running. :func:`exit_with_parent` is their watchdog;
:func:`stop_process` is how a parent ends one.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from typing import Any

__all__ = ["exit_with_parent", "stop_process"]


def exit_with_parent(code: int = 3, interval_s: float = 0.2) -> None:
    """End this process with ``code`` as soon as its parent has gone (it is re-parented).

    The watchdog is a daemon thread, not a task: it must work while the event loop is busy or
    stuck (a cancellation that a library swallows, a graceful close that waits on a peer that
    is gone too). It ends the process with :func:`os._exit`, because nobody is left to read
    its output or to wait for a graceful shutdown; the kernel closes its sockets.
    """
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval_s)
        os._exit(code)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def stop_process(proc: subprocess.Popen[Any], timeout_s: float = 10.0) -> None:
    """SIGTERM ``proc`` and wait ``timeout_s`` for it to finish; then SIGKILL and reap it."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
