"""Waiting on state a test can see, instead of sleeping a fixed time that a slow machine
outruns."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


async def until(condition: Callable[[], object], timeout_s: float = 5.0,
                what: str = "condition") -> None:
    """Return once ``condition()`` is true; fail the test, naming ``what``, after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} not met in {timeout_s:g} s"
        await asyncio.sleep(0.02)
