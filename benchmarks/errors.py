"""Why a benchmark could not run: the errors ``firstbyte bench`` reports as one line.

A part a benchmark starts (a router, a sim, a proxy, a Redis server, the emulated network)
that does not start or stops under it ends the run: the user reads which part and the end of
its log, not a traceback. Every such error is a :class:`BenchError`; anything else escaping a
scenario is a bug of the benchmark and keeps its traceback.
"""

from __future__ import annotations

_MAX_LOG_CHARS = 300
"""How much of a part's log a one-line error carries: its last lines, not its whole story."""


class BenchError(RuntimeError):
    """A benchmark cannot run here or now (the message says what, on one line)."""


class PartFailed(BenchError):
    """A process the benchmark started did not start, or did not come back."""

    def __init__(self, what: str, log: str = "") -> None:
        last = " | ".join(line.strip() for line in log.strip().splitlines()[-3:] if line.strip())
        if len(last) > _MAX_LOG_CHARS:
            last = "..." + last[-_MAX_LOG_CHARS:]
        super().__init__(f"{what} (its log ends: {last})" if last else what)
