"""The stream store shared through Redis Streams: resume any stream from any process.

The producing process keeps its streams in its own :class:`~firstbyte.router.streams.StreamStore`
(its readers read them from memory, as with one process) and mirrors every event into Redis:

- a stream is the Redis Stream ``{prefix}s:{id}``; event ``SEQ`` is the entry ``SEQ-0`` with the
  payload in field ``d`` (so ``Last-Event-ID: N`` is ``XREAD ... N-0``), ``XADD MAXLEN ~``
  bounds its length (checked every :data:`_BOUND_EVERY` events) and an expiry of
  ``streams.max_age_s`` its age; when the producing process trims a stream's history (its
  key went over its share of that process's store) the same events go from Redis (``XTRIM
  MINID``), and a reader elsewhere from before the trim point (or from before what ``MAXLEN``
  dropped) gets ``stream_history_trimmed``, its message naming which;
- the hash ``{prefix}m:{id}`` holds its owner (the API key's digest: a stream is readable only
  with the key that created it, here as in memory), the producing process's id, once the
  key's share trimmed it the first event kept (``cut``), and ``intact``, which the producer
  removes (``HDEL``, which a full Redis takes) when Redis refuses one of the stream's events:
  a reader elsewhere, caught up, then stops waiting for events Redis does not have;
- events are written by one :class:`_Writer` per process: everything queued since its last
  write goes in one round trip, as calls of one Lua script (one reply per 256 events, not one
  per chunk), at most every ``state.write_interval_ms`` (a write under load carries many
  streams' chunks).

Another process finds a stream with :meth:`SharedStreams.lookup` and reads it as a
:class:`RemoteStream`, which has the reading side of :class:`~firstbyte.router.streams.Stream`
(``after``, ``wait``, ``done``, ``attach``/``detach``), so the SSE, long-poll and WebSocket
readers serve both alike. Live events reach remote readers through one :class:`_Follower` per
process: a single ``XREAD BLOCK`` over every stream followed remotely (not a connection per
reader), re-issued with ``CLIENT UNBLOCK`` when a stream joins.

A producer that dies is noticed through its lease (:mod:`.lease`): a reader whose stream is
unfinished and whose producer's lease has lapsed appends a ``stream_lost`` error event and
``[DONE]`` (a Lua script, atomically, unless ``[DONE]`` is there). Entry ids are the sequence
numbers, so this also fences the producer: should it come back, its next ``XADD`` fails (id
not above the top) and it cancels its upstream request. A remote reader also marks itself
present (``{prefix}r:{id}``), so the producer does not cancel an upstream request that only
has readers elsewhere (the resume grace period).
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import functools
import hmac
import itertools
import logging
import math
import re
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Literal

from redis.exceptions import ResponseError

from firstbyte.protocol import error_codes
from firstbyte.protocol.codec import CHAT
from firstbyte.protocol.formats import BY_NAME
from firstbyte.protocol.responses import next_sequence_number
from firstbyte.tasks import cancel_and_wait

from ..chunkpath import MIRROR, PACK_XADDS
from ..hosting.limits import Throttle
from ..observability.logs import describe_error
from ..streams import DONE_DATA, HistoryTrimmed, Stream, StreamEvent
from .background import Background
from .errors import StateUnavailable
from .keys import Keys
from .lease import Lease, eviction_policy, redis_info
from .wire import Calls, bulk

if TYPE_CHECKING:
    from redis.asyncio import Redis
    from redis.commands.core import AsyncScript

__all__ = ["RemoteStream", "SharedStreams", "is_lost_event", "lost_event"]

log = logging.getLogger("firstbyte.router.shared")

_FIELD = b"d"
_CUT = "cut"
"""The metadata field holding the first id the producer's last key-share trim kept."""
Gap = Literal["share", "unwritten", "cap"]
"""Why events a reader elsewhere finds missing are gone: trimmed because the key went over
its share of the producer's store, never written (Redis away or full when they were made),
or cut by the bound on a stream's length (``state.max_events_per_stream``)."""
_throttle = Throttle(10.0)
"""Redis away: one warning per 10 s per kind (writes, follows), not one per attempt."""
_FOLLOW_BLOCK_MS = 250
"""Longest ``XREAD BLOCK`` of the follower: a stream that joins while a read is being sent
(so ``CLIENT UNBLOCK`` found nothing to unblock) waits at most this for its live events."""
_READ_COUNT = 1000
_EVICTIONS_KEPT = 256
"""Processes whose lease's eviction check :meth:`SharedStreams._evicted_by` keeps."""
_BATCH_TIMEOUT_S = 10.0
"""Longest wait for the replies to one batch of writes before the connection is dropped."""

# KEYS: events, lease. ARGV: error payload, expiry ms, the declaring reader's cursor. Appends
# the error and [DONE] after the last entry unless the stream is finished or its producer's
# lease is back; returns the sequence number of the [DONE] appended, 0 if finished already,
# -1 if the producer lives. The error goes after the reader's cursor too: a client that read
# from the producer itself may have seen events the producer never wrote here (writes are
# batched), and its resume must still get the error, not a [DONE] under an id it has seen.
# In a format that numbers its events (Responses), the error's ``"sequence_number":0`` becomes
# the number of its place: the last entry's, plus one per id after it (events numbered as
# their ids run: what the producer never wrote here took numbers too), or its id - 1.
_DECLARE_LOST = """
if redis.call('EXISTS', KEYS[2]) == 1 then return -1 end
local last = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
local seq = 0
local number = nil
if #last > 0 then
  if last[1][2][2] == '[DONE]' then return 0 end
  seq = tonumber(string.match(last[1][1], '^(%d+)'))
  number = string.match(last[1][2][2], '"sequence_number":%s*(%d+)')
end
local top = seq
seq = math.max(seq, math.min(tonumber(ARGV[3]), seq + 100000))
if number then number = tonumber(number) + 1 + seq - top else number = seq end
local event = string.gsub(ARGV[1], '"sequence_number":0,', '"sequence_number":' .. number .. ',', 1)
redis.call('XADD', KEYS[1], (seq + 1) .. '-0', 'd', event)
redis.call('XADD', KEYS[1], (seq + 2) .. '-0', 'd', '[DONE]')
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return seq + 2
"""
_NUMBER = re.compile(rb'"sequence_number":\d+,')
_UNNUMBERED = b'"sequence_number":0,'
"""How :func:`lost_event` and :func:`gone_event` number a Responses error before its place
is known."""


