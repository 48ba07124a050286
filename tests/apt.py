"""apt-get for the tests that install a system tool when it is missing (CI runs as root on a
fresh Debian): one install at a time across pytest-xdist's workers."""

from __future__ import annotations

import contextlib
import fcntl
import tempfile
from collections.abc import Iterator
from pathlib import Path

LOCK = Path(tempfile.gettempdir()) / "firstbyte-tests-apt.lock"


@contextlib.contextmanager
def apt_lock() -> Iterator[None]:
    """Held around each test helper's apt-get commands: two workers installing at once would
    have one fail on dpkg's lock (apt-get does not wait for it), and its test fail with it."""
    with LOCK.open("a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # released when the file closes
        yield
