"""Cyclic-GC settings for a router process, chosen for the TTFT tail rather than for memory.

CPython's cyclic collector stops the event loop while it runs, and a full (generation 2)
collection walks every tracked object in the process. In a router serving 100 streams that
was 40-90 ms of CPU once or twice a minute (``firstbyte bench router_overhead``, measured
with ``gc.callbacks``), about 55 000 of the objects walked being the modules, functions
and classes loaded at start-up, which never become garbage. Any stream whose first chunk
was due during such a pause waited for it: at 100 streams that is about 1% of them, i.e.
the P99.

:func:`tune_for_serving` (called once the server is listening):

- ``gc.collect()`` then ``gc.freeze()``: everything alive after start-up moves to the
  permanent generation, which collections skip (full collections went from 40-55 ms to
  ~15 ms of CPU in that run). Frozen objects are still freed by reference counting; only
  a reference cycle among them would be kept, and start-up state (modules, config, the
  app) lives for the process anyway.
- generation 0 threshold 700 -> :data:`GEN0_THRESHOLD`: collections are counted in net
  new container objects, and a relayed chunk leaves a few behind for a while, so at the
  default the young generation was collected every ~40 ms. At 5 000 there are ~7x fewer
  young collections (1-2 ms each instead of ~0.5 ms) and about a third of the GC CPU.

The process-wide state makes this a choice for a process that is a server: hosting applies it
when ``ServerOptions.tune_gc`` says so, which :func:`firstbyte.router.serve.serve` does
(``firstbyte router``) and :func:`firstbyte.router.serve.running_router`, which serves inside
someone else's program (tests, benchmarks' helpers), does only when asked.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass

__all__ = ["GEN0_THRESHOLD", "GCSettings", "restore", "tune_for_serving"]

GEN0_THRESHOLD = 5_000
"""Net new container objects between young-generation collections (CPython's default: 700)."""


@dataclass(frozen=True, slots=True)
class GCSettings:
    """The collector's state before :func:`tune_for_serving`, for :func:`restore`."""

    thresholds: tuple[int, int, int]
    frozen_before: int


def tune_for_serving(gen0_threshold: int = GEN0_THRESHOLD) -> GCSettings:
    """Collect, freeze what survives, raise the young-generation threshold.

    Returns the previous settings. Calling it again freezes what was allocated since (the
    thresholds stay as asked); nothing is ever unfrozen except by :func:`restore`.
    """
    if gen0_threshold < 1:
        raise ValueError("gen0_threshold must be at least 1 (0 disables the collector)")
    first, second, third = gc.get_threshold()
    before = GCSettings(thresholds=(first, second, third), frozen_before=gc.get_freeze_count())
    gc.collect()
    gc.freeze()
    gc.set_threshold(gen0_threshold, second, third)
    return before


def restore(settings: GCSettings) -> None:
    """Undo :func:`tune_for_serving`: the old thresholds; and if nothing was frozen before
    it, nothing frozen after (``gc.unfreeze`` releases the whole permanent generation, so
    when someone else had frozen objects first, they stay frozen together with ours)."""
    gc.set_threshold(*settings.thresholds)
    if settings.frozen_before == 0:
        gc.unfreeze()
