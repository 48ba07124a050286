"""The resumable stream store: every streamed completion is kept here while it is useful.

A :class:`Stream` is an append-only list of events numbered 1, 2, 3, ... (the SSE ``id``);
its last event is ``[DONE]``. Any number of readers can read it from any sequence number,
over any transport, while the producer (the upstream request) is still appending: a reader
that reconnects with its last seen sequence gets every later event exactly once.

The store is bounded by age, by total bytes and by bytes per owner (one API key's share).
A stream's bytes are charged to its owner as they are appended. The share is what an owner
keeps when the store is full, not a cap while it has room (the store is work-conserving): as
soon as an append or a new stream finds the store full, owners over their share lose their
*own* oldest history first, the first to go over first: the oldest events of their oldest
streams are trimmed (live streams included, never a live stream's newest event, so a reader
keeping up loses nothing), by what the store needs plus an eighth of the share (never below
7/8 of the share), so that trims come in batches of bounded size; a finished stream with
nothing but ``[DONE]`` left is dropped. A reader asking for events from before a
stream's trim point (:attr:`Stream.trimmed`) gets ``stream_history_trimmed``. So one owner's
growth never evicts another owner's streams nor fills the store for them. Only then, while the
store is still over ``max_total_bytes``, finished streams go oldest first, and when live
streams fill the whole store :meth:`StreamStore.make_room` refuses the *new* stream
(:class:`StoreFull`: 429).
Streams older than ``max_age_s`` are dropped; evicting an unfinished one cancels its producer
through its ``cancel_producer`` hook. Every index is kept in order as streams are created,
trimmed and finish, so an eviction or a trim costs O(1) per event or stream dropped, whatever
the number of streams. The clock is passed in (``now``), so eviction is tested without
sleeping; the only IO-ish parts are :meth:`Stream.wait`, an asyncio wait for new events, and
:meth:`Stream.relay_live`, where a reader caught up is handed each new event in the append.

Stream ids are 128 random bits (``secrets``), URL-safe base64 without padding. A stream is
bound to its owner (a digest of the API key); :meth:`StreamStore.get` returns ``None`` for a
foreign owner exactly as for an unknown id, so an id cannot be confirmed by a non-owner.
"""

from __future__ import annotations

import asyncio
import binascii
import contextlib
import hashlib
import hmac
import os
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

import msgspec

from firstbyte.protocol import error_codes
from firstbyte.protocol.sse import DONE

from . import chunkpath
from .observability.usage import TokenUsage

__all__ = [
    "DONE_DATA",
    "EVENT_OVERHEAD_BYTES",
    "HistoryTrimmed",
    "StoreFull",
    "Stream",
    "StreamEvent",
    "StreamStore",
    "new_stream_id",
    "owner_of",
]

DONE_DATA = DONE.encode()
EVENT_OVERHEAD_BYTES = 80
"""What the store charges an event beyond its data: what CPython 3.11 allocates for it (the
:class:`StreamEvent`, 32 bytes; its payload's bytes header, 33, and the allocator's rounding
to 16; its list slot with the list's growth, ~9). 64 undercharged a chat chunk by ~5-9%. Not
charged: a sequence number past the small ints' cache (256), 32 bytes, and a stream's own
~0.7 KB (its object, id and table entries)."""
_idle_clock = time.perf_counter
"""The direct readers' idle clock (:meth:`Stream.relay_live`): the clock the producer reads
once per upstream read anyway (:meth:`Stream.add` takes its reading), so a write to a
reader costs no clock call of its own."""
"""Per-event bookkeeping counted against the byte budget, so tiny events are not free."""


class HistoryTrimmed(Exception):
    """A reader asked for events from before a stream's trim point: they are gone for good
    (its key went over its share of the store). ``after`` is where the reader was, ``trimmed``
    the last event dropped. Read on another process, through the shared state, they may be
    gone for another reason: ``unwritten``, never written to it (Redis away or full when they
    were made); ``cap`` (the shared state's ``max_events_per_stream``), cut by its bound on a
    stream's length."""

    def __init__(
        self, after: int, trimmed: int, *, unwritten: bool = False, cap: int | None = None
    ) -> None:
        super().__init__(f"events {after + 1} to {trimmed} were trimmed")
        self.after = after
        self.trimmed = trimmed
        self.unwritten = unwritten
        self.cap = cap


