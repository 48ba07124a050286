"""Shedding new work when the router's memory runs short (sans-IO, the clock passed in).

Streams in flight keep their memory and go on; what is refused is work not yet started (a
new completion, a new WebSocket), answered at once with 503 ``overloaded`` so the client
tries another region instead of waiting on a router that may be killed for its memory.
"""

from __future__ import annotations

import os
from collections.abc import Callable

__all__ = ["MemoryGuard", "read_rss_bytes"]

_PAGE = os.sysconf("SC_PAGE_SIZE")


def read_rss_bytes() -> int:
    """This process's resident set size (``/proc/self/statm``, Linux)."""
    with open("/proc/self/statm", "rb") as statm:
        return int(statm.read().split()[1]) * _PAGE


class MemoryGuard:
    """Refuses new work while resident memory is over ``max_rss_bytes``.

    The size is read at most once per ``interval_s``: a reading costs a system call, and
    memory does not change faster than that matters here.
    """

    def __init__(
        self,
        max_rss_bytes: int | None,
        clock: Callable[[], float],
        read_rss: Callable[[], int] = read_rss_bytes,
        interval_s: float = 0.25,
    ) -> None:
        self.max_rss_bytes = max_rss_bytes
        self.clock = clock
        self.read_rss = read_rss
        self.interval_s = interval_s
        self.rss_bytes = 0
        self._read_at: float | None = None
        self.shedding = False
        """True while over the bound (the caller logs when this changes)."""

    def refusal(self) -> str | None:
        """The reason to refuse new work now, or None."""
        if self.max_rss_bytes is None:
            return None
        now = self.clock()
        if self._read_at is None or now - self._read_at >= self.interval_s:
            self._read_at = now
            self.rss_bytes = self.read_rss()
            self.shedding = self.rss_bytes > self.max_rss_bytes
        if not self.shedding:
            return None
        return (
            f"resident memory {self.rss_bytes >> 20} MiB over limits.max_rss_bytes"
            f" ({self.max_rss_bytes >> 20} MiB)"
        )
