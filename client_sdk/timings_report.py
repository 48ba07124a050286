"""Opt-in reports of client-felt latency to the router that served (``report_timings=True``).

After a stream that got its first token ends, its :class:`~firstbyte.client_sdk.timings.Timings`
become a :class:`~firstbyte.protocol.timings.TimingsRecord` (phases, offsets, how it was
sent, region and stream id: never the prompt, the output or any text) queued for the
router that served it. Every ``interval_s``, or as soon as ``batch_records`` are queued, a
background task posts each router's records in one ``POST /v1/edge/timings`` on the pooled
connection, authenticated with the client's key.

Reporting never blocks or fails the application: queueing is a constant-time append; the
queue holds at most ``max_queued`` records and drops the oldest when full; a failed or
refused post drops its batch (no retries: the figures are statistics, not data); closing the
client flushes what is queued within ``close_timeout_s``, then gives up.

:class:`TimingsQueue` is the sans-IO part (clock passed in); :class:`TimingsReporter` the
asyncio shell.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

import msgspec

from firstbyte.client_sdk.timings import Timings
from firstbyte.protocol.timings import TimingsRecord, TimingsReport, implausible
from firstbyte.tasks import cancel_and_wait

__all__ = ["TimingsQueue", "TimingsReporter", "encode_report", "timings_record"]

Target = TypeVar("Target", bound=Hashable)

_encoder = msgspec.json.Encoder()


def timings_record(timings: Timings) -> TimingsRecord | None:
    """The record to report for a finished stream, or None: no first token (no TTFT to
    report), no region (the server is not a firstbyte router), or a record the router would
    refuse as implausible (:func:`~firstbyte.protocol.timings.implausible`)."""
    if timings.first_token_ms is None or not timings.region:
        return None
    # Field by field from the wire type: what it does not name (text, inter-token gaps,
    # wall-clock time, Server-Timing) cannot go out.
    record = TimingsRecord(**{name: getattr(timings, name)
                              for name in TimingsRecord.__struct_fields__})
    return None if implausible(record) is not None else record


def encode_report(records: list[TimingsRecord]) -> bytes:
    """The ``POST /v1/edge/timings`` body for ``records``."""
    return _encoder.encode(TimingsReport(records=records))


class TimingsQueue(Generic[Target]):
    """Records waiting to be reported, by the router (``Target``) they go to.

    Holds at most ``max_queued`` records in all, dropping the oldest (``dropped`` counts them).
    :meth:`due` says when to flush: ``batch_records`` are queued, or the oldest has waited
    ``interval_s``.
    """

    def __init__(self, *, max_queued: int, batch_records: int, interval_s: float) -> None:
        if max_queued < 1 or batch_records < 1 or interval_s <= 0:
            raise ValueError("max_queued and batch_records must be >= 1, interval_s > 0")
        self.max_queued = max_queued
        self.batch_records = batch_records
        self.interval_s = interval_s
        self._records: deque[tuple[Target, TimingsRecord]] = deque(maxlen=max_queued)
        self._oldest_at: float | None = None
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._records)

    def add(self, target: Target, record: TimingsRecord, now: float) -> None:
        if len(self._records) == self.max_queued:
            self.dropped += 1  # the deque drops the oldest
        self._records.append((target, record))
        if self._oldest_at is None:
            self._oldest_at = now

    def due(self, now: float) -> bool:
        if len(self._records) >= self.batch_records:
            return True
        return self._oldest_at is not None and now - self._oldest_at >= self.interval_s

    def wait_s(self, now: float) -> float | None:
        """Seconds until :meth:`due` turns true by time alone (None: nothing queued)."""
        if self._oldest_at is None:
            return None
        return max(0.0, self._oldest_at + self.interval_s - now)

    def take(self) -> list[tuple[Target, list[TimingsRecord]]]:
        """Everything queued, as batches of at most ``batch_records`` per target, oldest first."""
        by_target: dict[Target, list[TimingsRecord]] = {}
        for target, record in self._records:
            by_target.setdefault(target, []).append(record)
        self._records.clear()
        self._oldest_at = None
        size = self.batch_records
        return [
            (target, records[i : i + size])
            for target, records in by_target.items()
            for i in range(0, len(records), size)
        ]


class TimingsReporter(Generic[Target]):
    """Queues records and posts them from one background task (see the module docstring).

    ``post(target, body)`` sends one report and returns the HTTP status; a failure (an
    exception, a status other than 2xx) is counted in ``failed_reports`` and otherwise ignored.
    """

    def __init__(
        self,
        post: Callable[[Target, bytes], Awaitable[int]],
        *,
        interval_s: float = 10.0,
        batch_records: int = 50,
        max_queued: int = 1000,
        close_timeout_s: float = 1.0,
    ) -> None:
        self._post = post
        self.queue: TimingsQueue[Target] = TimingsQueue(
            max_queued=max_queued, batch_records=batch_records, interval_s=interval_s
        )
        self.close_timeout_s = close_timeout_s
        self.sent_reports = 0
        self.failed_reports = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def note(self, target: Target, timings: Timings) -> None:
        """Queue a finished stream's timings for ``target`` (nothing if there is no record)."""
        record = timings_record(timings)
        if record is None:
            return
        self.queue.add(target, record, time.monotonic())
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())
        if self.queue.due(time.monotonic()):
            self._wake.set()

    async def flush(self) -> None:
        """Post everything queued now (each target's batches in turn)."""
        for target, records in self.queue.take():
            try:
                status = await self._post(target, encode_report(records))
            except Exception:  # never the application's problem
                status = 0
            if 200 <= status < 300:
                self.sent_reports += 1
            else:
                self.failed_reports += 1

    async def _run(self) -> None:
        while len(self.queue):
            wait_s = self.queue.wait_s(time.monotonic())
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait_s):
                    await self._wake.wait()
            self._wake.clear()
            if self.queue.due(time.monotonic()):
                await self.flush()

    async def aclose(self) -> None:
        """Flush within ``close_timeout_s``, then stop the background task."""
        task, self._task = self._task, None
        if task is not None:
            with contextlib.suppress(Exception):
                await cancel_and_wait(task)
        if len(self.queue):
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.close_timeout_s):
                    await self.flush()
