"""The stream store, sans sockets: ids, ownership, exactly-once reads, eviction by an
injected clock (age, bytes, finished first)."""

from __future__ import annotations

import asyncio

from firstbyte.router.readers import follow, parse_after, poll, sse_events
from firstbyte.router.streams import DONE_DATA, StreamStore, owner_of

ALICE = owner_of("sk-alice-000000")
BOB = owner_of("sk-bob-00000000")


def test_ids_are_random_128_bit_and_owned() -> None:
    store = StreamStore(max_total_bytes=1 << 20, max_age_s=60)
    ids = {store.create(ALICE, 0.0).id for _ in range(200)}
    assert len(ids) == 200
    assert all(len(i) == 22 for i in ids)
    some = next(iter(ids))
    assert store.get(some, ALICE) is not None
    assert store.get(some, BOB) is None
    assert store.get("nope", ALICE) is None


def test_sequence_numbers_and_after() -> None:
    store = StreamStore(max_total_bytes=1 << 20, max_age_s=60)
    stream = store.create(ALICE, 0.0)
    for i in range(5):
        stream.append(b'{"n": %d}' % i, 1.0)
    stream.finish(2.0)
    assert [e.seq for e in stream.events] == [1, 2, 3, 4, 5, 6]
    assert stream.events[-1].data == DONE_DATA
    assert stream.done
    assert [e.seq for e in stream.after(3)] == [4, 5, 6]
    assert stream.after(6) == []
    assert stream.append(b"late", 3.0) is None  # nothing after [DONE]


def test_parse_after() -> None:
    assert parse_after(None) == 0
    assert parse_after("") == 0
    assert parse_after("17") == 17
    for bad in ("-1", "1.5", "abc", "1e3", "٣", "9" * 30):
        assert parse_after(bad) is None


def test_eviction_by_age_uses_the_injected_clock() -> None:
    store = StreamStore(max_total_bytes=1 << 20, max_age_s=100)
    old = store.create(ALICE, 0.0)
    young = store.create(ALICE, 50.0)
    cancelled: list[str] = []
    old.cancel_producer = lambda: cancelled.append(old.id)
    assert store.evict(100.0) == []
    assert store.evict(100.5) == [old]
    assert cancelled == [old.id]  # an unfinished stream's producer is cancelled
    assert store.get(old.id, ALICE) is None
    assert store.get(young.id, ALICE) is young
    assert old.evicted


def test_eviction_by_bytes_takes_finished_streams_first_oldest_first() -> None:
    store = StreamStore(max_total_bytes=3000, max_age_s=1e9)
    running_old = store.create(ALICE, 0.0)
    finished_old = store.create(ALICE, 1.0)
    finished_new = store.create(ALICE, 2.0)
    running_new = store.create(ALICE, 3.0)
    for stream in (running_old, finished_old, finished_new, running_new):
        stream.append(b"x" * 600, 4.0)
    finished_old.finish(5.0)
    finished_new.finish(6.0)
    assert store.evict(7.0) == []  # ~4 * 660 + 2 * 70 bytes: under budget
    running_new.append(b"x" * 600, 8.0)  # now over by one event
    assert store.evict(9.0) == [finished_old]
    running_new.append(b"x" * 1500, 10.0)
    evicted = store.evict(11.0)
    assert evicted == [finished_new, running_old]  # finished first, then oldest running
    assert store.total_bytes <= store.max_total_bytes
    assert len(store) == 1


async def test_follow_delivers_every_event_once_while_in_progress() -> None:
    store = StreamStore(max_total_bytes=1 << 20, max_age_s=60)
    stream = store.create(ALICE, 0.0)
    stream.append(b"1", 0.0)
    stream.append(b"2", 0.0)

    async def produce() -> None:
        for i in range(3, 8):
            await asyncio.sleep(0.01)
            stream.append(str(i).encode(), 0.0)
        stream.finish(0.0)

    producer = asyncio.create_task(produce())
    seen: list[int] = []
    async for batch in follow(stream, 1, idle_s=5):
        seen.extend(e.seq for e in batch)
    await producer
    assert seen == [2, 3, 4, 5, 6, 7, 8]
    assert stream.readers == 0


async def test_sse_reframes_with_ids_and_pings_when_idle() -> None:
    store = StreamStore(max_total_bytes=1 << 20, max_age_s=60)
    stream = store.create(ALICE, 0.0)
    stream.append(b'{"a":1}', 0.0)
    out: list[bytes] = []
    reader = sse_events(stream, 0, heartbeat_s=0.05)
    out.append(await reader.__anext__())
    out.append(await reader.__anext__())  # idle: a ping comment
    stream.finish(0.0)
    out.extend([piece async for piece in reader])
    assert out == [b'id: 1\ndata: {"a":1}\n\n', b": ping\n", b"id: 2\ndata: [DONE]\n\n"]


async def test_poll_batches_and_done() -> None:
    store = StreamStore(max_total_bytes=1 << 20, max_age_s=60)
    stream = store.create(ALICE, 0.0)
    empty = await poll(stream, 0, 0.05)
    assert (empty.events, empty.done, empty.next) == ([], False, 0)
    stream.append(b'{"a":1}', 0.0)
    stream.append(b'{"a":2}', 0.0)
    batch = await poll(stream, 0, 1)
    assert [e.seq for e in batch.events] == [1, 2]
    assert batch.next == 2
    assert not batch.done
    stream.finish(0.0)
    last = await poll(stream, 2, 10)  # finished: answers at once
    assert (last.events, last.done, last.next) == ([], True, 2)
