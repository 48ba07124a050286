"""Deadlines that nearly all go unused, on one loop timer.

Each streamed attempt to a local backend has a first-byte deadline (see
:meth:`firstbyte.router.pipeline.proxy._Producer._arm_first_byte`) that its answer's head
almost always beats by seconds. A loop timer of its own costs a timer made, started,
stopped and closed per request; here a deadline is a list appended to another, cancelled by
clearing its callback, and one loop timer stands for all of them: armed at the earliest
deadline still pending, and at its expiry the deadlines due run, the cancelled ones are
dropped and the timer is armed again for the earliest left. A deadline runs when its own
timer would have: at the first loop turn after it is due (within the loop's millisecond).
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable
from typing import Any

__all__ = ["Deadlines"]

_WHEN, _CALLBACK, _ARG = 0, 1, 2
# A deadline is due within a millisecond of its time: the loop's timers have that
# resolution (uvloop's count whole milliseconds), so one may fire just before.
_RESOLUTION_S = 0.001
# The shared timer runs in no request's context (the one that armed it would be kept alive).
_EMPTY = contextvars.Context()


class Deadlines:
    """Callbacks at deadlines on ``loop``, most of them cancelled long before they are due."""

    __slots__ = ("_armed_at", "_pending", "_timer", "loop")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._pending: list[list[Any]] = []
        """Every deadline set since the timer last fired, cancelled or not."""
        self._timer: asyncio.TimerHandle | None = None
        self._armed_at = float("inf")
        """When :attr:`_timer` fires (infinity: not armed)."""

    def call_later(self, delay_s: float, callback: Callable[[Any], object], arg: Any) -> list[Any]:
        """``callback(arg)`` in ``delay_s`` seconds, unless :meth:`cancel` is given the
        returned deadline first."""
        when = self.loop.time() + delay_s
        deadline = [when, callback, arg]
        self._pending.append(deadline)
        if when < self._armed_at:  # the earliest: the timer is (re)armed for it
            if self._timer is not None:
                self._timer.cancel()
            self._armed_at = when
            self._timer = self.loop.call_at(when, self._expired, context=_EMPTY)
        return deadline

    @staticmethod
    def cancel(deadline: list[Any]) -> None:
        """``deadline``'s callback will not run (a no-op once it has)."""
        deadline[_CALLBACK] = None

    def __len__(self) -> int:
        """Deadlines not yet run or dropped (cancelled ones too, until the timer fires)."""
        return len(self._pending)

    def close(self) -> None:
        """Cancel every deadline and the loop timer."""
        for deadline in self._pending:
            deadline[_CALLBACK] = None
        self._pending = []
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._armed_at = float("inf")

    def _expired(self) -> None:
        self._timer = None
        due_by = self.loop.time() + _RESOLUTION_S
        due: list[list[Any]] = []
        left: list[list[Any]] = []
        for deadline in self._pending:
            if deadline[_CALLBACK] is None:
                continue
            (due if deadline[_WHEN] <= due_by else left).append(deadline)
        self._pending = left
        if left:
            self._armed_at = when = min(deadline[_WHEN] for deadline in left)
            self._timer = self.loop.call_at(when, self._expired, context=_EMPTY)
        else:
            self._armed_at = float("inf")
        due.sort(key=lambda deadline: deadline[_WHEN])  # in their order, as timers would
        for deadline in due:
            callback = deadline[_CALLBACK]
            if callback is not None:  # not cancelled by a callback run before it
                deadline[_CALLBACK] = None
                try:
                    callback(deadline[_ARG])
                except Exception as exc:  # as the loop does for a timer's: the others run
                    self.loop.call_exception_handler(
                        {"message": f"Exception in deadline callback {callback!r}",
                         "exception": exc}
                    )
