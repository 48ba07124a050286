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

- full collections deferred to a quiet moment: once one is due (CPython's own count: ten
  collections of the middle generation since the last full one), :func:`collect_when_quiet`
  runs it when the process used at most :data:`QUIET_CPU_SHARE` of a core over the last
  second, or :data:`MAX_DEFER_S` after it became due, whichever comes first (CPython's own
  trigger is set back to :data:`DEFERRED_THIRD`). A full collection walks every live
  object: a router holding 2,000 streams spent 227 ms in one, in the middle of
  ``bench router_workers``' ramp (every stream's first token late by as much); between
  ramps the same collection costs a few ms and no one waits for it.

The process-wide state makes this a choice for a process that is a server: hosting applies it
when ``ServerOptions.tune_gc`` says so, which :func:`firstbyte.router.serve.serve` does
(``firstbyte router``) and :func:`firstbyte.router.serve.running_router`, which serves inside
someone else's program (tests, benchmarks' helpers), does only when asked.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
from dataclasses import dataclass

__all__ = [
    "GEN0_THRESHOLD", "FullCollections", "GCSettings", "collect_when_quiet", "restore",
    "tune_for_serving",
]

GEN0_THRESHOLD = 5_000
"""Net new container objects between young-generation collections (CPython's default: 700)."""


FULL_DUE_AFTER = 10
"""Collections of the middle generation after which a full one is due (CPython's default
third threshold)."""
DEFERRED_THIRD = 10_000
"""CPython's third threshold while :func:`collect_when_quiet` runs full collections: it then
runs one by itself only if that task stopped."""
QUIET_CPU_SHARE = 0.05
"""A process using at most this share of a core over the last check is quiet (an idle router
uses ~0.4%)."""
MAX_DEFER_S = 60.0
"""Longest a due full collection waits for a quiet moment: a process that is never quiet
still collects its cyclic garbage."""
CHECK_S = 1.0
_DEFERRING: set[asyncio.Task[None]] = set()


@dataclass(slots=True)
class FullCollections:
    """When a due full collection runs (sans-IO: told the time, the process's CPU seconds and
    the middle generation's collections since the last full one, at each check)."""

    quiet_share: float = QUIET_CPU_SHARE
    max_defer_s: float = MAX_DEFER_S
    due_after: int = FULL_DUE_AFTER
    _seen: tuple[float, float] | None = None
    """(time, CPU seconds) at the last check."""
    _due_since: float | None = None

    def now_due(self, now: float, cpu_s: float, gen1_collections: int) -> bool:
        """Whether to run the full collection now."""
        seen, self._seen = self._seen, (now, cpu_s)
        if gen1_collections < self.due_after:
            self._due_since = None
            return False
        if self._due_since is None:
            self._due_since = now
        if now - self._due_since >= self.max_defer_s:
            return True
        if seen is None or now <= seen[0]:
            return False
        return (cpu_s - seen[1]) / (now - seen[0]) <= self.quiet_share


async def collect_when_quiet(
    policy: FullCollections | None = None, check_s: float = CHECK_S
) -> None:
    """Run each due full collection when ``policy`` says (every ``check_s``), for ever."""
    policy = policy or FullCollections()
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(check_s)
        if policy.now_due(loop.time(), time.process_time(), gc.get_count()[2]):
            gc.collect()


@dataclass(frozen=True, slots=True)
class GCSettings:
    """The collector's state before :func:`tune_for_serving`, for :func:`restore`."""

    thresholds: tuple[int, int, int]
    frozen_before: int
    deferring: asyncio.Task[None] | None = None
    """The :func:`collect_when_quiet` task it started, if any."""


def tune_for_serving(gen0_threshold: int = GEN0_THRESHOLD) -> GCSettings:
    """Collect, freeze what survives, raise the young-generation threshold; in a running
    event loop, also defer full collections to quiet moments (:func:`collect_when_quiet`,
    a task of that loop).

    Returns the previous settings. Calling it again freezes what was allocated since (the
    thresholds stay as asked); nothing is ever unfrozen except by :func:`restore`.
    """
    if gen0_threshold < 1:
        raise ValueError("gen0_threshold must be at least 1 (0 disables the collector)")
    first, second, third = gc.get_threshold()
    deferring = None
    if not _DEFERRING:  # one task a process (called again: the first one goes on)
        with contextlib.suppress(RuntimeError):  # no running loop: CPython's own trigger stays
            deferring = asyncio.get_running_loop().create_task(collect_when_quiet())
            _DEFERRING.add(deferring)  # the loop keeps a task weakly: held here until done
            deferring.add_done_callback(_DEFERRING.discard)
    before = GCSettings(
        thresholds=(first, second, third), frozen_before=gc.get_freeze_count(),
        deferring=deferring,
    )
    gc.collect()
    gc.freeze()
    gc.set_threshold(gen0_threshold, second, DEFERRED_THIRD if _DEFERRING else third)
    return before


def restore(settings: GCSettings) -> None:
    """Undo :func:`tune_for_serving`: the old thresholds, no deferral; and if nothing was
    frozen before it, nothing frozen after (``gc.unfreeze`` releases the whole permanent
    generation, so when someone else had frozen objects first, they stay frozen together
    with ours)."""
    if settings.deferring is not None:
        settings.deferring.cancel()
    gc.set_threshold(*settings.thresholds)
    if settings.frozen_before == 0:
        gc.unfreeze()
