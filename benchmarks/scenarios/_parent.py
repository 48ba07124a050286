"""Helper processes of a benchmark world end with their parent.

The world starts its helpers in their own session (so a terminal's Ctrl-C reaches only the
parent, which then tears everything down in order); the price is that a parent killed with
SIGKILL would leave them running. :func:`orphaned` is their watchdog.
"""

from __future__ import annotations

import asyncio
import os

__all__ = ["orphaned"]


async def orphaned(interval_s: float = 0.5) -> None:
    """Return once this process's parent has gone (it is re-parented to another process)."""
    parent = os.getppid()
    while os.getppid() == parent:  # noqa: ASYNC110 (nothing to wait on: the kernel re-parents)
        await asyncio.sleep(interval_s)