class _RandomBytes:
    """The operating system's random bytes (``os.urandom``), drawn 4 KiB at a time: one
    ``getrandom`` system call for 256 stream ids, not one per request. A child process
    forked with some left starts afresh, so two processes never hand out the same bytes."""

    __slots__ = ("_at", "_pool")
    _SIZE = 4096

    def __init__(self) -> None:
        self._pool = b""
        self._at = 0

    def take(self, n: int) -> bytes:
        at = self._at
        if at + n > len(self._pool):
            self._pool, at = os.urandom(self._SIZE), 0
        self._at = at + n
        return self._pool[at : at + n]

    def forget(self) -> None:
        self._pool, self._at = b"", 0


_random = _RandomBytes()
os.register_at_fork(after_in_child=_random.forget)


_URL_SAFE = bytes.maketrans(b"+/", b"-_")


def new_stream_id() -> str:
    """128 random bits (the operating system's, as ``secrets``') as 22 URL-safe base64
    characters."""
    # base64.urlsafe_b64encode's own steps, without its two Python calls a stream.
    encoded = binascii.b2a_base64(_random.take(16), newline=False).translate(_URL_SAFE)
    return encoded.rstrip(b"=").decode()


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


_compiled_add = (
    None
    if chunkpath.STREAM_ADDER is None
    else chunkpath.STREAM_ADDER(StreamEvent, EVENT_OVERHEAD_BYTES)
)
""":meth:`Stream.add`'s work in C (``router/_chunkpath.c``, ``stream_add``, what the compiled
read path does for the reads it takes): the last event added, or None where it did nothing
and the Python that follows runs (no store, a finished stream, a trim or a reclaim to do)."""


