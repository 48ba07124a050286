"""The stream store shared through Redis Streams: resume any stream from any process.

The producing process keeps its streams in its own :class:`~firstbyte.router.streams.StreamStore`
(its readers read them from memory, as with one process) and mirrors every event into Redis:

- a stream is the Redis Stream ``{prefix}s:{id}``; event ``SEQ`` is the entry ``SEQ-0`` with the
  payload in field ``d`` (so ``Last-Event-ID: N`` is ``XREAD ... N-0``), ``XADD MAXLEN ~``
  bounds its length and an expiry of ``streams.max_age_s`` its age; when the producing
  process trims a stream's history (its key went over its share of that process's store) the
  same events go from Redis (``XTRIM MINID``), and a reader elsewhere from before the trim
  point (or from before what ``MAXLEN`` dropped) gets ``stream_history_trimmed``;
- the hash ``{prefix}m:{id}`` holds its owner (the API key's digest: a stream is readable only
  with the key that created it, here as in memory) and the producing process's id;
- events are written by one :class:`_Writer` per process that pipelines everything queued
  since its last round trip (one round trip carries many streams' chunks under load).

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
import hmac
import inspect
import logging
import math
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from redis.asyncio import ConnectionPool
from redis.exceptions import ResponseError

from firstbyte.protocol import error_codes
from firstbyte.protocol.openai import encode, error_body

from ..hosting.limits import Throttle
from ..streams import HistoryTrimmed, Stream, StreamEvent
from .background import Background
from .errors import StateUnavailable, describe
from .keys import Keys
from .lease import Lease

if TYPE_CHECKING:
    from redis.asyncio import Redis

__all__ = ["RemoteStream", "SharedStreams", "lost_event"]

log = logging.getLogger("firstbyte.router.shared")

_FIELD = b"d"
_throttle = Throttle(10.0)
"""Redis away: one warning per 10 s per kind (writes, follows), not one per attempt."""
_FOLLOW_BLOCK_MS = 250
"""Longest ``XREAD BLOCK`` of the follower: a stream that joins while a read is being sent
(so ``CLIENT UNBLOCK`` found nothing to unblock) waits at most this for its live events."""
_READ_COUNT = 1000
_BATCH_TIMEOUT_S = 10.0
"""Longest wait for the replies to one batch of writes before the connection is dropped."""

# KEYS: events, lease. ARGV: error payload, expiry ms. Appends the error and [DONE] after the
# last entry unless the stream is finished or its producer's lease is back; returns the
# sequence number of the [DONE] appended, 0 if finished already, -1 if the producer lives.
_DECLARE_LOST = """
if redis.call('EXISTS', KEYS[2]) == 1 then return -1 end
local last = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
local seq = 0
if #last > 0 then
  if last[1][2][2] == '[DONE]' then return 0 end
  seq = tonumber(string.match(last[1][1], '^(%d+)'))
