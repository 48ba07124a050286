"""The retry budget, sans-IO: when a refused request is sent again, and after what wait.

A request refused before its stream started (``429``, ``503``: the region is saturated or its
router is draining) is sent again after the server's ``Retry-After`` (never sooner), or after
a doubling backoff when it sent none; a stream that ended with ``draining`` before any token,
and a ``503`` ``draining`` refusal's first resend (to the same region on a new connection: the
refusal was one router process's), are sent again at once. Each costs one retry of
``retries``, and the waits of one request add up to at most ``budget_s``: a ``Retry-After``
longer than the budget left raises the error at once rather than after a wait that cannot end
in a retry. Nothing is retried once a token was delivered (a retry would repeat it): the
caller asks only before.
"""

from __future__ import annotations

__all__ = ["FIRST_BACKOFF_S", "RETRY_STATUSES", "RetryBudget"]

RETRY_STATUSES = frozenset({429, 503})
"""The answers a request is sent again for: saturated, or draining / unavailable for now."""

FIRST_BACKOFF_S = 1.0
"""The wait before the first retry when the answer has no ``Retry-After`` (nor, over
WebSocket, ``retry_after``: an older router's ``error`` message); doubled each time. The
router's shortest ``Retry-After`` is 1 s (whole seconds), so a shorter wait would only spend a
retry on a refusal."""


class RetryBudget:
    """How many retries one request has left, and how much waiting."""

    def __init__(self, retries: int, budget_s: float) -> None:
        self.retries = retries
        self.budget_s = budget_s
        self.used = 0
        self.waited_s = 0.0

    def delay(self, retry_after: float | None) -> float | None:
        """Spend a retry: the seconds to wait before sending again (``retry_after`` when the
        server gave one, else the backoff), or None when the budget cannot cover it (then
        the refusal is the answer)."""
        if self.used >= self.retries:
            return None
        wait = max(retry_after if retry_after is not None else FIRST_BACKOFF_S * 2**self.used,
                   0.0)
        if self.waited_s + wait > self.budget_s:
            return None
        self.used += 1
        self.waited_s += wait
        return wait
