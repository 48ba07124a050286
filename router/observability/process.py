"""The process's own families on ``/metrics``: CPU, memory, start time, worker restarts.

The first three carry the names every Prometheus client library gives them
(``process_cpu_seconds_total``, ``process_resident_memory_bytes``,
``process_start_time_seconds``), so stock dashboards and ``CPU per chunk`` (CPU seconds over
relayed chunks) work without a client library here. ``firstbyte_router_worker_restarts_total``
says how often the supervisor (``listen.workers > 1``, :mod:`firstbyte.router.workers`)
started a new process in this worker's slot: each worker knows its slot's count from its fork,
so the series of one slot only grows, whichever worker a scrape reaches.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ..hosting.prometheus import labels, render_counter, render_gauge
from ..overload import read_rss_bytes
from .logs import set_worker

__all__ = ["WorkerSlot", "render", "set_worker_slot", "worker_slot"]


@dataclass(frozen=True, slots=True)
class WorkerSlot:
    """Which worker slot this process serves, and how many times that slot was restarted."""

    index: int = 0
    restarts: int = 0


_STARTED_AT = time.time()
_slot = WorkerSlot()


def set_worker_slot(index: int, restarts: int) -> None:
    """Called in a forked worker before it serves (the supervisor knows the count)."""
    global _slot
    _slot = WorkerSlot(index, restarts)
    set_worker(index)  # and its log lines say so


def worker_slot() -> WorkerSlot:
    return _slot


def render() -> list[str]:
    """The families of the module docstring, read now (a few system calls per scrape)."""
    slot = _slot
    return [
        *render_counter(
            "process_cpu_seconds_total",
            "User and system CPU time of this process, in seconds.",
            [("", time.process_time())],
            ".3f",
        ),
        *render_gauge(
            "process_resident_memory_bytes",
            "Resident memory of this process, in bytes.",
            [("", read_rss_bytes())],
        ),
        *render_gauge(
            "process_start_time_seconds",
            "When this process started, in seconds since the Unix epoch.",
            [("", _STARTED_AT)],
            ".3f",
        ),
        *render_counter(
            "firstbyte_router_worker_restarts_total",
            "New processes the supervisor started in this worker's slot after one exited.",
            [(labels(worker=str(slot.index)), slot.restarts)],
        ),
    ]