end
redis.call('XADD', KEYS[1], (seq + 1) .. '-0', 'd', ARGV[1])
redis.call('XADD', KEYS[1], (seq + 2) .. '-0', 'd', '[DONE]')
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return seq + 2
"""


def lost_event() -> bytes:
    """The error event a reader gets when its stream's producer died mid-stream."""
    return encode(
        error_body(
            "The router process producing this stream stopped before it finished;"
            " the events before this one are all there is.",
            "server_error",
            code=error_codes.STREAM_LOST,
        )
    )


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
        self.events: list[StreamEvent] = []
        self.cursor = 0
        """The last sequence number read from Redis."""
        self.evicted = False
        """The stream is gone from Redis (expired): no more events will come."""
        self.trimmed = 0
        """Events found missing before the first one read (trimmed from Redis)."""
        self._shared = shared
        self._waiters: list[asyncio.Future[None]] = []
        self._following = False
        self._touched_at = -1e9

    @property
    def done(self) -> bool:
        return bool(self.events) and self.events[-1].is_done

    def after(self, seq: int) -> list[StreamEvent]:
        if seq < self.trimmed:
            raise HistoryTrimmed(seq, self.trimmed)
        events = self.events
        if not events or events[-1].seq <= seq:
            return []
        return events[bisect.bisect_right(events, seq, key=lambda e: e.seq) :]

    def attach(self, now: float) -> None:
        self._touch(now)

    def detach(self, now: float) -> None:
        self._unfollow()

    def receive(self, entries: Sequence[Any]) -> None:
        """Entries read from Redis (by the follower or directly): keep the new ones, wake."""
        new = _events(entries, self.cursor)
        if not new:
            return
        if new[0].seq > self.cursor + 1:  # XREAD skips what is gone: the history was trimmed
            self.trimmed = max(self.trimmed, new[0].seq - 1)
        self.events.extend(new)
        self.cursor = new[-1].seq
        if new[-1].is_done:
            self._unfollow()
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

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
                self.receive(await self._shared.read_now(self))
            if self.after(seq) or self.done or timeout_s == 0:
                return bool(self.after(seq))
            self._following = True
            self._shared.follower.add(self)
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
                return True
            if step >= step_s:  # a whole check interval without an event: is the producer alive?
                with contextlib.suppress(StateUnavailable):  # Redis away: ask again next time
                    await self._shared.check_producer(self)
                if self.after(seq):
                    return True
                if self.evicted:
                    return False

    async def relay_live(
        self, seq: int, write: Callable[[StreamEvent], bool], idle_s: float | None
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
    ) -> None:
        self._redis = redis
        self.keys = keys
        self.lease = lease
        self.max_age_ms = int(max_age_s * 1000)
        self.reader_ttl_ms = int(max(reader_grace_s, 3 * lease.check_interval_s) * 1000)
        self.writer = _Writer(redis, keys, process, self.max_age_ms, max_events)
        # New streams' metadata goes on a writer (and connection) of its own: behind the event
        # writer's batches, a new stream's id waited for one to two of them (a batch under
        # load is thousands of XADDs), which added 80 ms to 1 s to TTFT at 100 streams.
        self.announcer = _Writer(redis, keys, process, self.max_age_ms, max_events)
        self.follower = _Follower(redis)
        self._declare_lost = redis.register_script(_DECLARE_LOST)
        self.background = Background()
        self.lost_declared = 0

    def start(self) -> None:
        self.writer.start()
        self.announcer.start()
        self.follower.start()

    def publish(self, stream: Stream) -> None:
        """Mirror ``stream`` (new, empty) into Redis from now on."""
        self.announcer.announce(stream)
        stream.mirror = self.writer.push
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
            raise StateUnavailable(f"stream lookup: {describe(exc)}") from exc
        stored = meta.get(b"owner")
        if stored is None or not hmac.compare_digest(stored, owner):
            return None
        ttft = meta.get(b"ttft")
        process = meta.get(b"proc", b"").decode()
        remote = RemoteStream(self, stream_id, process, None if ttft is None else float(ttft))
        remote.subject = meta.get(b"subj", b"").decode() or None
        return remote

    async def read_now(self, remote: RemoteStream) -> list[Any]:
        """The stored entries after ``remote.cursor`` (no waiting)."""
        key = self.keys.events(remote.id)
        try:
            reply: Any = await self._redis.xread({key: f"{remote.cursor}-0"}, count=_READ_COUNT)
        except Exception as exc:
            raise StateUnavailable(f"stream read: {describe(exc)}") from exc
        return list(reply[0][1]) if reply else []

    def touch_reader(self, stream_id: str) -> None:
        """Mark ``stream_id`` as read by this process (keeps its producer from cancelling)."""
        key = self.keys.reader(stream_id)
        self.background.spawn(self._redis.set(key, b"1", px=self.reader_ttl_ms))

    async def check_producer(self, remote: RemoteStream) -> None:
        """If the stream's producer lost its lease, end the stream as lost; mark it evicted
        if it expired. Called by a reader after a check interval without events."""
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.exists(self.keys.lease(remote.process))
                pipe.exists(self.keys.meta(remote.id))
                alive, present = await pipe.execute()
            if not present:
                remote.evicted = True
                return
            if alive:
                return
            declared = await self._declare_lost(
                keys=[self.keys.events(remote.id), self.keys.lease(remote.process)],
                args=[lost_event(), self.max_age_ms],
            )
        except Exception as exc:
            raise StateUnavailable(f"producer check: {describe(exc)}") from exc
        if declared > 0:
            self.lost_declared += 1
            log.warning("stream %s lost: its process %s stopped", remote.id, remote.process)
        remote.receive(await self.read_now(remote))

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


def _bulk(value: bytes) -> bytes:
    """One RESP bulk string."""
    return b"$%d\r\n%s\r\n" % (len(value), value)


_NAMED_GET = "command_name" in inspect.signature(ConnectionPool.get_connection).parameters and (
    inspect.signature(ConnectionPool.get_connection).parameters["command_name"].default
    is inspect.Parameter.empty
)
"""redis-py 5.0-5.2 require a command name to hand out a connection; later ones warn if given."""


async def _pooled(pool: ConnectionPool) -> Any:
    """A connection from ``pool`` (on every redis-py the pyproject range allows)."""
    if _NAMED_GET:
        return await pool.get_connection("XADD")  # type: ignore[no-untyped-call]
    return await pool.get_connection()  # type: ignore[no-untyped-call,unused-ignore]


