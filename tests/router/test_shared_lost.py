"""A lost stream's error reaches every reader, whatever the dead producer wrote to Redis.

The producer batches its writes to Redis; a client reading from the producer itself can see
events that never reached Redis before the process died. Its resume elsewhere must still end
with the stream's ``stream_lost`` error, under an id it has not seen (not a bare ``[DONE]``),
and a reader further behind gets the same error, not a "history trimmed" answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import pytest
from redis.asyncio import Redis

from firstbyte.benchmarks.redis_server import RedisServer
from firstbyte.protocol import error_codes
from firstbyte.router.shared.keys import Keys
from firstbyte.router.shared.lease import Lease
from firstbyte.router.shared.streams import (
    SharedStreams,
    _Follower,
    is_lost_event,
    lost_event,
)
from tests.router.redis_fixture import redis_server  # noqa: F401 (a fixture)

pytestmark = pytest.mark.asyncio


async def test_a_reader_past_what_redis_holds_still_gets_the_lost_error(
    redis_server: RedisServer,  # noqa: F811
) -> None:
    redis = Redis.from_url(redis_server.url)
    keys = Keys("fb-lost-cursor:")
    shared = SharedStreams(
        redis, keys, Lease(redis, keys, "reader", 0.3), "reader",
        max_age_s=60, max_events=1000, reader_grace_s=1,
    )
    try:
        # The dead producer "dead" (no lease) wrote events 1-3 (Responses events numbered
        # 0-2) and a response format's meta; its own client had seen events up to 5.
        for seq in (1, 2, 3):
            event = b'event: e\ndata: {"type":"e","sequence_number":%d}' % (seq - 1)
            await redis.xadd(keys.events("s1"), {"d": event}, id=f"{seq}-0")
        await redis.hset(keys.meta("s1"), mapping={"owner": b"o", "proc": b"dead",
                                                   "fmt": b"responses"})
        ahead = await shared.lookup("s1", b"o")
        behind = await shared.lookup("s1", b"o")
        assert ahead is not None
        assert behind is not None
        assert ahead.format == "responses"

        assert await ahead.wait(5, timeout_s=3)
        events = ahead.after(5)
        assert [e.seq for e in events] == [6, 7]
        assert is_lost_event(events[0].data, "responses")
        error = json.loads(events[0].data.split(b"data: ", 1)[1])
        assert error["code"] == error_codes.STREAM_LOST
        # Numbered for its place: after event 5, which its client read as number 4.
        assert error["sequence_number"] == 5
        assert events[0].data == lost_event("responses").replace(
            b'"sequence_number":0,', b'"sequence_number":5,'
        )
        assert events[1].is_done

        # Another reader at 2 gets event 3, then the same error: no HistoryTrimmed.
        assert await behind.wait(2, timeout_s=3)
        assert [e.seq for e in behind.after(2)] == [3, 6, 7]
        assert shared.lost_declared == 1
    finally:
        await redis.aclose()


async def _through_a_cancel(entered: asyncio.Event) -> None:
    """Set ``entered``, then go on for 50 ms whether the task is cancelled meanwhile or not:
    what redis-py 8.2 did with a command whose reply came as its task was cancelled."""
    entered.set()
    call = asyncio.ensure_future(asyncio.sleep(0.05))
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.shield(call)
    await call


async def test_a_lease_stops_though_its_cancel_lands_in_a_renewal_that_returns(
    redis_server: RedisServer,  # noqa: F811
) -> None:
    """redis-py can finish a command normally though its task was cancelled meanwhile (a
    renewal answered as the process stopped, after Redis had stalled): the renewing loop then
    slept on with the cancel spent, and the process never exited. Stopping is a flag the loop
    reads, not only a cancel. The renewal here absorbs the cancel the same way, on purpose."""
    redis = Redis.from_url(redis_server.url)
    lease = Lease(redis, Keys("fb-lease-stop:"), "p1", 0.3)
    real_pexpire = redis.pexpire  # a renewal of a lease held
    renewing = asyncio.Event()

    async def absorbing_pexpire(*args: Any, **kwargs: Any) -> Any:
        await _through_a_cancel(renewing)
        return await real_pexpire(*args, **kwargs)

    try:
        await lease.start()
        redis.pexpire = absorbing_pexpire  # type: ignore[method-assign]
        await asyncio.wait_for(renewing.wait(), 2)  # a renewal is in flight: stop now
        await asyncio.wait_for(lease.aclose(), 2)
        assert await redis.exists(lease.key) == 0
    finally:
        redis.pexpire = real_pexpire  # type: ignore[method-assign]
        await redis.aclose()


async def test_the_follower_stops_though_its_cancel_lands_in_a_read_that_returns(
    redis_server: RedisServer,  # noqa: F811
) -> None:
    """The same for the one ``XREAD BLOCK`` that follows remote streams: a read that returns
    though its task was cancelled must not start the next one."""
    redis = Redis.from_url(redis_server.url)
    follower = _Follower(redis)
    real_client = redis.client
    reading = asyncio.Event()

    def client() -> Any:
        conn = real_client()
        real_xread = conn.xread

        async def absorbing_xread(*args: Any, **kwargs: Any) -> Any:
            await _through_a_cancel(reading)
            return await real_xread(*args, **{**kwargs, "block": 10})

        conn.xread = absorbing_xread  # type: ignore[method-assign]
        return conn

    class Reader:
        cursor = 0

        def receive(self, entries: object) -> None:
            pass

    try:
        redis.client = client  # type: ignore[method-assign]
        follower._followed[b"fb-follow-stop:s:x"] = [Reader()]  # type: ignore[list-item]
        follower.start()
        await asyncio.wait_for(reading.wait(), 2)  # a read is in flight: stop now
        await asyncio.wait_for(follower.aclose(), 2)
    finally:
        redis.client = real_client  # type: ignore[method-assign]
        await redis.aclose()


async def test_waits_shorter_than_the_check_interval_still_find_the_producer_dead(
    redis_server: RedisServer,  # noqa: F811
) -> None:
    """A reader's waits end at each heartbeat (``limits.heartbeat_interval_s``); shorter than
    the producer check's interval (``lease_s / 3``), no single wait reached it, so a reader
    elsewhere of a dead producer's stream got heartbeats for ever. The quiet time is counted
    over the waits."""
    redis = Redis.from_url(redis_server.url)
    keys = Keys("fb-lost-short:")
    lease = Lease(redis, keys, "reader", 0.3)  # a check every 0.1 s of quiet
    shared = SharedStreams(redis, keys, lease, "reader", max_age_s=60, max_events=1000,
                           reader_grace_s=1)
    try:
        await redis.xadd(keys.events("s1"), {"d": b'{"n":1}'}, id="1-0")
        await redis.hset(keys.meta("s1"), mapping={"owner": b"o", "proc": b"dead"})
        reader = await shared.lookup("s1", b"o")
        assert reader is not None
        heartbeats = 0
        while not reader.after(1) and heartbeats < 60:  # 3 s of heartbeats 0.05 s apart
            if not await reader.wait(1, timeout_s=lease.check_interval_s / 2):
                heartbeats += 1
        events = reader.after(1)
        assert events, f"no stream_lost after {heartbeats} heartbeats"
        assert is_lost_event(events[0].data, "chat")
        assert events[-1].is_done
        assert shared.lost_declared == 1
    finally:
        await redis.aclose()