@dataclass(eq=False, slots=True)
class Stream:
    """One stream: its events, its owner, and who is reading it. Slots: the compiled
    per-chunk path reads and writes its fields at their offsets (:meth:`add`)."""

    id: str
    owner: bytes
    created_at: float
    subject: str | None = None
    """The subject (an app's end user) it was made for: a client token of another subject
    of the same key cannot read it (:meth:`RouterState.find_stream`)."""
    format: str = "chat"
    """Its wire format (a codec's name, :data:`firstbyte.protocol.formats.BY_NAME`): the
    shape of the error event a reader elsewhere ends it with if its producer dies."""
    events: list[StreamEvent] = field(default_factory=list)
    finished_at: float | None = None
    size_bytes: int = 0
    """Bytes of the events kept (with their bookkeeping), charged to the owner."""
    trimmed: int = 0
    """Events dropped from the front (its owner went over its share): ``events[0]`` is event
    ``trimmed + 1``; a reader from before ``trimmed`` cannot be served."""
    readers: int = 0
    last_reader_at: float = 0.0
    """When a reader last attached, detached or polled (for the resume grace period)."""
    upstream_ttft_ms: float | None = None
    """Upstream request sent to its first content chunk, once known."""
    usage: TokenUsage | None = None
    """What the upstream said the completion cost, once it ended (its usage chunk may have
    been dropped from the events: the router asked for it, not the client)."""
    cancel_producer: Callable[..., object] | None = None
    """Cancels the upstream request (``task.cancel``; an optional message says why)."""
    mirror: Callable[[Stream, StreamEvent], object] | None = field(default=None, repr=False)
    """Called with every appended event when the stream is shared with other processes
    (:mod:`firstbyte.router.shared.streams` writes it to Redis)."""
    on_finish: Callable[[], object] | None = field(default=None, repr=False)
    """Called once when ``[DONE]`` is appended (the shared state gives back the key's slot)."""
    on_trim: Callable[[Stream], object] | None = field(default=None, repr=False)
    """Called after events were trimmed from the front (the shared state trims Redis too)."""
    evicted: bool = False
    _store: StreamStore | None = field(default=None, repr=False)
    loop: asyncio.AbstractEventLoop | None = field(default=None, repr=False)
    """The loop its readers wait in (the serving loop): given by the proxy as it starts the
    stream's producer, else known at the first wait."""
    _waiters: list[asyncio.Future[None]] = field(default_factory=list, repr=False)
    """One future per reader blocked in :meth:`wait`, all resolved by the next change."""
    _taps: list[_Tap] = field(default_factory=list, repr=False)
    """Readers caught up and written to from :meth:`append` itself (:meth:`relay_live`)."""

    @property
    def done(self) -> bool:
        return self.finished_at is not None

    @property
    def last_seq(self) -> int:
        return self.trimmed + len(self.events)

    def append(self, data: bytes, now: float) -> StreamEvent | None:
        """Add one event; returns it, or ``None`` if the stream is already finished."""
        if self.finished_at is not None:
            return None
        if _compiled_add is not None and data != DONE_DATA:
            # add's work in C for an event that does not finish the stream (the first
            # content, as a rule): the same effects, the idle clock read in C if needed.
            stored: StreamEvent | None = _compiled_add(self, [data], None)
            if stored is not None:
                return stored
        events = self.events
        event = StreamEvent(self.trimmed + len(events) + 1, data)
        events.append(event)
        size = len(data) + EVENT_OVERHEAD_BYTES
        self.size_bytes += size
        done = data == DONE_DATA
        if done:
            self.finished_at = now
            if self.on_finish is not None:
                on_finish, self.on_finish = self.on_finish, None
                on_finish()
        store = self._store
        if store is not None:
            # The store's bookkeeping of a grown stream, here rather than in a method of
            # the store's: a call less an event (two a request at least).
            store.total_bytes += size
            usage = store._owners[self.owner]
            usage.bytes += size
            if done:
                del store._live[self.id]
                store._finished[self.id] = self
                usage.live -= 1
            if store._shares and usage.bytes > store.max_owner_bytes:
                store._over_share.setdefault(self.owner, usage)
            if store._over_share and store.total_bytes > store.max_total_bytes:
                # Charged as it grows: the store full, owners over their share pay with
                # their own history at once, so one owner's growth never takes another's
                # streams or room.
                store._reclaim(strict=True)
        if self.mirror is not None:
            self.mirror(self, event)
        taps = self._taps
        if taps:  # _feed_taps' work, inline: a call fewer (an append or two a request)
            if done:
                self._release_taps()  # [DONE] is not written: its readers send it
            else:
                added = [event]
                refused = False
                written_at = _idle_clock()
                for tap in taps:
                    if tap.write(added):
                        tap.seq = event.seq
                        tap.last_at = written_at
                    else:
                        tap.released = refused = True
                if refused:
                    self._drop_released_taps()
        if self._waiters:
            self._wake()
        return event

    def extend(self, payloads: list[bytes], now: float) -> None:
        """Add events in order, as :meth:`append` each, but hand them to the readers
        together: a reader written directly (:meth:`relay_live`) gets one write for what one
        upstream read brought, not one per event (a write is a system call and a TCP
        segment on the reader's connection)."""
        if payloads and DONE_DATA not in payloads:
            # Nothing finishes: add's work, which has these effects in one call (in C
            # where it can) rather than an append per event.
            self.add(payloads, _idle_clock())
            return
        taps, self._taps = self._taps, []  # held while appending: they get the batch
        added = []
        try:
            for data in payloads:
                event = self.append(data, now)
                if event is None:
                    break
                added.append(event)
        finally:
            self._taps = taps
        if added and taps:
            self._feed_taps(added)

    def add(self, payloads: list[bytes], read_at: float) -> None:
        """:meth:`extend` for the producer's hot path: events that are not ``[DONE]`` (so
        no store clock: nothing finishes), appended in one call that charges the store,
        mirrors them, hands them to the direct readers in one batch and wakes the others.
        The same effects as :meth:`extend`, with the per-event calls of :meth:`append`
        inlined. ``read_at``: the read's :func:`time.perf_counter` reading, the direct
        readers' idle clock (:meth:`relay_live`).

        The compiled read path (``router/_chunkpath.c``, ``stream_add``) does the same in C
        for the reads where this neither trims nor reclaims, reading this stream's and its
        store's slots at their offsets; it calls this method for every other read, so this
        stays the definition (``tests/router/test_chunkpath.py`` compares the two). The same
        C does this method's reads where it can (:data:`_compiled_add`: the reads the
        producer relays itself, a stream's first events as a rule)."""
        if self.finished_at is not None:
            return
        if _compiled_add is not None and _compiled_add(self, payloads, read_at) is not None:
            return
        events = self.events
        seq = self.trimmed + len(events)
        if len(payloads) == 1:  # one event a read, the common case: no loop
            seq += 1
            data = payloads[0]
            added = [StreamEvent(seq, data)]
            size = len(data) + EVENT_OVERHEAD_BYTES
        else:
            added = []
            size = 0
            for data in payloads:
                seq += 1
                added.append(StreamEvent(seq, data))
                size += len(data) + EVENT_OVERHEAD_BYTES
        events += added
        self.size_bytes += size
        store = self._store
        if store is not None:
            # append's store bookkeeping, for events that cannot finish the stream.
            store.total_bytes += size
            usage = store._owners[self.owner]
            usage.bytes += size
            if store._shares and usage.bytes > store.max_owner_bytes:
                store._over_share.setdefault(self.owner, usage)
            if store._over_share and store.total_bytes > store.max_total_bytes:
                store._reclaim(strict=True)
        mirror = self.mirror
        if mirror is not None:
            for event in added:
                mirror(self, event)
        taps = self._taps
        if taps:  # _feed_taps' loop, inline: one call fewer per read ([DONE] cannot be here)
            refused = False
            for tap in taps:
                if tap.write(added):
                    tap.seq = seq
                    tap.last_at = read_at
                else:
                    tap.released = refused = True
            if refused:
                self._drop_released_taps()
        if self._waiters:
            self._wake()

    def finish(self, now: float) -> None:
        """Append ``[DONE]`` unless already there."""
        self.append(DONE_DATA, now)

    def after(self, seq: int) -> list[StreamEvent]:
        """Every event with sequence number greater than ``seq``, in order; raises
        :class:`HistoryTrimmed` if some of them were trimmed."""
        if seq < self.trimmed:
            raise HistoryTrimmed(seq, self.trimmed)
        return self.events[seq - self.trimmed :]

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
        if self.last_seq > seq or self.evicted or timeout_s == 0:
            return self.last_seq > seq
        # A bare future and a timer handle, not ``wait_for(event.wait())``: that made a task
        # per call, and every live reader calls this once per relayed chunk. The loop is
        # looked up once per stream: on Python 3.11 each lookup is a getpid() system call.
        loop = self.loop
        if loop is None:
            loop = self.loop = asyncio.get_running_loop()
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
        return self.last_seq > seq

    async def relay_live(
        self, seq: int, write: Callable[[list[StreamEvent]], bool], idle_s: float | None
    ) -> tuple[int, bool]:
        """For a reader caught up at ``seq``: hand the events appended from now on to
        ``write`` within :meth:`append` / :meth:`extend` (the producer's data callback; one
        call per append or extend, with its events in order), with no wake-up of the reader,
        until ``write`` refuses a batch (returns False, having written none of it: the
        reader's connection cannot take it now), the stream's ``[DONE]`` (not written: the
        reader sends it and ends), an eviction, or ``idle_s`` without an event. Returns the
        last sequence number written and whether it returned for being idle. Anything not
        written is in the store, after the returned number, for the reader's own path."""
        # last_seq and done, inline: two calls fewer (once a streamed request at least).
        if (
            self.trimmed + len(self.events) > seq
            or self.evicted
            or self.finished_at is not None
            or idle_s == 0
        ):
            return seq, False
        loop = self.loop
        if loop is None:
            loop = self.loop = asyncio.get_running_loop()
        tap = _Tap(write, seq, loop.create_future(), _idle_clock(), loop)
        self._taps.append(tap)
        if idle_s is not None:
            tap.idle_s = idle_s
            tap.timer = loop.call_later(idle_s, tap.check_idle)
        try:
            await tap.waiter
        finally:
            tap.close()
            if tap in self._taps:
                self._taps.remove(tap)
        return tap.seq, tap.idle

    def _feed_taps(self, events: list[StreamEvent]) -> None:
        done = events[-1].data == DONE_DATA  # only ever the last: nothing is added after it
        if done:
            events = events[:-1]
            if not events:
                self._release_taps()
                return
        refused = False
        last = events[-1].seq
        now = _idle_clock()
        for tap in self._taps:
            if tap.write(events):
                tap.seq = last
                tap.last_at = now
            else:
                tap.released = refused = True
        if done:
            self._release_taps()
            return
        if refused:
            self._drop_released_taps()

    def _drop_released_taps(self) -> None:
        """Release the taps whose write was refused (their readers go on from the store)."""
        taps = self._taps
        self._taps = [tap for tap in taps if not tap.released]
        for tap in taps:
            if tap.released:
                tap.release()

    def _release_taps(self) -> None:
        taps, self._taps = self._taps, []
        for tap in taps:
            tap.release()

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)
        if self._taps and (self.evicted or self.done):
            self._release_taps()


