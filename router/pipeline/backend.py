"""Backend choice: which upstream inference server takes this request.

Chat requests get their backend from the routing stage (``router/multiregion.py``: prefix
affinity balanced by load), which runs first and sets ``ctx.backend``; a stage that already
chose is respected. :func:`choose_backend` picks only for the rest (e.g. ``GET /v1/models``):
the healthy backend with the fewest requests in flight, ties broken round-robin.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from .context import CONTINUE, Fallback, Outcome, RequestContext

__all__ = ["PEER_PREFIX", "Backend", "BackendPool", "choose_backend"]

PEER_PREFIX = "peer:"
"""Name prefix of the :class:`Backend` that stands for a peer region's router."""


@dataclass(eq=False)
class Backend:
    """One upstream: its base URL (ending without ``/``) and live load."""

    name: str
    url: str
    api_key: str | None = field(default=None, repr=False)  # a repr may end up in a log
    in_flight: int = 0
    healthy: bool = True
    requests: int = 0
    failures: int = 0


class BackendPool:
    """The configured upstreams, with a round-robin cursor for tie-breaks."""

    def __init__(self, backends: list[Backend]) -> None:
        self.backends = backends
        self._next = 0

    def pick(self) -> Backend | None:
        """Least in-flight among healthy backends; round-robin among equals."""
        healthy = [b for b in self.backends if b.healthy]
        if not healthy:
            return None
        least = min(b.in_flight for b in healthy)
        count = len(self.backends)
        for step in range(count):
            candidate = self.backends[(self._next + step) % count]
            if candidate.healthy and candidate.in_flight == least:
                self._next = (self._next + step + 1) % count
                return candidate
        return None  # unreachable: a healthy backend with the least load exists

    @property
    def in_flight(self) -> int:
        return sum(b.in_flight for b in self.backends)


def choose_backend(ctx: RequestContext, pool: BackendPool) -> Outcome:
    """Set ``ctx.backend`` (unless an earlier stage did) and stamp ``ctx.routed_at``."""
    if ctx.backend is None:
        backend = pool.pick()
        if backend is None:
            # A later stage (peer-region forwarding) may take over; otherwise the app
            # answers 503.
            return Fallback("no healthy upstream in this region")
        ctx.backend = backend
    ctx.routed_at = time.perf_counter()
    return CONTINUE
