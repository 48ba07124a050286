"""Plain-text progress for long benchmark runs, on stderr, without a dependency.

On a terminal the bar redraws in place (``\\r``); otherwise (CI logs, pipes) it prints one line
at every quarter so logs stay short. Both go to stderr, so ``--json`` output on stdout stays
clean.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["Progress"]


class Progress:
    """``with Progress(total, "label") as bar: ... bar.advance()``.

    Drawing is rate-limited (at most every 0.1 s on a terminal) so a tight benchmark loop does
    not pay for it.
    """

    def __init__(
        self, total: int, label: str, *, stream: TextIO | None = None, width: int = 30
    ) -> None:
        self.total = max(total, 1)
        self.label = label
        self.done = 0
        self._stream = stream if stream is not None else sys.stderr
        self._tty = bool(getattr(self._stream, "isatty", lambda: False)())
        self._width = width
        self._started = time.monotonic()
        self._last_draw = 0.0
        self._last_quarter = 0

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.finish()

    def advance(self, n: int = 1) -> None:
        self.done = min(self.done + n, self.total)
        if self._tty:
            now = time.monotonic()
            if now - self._last_draw >= 0.1 or self.done == self.total:
                self._last_draw = now
                self._draw(end="")
            return
        quarter = self.done * 4 // self.total
        if quarter > self._last_quarter and quarter < 4:
            self._last_quarter = quarter
            self._draw(end="\n")

    def finish(self) -> None:
        if self._last_quarter == 4:
            return
        self._last_quarter = 4
        self._draw(end="\n")

    def _draw(self, *, end: str) -> None:
        filled = self._width * self.done // self.total
        bar = "#" * filled + "." * (self._width - filled)
        elapsed = time.monotonic() - self._started
        text = f"{self.label} [{bar}] {self.done}/{self.total} {elapsed:.1f}s"
        prefix = "\r" if self._tty else ""
        self._stream.write(prefix + text + end)
        self._stream.flush()
