"""The resumable stream store: every streamed completion is kept here while it is useful.

A :class:`Stream` is an append-only list of events numbered 1, 2, 3, ... (the SSE ``id``);
its last event is ``[DONE]``. Any number of readers can read it from any sequence number,
over any transport, while the producer (the upstream request) is still appending: a reader
that reconnects with its last seen sequence gets every later event exactly once.

The store is bounded by total bytes and by age. Eviction (``StreamStore.evict(now)``) drops
streams older than ``max_age_s``, then, while over ``max_total_bytes``, finished streams
oldest first and only then unfinished ones. Evicting an unfinished stream cancels its
producer through its ``cancel_producer`` hook. The clock is passed in (``now``), so eviction is
tested without sleeping; the only IO-ish part is :meth:`Stream.wait`, an asyncio wait for
new events.

Stream ids are 128 random bits (``secrets``), URL-safe base64 without padding. A stream is
bound to its owner (a digest of the API key); :meth:`StreamStore.get` returns ``None`` for a
foreign owner exactly as for an unknown id, so an id cannot be confirmed by a non-owner.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import hmac
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from firstbyte.protocol.sse import DONE

__all__ = ["DONE_DATA", "Stream", "StreamEvent", "StreamStore", "new_stream_id", "owner_of"]

DONE_DATA = DONE.encode()
_EVENT_OVERHEAD_BYTES = 64
"""Per-event bookkeeping counted against the byte budget, so tiny events are not free."""


def new_stream_id() -> str:
    """128 random bits as 22 URL-safe base64 characters."""
    return base64.urlsafe_b64encode(secrets.token_bytes(16)).rstrip(b"=").decode()


def owner_of(api_key: str | None) -> bytes:
    """The owner token stored with a stream: a digest, so the key itself is never kept."""
    return hashlib.sha256(b"firstbyte-stream-owner\0" + (api_key or "").encode()).digest()


class StreamEvent(msgspec.Struct, frozen=True, gc=False):
    """One stored event. Not tracked by the cyclic GC (``gc=False``: an int and bytes can
    form no cycle): the store keeps up to ``max_total_bytes`` of them, ~10^6 at the default,
    and a full collection walking them all stalled the router's event loop for tens of ms
    (see :mod:`firstbyte.router.hosting.gc_tuning`). Creating one is also ~5x cheaper than a frozen
    dataclass."""

    seq: int
    data: bytes
    """The event payload: a chunk's JSON, an ``{"error": ...}`` object, or ``[DONE]``."""

    @property
    def is_done(self) -> bool:
        return self.data == DONE_DATA