@functools.lru_cache(maxsize=64)  # a few formats, times the policies a Redis can have
def lost_event(format: str = "chat", *, evicted_by: str | None = None) -> bytes:
    """The error event a reader gets when its stream's producer died mid-stream, in the
    stream's wire format (OpenAI's error body for chat and completions); a Responses one is
    numbered 0 here, and by its place in the stream as it is appended (``_DECLARE_LOST``).

    ``evicted_by``: the ``maxmemory-policy`` of a Redis that evicts and has evicted keys
    (:func:`~.lease.eviction_policy`): the lease may have been evicted, the process may run
    on, and the message says so rather than that the process stopped."""
    if evicted_by is None:
        message = (
            "The router process producing this stream stopped before it finished;"
            " the events before this one are all there is."
        )
    else:
        message = (
            "The lease of the router process producing this stream is gone from the region's"
            " shared state before the stream finished: it may have been evicted by Redis"
            f" (maxmemory-policy {evicted_by}), the process still running; the stream ends"
            " here, and the events before this one are all there is."
        )
    return BY_NAME.get(format, CHAT).error_event(
        message, "server_error", code=error_codes.STREAM_LOST
    )


def gone_event(format: str = "chat") -> bytes:
    """The error event a reader elsewhere gets when its stream left Redis before its end
    (expired, or evicted by a ``maxmemory`` policy other than ``noeviction``): the same
    ``stream_lost`` as for a dead producer, so the SDK raises ``StreamLostError`` with the
    text delivered so far, instead of a response that ends without ``[DONE]``. A Responses
    one is numbered 0 here, and by its place as :meth:`RemoteStream.gone` appends it."""
    return BY_NAME.get(format, CHAT).error_event(
        "This stream is gone from the region's shared state (Redis: expired or evicted)"
        " before it finished; the events before this one are all there is here.",
        "server_error",
        code=error_codes.STREAM_LOST,
    )


_POLICY = re.compile(rb"maxmemory-policy [^)]*")
_ANY_POLICY = "_"


def is_lost_event(data: bytes, format: str) -> bool:
    """Is ``data`` a :func:`lost_event` of ``format`` (either text, any policy named),
    whatever number it was given? Asked at a gap only, not per event."""
    data = _NUMBER.sub(_UNNUMBERED, data, count=1)
    if data == lost_event(format):
        return True
    named = _POLICY.sub(b"maxmemory-policy " + _ANY_POLICY.encode(), data, count=1)
    return named == lost_event(format, evicted_by=_ANY_POLICY)


def _seq(entry_id: bytes) -> int:
    """The sequence number of a Redis Stream entry id ``b"SEQ-0"``."""
    return int(entry_id.split(b"-", 1)[0])


def _events(entries: Iterable[Any], after: int) -> list[StreamEvent]:
    """Redis Stream entries ``(b"SEQ-0", {b"d": data})`` as events after ``after``."""
    out: list[StreamEvent] = []
    for entry_id, fields in entries:
        seq = int(entry_id.split(b"-", 1)[0])
        if seq > after:
            out.append(StreamEvent(seq, fields[_FIELD]))
    return out