class _Writer:
    """Writes this process's streams into Redis: everything queued since the last round
    trip goes in one pipeline, in order, so a stream's events are added in sequence."""

    def __init__(
        self, redis: Redis, keys: Keys, process: str, max_age_ms: int, max_events: int
    ) -> None:
        self._redis = redis
        self._keys = keys
        self._process = process.encode()
        self._max_age_ms = max_age_ms
        self._maxlen = b"$6\r\nMAXLEN\r\n$1\r\n~\r\n" + _bulk(b"%d" % max_events)
        self._queue: list[tuple[Stream, StreamEvent | None]] = []
        self._wake: asyncio.Future[None] | None = None
        self._idle = asyncio.Event()
        """Set while nothing is queued or being written."""
        self._announced: dict[str, asyncio.Future[None]] = {}
        self._task: asyncio.Task[None] | None = None
        self.round_trips = 0
        self.commands = 0
        self.failures = 0
        self.fenced = 0

    def start(self) -> None:
        if self._task is None:
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
        """Queue one event of ``stream`` (``None``: its metadata) for the next round trip."""
        self._queue.append((stream, event))
        self._idle.clear()
        wake = self._wake
        if wake is not None and not wake.done():
            wake.set_result(None)

    def trim(self, stream: Stream) -> None:
        """Queue the trim of ``stream``'s events up to ``stream.trimmed`` (after its XADDs)."""
        self.push(stream, _TRIM)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._queue:
                self._idle.set()
                self._wake = loop.create_future()
                await self._wake
                self._wake = None
            batch, self._queue = self._queue, []
            await self._write(batch)

    async def _write(self, batch: list[tuple[Stream, StreamEvent | None]]) -> None:
        # The commands are packed here and sent on one of redis-py's pooled connections: its
        # pipeline builds each command through several layers of Python, which cost the router
        # ~24 us per relayed chunk (bench router_workers); a prepacked XADD costs ~2.
        keys = self._keys
        parts: list[bytes] = []
        producers: list[Stream | None] = []  # per command: the stream whose XADD it is
        max_age = _bulk(b"%d" % self._max_age_ms)
        for stream, event in batch:
            if event is None:
                meta = _bulk(keys.meta(stream.id).encode())
                subject = b"" if stream.subject is None else stream.subject.encode()
                parts += (b"*8\r\n$4\r\nHSET\r\n", meta, b"$5\r\nowner\r\n", _bulk(stream.owner),
                          b"$4\r\nproc\r\n", _bulk(self._process),
                          b"$4\r\nsubj\r\n", _bulk(subject),
                          b"*3\r\n$7\r\nPEXPIRE\r\n", meta, max_age)
                producers += (None, None)
                continue
            key = _bulk(keys.events(stream.id).encode())
            if event is _TRIM:
                parts += (b"*4\r\n$5\r\nXTRIM\r\n", key, b"$5\r\nMINID\r\n",
                          _bulk(b"%d-0" % (stream.trimmed + 1)))
                producers.append(None)
                continue
            parts += (b"*8\r\n$4\r\nXADD\r\n", key, self._maxlen, _bulk(b"%d-0" % event.seq),
                      b"$1\r\nd\r\n", _bulk(event.data))
            producers.append(stream)
            if event.seq == 1:
                parts += (b"*3\r\n$7\r\nPEXPIRE\r\n", key, max_age)
                producers.append(None)
            if event.is_done and stream.upstream_ttft_ms is not None:
                parts += (b"*4\r\n$4\r\nHSET\r\n", _bulk(keys.meta(stream.id).encode()),
                          b"$4\r\nttft\r\n", _bulk(b"%.3f" % stream.upstream_ttft_ms))
                producers.append(None)
        self.round_trips += 1
        self.commands += len(producers)
        results: list[Any] = [None] * len(producers)
        pool = self._redis.connection_pool
        try:
            connection = await _pooled(pool)
        except Exception as exc:
            self._failed(len(producers), exc)
        else:
            try:
                await connection.send_packed_command(b"".join(parts), check_health=False)
                # One deadline for the whole batch, none per reply: redis-py arms a timeout
                # for every reply it reads, which was a third of the writer's CPU per event.
                async with asyncio.timeout(_BATCH_TIMEOUT_S):
                    for i in range(len(producers)):
                        try:
                            results[i] = await connection.read_response(
                                disable_decoding=True, timeout=math.inf
                            )
                        except ResponseError as refused:  # one command refused: read on
                            results[i] = refused
            except Exception as exc:  # Redis away: local readers go on, remote ones see a gap
                await connection.disconnect()
                self._failed(len(producers), exc)
            finally:
                await pool.release(connection)
        for producer, result in zip(producers, results, strict=True):
            if producer is not None and isinstance(result, Exception) and producer.mirror:
                self._fence(producer, result)
        for stream, event in batch:
            if event is None:
                future = self._announced.pop(stream.id, None)
                if future is not None and not future.done():
                    future.set_result(None)

    def _failed(self, commands: int, exc: Exception) -> None:
        self.failures += 1
        held = _throttle.allow("write", time.monotonic())
        if held is not None:
            more = f" ({held} more failed batches since the last report)" if held else ""
            log.warning("cannot write %d stream commands to Redis: %s%s", commands,
                        describe(exc), more)

    def _fence(self, stream: Stream, error: Exception) -> None:
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
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._task = None


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
        while True:
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
                held = _throttle.allow("follow", time.monotonic())
                if held is not None:
                    more = f" ({held} more since the last report)" if held else ""
                    log.warning("following remote streams failed: %s%s", describe(exc), more)
                await self._reset()
                await asyncio.sleep(0.2)
                continue
            self.reads += 1
            for key, entries in reply or ():
                for remote in list(self._followed.get(key, ())):
                    remote.receive(entries)

    async def _reset(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(Exception):
                await self._conn.aclose()
        self._conn = None
        self._client_id = None

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await self._reset()
