"""Why a reader on another process is missing a stream's first events: a stream's Redis copy is
bounded per stream (``XADD MAXLEN ~ state.max_events_per_stream``) and trimmed with the
producer's memory when the key goes over its share of the store (``XTRIM MINID``). The
``stream_history_trimmed`` message names the cause that cut what the reader missed (it named
the key's share for both), on a real Valkey.
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

from firstbyte.benchmarks.redis_server import RedisServer
from firstbyte.router.readers import poll, trimmed_body
from firstbyte.router.shared.keys import Keys
from firstbyte.router.shared.lease import Lease
from firstbyte.router.shared.streams import SharedStreams
from firstbyte.router.streams import HistoryTrimmed, StreamStore
from tests.router.redis_fixture import redis_server  # noqa: F401 (a fixture)

MAX_EVENTS = 16
"""``state.max_events_per_stream`` of both processes (its least)."""


def _process(redis: Redis, keys: Keys, name: str) -> SharedStreams:
    return SharedStreams(
        redis, keys, Lease(redis, keys, name, 0.3), name,
        max_age_s=60, max_events=MAX_EVENTS, reader_grace_s=1,
    )


@pytest.fixture
async def processes(
    redis_server: RedisServer,  # noqa: F811
) -> AsyncIterator[tuple[SharedStreams, SharedStreams]]:
    """A producing process and a reading one on the session's Valkey, keys of their own."""
    redis = Redis.from_url(redis_server.url)
    keys = Keys(f"fb-trims-{secrets.token_hex(4)}:")
    producer, reader = _process(redis, keys, "producer"), _process(redis, keys, "reader")
    producer.start()
    try:
        yield producer, reader
    finally:
        await producer.aclose()
        await reader.aclose()
        await redis.aclose()


async def _produced(
    producer: SharedStreams, store: StreamStore, stream_id: str, events: int, pad: int = 40
) -> None:
    """``events`` events (``pad`` bytes and a few) of a finished stream of this store, all
    written to Redis."""
    stream = store.create(b"owner", 0.0, stream_id)
    producer.publish(stream)
    await producer.announced(stream)
    for n in range(events):
        stream.append(b'{"n":%d,"pad":"%s"}' % (n, b"x" * pad), 0.0)
    stream.finish(0.0)
    await producer.writer.aclose()  # writes everything queued, in order


async def test_a_reader_behind_the_per_stream_bound_is_told_of_the_bound(
    processes: tuple[SharedStreams, SharedStreams],
) -> None:
    """300 events in a store with room: only ``MAXLEN`` cut the Redis copy. A resume from 0
    on the other process gets the bound and its setting, not the key's share, both as the
    410 of a long-poll and as the error body of SSE and WebSocket."""
    producer, reader = processes
    store = StreamStore(max_total_bytes=1 << 24, max_age_s=60)
    await _produced(producer, store, "capped", 300)
    assert store.trimmed_events == 0  # the key's share cut nothing
    remote = await reader.lookup("capped", b"owner")
    assert remote is not None
    with pytest.raises(HistoryTrimmed) as trimmed:
        await poll(remote, 0, 3.0)
    assert trimmed.value.after == 0
    assert 0 < trimmed.value.trimmed <= 300 - MAX_EVENTS
    message = trimmed_body(trimmed.value).error.message
    assert f"keeps about the last {MAX_EVENTS} events" in message
    assert "state.max_events_per_stream" in message
    assert "key's share" not in message


async def test_a_reader_behind_the_keys_share_is_told_of_the_share(
    processes: tuple[SharedStreams, SharedStreams],
) -> None:
    """A store whose one key goes over its share while the stream is produced: the producer
    trims its memory and Redis alike (``XTRIM MINID``), below the bound. The resume from 0
    elsewhere is told of the key's share, as before."""
    producer, reader = processes
    store = StreamStore(max_total_bytes=4096, max_age_s=60, max_owner_bytes=1024)
    # Fewer events than the bound (it cuts nothing), 6 KB of them: over the store's 4 KB.
    await _produced(producer, store, "shared", 12, pad=500)
    assert store.trimmed_events > 0
    remote = await reader.lookup("shared", b"owner")
    assert remote is not None
    with pytest.raises(HistoryTrimmed) as trimmed:
        await poll(remote, 0, 3.0)
    assert (trimmed.value.after, trimmed.value.trimmed) == (0, store.trimmed_events)
    message = trimmed_body(trimmed.value).error.message
    assert "went over the key's share of the stream store" in message
    assert "max_events_per_stream" not in message