@dataclass(eq=False)
class Stream:
    """One stream: its events, its owner, and who is reading it."""

    id: str
    owner: bytes
    created_at: float
    events: list[StreamEvent] = field(default_factory=list)
    finished_at: float | None = None
    size_bytes: int = 0
    readers: int = 0
    last_reader_at: float = 0.0
    """When a reader last attached, detached or polled (for the resume grace period)."""
    upstream_ttft_ms: float | None = None
    """Upstream request sent to its first content chunk, once known."""
    cancel_producer: Callable[[], object] | None = None
    mirror: Callable[[Stream, StreamEvent], object] | None = field(default=None, repr=False)
    """Called with every appended event when the stream is shared with other processes
    (:mod:`firstbyte.router.shared.streams` writes it to Redis)."""
    evicted: bool = False
    _store: StreamStore | None = field(default=None, repr=False)
    _waiters: list[asyncio.Future[None]] = field(default_factory=list, repr=False)
    """One future per reader blocked in :meth:`wait`, all resolved by the next change."""

    @property
    def done(self) -> bool:
        return self.finished_at is not None

    @property
    def last_seq(self) -> int:
        return len(self.events)

    def append(self, data: bytes, now: float) -> StreamEvent | None:
        """Add one event; returns it, or ``None`` if the stream is already finished."""
        if self.finished_at is not None:
            return None
        event = StreamEvent(len(self.events) + 1, data)
        self.events.append(event)
        size = len(data) + _EVENT_OVERHEAD_BYTES
        self.size_bytes += size
        if self._store is not None:
            self._store.total_bytes += size
        if event.is_done:
            self.finished_at = now
        if self.mirror is not None:
            self.mirror(self, event)
        self._wake()
        return event

    def finish(self, now: float) -> None:
        """Append ``[DONE]`` unless already there."""
        self.append(DONE_DATA, now)

    def after(self, seq: int) -> list[StreamEvent]:
        """Every event with sequence number greater than ``seq``, in order."""
        return self.events[max(seq, 0) :]

    def attach(self, now: float) -> None:
        self.readers += 1
        self.last_reader_at = now

    def detach(self, now: float) -> None:
        self.readers = max(0, self.readers - 1)
        self.last_reader_at = now

    def unattended_for(self, now: float) -> float:
        """Seconds since the last reader left (0 while one is attached)."""
        return 0.0 if self.readers else max(0.0, now - self.last_reader_at)

    async def wait(self, seq: int, timeout_s: float | None) -> bool:
        """Wait until an event after ``seq`` exists (or the stream is evicted); False on timeout
        (at once when ``timeout_s`` is 0)."""
        if len(self.events) > seq or self.evicted or timeout_s == 0:
            return len(self.events) > seq
        # A bare future and a timer handle, not ``wait_for(event.wait())``: that made a task
        # per call, and every live reader calls this once per relayed chunk.
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()
        self._waiters.append(waiter)
        timer = None if timeout_s is None else loop.call_later(timeout_s, _expire, waiter)
        try:
            await waiter
        finally:
            if timer is not None:
                timer.cancel()
            if self._waiters:  # still listed after a timeout or a cancel, not after a wake
                with contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)
        return len(self.events) > seq

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)


def _expire(waiter: asyncio.Future[None]) -> None:
    """The wait's timeout: resolve it like a wake-up; ``wait`` then finds nothing new."""
    if not waiter.done():
        waiter.set_result(None)


class StreamStore:
    """All streams of one router process, bounded by bytes and age."""

    def __init__(self, *, max_total_bytes: int, max_age_s: float) -> None:
        self.max_total_bytes = max_total_bytes
        self.max_age_s = max_age_s
        self._streams: dict[str, Stream] = {}
        self.total_bytes = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._streams)

    def running(self) -> list[Stream]:
        """Streams whose producer has not finished."""
        return [s for s in self._streams.values() if not s.done]

    def create(self, owner: bytes, now: float) -> Stream:
        stream = Stream(id=new_stream_id(), owner=owner, created_at=now, last_reader_at=now)
        stream._store = self
        self._streams[stream.id] = stream
        return stream

    def get(self, stream_id: str, owner: bytes) -> Stream | None:
        """The stream if it exists and belongs to ``owner``; ``None`` otherwise (same answer)."""
        stream = self._streams.get(stream_id)
        if stream is None or not hmac.compare_digest(stream.owner, owner):
            return None
        return stream

    def evict(self, now: float) -> list[Stream]:
        """Drop streams past their age, then the oldest (finished first) until under budget.

        The router calls this from its housekeeping tick (at least once a second) and
        :meth:`evict_over_budget` whenever it creates a stream.
        """
        evicted: list[Stream] = []
        for stream in list(self._streams.values()):
            if now - stream.created_at > self.max_age_s:
                evicted.append(self._drop(stream))
        return evicted + self.evict_over_budget()

    def evict_over_budget(self) -> list[Stream]:
        """While over ``max_total_bytes``: drop finished streams, then running ones, oldest
        first. O(1) when under budget."""
        evicted: list[Stream] = []
        if self.total_bytes > self.max_total_bytes:
            # Finished streams go before running ones; oldest first within each group.
            order = sorted(
                self._streams.values(), key=lambda s: (not s.done, s.finished_at or s.created_at)
            )
            for stream in order:
                if self.total_bytes <= self.max_total_bytes:
                    break
                evicted.append(self._drop(stream))
        return evicted

    def _drop(self, stream: Stream) -> Stream:
        del self._streams[stream.id]
        self.total_bytes -= stream.size_bytes
        stream._store = None
        self.evictions += 1
        stream.evicted = True
        stream._wake()
        if not stream.done and stream.cancel_producer is not None:
            stream.cancel_producer()
        return stream
