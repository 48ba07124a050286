"""Fire-and-forget Redis commands whose answer nobody waits for (a release, a refresh).

Each runs as a task held in a set (so it is not garbage-collected mid-flight); a failure is
logged at debug level (Redis away: the lease, the key's expiry or the next refresh repairs
what the command would have done) and :meth:`Background.aclose` cancels what is left.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import Any

__all__ = ["Background"]

log = logging.getLogger("firstbyte.router.shared")


class Background:
    """The commands in flight that no caller awaits."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Future[Any]] = set()

    def __len__(self) -> int:
        return len(self._tasks)

    def spawn(self, command: Awaitable[Any]) -> None:
        """Run ``command`` in the background."""
        task = asyncio.ensure_future(command)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Future[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.debug("shared-state command failed: %s", task.exception())

    async def drain(self, timeout_s: float = 1.0) -> None:
        """Wait (up to ``timeout_s``) for what is in flight: a clean exit releases its slots."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout_s)

    async def aclose(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