class _Tap:
    """One reader of :meth:`Stream.relay_live`: where its events go and how long it waits."""

    __slots__ = ("idle", "idle_s", "last_at", "loop", "released", "seq", "timer", "waiter", "write")

    def __init__(
        self,
        write: Callable[[list[StreamEvent]], bool],
        seq: int,
        waiter: asyncio.Future[None],
        now: float,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.write = write
        self.seq = seq
        self.waiter = waiter
        self.last_at = now
        """When it was last written to (or started): its idle clock."""
        self.loop = loop
        self.idle = False
        self.idle_s = 0.0
        self.released = False
        self.timer: asyncio.TimerHandle | None = None

    def check_idle(self) -> None:
        # One timer per idle period, moved on when it fires after writes, rather than
        # rescheduled per event: events are per chunk, idle periods are rare.
        now = _idle_clock()
        if now - self.last_at >= self.idle_s:
            self.timer = None
            self.idle = True
            self.release()
        else:
            self.timer = self.loop.call_later(self.last_at + self.idle_s - now, self.check_idle)

    def release(self) -> None:
        self.released = True
        if not self.waiter.done():
            self.waiter.set_result(None)

    def close(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None


def _expire(waiter: asyncio.Future[None]) -> None:
    """The wait's timeout: resolve it like a wake-up; ``wait`` then finds nothing new."""
    if not waiter.done():
        waiter.set_result(None)


@dataclass(eq=False, slots=True)
class _Owner:
    """One owner's share of the store: bytes held, live streams, and its streams in the order
    its history is trimmed in (creation order; a live stream trimmed bare goes to the back)."""

    bytes: int = 0
    live: int = 0
    streams: OrderedDict[str, Stream] = field(default_factory=OrderedDict)


class StoreFull(Enum):
    """Why the store refused a new stream (the error code the client gets)."""

    STORE = error_codes.STREAM_STORE_FULL
    """Live streams fill the whole store (every owner within its share, so none can be
    trimmed for another; finished streams are all gone)."""


class StreamStore:
    """All streams of one router process, bounded by bytes (overall and per owner) and age.

    Every stream sits in ordered indexes (creation order; finish order; per owner, trim
    order), so finding the next one to evict or trim is O(1) and dropping it is O(1): no index
    is ever sorted.
    """

    # Slots: the compiled per-chunk path (router/_chunkpath.c) reads and writes the byte
    # counts at their offsets, as it does the stream's.
    __slots__ = (
        "_finished", "_live", "_over_share", "_owner_low_bytes", "_owners", "_retrim",
        "_shares", "_streams", "evicted_by", "evictions", "max_age_s", "max_owner_bytes",
        "max_total_bytes", "total_bytes", "trimmed_events",
    )

    def __init__(
        self, *, max_total_bytes: int, max_age_s: float, max_owner_bytes: int | None = None
    ) -> None:
        self.max_total_bytes = max_total_bytes
        self.max_age_s = max_age_s
        self.max_owner_bytes = max_total_bytes
        self._owner_low_bytes = max_total_bytes
        self._shares = False
        self._retrim = False
        self.set_bounds(
            max_total_bytes=max_total_bytes, max_age_s=max_age_s, max_owner_bytes=max_owner_bytes
        )
        self._streams: OrderedDict[str, Stream] = OrderedDict()  # creation order
        self._live: dict[str, Stream] = {}
        self._finished: OrderedDict[str, Stream] = OrderedDict()  # finish order
        self._owners: dict[bytes, _Owner] = {}
        self._over_share: dict[bytes, _Owner] = {}
        """Owners over their share, in the order they went over (an ordered set): trimmed in
        that order when the store is full."""
        self.total_bytes = 0
        self.evictions = 0
        self.evicted_by: Counter[str] = Counter()
        """Evictions by reason: ``age``, ``key_share`` (an owner over its share), ``bytes``."""
        self.trimmed_events = 0
        """Events trimmed from the front of streams whose owner went over its share."""

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
        # Trimmed to 7/8 of the share, not to the share: the next trim waits for 1/8 of it to
        # grow again, so trims (and list shifts) come in batches, amortised O(1) per event.
        self._owner_low_bytes = self.max_owner_bytes - self.max_owner_bytes // 8
        # A share as large as the store is no share: the store's own bound applies (finished
        # streams oldest first, then refusals), nobody's history is trimmed.
        self._shares = self.max_owner_bytes < max_total_bytes
        self._retrim = self._shares

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

        Evicts what is past its age; then, the store being full, trims the history of owners
        over their share (``owner``'s too, if it is one), then evicts the oldest finished
        streams of anyone. No owner is refused for its share; when live streams of owners
        within their shares fill the whole store, the answer is a refusal.
        """
        streams = self._streams
        # The oldest stream within its age (the usual case): none is, and _evict_aged, a
        # call making a list, has nothing to do.
        if streams and now - next(iter(streams.values())).created_at > self.max_age_s:
            self._evict_aged(now)
        # With room, _reclaim and _evict_over_budget find nothing to do (non-strict, they
        # act at the bound): not called, two calls a request less.
        if self.total_bytes < self.max_total_bytes:
            return None
        self._reclaim(strict=False)
        self._evict_over_budget(strict=False)
        return StoreFull.STORE if self.total_bytes >= self.max_total_bytes else None

    def create(self, owner: bytes, now: float, stream_id: str | None = None) -> Stream:
        """A new, empty stream of ``owner`` (call :meth:`make_room` first to respect bounds),
        with a new id unless ``stream_id`` (one from :func:`new_stream_id`) is given."""
        if not stream_id:
            stream_id = new_stream_id()
        # Positional, the rest set after: keyword arguments cost the call a dict (~2k
        # instructions of the ~7k a stream's making took, once a streamed request).
        stream = Stream(stream_id, owner, now)
        stream.last_reader_at = now
        stream._store = self
        self._streams[stream_id] = stream
        self._live[stream_id] = stream
        usage = self._owners.get(owner)
        if usage is None:
            usage = self._owners[owner] = _Owner()
        usage.live += 1
        usage.streams[stream_id] = stream
        return stream

    def get(self, stream_id: str, owner: bytes) -> Stream | None:
        """The stream if it exists and belongs to ``owner``; ``None`` otherwise (same answer)."""
        stream = self._streams.get(stream_id)
        if stream is None or not hmac.compare_digest(stream.owner, owner):
            return None
        return stream

    def evict(self, now: float) -> list[Stream]:
        """Drop streams past their age (live ones too: ``max_age_s`` bounds a stream's life),
        then, while over ``max_total_bytes``, trim owners over their share, then drop the
        oldest finished streams. The router calls this from its housekeeping tick."""
        evicted = self._evict_aged(now)
        if self._retrim:  # new bounds (a reload): who is over its share now, once
            self._retrim = False
            self._over_share = {
                owner: usage
                for owner, usage in self._owners.items()
                if self._shares and usage.bytes > self.max_owner_bytes
            }
        return evicted + self._reclaim(strict=True) + self._evict_over_budget(strict=True)

    def _evict_aged(self, now: float) -> list[Stream]:
        evicted: list[Stream] = []
        while self._streams:
            oldest = next(iter(self._streams.values()))
            if now - oldest.created_at <= self.max_age_s:
                break
            evicted.append(self._drop(oldest, "age"))
        return evicted

    def _evict_over_budget(self, *, strict: bool) -> list[Stream]:
        """The oldest finished streams while the store is over budget (or at it unless
        ``strict``). Each drop is O(1)."""
        evicted: list[Stream] = []
        limit = self.max_total_bytes
        while self._finished and (
            self.total_bytes > limit or (not strict and self.total_bytes >= limit)
        ):
            evicted.append(self._drop(next(iter(self._finished.values())), "bytes"))
        return evicted

    def _reclaim(self, *, strict: bool) -> list[Stream]:
        """While the store is over its bound (or at it unless ``strict``), trim the owners over
        their share, the first to go over first, each by what the store is over its bound
        plus an eighth of its share, never below 7/8 of the share. Returns the streams
        dropped.

        An eighth of the share beyond the excess makes trims come in batches (the next one
        waits for that much to grow again); no more than that, because a trim is work done at
        once in the append that found the store full: one key holding most of a full store
        (a quarter of it is its share) was trimmed to 7/8 of its share in one go, ~200 MB of
        streams at the defaults, an ~85 ms stall of the event loop for every stream."""
        dropped: list[Stream] = []
        limit = self.max_total_bytes
        batch = self.max_owner_bytes // 8
        while self._over_share and (
            self.total_bytes > limit or (not strict and self.total_bytes >= limit)
        ):
            owner, usage = next(iter(self._over_share.items()))
            # Out of the set while trimmed (the newest events of its live streams may be all
            # it holds, and the loop must end); back in it if still over its share.
            del self._over_share[owner]
            excess = self.total_bytes - limit
            dropped += self._trim(usage, max(self._owner_low_bytes, usage.bytes - excess - batch))
            if (usage.bytes > self.max_owner_bytes and usage.streams
                    and self.total_bytes < limit):
                # Still first in line: the first to go over is trimmed first, every time.
                self._over_share = {owner: usage, **self._over_share}
        return dropped

    def _trim(self, usage: _Owner, target: int) -> list[Stream]:
        """Trim the owner's oldest history until it holds ``target`` bytes or less: events from
        the front of its oldest stream first; a finished stream with nothing left worth
        keeping is dropped, a live one keeps its newest event (and goes to the back). Returns
        the streams dropped. O(1) per event trimmed, plus one list shift per stream touched."""
        dropped: list[Stream] = []
        idle = 0  # streams visited in a row with nothing to trim (bounds the loop)
        while usage.bytes > target and usage.streams and idle <= len(usage.streams):
            stream = next(iter(usage.streams.values()))
            excess = usage.bytes - target
            keep = 1  # a live stream's newest event: a reader keeping up is never cut off
            events = stream.events
            count = freed = 0
            while count < len(events) - keep and freed < excess:
                freed += len(events[count].data) + EVENT_OVERHEAD_BYTES
                count += 1
            if stream.done and count == len(events) - keep:  # only its [DONE] would be left
                dropped.append(self._drop(stream, "key_share"))
                idle = 0
                continue
            if count:
                del events[:count]
                stream.trimmed += count
                stream.size_bytes -= freed
                usage.bytes -= freed
                self.total_bytes -= freed
                self.trimmed_events += count
                idle = 0
                if stream.on_trim is not None:
                    stream.on_trim(stream)
            else:
                idle += 1
            if usage.bytes > target:  # this one has nothing more to give: the next one
                usage.streams.move_to_end(stream.id)
        return dropped

    # --- bookkeeping, called by Stream ---------------------------------------------------
    def _drop(self, stream: Stream, reason: str) -> Stream:
        del self._streams[stream.id]
        usage = self._owners[stream.owner]
        usage.bytes -= stream.size_bytes
        self.total_bytes -= stream.size_bytes
        del usage.streams[stream.id]
        if stream.done:
            del self._finished[stream.id]
        else:
            del self._live[stream.id]
            usage.live -= 1
        if not usage.streams:
            del self._owners[stream.owner]
            self._over_share.pop(stream.owner, None)
        stream._store = None
        self.evictions += 1
        self.evicted_by[reason] += 1
        stream.evicted = True
        stream._wake()
        if not stream.done and stream.cancel_producer is not None:
            stream.cancel_producer()
        return stream
