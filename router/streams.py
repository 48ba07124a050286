"""The resumable stream store: every streamed completion is kept here while it is useful.

A :class:`Stream` is an append-only list of events numbered 1, 2, 3, ... (the SSE ``id``);
its last event is ``[DONE]``. Any number of readers can read it from any sequence number,
over any transport, while the producer (the upstream request) is still appending: a reader
that reconnects with its last seen sequence gets every later event exactly once.

The store is bounded by age, by total bytes and by bytes per owner (one API key's share).
Eviction drops streams older than ``max_age_s``; then finished streams of an owner over its
share (its own, before anyone else's); then, while over ``max_total_bytes``, finished streams
oldest first. The byte bounds never evict a live (unfinished) stream: when live streams fill
an owner's share or the whole store, :meth:`StreamStore.make_room` refuses the *new* stream
instead (:class:`StoreFull`), and the router answers 429. Evicting an unfinished stream (by
age) cancels its producer through its ``cancel_producer`` hook. Every index is kept in order
as streams are created and finish, so an eviction costs O(1), whatever the number of streams.
The clock is passed in (``now``), so eviction is tested without sleeping; the only IO-ish part
is :meth:`Stream.wait`, an asyncio wait for new events.

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
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

import msgspec

from firstbyte.protocol import error_codes
from firstbyte.protocol.sse import DONE

__all__ = [
    "DONE_DATA",
    "StoreFull",
    "Stream",
    "StreamEvent",
    "StreamStore",
    "new_stream_id",
    "owner_of",
]

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
    subject: str | None = None
    """The subject (an app's end user) it was made for: a client token of another subject
    of the same key cannot read it (:meth:`RouterState.find_stream`)."""
    events: list[StreamEvent] = field(default_factory=list)
    finished_at: float | None = None
    size_bytes: int = 0
    readers: int = 0
    last_reader_at: float = 0.0
    """When a reader last attached, detached or polled (for the resume grace period)."""
    upstream_ttft_ms: float | None = None
    """Upstream request sent to its first content chunk, once known."""
    cancel_producer: Callable[..., object] | None = None
    """Cancels the upstream request (``task.cancel``; an optional message says why)."""
    mirror: Callable[[Stream, StreamEvent], object] | None = field(default=None, repr=False)
    """Called with every appended event when the stream is shared with other processes
    (:mod:`firstbyte.router.shared.streams` writes it to Redis)."""
    on_finish: Callable[[], object] | None = field(default=None, repr=False)
    """Called once when ``[DONE]`` is appended (the shared state gives back the key's slot)."""
    evicted: bool = False
    _store: StreamStore | None = field(default=None, repr=False)
    _loop: asyncio.AbstractEventLoop | None = field(default=None, repr=False)
    """The loop its readers wait in (the serving loop), known at the first wait."""
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
        if event.is_done:
            self.finished_at = now
            if self.on_finish is not None:
                on_finish, self.on_finish = self.on_finish, None
                on_finish()
        if self._store is not None:
            self._store._grew(self, size)
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
        # per call, and every live reader calls this once per relayed chunk. The loop is
        # looked up once per stream: on Python 3.11 each lookup is a getpid() system call.
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
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


@dataclass(eq=False)
class _Owner:
    """One owner's share of the store: bytes held, live streams, finished streams in the
    order they finished (the order its own streams are evicted in)."""

    bytes: int = 0
    live: int = 0
    finished: OrderedDict[str, Stream] = field(default_factory=OrderedDict)


class StoreFull(Enum):
    """Why the store refused a new stream (the error code the client gets)."""

    KEY = error_codes.KEY_STORE_FULL
    """The owner's own live streams fill its share."""
    STORE = error_codes.STREAM_STORE_FULL
    """Live streams fill the whole store."""


class StreamStore:
    """All streams of one router process, bounded by bytes (overall and per owner) and age.

    Every stream sits in ordered indexes (creation order; finish order, overall and per owner),
    so finding the next one to evict is O(1) and dropping it is O(1): no index is ever sorted.
    """

    def __init__(
        self, *, max_total_bytes: int, max_age_s: float, max_owner_bytes: int | None = None
    ) -> None:
        self.max_total_bytes = max_total_bytes
        self.max_age_s = max_age_s
        self.max_owner_bytes = max_total_bytes
        self._shares = False
        self.set_bounds(
            max_total_bytes=max_total_bytes, max_age_s=max_age_s, max_owner_bytes=max_owner_bytes
        )
        self._streams: OrderedDict[str, Stream] = OrderedDict()  # creation order
        self._live: dict[str, Stream] = {}
        self._finished: OrderedDict[str, Stream] = OrderedDict()  # finish order
        self._owners: dict[bytes, _Owner] = {}
        self._over_share: dict[bytes, None] = {}
        """Owners over their share that have a finished stream to give up (an ordered set)."""
        self.total_bytes = 0
        self.evictions = 0
        self.evicted_by: Counter[str] = Counter()
        """Evictions by reason: ``age``, ``key_share`` (an owner over its share), ``bytes``."""

    def set_bounds(
        self, *, max_total_bytes: int, max_age_s: float, max_owner_bytes: int | None = None
    ) -> None:
        """Set the store's bounds (at start, and on reload); the next :meth:`evict` applies
        smaller ones to the streams held."""
        self.max_total_bytes = max_total_bytes
        self.max_age_s = max_age_s
        self.max_owner_bytes = (
            max_total_bytes if max_owner_bytes is None else min(max_owner_bytes, max_total_bytes)
        )
        # A share as large as the store is no share: the store's own bound applies.
        self._shares = self.max_owner_bytes < max_total_bytes

    def __len__(self) -> int:
        return len(self._streams)

    def running(self) -> list[Stream]:
        """Streams whose producer has not finished (O(running), not O(stored))."""
        return list(self._live.values())

    def live_streams(self, owner: bytes) -> int:
        """How many of ``owner``'s streams are still being produced."""
        usage = self._owners.get(owner)
        return 0 if usage is None else usage.live

    def owner_bytes(self, owner: bytes) -> int:
        usage = self._owners.get(owner)
        return 0 if usage is None else usage.bytes

    def make_room(self, owner: bytes, now: float) -> StoreFull | None:
        """Make room for a new stream of ``owner``, or say why there is none.

        Evicts what is past its age, then ``owner``'s own finished streams while it is at its
        share, then (the store being full) finished streams of owners over their share, then
        the oldest finished streams of anyone. A live stream is never evicted for room: when
        live streams fill the owner's share or the store, the answer is a refusal.
        """
        self._evict_aged(now)
        usage = self._owners.get(owner)
        if usage is not None and self._shares:
            while usage.bytes >= self.max_owner_bytes and usage.finished:
                self._drop(next(iter(usage.finished.values())), "key_share")
            if usage.bytes >= self.max_owner_bytes:
                return StoreFull.KEY
        self._evict_over_budget(strict=False)
        return StoreFull.STORE if self.total_bytes >= self.max_total_bytes else None

    def create(self, owner: bytes, now: float) -> Stream:
        """A new, empty stream of ``owner`` (call :meth:`make_room` first to respect bounds)."""
        stream = Stream(id=new_stream_id(), owner=owner, created_at=now, last_reader_at=now)
        stream._store = self
        self._streams[stream.id] = stream
        self._live[stream.id] = stream
        usage = self._owners.get(owner)
        if usage is None:
            usage = self._owners[owner] = _Owner()
        usage.live += 1
        return stream

    def get(self, stream_id: str, owner: bytes) -> Stream | None:
        """The stream if it exists and belongs to ``owner``; ``None`` otherwise (same answer)."""
        stream = self._streams.get(stream_id)
        if stream is None or not hmac.compare_digest(stream.owner, owner):
            return None
        return stream

    def evict(self, now: float) -> list[Stream]:
        """Drop streams past their age (live ones too: ``max_age_s`` bounds a stream's life),
        then finished streams of owners over their share, then the oldest finished streams
        while over ``max_total_bytes``. The router calls this from its housekeeping tick."""
        return self._evict_aged(now) + self._evict_over_budget(strict=True)

    def _evict_aged(self, now: float) -> list[Stream]:
        evicted: list[Stream] = []
        while self._streams:
            oldest = next(iter(self._streams.values()))
            if now - oldest.created_at <= self.max_age_s:
                break
            evicted.append(self._drop(oldest, "age"))
        return evicted

    def _evict_over_budget(self, *, strict: bool) -> list[Stream]:
        """Finished streams of owners over their share, then (while the store is over budget,
        or at it unless ``strict``) the oldest finished ones. Each drop is O(1)."""
        evicted: list[Stream] = []
        while self._over_share:
            usage = self._owners[next(iter(self._over_share))]
            evicted.append(self._drop(next(iter(usage.finished.values())), "key_share"))
        limit = self.max_total_bytes
        while self._finished and (
            self.total_bytes > limit or (not strict and self.total_bytes >= limit)
        ):
            evicted.append(self._drop(next(iter(self._finished.values())), "bytes"))
        return evicted

    # --- bookkeeping, called by Stream ---------------------------------------------------
    def _grew(self, stream: Stream, size: int) -> None:
        self.total_bytes += size
        usage = self._owners[stream.owner]
        usage.bytes += size
        if stream.done:  # the [DONE] event
            del self._live[stream.id]
            self._finished[stream.id] = stream
            usage.live -= 1
            usage.finished[stream.id] = stream
            self._check_share(stream.owner, usage)
        elif self._shares and usage.finished and usage.bytes > self.max_owner_bytes:
            # Growing can only put an owner over its share (the per-token path: no pop).
            self._over_share[stream.owner] = None

    def _check_share(self, owner: bytes, usage: _Owner) -> None:
        if self._shares and usage.bytes > self.max_owner_bytes and usage.finished:
            self._over_share[owner] = None
        else:
            self._over_share.pop(owner, None)

    def _drop(self, stream: Stream, reason: str) -> Stream:
        del self._streams[stream.id]
        usage = self._owners[stream.owner]
        usage.bytes -= stream.size_bytes
        self.total_bytes -= stream.size_bytes
        if stream.done:
            del self._finished[stream.id]
            del usage.finished[stream.id]
        else:
            del self._live[stream.id]
            usage.live -= 1
        if usage.bytes == 0 and usage.live == 0:
            del self._owners[stream.owner]
            self._over_share.pop(stream.owner, None)
        else:
            self._check_share(stream.owner, usage)
        stream._store = None
        self.evictions += 1
        self.evicted_by[reason] += 1
        stream.evicted = True
        stream._wake()
        if not stream.done and stream.cancel_producer is not None:
            stream.cancel_producer()
        return stream
