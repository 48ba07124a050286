"""The load generator's own cyclic GC, held off while a phase measures a target."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["gc_held_off"]


@contextmanager
def gc_held_off() -> Iterator[None]:
    """Collect now, then no cyclic GC in this (load generator) process until the block ends.

    A full collection in the middle of a phase stalls every client of the load generator at
    once (30-90 ms at 2,000 streams, logged in ``bench router_workers``), and the target under
    test is charged with it. What a phase leaves in reference cycles waits for the next
    collection, at the block's end or the next one's start.
    """
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