class RemoteStream:
    """A stream produced by another process, read through Redis by one local reader.

    It has the reading side of :class:`~firstbyte.router.streams.Stream`; events read so far
    are kept, from the reader's starting point on.
    """

    def __init__(
        self, shared: SharedStreams, stream_id: str, process: str, ttft_ms: float | None
    ) -> None:
        self.id = stream_id
        self.process = process
        """The producing process (whose lease says whether it still runs)."""
        self.upstream_ttft_ms = ttft_ms
        self.subject: str | None = None
        """The subject it was made for (``subj`` in its metadata)."""
        self.format = "chat"
        """Its wire format (``fmt`` in its metadata, written for formats other than chat)."""
        self.events: list[StreamEvent] = []
        self.cursor = 0
        """The last sequence number read from Redis."""
        self.evicted = False
        """The stream is gone from Redis (expired): no more events will come."""
        self.trimmed = 0
        """Events found missing before the first one read (trimmed from Redis)."""
        self.gap: Gap = "share"
        """Why those missing events are gone (:meth:`SharedStreams.why_missing`)."""
        self.holes: list[tuple[int, int]] = []
        """``(before, after)`` of each run of events missing between two read in one batch
        (the producer's writes of them failed: Redis away or full), in order."""
        self.marks_holes = False
        """Its producer says in its metadata whether every event so far is in Redis
        (``intact``, with ``v`` 2): :meth:`SharedStreams.check_producer` can end it."""
        self.unwritten_from: int | None = None
        """Set when Redis lacks events after this one (a write refused, Redis full) and has
        none past them: a reader here gets ``stream_history_trimmed`` instead of waiting for
        them (while Redis stays full, until the stream expired)."""
        self._shared = shared
        self._waiters: list[asyncio.Future[None]] = []
        self._following = False
        self._touched_at = -1e9
        self._quiet_from = 0.0
        """When its readers here last got an event or asked about its producer (loop time):
        the producer check's interval is counted from it, over a reader's successive waits."""

    @property
    def done(self) -> bool:
        return bool(self.events) and self.events[-1].is_done

    def after(self, seq: int) -> list[StreamEvent]:
        if seq < self.trimmed:
            gap = self.gap
            raise HistoryTrimmed(
                seq, self.trimmed, unwritten=gap == "unwritten",
                cap=self._shared.max_events if gap == "cap" else None,
            )
        events = self.events
        if not events or events[-1].seq <= seq:
            if self.unwritten_from is not None and seq >= self.unwritten_from:
                raise HistoryTrimmed(seq, seq + 1, unwritten=True)
            return []
        if self.holes:
            return self._around_holes(seq)
        return events[bisect.bisect_right(events, seq, key=lambda e: e.seq) :]

    def _around_holes(self, seq: int) -> list[StreamEvent]:
        """:meth:`after` of a stream with :attr:`holes`: the events up to the next hole, then
        :class:`HistoryTrimmed` for a reader at its edge (or inside it), as for a trimmed
        front: never the events after a hole as if none were missing."""
        events = self.events
        start = bisect.bisect_right(events, seq, key=lambda e: e.seq)
        for before, after in self.holes:
            if seq < before:
                end = bisect.bisect_right(events, before, key=lambda e: e.seq)
                return events[start:end]
            if seq < after - 1:
                raise HistoryTrimmed(seq, after - 1, unwritten=True)
        return events[start:]

    def gone(self) -> None:
        """The stream left Redis unfinished: end it here with :func:`gone_event` and
        ``[DONE]`` after the last event read (nothing is written to Redis), the error
        numbered for its place in a format that numbers its events (:meth:`_next_number`)."""
        seq = self.cursor
        error = gone_event(self.format).replace(
            _UNNUMBERED, b'"sequence_number":%d,' % self._next_number(), 1)
        self.receive([
            (b"%d-0" % (seq + 1), {b"d": error}),
            (b"%d-0" % (seq + 2), {b"d": DONE_DATA}),
        ])

    def _next_number(self) -> int:
        """The ``sequence_number`` (Responses) of an event added after :attr:`cursor`, as
        :data:`_DECLARE_LOST` numbers a dead producer's: one past the last event read's, plus
        one per id after it; with none read (a reader resumed there) or none numbered, the
        cursor (event N is numbered N - 1, the store's ids counting from 1, the numbers
        from 0)."""
        last = self.events[-1] if self.events else None
        number = None if last is None else next_sequence_number(last.data)
        if last is None or number is None:
            return self.cursor
        return number + self.cursor - last.seq

    def attach(self, now: float) -> None:
        self._touch(now)

    def detach(self, now: float) -> None:
        self._unfollow()

    def skips(self, entries: Sequence[Any]) -> bool:
        """Do ``entries`` (read from Redis) start past the event after :attr:`cursor`, but for
        a lost stream's error (what :meth:`receive` counts as :attr:`trimmed`)?"""
        for entry_id, fields in entries:
            seq = int(entry_id.split(b"-", 1)[0])
            if seq > self.cursor:
                return seq > self.cursor + 1 and not is_lost_event(fields[_FIELD], self.format)
        return False

    def receive(self, entries: Sequence[Any], gap: Gap = "share") -> None:
        """Entries read from Redis (by the follower or directly): keep the new ones, wake.
        ``gap``: why the events they skip (:meth:`skips`) are gone
        (:meth:`SharedStreams.deliver` asks Redis)."""
        new = _events(entries, self.cursor)
        if not new:
            return
        # XREAD skips what is gone: the history was trimmed (or never written). Unless the
        # gap is before a lost stream's error (placed after another reader's cursor): what
        # the dead producer never wrote is gone, and the error says so.
        if new[0].seq > self.cursor + 1 and not is_lost_event(new[0].data, self.format):
            self.trimmed = max(self.trimmed, new[0].seq - 1)
            self.gap = gap
        if new[-1].seq - new[0].seq >= len(new):  # a hole inside: events never written
            self._find_holes(new)
        self.events.extend(new)
        self.cursor = new[-1].seq
        if new[-1].is_done:
            self._unfollow()
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def _find_holes(self, new: list[StreamEvent]) -> None:
        """Note the runs missing between consecutive events of ``new``: what a write that
        failed dropped (a reader reading past one gets ``stream_history_trimmed``, as for a
        trimmed front, instead of a silent gap). Not before a lost stream's error: what a dead
        producer never wrote is gone, and the error says so."""
        for previous, event in itertools.pairwise(new):
            if event.seq > previous.seq + 1 and not is_lost_event(event.data, self.format):
                self.holes.append((previous.seq, event.seq))

    async def wait(self, seq: int, timeout_s: float | None) -> bool:
        """Wait until an event after ``seq`` exists; False on timeout or if the stream is gone.

        While it waits it checks the producer's lease every ``lease_s / 3``: a lapsed lease
        ends the stream with a ``stream_lost`` event (returned as new events, not a timeout).
        """
        if self.after(seq) or self.evicted or self.done:
            return bool(self.after(seq))
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        self.cursor = max(self.cursor, seq)
        if not self._following:
            # Catch up at once (a resuming reader gets what is stored in one read), then follow
            # (Redis away: the follower catches up from the cursor once it answers again).
            with contextlib.suppress(StateUnavailable):
                await self._shared.deliver(self, await self._shared.read_now(self))
            if self.after(seq) or self.done or timeout_s == 0:
                return bool(self.after(seq))
            self._following = True
            self._shared.follower.add(self)
            self._quiet_from = loop.time()
        step_s = self._shared.lease.check_interval_s
        while True:
            now = loop.time()
            self._touch(now)
            if deadline is not None and now >= deadline:
                return False
            step = step_s if deadline is None else min(step_s, deadline - now)
            waiter: asyncio.Future[None] = loop.create_future()
            self._waiters.append(waiter)
            timer = loop.call_later(step, _expire, waiter)
            try:
                await waiter
            finally:
                timer.cancel()
                with contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)
            if self.after(seq):
                self._quiet_from = loop.time()
                return True
            # A whole check interval without an event: is the producer alive? Counted over
            # successive waits: a reader's wait ends at each heartbeat, which may come sooner.
            if loop.time() - self._quiet_from >= step_s:
                self._quiet_from = loop.time()
                with contextlib.suppress(StateUnavailable):  # Redis away: ask again next time
                    await self._shared.check_producer(self)
                if self.after(seq):
                    return True
                if self.evicted:
                    return False

    async def relay_live(
        self, seq: int, write: Callable[[list[StreamEvent]], bool], idle_s: float | None
    ) -> tuple[int, bool]:
        """Events come in batches from Redis here, not one by one from a producer: nothing
        is written directly; returns when an event after ``seq`` exists, or idle."""
        return seq, not await self.wait(seq, idle_s)

    def _touch(self, now: float) -> None:
        """Mark this stream as read elsewhere (at most once per check interval)."""
        if now - self._touched_at >= self._shared.lease.check_interval_s:
            self._touched_at = now
            self._shared.touch_reader(self.id)

    def _unfollow(self) -> None:
        if self._following:
            self._following = False
            self._shared.follower.discard(self)


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class SharedStreams:
    """The Redis side of this process's streams (see the module docstring)."""

    def __init__(
        self,
        redis: Redis,
        keys: Keys,
        lease: Lease,
        process: str,
        *,
        max_age_s: float,
        max_events: int,
        reader_grace_s: float,
        write_interval_s: float = 0.0,
    ) -> None:
        self._redis = redis
        self.keys = keys
        self.lease = lease
        self.max_age_ms = int(max_age_s * 1000)
        self.max_events = max_events
        """``state.max_events_per_stream``: about how many events Redis keeps of a stream
        (a region's processes share the setting: a reader names it for the producer's)."""
        self.reader_ttl_ms = int(max(reader_grace_s, 3 * lease.check_interval_s) * 1000)
        self.writer = _Writer(redis, keys, process, self.max_age_ms, max_events, write_interval_s)
        # New streams' metadata goes on a writer (and connection) of its own: behind the event
        # writer's batches, a new stream's id waited for one to two of them (a batch under
        # load is thousands of XADDs), which added 80 ms to 1 s to TTFT at 100 streams.
        self.announcer = _Writer(redis, keys, process, self.max_age_ms, max_events)
        self.follower = _Follower(redis)
        self._declare_lost = redis.register_script(_DECLARE_LOST)
        self.background = Background()
        self.lost_declared = 0
        self._evictions: dict[str, tuple[float, str | None]] = {}
        """:meth:`_evicted_by`'s answers: by process, when asked (``time.monotonic``) and
        the policy."""

    def start(self) -> None:
        self.writer.start()
        self.announcer.start()
        self.follower.start()

    def publish(self, stream: Stream, announced: bool = False) -> None:
        """Mirror ``stream`` (new, empty) into Redis from now on; its metadata too, unless
        it is ``announced`` already (by its admission)."""
        if not announced:
            self.announcer.announce(stream)
        stream.mirror = self.writer.mirror
        stream.on_trim = self.writer.trim

    async def announced(self, stream: Stream) -> None:
        """Return once ``stream`` can be found by other processes (its metadata is written):
        await this before its id leaves the process."""
        await self.announcer.announced(stream.id)

    async def lookup(self, stream_id: str, owner: bytes) -> RemoteStream | None:
        """The stream if Redis has it and ``owner`` created it; ``None`` otherwise (the same
        answer for both, as in memory); :class:`StateUnavailable` if Redis does not answer."""
        try:
            meta: dict[bytes, bytes] = await self._redis.hgetall(  # type: ignore[assignment]
                self.keys.meta(stream_id)
            )
        except Exception as exc:
            raise StateUnavailable(f"stream lookup: {describe_error(exc)}") from exc
        stored = meta.get(b"owner")
        if stored is None or not hmac.compare_digest(stored, owner):
            return None
        ttft = meta.get(b"ttft")
        process = meta.get(b"proc", b"").decode()
        remote = RemoteStream(self, stream_id, process, None if ttft is None else float(ttft))
        remote.subject = meta.get(b"subj", b"").decode() or None
        remote.marks_holes = meta.get(b"v", b"1") >= b"2"
        remote.format = meta.get(b"fmt", b"chat").decode()
        return remote

    async def read_now(self, remote: RemoteStream) -> list[Any]:
        """The stored entries after ``remote.cursor`` (no waiting)."""
        key = self.keys.events(remote.id)
        try:
            reply: Any = await self._redis.xread({key: f"{remote.cursor}-0"}, count=_READ_COUNT)
        except Exception as exc:
            raise StateUnavailable(f"stream read: {describe_error(exc)}") from exc
        return list(reply[0][1]) if reply else []

    def touch_reader(self, stream_id: str) -> None:
        """Mark ``stream_id`` as read by this process (keeps its producer from cancelling)."""
        self.background.spawn(self._touch(self.keys.reader(stream_id)))

    async def _touch(self, key: str) -> None:
        # Renewed with PEXPIRE, which a full Redis (maxmemory, noeviction) still takes where it
        # refuses SET: a marker made before Redis filled keeps its reader counted, and the
        # producer does not cancel a stream read only elsewhere after its grace period.
        if not await self._redis.pexpire(key, self.reader_ttl_ms):
            await self._redis.set(key, b"1", px=self.reader_ttl_ms)

    async def check_producer(self, remote: RemoteStream) -> None:
        """If the stream's producer lost its lease, end the stream as lost; if the stream
        left Redis unfinished (its metadata, or its events once read, expired or evicted),
        end it with :meth:`RemoteStream.gone`; if its producer could not write some of its
        events (its metadata no longer ``intact``: Redis full), set
        :attr:`RemoteStream.unwritten_from` after what Redis has. Called by a reader after a
        check interval without events: one round trip, whatever it finds but a lapsed lease
        or a hole."""
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.exists(self.keys.lease(remote.process))
                pipe.hmget(self.keys.meta(remote.id), ["owner", "intact"])
                pipe.exists(self.keys.events(remote.id))
                alive, (owner, intact), stored = await pipe.execute()
            # Its events key is made by its first event: missing once read from, it is gone.
            if owner is None or (not stored and remote.events):
                remote.gone()
                return
            if alive and intact is None and remote.marks_holes:
                await self._unwritten(remote)
                return
            if alive:
                return
            evicted_by = await self._evicted_by(remote.process)
            declared = await self._declare_lost(
                keys=[self.keys.events(remote.id), self.keys.lease(remote.process)],
                args=[lost_event(remote.format, evicted_by=evicted_by), self.max_age_ms,
                      remote.cursor],
            )
        except Exception as exc:
            raise StateUnavailable(f"producer check: {describe_error(exc)}") from exc
        if declared > 0:
            self.lost_declared += 1
            if evicted_by is None:
                log.warning("stream %s lost: its process %s stopped", remote.id, remote.process)
            else:
                log.warning("stream %s lost: the lease of its process %s is gone; it may have"
                            " been evicted by Redis (maxmemory-policy %s; run it with"
                            " noeviction)", remote.id, remote.process, evicted_by)
        await self.deliver(remote, await self.read_now(remote))

    async def _evicted_by(self, process: str) -> str | None:
        """:func:`~.lease.eviction_policy` for ``process``'s lease, found gone: one ``INFO``
        per process whose lease a reader finds gone, kept for ``lease_s`` (a dead process's
        streams are declared lost one by one, each asking), never asked while leases are
        there."""
        now = time.monotonic()
        known = self._evictions.get(process)
        if known is not None and now - known[0] < self.lease.lease_s:
            return known[1]
        policy = eviction_policy(await redis_info(self._redis))
        if len(self._evictions) >= _EVICTIONS_KEPT:
            self._evictions.clear()
        self._evictions[process] = (now, policy)
        return policy

    async def _unwritten(self, remote: RemoteStream) -> None:
        """``remote``'s producer dropped events Redis refused (full), and a reader here
        caught up saw none past them: read what Redis has (a write may have landed since the
        follower's last read), then end the reader after it, as for a hole between events
        (:meth:`RemoteStream.after`), rather than have it wait for events Redis will not get
        while it stays full (their producer writes the stream's end once Redis has room)."""
        await self.deliver(remote, await self.read_now(remote))
        if not remote.done and remote.unwritten_from is None:
            remote.unwritten_from = remote.cursor
            log.info("stream %s: its process %s could not write events past %d to Redis"
                     " (full); its reader here is told so", remote.id, remote.process,
                     remote.cursor)

    async def deliver(self, remote: RemoteStream, entries: Sequence[Any]) -> None:
        """Hand ``entries`` to ``remote``; when they skip events after its cursor, first ask
        Redis why those are gone (:meth:`why_missing`): the reader is told
        (``stream_history_trimmed``'s message)."""
        if remote.skips(entries):
            remote.receive(entries, await self.why_missing(remote, entries))
        else:
            remote.receive(entries)

    async def why_missing(self, remote: RemoteStream, entries: Sequence[Any]) -> Gap:
        """Why are the events between ``remote.cursor`` and the first of ``entries`` after
        it gone? Never written (Redis away or full when they were made), or trimmed from the
        front: by the producer when the key went over its share of its store (``XTRIM MINID``,
        the first id it kept noted as ``cut`` in the stream's metadata), else by the length
        bound (``XADD MAXLEN ~``, which notes nothing). An entry at or before the cursor
        means none after it was trimmed, and a stream that never lost an entry
        (``entries-added`` is its length, Redis 7) lost none to a trim. Asked only at such a
        gap; Redis not answering: unknown, taken as the key's share (as before the bound
        was told apart)."""
        key = self.keys.events(remote.id)
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.xrevrange(key, f"{remote.cursor}-0", "-", count=1)
                pipe.xinfo_stream(key)
                pipe.hget(self.keys.meta(remote.id), _CUT)
                before, info, cut = await pipe.execute()
        except Exception:
            return "share"
        if before or info.get("entries-added") == info.get("length"):
            return "unwritten"
        # The first event read past the gap: the share's trim kept it (or one before it), or
        # the bound cut what the share's did not.
        first = next(seq for seq in (_seq(entry_id) for entry_id, _ in entries)
                     if seq > remote.cursor)
        return "share" if cut is not None and _seq(cut) >= first else "cap"

    async def keep_attended(self, streams: Iterable[Stream], now: float, grace_s: float) -> None:
        """Count a reader elsewhere as attending: for this process's streams unattended for
        half the grace period, a present reader key renews ``last_reader_at``."""
        candidates = [s for s in streams if s.unattended_for(now) >= grace_s / 2]
        if not candidates:
            return
        async with self._redis.pipeline(transaction=False) as pipe:
            for stream in candidates:
                pipe.exists(self.keys.reader(stream.id))
            present = await pipe.execute()
        for stream, seen in zip(candidates, present, strict=True):
            if seen:
                stream.last_reader_at = max(stream.last_reader_at, now)

    async def aclose(self) -> None:
        await self.writer.aclose()
        await self.announcer.aclose()
        await self.follower.aclose()
        await self.background.aclose()


_TRIM = StreamEvent(0, b"")
"""Queued in place of an event: trim the stream's Redis history to its trim point."""
_INTACT, _HOLED, _DUE = range(3)
"""A stream's ``intact`` in Redis, as the writer follows it (:meth:`_Writer._heal`): there;
removed (an XADD refused); removed, a later XADD taken (to be said again)."""

# KEYS: one per operation. ARGV: 1 MAXLEN, 2 expiry ms, 3 this process, then three per
# operation: its kind and two values. x: XADD (id, data); X: the same, then PEXPIRE (a
# stream's first event); m: a new stream's metadata (owner, subject); t: its upstream TTFT;
# f: its wire format (written for formats other than chat); i: ``intact`` again (below);
# r: XTRIM MINID (the first id kept), also noted as the metadata's ``cut`` (a reader elsewhere
# tells the key's share from MAXLEN by it; not made again if expired). Only a stream's first
# event and its metadata make a key (with its expiry): the others go to keys that exist, so a
# stream Redis lost (restarted empty; expired) is not made again without an expiry, to be
# kept forever (x and y: XADD NOMKSTREAM, Redis 6.2; one whose metadata is there, its first
# events dropped by a failed write, is made as by X: the metadata key is the events key with
# m: for s:, Keys). Each
# runs whatever the others did (an XADD refused fences its producer, not the batch); returns
# the XADDs refused for their id (another process declared the stream lost: the fence), by
# index, the other operations refused (Redis full: OOM) by minus their index, then the first
# of those errors as a string: their events are dropped, as when Redis is away, and the
# stream goes on. The metadata says ``intact`` from its creation (``v`` 2: its producer keeps
# it; a router from before wrote neither); a stream with an XADD refused so loses it, by an
# HDEL (not refused by a full Redis, unlike every write that grows memory) at the end of the
# call: a reader elsewhere, caught up, stops waiting for events Redis will not get
# (:meth:`SharedStreams.check_producer`); once Redis takes a later event of it, the writer
# says ``intact`` again (i, first in its next call: a reader past the hole waits for the next
# event instead). At the end, because once a script has run a write
# command Redis lets its later ones past ``maxmemory`` (measured on Valkey 8: an XADD after
# an HDEL, even one that removed nothing, was taken while full).
_APPEND = """
local maxlen, age, proc = ARGV[1], ARGV[2], ARGV[3]
local refused, why, holed = {}, nil, {}
for i = 1, #KEYS do
  local kind, a, b, key = ARGV[3 * i + 1], ARGV[3 * i + 2], ARGV[3 * i + 3], KEYS[i]
  local ok
  if kind == 'x' then
    ok = redis.pcall('XADD', key, 'NOMKSTREAM', a, 'd', b)
  elseif kind == 'y' then
    ok = redis.pcall('XADD', key, 'NOMKSTREAM', 'MAXLEN', '~', maxlen, a, 'd', b)
  end
  if ok == false and redis.call('EXISTS', (string.gsub(key, 's:([^:]+)$', 'm:%1'))) == 1 then
    kind = 'X'  -- its metadata is there, its first events were dropped: made now
  end
  if ok ~= nil and kind ~= 'X' then  -- x or y, done
  elseif kind == 'X' then
    ok = redis.pcall('XADD', key, 'MAXLEN', '~', maxlen, a, 'd', b)
    if type(ok) ~= 'table' then redis.call('PEXPIRE', key, age) end
  elseif kind == 'm' then
    ok = redis.pcall('HSET', key, 'owner', a, 'proc', proc, 'subj', b, 'v', '2', 'intact', '1')
    redis.call('PEXPIRE', key, age)
  elseif redis.call('EXISTS', key) == 0 then
    ok = false
  elseif kind == 't' then
    ok = redis.pcall('HSET', key, 'ttft', a)
  elseif kind == 'f' then
    ok = redis.pcall('HSET', key, 'fmt', a)
  elseif kind == 'i' then
    ok = redis.pcall('HSET', key, 'intact', '1')
  else
    ok = redis.pcall('XTRIM', key, 'MINID', a)
    local meta = (string.gsub(key, 's:([^:]+)$', 'm:%1'))
    if type(ok) == 'number' and redis.call('EXISTS', meta) == 1 then
      redis.pcall('HSET', meta, 'cut', a)  -- for readers elsewhere: the share cut, not MAXLEN
    end
  end
  if type(ok) == 'table' and ok.err then
    if string.find(ok.err, _FENCED, 1, true) then refused[#refused + 1] = i
    else
      if not why then why = ok.err end
      refused[#refused + 1] = -i
      if kind == 'x' or kind == 'y' or kind == 'X' then
        holed[(string.gsub(key, 's:([^:]+)$', 'm:%1'))] = true
      end
    end
  end
end
-- Last: once a script has run a write command, Redis lets its later ones past maxmemory.
for meta in pairs(holed) do redis.call('HDEL', meta, 'intact') end
if why then refused[#refused + 1] = why end
return refused
""".replace("_FENCED", "'equal or smaller than the target stream top item'")
"""The fence is told from other refusals by XADD's message for an id not above the top
(Redis and Valkey alike): an OOM had fenced, and cancelled, every stream written while Redis
was full."""
# KEYS: a stream's events. ARGV: the sequence number of its [DONE], and [DONE]. Appends it
# unless the stream is gone (expired, or Redis restarted empty: no reader can find it) or
# Redis has it (or anything past it: declared lost). Returns 1 if it appended, else 0.
_END_DROPPED = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local last = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
if #last > 0 and tonumber(string.match(last[1][1], '^(%d+)')) >= tonumber(ARGV[1]) then
  return 0
end
redis.call('XADD', KEYS[1], ARGV[1] .. '-0', 'd', ARGV[2])
return 1
"""
_BOUND_EVERY = 64
"""A stream's length is bounded (``XADD MAXLEN ~``) by its first event and every this many
after (``y``; ``x`` adds alone): the bound cost Redis ~0.5 µs an event, a fifth of its work for
one, while ``~`` lets a stream run a whole node (100 entries) past it anyway. Fewer for small
bounds (:meth:`_Writer.__init__`): at least one check every eighth of the bound."""
_NAMES_KEPT = 1 << 14
"""Streams whose packed event key the writer keeps (:attr:`_Writer._names`); past this many
it forgets them all and packs each again once (a key is a function of the stream's id)."""
_OPS_PER_CALL = 256
"""Operations per script call: Redis runs a script alone, so one call of a big batch would
hold every other client (the admissions of all processes) for its whole length; 256 XADDs
take it ~0.5 ms."""


class _Writer:
    """Writes this process's streams into Redis: everything queued since the last write goes
    in one round trip, in order (a stream's events are added in sequence), as calls of one
    script (:data:`_APPEND`), each carrying up to :data:`_OPS_PER_CALL` operations.

    Writes start at most every ``interval_s``: under load a write carries tens of chunks
    instead of a few, and its cost (a send, a reply to parse, a pooled connection) is shared
    by all of them; an event waits at most ``interval_s`` plus a round trip before readers
    elsewhere can see it (readers in this process read it from memory at once).
    """

    def __init__(
        self, redis: Redis, keys: Keys, process: str, max_age_ms: int, max_events: int,
        interval_s: float = 0.0,
    ) -> None:
        self._redis = redis
        self._keys = keys
        self._process = process.encode()
        self._head = (bulk(_APPEND.encode()), bulk(b"%d" % max_events),
                      bulk(b"%d" % max_age_ms), bulk(self._process))
        self._bound_every = max(1, min(_BOUND_EVERY, max_events // 8))
        """Events between two that bound their stream's length (:data:`_BOUND_EVERY`)."""
        self._interval_s = interval_s
        self._queue: list[tuple[Stream, StreamEvent | None]] = []
        """What the next write carries, in order (kept as one list: :attr:`mirror` holds it)."""
        self._names: dict[str, bytes] = {}
        """Each stream's event key as a RESP bulk string, by stream id: packed once a stream,
        not once a write (a write carries about one event of each live stream)."""
        self._wake: asyncio.Future[None] | None = None
        self._idle = asyncio.Event()
        """Set while nothing is queued or being written."""
        self._announced: dict[str, asyncio.Future[None]] = {}
        self.mirror: Callable[[Stream, StreamEvent], object] = (
            self.push if MIRROR is None else MIRROR(self._queue, self._first_queued))
        """Each shared stream's :attr:`~firstbyte.router.streams.Stream.mirror`: :meth:`push`,
        compiled where it was built (no Python call per relayed event)."""
        self._task: asyncio.Task[None] | None = None
        self._calls: Calls | None = None
        """The writer's own connection (made by :meth:`start`), taken from the pool once (the
        pool's hand-out and return were a third of a write's CPU), its replies parsed in its
        data callback: a write read through redis-py (a reading task, its parser, a timeout
        per batch) made ~45 Python calls, at low load more than the few events it carried."""
        self.round_trips = 0
        self.calls = 0
        """Script calls sent (replies read)."""
        self.commands = 0
        """Operations written (an XADD, a stream's metadata, ...)."""
        self.failures = 0
        self.fenced = 0
        self.dropped: dict[str, Stream] = {}
        """Streams with events a failed write dropped, by id, until their end is in Redis."""
        self._end: AsyncScript | None = None
        """:data:`_END_DROPPED`, registered at its first use (rare: after a failed write)."""
        self._holed: dict[str, Stream] = {}
        """Streams whose metadata says they are not ``intact`` (an XADD refused), by id."""
        self._healed: dict[str, Stream] = {}
        """Those of them whose last XADD Redis took since: ``intact`` again, by the next
        write (first in it, before any event that write carries)."""
        self._heal_due = False
        """Write :attr:`_healed` even with no event queued: set when a stream joins it (not
        when Redis refuses its ``intact``: then the next housekeeping tick, :meth:`end_dropped`,
        sets it, not a write per interval against a full Redis)."""

    def start(self) -> None:
        if self._task is None:
            self._calls = Calls(self._redis.connection_pool, _BATCH_TIMEOUT_S)
            self._task = asyncio.create_task(self._run())

    def announce(self, stream: Stream) -> None:
        """Write ``stream``'s metadata (:meth:`announced` says when it is there)."""
        self._announced[stream.id] = asyncio.get_running_loop().create_future()
        self.push(stream, None)

    async def announced(self, stream_id: str) -> None:
        future = self._announced.get(stream_id)
        if future is not None:
            await asyncio.shield(future)

    def push(self, stream: Stream, event: StreamEvent | None) -> None:
        """Queue one event of ``stream`` (``None``: its metadata) for the next write."""
        queue = self._queue
        queue.append((stream, event))
        if len(queue) == 1:  # called per relayed chunk: the rest is done once per write
            self._first_queued()

    def _first_queued(self) -> None:
        """The queue was empty: the writer has work again."""
        self._idle.clear()
        wake = self._wake
        if wake is not None and not wake.done():
            wake.set_result(None)

    def trim(self, stream: Stream) -> None:
        """Queue the trim of ``stream``'s events up to ``stream.trimmed`` (after its XADDs)."""
        self.push(stream, _TRIM)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        last = -math.inf
        while True:
            if not self._queue and not self._heal_due:
                self._idle.set()
                self._wake = loop.create_future()
                await self._wake
                self._wake = None
            pause = last + self._interval_s - loop.time()
            if pause > 0:  # the events of the rest of the interval go with these
                await asyncio.sleep(pause)
            last = loop.time()
            batch = self._queue.copy()
            self._queue.clear()
            await self._write(batch)

    def _pack(
        self, batch: list[tuple[Stream, StreamEvent | None]]
    ) -> tuple[bytes, list[list[Stream | None]]]:
        """The script calls for ``batch``, and per call the stream whose XADD each operation
        is (None for the others)."""
        keys = self._keys
        calls: list[bytes] = []
        producers: list[list[Stream | None]] = []
        names: list[bytes] = []
        values: list[bytes] = []
        ops: list[Stream | None] = []

        def close() -> None:
            calls.append(b"*%d\r\n$4\r\nEVAL\r\n" % (6 + 4 * len(ops)) + self._head[0]
                         + bulk(b"%d" % len(ops)) + b"".join(names) + b"".join(self._head[1:])
                         + b"".join(values))
            producers.append(list(ops))
            names.clear()
            values.clear()
            ops.clear()

        for stream in self._healed.values():  # before this write's events (rare)
            names.append(bulk(keys.meta(stream.id).encode()))
            values += (b"$1\r\ni\r\n", b"$0\r\n\r\n", b"$0\r\n\r\n")
            ops.append(None)
            if len(ops) >= _OPS_PER_CALL:
                close()
        named = self._names
        if len(named) > _NAMES_KEPT:
            named.clear()
        xadds, name_of, every = PACK_XADDS, self._name_of, self._bound_every
        i, count = 0, len(batch)
        while i < count:
            if xadds is not None:  # compiled: a run of plain events at once
                i, run_names, run_values, run_ops = xadds(
                    batch, i, _OPS_PER_CALL - len(ops), named, name_of, _TRIM, DONE_DATA, every)
                if run_ops:
                    names.append(run_names)
                    values.append(run_values)
                    ops += run_ops
                    if len(ops) >= _OPS_PER_CALL:
                        close()
                    continue
            stream, event = batch[i]  # what the compiled run stopped at, or every item
            i += 1
            if event is not None and event is not _TRIM:  # an event: the common case, first
                name = named.get(stream.id)
                if name is None:
                    name = named[stream.id] = name_of(stream.id)
                names.append(name)
                seq, data = event.seq, event.data
                entry = b"%d-0" % seq
                values.append(b"$1\r\n%s\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n" % (
                    b"X" if seq == 1 else b"y" if seq % every == 0 else b"x", len(entry), entry,
                    len(data), data))
                ops.append(stream)
                if data == DONE_DATA and stream.upstream_ttft_ms is not None:
                    names.append(bulk(keys.meta(stream.id).encode()))
                    values += (b"$1\r\nt\r\n", bulk(b"%.3f" % stream.upstream_ttft_ms),
                               b"$0\r\n\r\n")
                    ops.append(None)
            elif event is None:  # a new stream's metadata
                subject = b"" if stream.subject is None else stream.subject.encode()
                names.append(bulk(keys.meta(stream.id).encode()))
                values += (b"$1\r\nm\r\n", bulk(stream.owner), bulk(subject))
                ops.append(None)
                if stream.format != "chat":  # set by now: the write comes a turn later
                    # (chat's metadata as before); a reader elsewhere ends a lost
                    # producer's stream in it.
                    names.append(bulk(keys.meta(stream.id).encode()))
                    values += (b"$1\r\nf\r\n", bulk(stream.format.encode()), b"$0\r\n\r\n")
                    ops.append(None)
            else:  # its trim point
                names.append(name_of(stream.id))
                values += (b"$1\r\nr\r\n", bulk(b"%d-0" % (stream.trimmed + 1)), b"$0\r\n\r\n")
                ops.append(None)
            if len(ops) >= _OPS_PER_CALL:
                close()
        if ops:
            close()
        return b"".join(calls), producers

    def _name_of(self, stream_id: str) -> bytes:
        """A stream's event key, as a RESP bulk string."""
        return bulk(self._keys.events(stream_id).encode())

    async def _write(self, batch: list[tuple[Stream, StreamEvent | None]]) -> None:
        # Packed here and sent on the writer's own connection (:mod:`.wire`): redis-py's
        # pipeline cost the router ~24 us per relayed chunk (bench router_workers), a
        # prepacked XADD ~2 plus ~4 to parse its reply; a script call per batch has one reply.
        packed, producers = self._pack(batch)
        self._heal_due = False
        if not producers:
            return
        self.round_trips += 1
        self.calls += len(producers)
        self.commands += sum(len(ops) for ops in producers)
        # A lost batch drops the connection; the next write reconnects.
        assert self._calls is not None, "started"
        replies = self._calls.call_many(packed, len(producers))
        lost: Exception | None = None
        unwritten = 0
        healing = self._healed
        if healing:
            self._healed = {}
        outcomes: list[tuple[list[Stream | None], set[int]]] | None = None
        """Each call's operations and those refused, kept while some stream is not
        ``intact`` (rare): whose last XADD Redis took (:meth:`_heal`). A call lost whole
        (Redis away) counts as all refused: its restorations are still due; its streams'
        ``intact`` was not removed, and saying it again later is harmless."""
        if healing or self._holed:
            outcomes = []
        for ops, reply in zip(producers, replies, strict=True):
            try:
                refused = await reply
            except ResponseError as exc:  # the whole call refused (not a fence)
                self._failed(len(ops), exc)
                for producer in ops:
                    self._dropped_one(producer)
                if outcomes is not None:
                    outcomes.append((ops, {-i for i in range(1, len(ops) + 1)}))
                continue
            except Exception as exc:  # Redis away: local readers go on, remote ones see a gap
                lost = exc
                unwritten += len(ops)
                for producer in ops:
                    self._dropped_one(producer)
                if outcomes is not None:
                    outcomes.append((ops, {-i for i in range(1, len(ops) + 1)}))
                continue
            for index in refused:
                if isinstance(index, bytes):  # why the ones below were refused
                    lost = ResponseError(index.decode(errors="replace"))
                elif index < 0:  # refused, not fenced (Redis full): dropped
                    producer = ops[-index - 1]
                    self._dropped_one(producer)
                    unwritten += 1
                    if producer is not None and outcomes is None:  # an XADD: not intact
                        outcomes = []  # (no stream was holed before: those calls change none)
                else:
                    producer = ops[index - 1]
                    if producer is not None and producer.mirror:
                        self._fence(producer, f"an XADD of {producer.id} was refused")
            if outcomes is not None:
                outcomes.append((ops, {i for i in refused if isinstance(i, int)}))
        if lost is not None:
            self._failed(unwritten, lost)
        if outcomes is not None:
            self._heal(healing, outcomes)
        if self._announced:  # a pass over every event of the write, only for announcements
            for stream, event in batch:
                if event is None:
                    future = self._announced.pop(stream.id, None)
                    if future is not None and not future.done():
                        future.set_result(None)

    def _heal(
        self, healing: dict[str, Stream],
        outcomes: list[tuple[list[Stream | None], set[int]]],
    ) -> None:
        """After a write, each stream's ``intact`` as Redis has it, from the write's
        operations in order: an XADD refused removed it (:attr:`_holed`); one taken after
        that makes it due again (:attr:`_healed`), said first in the next write, which a
        stream due since a write before opened with (``healing``; refused: still due, and
        tried again by the next housekeeping tick, not by a write per interval against a full
        Redis). Runs only while some stream is not intact."""
        state = dict.fromkeys(self._holed, _HOLED)
        streams = {**healing, **self._holed}
        for at, stream in enumerate(healing.values()):  # the first operations (:meth:`_pack`)
            call, index = divmod(at, _OPS_PER_CALL)
            denied = call < len(outcomes) and -(index + 1) in outcomes[call][1]
            state[stream.id] = _DUE if denied else _INTACT
        fresh = False
        for ops, refused in outcomes:
            for index, producer in enumerate(ops, start=1):
                if producer is None:
                    continue
                if -index in refused:
                    state[producer.id] = _HOLED
                    streams[producer.id] = producer
                elif state.get(producer.id) == _HOLED:
                    state[producer.id] = _DUE
                    fresh = True
        self._holed, self._healed = {}, {}
        for stream_id, now in state.items():
            stream = streams[stream_id]
            if now == _INTACT or stream.mirror is None:  # intact; or fenced: ended elsewhere
                continue
            if stream.done and stream_id not in self.dropped:
                continue  # its end is in Redis: its readers elsewhere end there
            self._holed[stream_id] = stream
            if now == _DUE:
                self._healed[stream_id] = stream
        if fresh:
            self._heal_due = True
            self._idle.clear()

    def _dropped_one(self, producer: Stream | None) -> None:
        """An event of ``producer`` (None: another operation) was not written: its end is
        made sure of (:meth:`end_dropped`)."""
        if producer is not None:
            self.dropped[producer.id] = producer

    async def end_dropped(self) -> None:
        """Write ``[DONE]`` into Redis for each finished stream some of whose events a
        failed write dropped, if Redis lacks it: a reader elsewhere waited for it until the
        stream expired (``streams.max_age_s``), the producer alive. The streams still live,
        or whose end Redis does not take yet, are kept for the next call. Also has the
        writer say ``intact`` again of streams for which Redis refused it (:attr:`_healed`)."""
        if self._healed and not self._heal_due:  # their ``intact`` refused: again
            self._heal_due = True
            self._first_queued()
        for stream_id, stream in list(self.dropped.items()):
            if stream.mirror is None:  # fenced: another process ended it
                del self.dropped[stream_id]
            elif stream.done:
                if self._end is None:
                    self._end = self._redis.register_script(_END_DROPPED)
                await self._end(keys=[self._keys.events(stream_id)],
                                args=[stream.last_seq, DONE_DATA])
                del self.dropped[stream_id]

    def _failed(self, commands: int, exc: Exception) -> None:
        self.failures += 1
        more = _throttle.report("write", time.monotonic(), "failed batches")
        if more is not None:
            log.warning("cannot write %d stream commands to Redis: %s%s", commands,
                        describe_error(exc), more)

    def _fence(self, stream: Stream, error: str) -> None:
        """An ``XADD`` refused: another process declared this stream lost (its entry ids
        are past ours). Stop mirroring it and cancel its upstream request."""
        self.fenced += 1
        log.warning("stream %s was declared lost elsewhere (%s); cancelling it", stream.id, error)
        stream.mirror = None
        if not stream.done and stream.cancel_producer is not None:
            stream.cancel_producer()

    async def aclose(self, timeout_s: float = 2.0) -> None:
        """Write what is queued (for up to ``timeout_s``), then stop."""
        if self._task is None:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout_at(deadline):
                await self._idle.wait()
        await cancel_and_wait(self._task)
        self._task = None
        if self._calls is not None:  # a write still in flight: what is left of the time
            await self._calls.aclose(max(0.0, deadline - loop.time()))


class _Follower:
    """One ``XREAD BLOCK`` over every stream this process follows remotely.

    It runs on a connection of its own; adding a stream unblocks the read in flight (``CLIENT
    UNBLOCK``) so the next read includes it.
    """

    def __init__(self, redis: Redis) -> None:
        self._redis = redis
        self._conn: Redis | None = None
        self._client_id: int | None = None
        self._followed: dict[bytes, list[RemoteStream]] = {}
        self._changed: asyncio.Future[None] | None = None
        self._task: asyncio.Task[None] | None = None
        self._blocked = False
        self.reads = 0
        self._stopping = False
        """Set by :meth:`aclose`: the reads end (as :class:`~.lease.Lease`'s renewals, a
        cancel that lands as a read's reply comes can be absorbed by redis-py)."""

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run())

    def add(self, remote: RemoteStream) -> None:
        key = remote._shared.keys.events(remote.id).encode()
        self._followed.setdefault(key, []).append(remote)
        if self._changed is not None and not self._changed.done():
            self._changed.set_result(None)
        if self._blocked and self._client_id is not None:
            client_id = self._client_id
            remote._shared.background.spawn(self._redis.client_unblock(client_id))

    def discard(self, remote: RemoteStream) -> None:
        key = remote._shared.keys.events(remote.id).encode()
        followers = self._followed.get(key)
        if followers is not None:
            with contextlib.suppress(ValueError):
                followers.remove(remote)
            if not followers:
                del self._followed[key]

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._stopping:
            if not self._followed:
                self._changed = loop.create_future()
                await self._changed
                self._changed = None
            try:
                if self._conn is None:
                    self._conn = self._redis.client()
                    self._client_id = int(await self._conn.client_id())
                cursors = {
                    key: f"{min(r.cursor for r in readers)}-0"
                    for key, readers in self._followed.items()
                }
                self._blocked = True
                try:
                    reply: Any = await self._conn.xread(
                        cursors,  # type: ignore[arg-type]
                        count=_READ_COUNT,
                        block=_FOLLOW_BLOCK_MS,
                    )
                finally:
                    self._blocked = False
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                more = _throttle.report("follow", time.monotonic())
                if more is not None:
                    log.warning("following remote streams failed: %s%s", describe_error(exc), more)
                await self._reset()
                await asyncio.sleep(0.2)
                continue
            self.reads += 1
            for key, entries in reply or ():
                for remote in list(self._followed.get(key, ())):
                    if remote.skips(entries):  # a gap: trimmed or never written? (rare)
                        await remote._shared.deliver(remote, entries)
                    else:
                        remote.receive(entries)

    async def _reset(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(Exception):
                await self._conn.aclose()
        self._conn = None
        self._client_id = None

    async def aclose(self) -> None:
        self._stopping = True
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None
        await self._reset()
