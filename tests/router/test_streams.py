"""The stream store, sans sockets: ids, ownership, exactly-once reads, eviction by an
injected clock (age, bytes, finished first, a key over its share trimmed first, never a live
stream evicted for bytes) and its cost (constant per new stream, whatever the number stored)."""

from __future__ import annotations

import asyncio
import base64
import json
import math
import os
import time
import tracemalloc
from collections.abc import Callable

import pytest

from firstbyte.router import streams
from firstbyte.router.readers import BATCH_BYTES, follow, parse_after, poll, sse_events
from firstbyte.router.streams import (
    DONE_DATA,
    EVENT_OVERHEAD_BYTES,
    HistoryTrimmed,
    StoreFull,
    Stream,
    StreamStore,
    new_stream_id,
    owner_of,
)

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


def test_the_store_charges_an_event_what_it_allocates() -> None:
    """``max_total_bytes`` bounds memory only if an event's charge is what it costs: the
    event, its payload's object and its list slot (64 bytes undercharged a chat chunk by
    ~5%, more with the allocator's rounding). Measured with tracemalloc on 250 events
    (sequence numbers within the small ints' cache, as most streams' are)."""
    store = StreamStore(max_total_bytes=1 << 30, max_age_s=1e9)
    stream = store.create(ALICE, 0.0)
    stream.add([b"x" * 135], 0.0)  # the events list's first allocation is not the events'
    charged_before = store.total_bytes
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(250):
            stream.add([(b"%03d" % i) * 45], 0.0)  # a new 135-byte payload each
        allocated = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    charged = store.total_bytes - charged_before
    # tracemalloc counts the sizes asked for, not the allocator's rounding up to 16 bytes:
    # the charge is at least that, and not far over.
    assert allocated <= charged <= 1.10 * allocated, (charged, allocated)


def test_eviction_by_bytes_takes_finished_streams_oldest_first_never_a_live_one() -> None:
    store = StreamStore(max_total_bytes=3000, max_age_s=1e9)
    running_old = store.create(ALICE, 0.0)
    finished_old = store.create(ALICE, 1.0)
    finished_new = store.create(ALICE, 2.0)
    running_new = store.create(ALICE, 3.0)
    for stream in (running_old, finished_old, finished_new, running_new):
        stream.append(b"x" * 600, 4.0)
    finished_new.finish(5.0)  # finishes first, so it is the older finished stream
    finished_old.finish(6.0)
    assert store.evict(7.0) == []  # ~4 * 660 + 2 * 70 bytes: under budget
    assert store.running() == [running_old, running_new]
    running_new.append(b"x" * 600, 8.0)  # now over by one event
    assert store.evict(9.0) == [finished_new]
    running_new.append(b"x" * 2500, 10.0)  # running_new alone is now over the budget
    assert store.evict(11.0) == [finished_old]  # then no finished stream is left:
    assert store.total_bytes > store.max_total_bytes  # the live ones stay, over budget
    assert store.make_room(BOB, 12.0) is StoreFull.STORE  # and a new stream is refused
    assert not running_old.evicted
    assert not running_new.evicted
    running_old.finish(13.0)
    assert store.make_room(BOB, 14.0) is StoreFull.STORE  # running_new alone fills it
    running_new.finish(15.0)
    assert store.make_room(BOB, 16.0) is None  # finished streams made room
    assert store.evicted_by == {"bytes": 4}
    assert len(store) == 0


def test_a_key_over_its_share_loses_its_own_oldest_history_first() -> None:
    store = StreamStore(max_total_bytes=10_000, max_age_s=1e9, max_owner_bytes=2_500)
    bob = store.create(BOB, 0.0)
    bob.append(b"b" * 900, 0.0)
    bob.finish(0.5)  # Bob's finished stream is the oldest in the store
    alice: list[Stream] = []
    for i in range(8):  # ~1 KB each: Alice at 8 KB is over her share, the store still has room
        assert store.make_room(ALICE, float(i + 1)) is None
        stream = store.create(ALICE, float(i + 1))
        stream.append(b"a" * 900, float(i + 1))
        stream.finish(float(i + 1))
        alice.append(stream)
    assert store.evictions == 0  # work-conserving: nothing goes while there is room
    assert store.owner_bytes(ALICE) > 2_500
    # Her next stream fills the store: her own oldest finished streams go, whole (only their
    # [DONE] would be left), not Bob's, and at that append, not at a housekeeping tick.
    assert store.make_room(ALICE, 9.0) is None
    stream = store.create(ALICE, 9.0)
    stream.append(b"a" * 900, 9.0)
    alice.append(stream)
    assert store.total_bytes <= 10_000
    # By what the store is over its bound plus an eighth of her share (312 bytes), not
    # down to 7/8 of her share: she keeps what the store has room for.
    assert store.total_bytes >= 10_000 - 2 * 1_000
    evicted = [s.evicted for s in alice]
    assert evicted == sorted(evicted, reverse=True)  # the oldest first
    assert evicted[0]
    assert not evicted[-2]
    assert store.get(bob.id, BOB) is bob
    # Live streams growing past the store: her own history is trimmed, oldest first, and
    # her next stream is admitted; nobody else's is touched.
    live = [store.create(ALICE, 10.0) for _ in range(5)]
    for _ in range(30):
        for stream in live:
            stream.append(b"a" * 300, 10.0)
            assert store.total_bytes <= 10_000
    assert store.make_room(ALICE, 11.0) is None
    assert all(s.evicted for s in alice[:8])  # her finished ones went first
    assert not any(s.evicted for s in live)  # live streams are trimmed, never evicted
    assert live[0].trimmed > 0
    assert all(s.last_seq == 30 for s in live)
    assert all(len(s.events) >= 1 for s in live)  # each keeps at least its newest event
    with pytest.raises(HistoryTrimmed) as gone:
        live[0].after(0)
    assert (gone.value.after, gone.value.trimmed) == (0, live[0].trimmed)
    assert [e.seq for e in live[0].after(live[0].trimmed)] == list(
        range(live[0].trimmed + 1, 31))
    assert store.make_room(BOB, 11.0) is None  # Bob still has room
    assert store.get(bob.id, BOB) is bob
    assert bob.trimmed == 0
    assert store.evicted_by == {"key_share": 8}  # her 8 finished streams, whole
    assert store.live_streams(ALICE) == 6
    assert store.total_bytes == store.owner_bytes(ALICE) + store.owner_bytes(BOB)


def test_one_keys_growth_never_refuses_or_evicts_another_keys_streams() -> None:
    """The issue's case with an injected clock: key A's long live outputs go far past its
    quarter of the store; key B's finished streams stay whole and its new streams are
    admitted, at every step."""
    store = StreamStore(max_total_bytes=40_000, max_age_s=1e9, max_owner_bytes=10_000)
    finished_b = []
    for i in range(4):
        stream = store.create(BOB, float(i))
        stream.append(b"b" * 2_000, float(i))
        stream.finish(float(i))
        finished_b.append(stream)
    running_a = [store.create(ALICE, 10.0) for _ in range(8)]
    now = 10.0
    for _ in range(50):  # 8 streams x 50 events x ~1 KB: 10x the store, 40x A's share
        now += 1.0
        for stream in running_a:
            stream.append(b"a" * 1_000, now)
            assert store.total_bytes <= 40_000
        assert store.make_room(BOB, now) is None
        store.evict(now)
    assert not any(s.evicted for s in finished_b)
    assert all(s.trimmed == 0 and s.after(0)[-1].is_done for s in finished_b)
    assert store.evictions == 0
    assert store.trimmed_events > 300


def test_trims_come_in_batches() -> None:
    """A key over its share in a full store is trimmed to 7/8 of its share, so the trims
    (each a list shift of the stream trimmed) are at most one per eighth of the share
    appended, not one per event."""
    trims: list[int] = []
    store = StreamStore(max_total_bytes=160_000, max_age_s=1e9, max_owner_bytes=80_000)
    stream = store.create(ALICE, 0.0)
    stream.on_trim = lambda s: trims.append(s.trimmed)
    event = b"a" * (1_000 - EVENT_OVERHEAD_BYTES)
    for _ in range(8_000):  # 8 MB through a 160 KB store
        stream.append(event, 1.0)
        assert store.total_bytes <= 160_000
    assert stream.trimmed == trims[-1] >= 8_000 - 160
    assert len(trims) <= 8_000 * 1_000 // (80_000 // 8)  # <= 800 trims for 8,000 events
    assert trims == sorted(trims)


def test_a_key_holding_most_of_a_full_store_is_trimmed_a_batch_at_a_time() -> None:
    """One key far over its share (the one application of a region, under one key) loses an
    eighth of its share beyond what the store needs at each trim, not everything above 7/8
    of its share at once (that was 78% of the store in one append: an ~85 ms stall at the
    defaults); its finished streams go oldest first, and the store stays near full."""
    store = StreamStore(max_total_bytes=100_000, max_age_s=1e9, max_owner_bytes=25_000)
    event = b"a" * (1_000 - EVENT_OVERHEAD_BYTES)
    freed: list[int] = []
    for i in range(300):  # 300 streams of 10 events: 3x the store
        assert store.make_room(ALICE, float(i)) is None
        stream = store.create(ALICE, float(i))
        for _ in range(9):
            before = store.total_bytes
            stream.append(event, float(i))
            if store.total_bytes < before:
                freed.append(before + 1_000 - store.total_bytes)
        stream.finish(float(i))
        assert store.total_bytes <= 100_000
    assert freed  # trims happened, each at most the excess plus an eighth of her share
    assert max(freed) <= 1_000 + 25_000 // 8 + 10_000  # and whole streams of 10 events
    assert store.total_bytes >= 100_000 - 25_000 // 8 - 10_000 - 1_000
    assert store.evicted_by == {"key_share": store.evictions}
    kept = [s for s in store._streams.values()]
    assert [s.created_at for s in kept] == sorted(s.created_at for s in kept)
    assert kept[-1].created_at == 299.0  # the newest are kept, the oldest went


async def test_a_reader_keeping_up_is_never_cut_and_one_left_behind_gets_an_error() -> None:
    store = StreamStore(max_total_bytes=8_000, max_age_s=1e9, max_owner_bytes=4_000)
    stream = store.create(ALICE, 0.0)
    stream.append(b"x" * 500, 0.0)
    behind = sse_events(stream, 0, heartbeat_s=5)
    assert (await behind.__anext__()).startswith(b"id: 1\n")  # then this reader stalls
    seen: list[int] = []

    async def keeping_up() -> None:
        async for batch in follow(stream, 0, idle_s=5):
            seen.extend(e.seq for e in batch)

    reader = asyncio.create_task(keeping_up())
    for _ in range(40):  # 40 x ~0.5 KB through an 8 KB store, one event at a time
        await asyncio.sleep(0)
        stream.append(b"x" * 500, 1.0)
    stream.finish(2.0)
    await asyncio.wait_for(reader, 5)
    assert stream.trimmed > 0
    assert seen == list(range(1, 43))  # every event, once, though most are trimmed now
    rest = [piece async for piece in behind]  # the stalled reader resumes: too late
    assert len(rest) == 1
    assert b"id:" not in rest[0]
    assert json.loads(rest[0].removeprefix(b"data: "))["error"]["code"] == (
        "stream_history_trimmed")
    with pytest.raises(HistoryTrimmed):
        await poll(stream, 3, 0)


_TRIMMED_MESSAGE = (
    "Events 2 to {trimmed} of this stream were dropped: its API key's streams went over the"
    " key's share of the stream store. Read on from after={trimmed}, or send the request again."
)


def _named(name: str, data: dict[str, object]) -> bytes:
    return b"event: %s\ndata: %s" % (name.encode(), json.dumps(data).encode())


async def _overtaken(stream: Stream, event: Callable[[int], bytes]) -> tuple[bytes, bytes]:
    """A reader of ``stream`` takes its first event then stalls while 40 more of ``event(n)``
    (n from 1) go through the store and trim it past the reader, and the stream ends: (the
    first event's SSE, what the reader gets after it), one piece."""
    stream.append(event(0), 0.0)
    behind = sse_events(stream, 0, heartbeat_s=5)
    first = await behind.__anext__()
    for n in range(1, 41):
        stream.append(event(n), 1.0)
    stream.finish(2.0)
    assert stream.trimmed > 1
    (rest,) = [piece async for piece in behind]
    return first, rest


async def test_a_reader_left_behind_a_responses_stream_gets_its_error_event() -> None:
    # A Responses stream: the error is the format's named event, numbered after the last
    # event in the store (the reader missed the numbers of the events trimmed before it).
    store = StreamStore(max_total_bytes=8_000, max_age_s=1e9, max_owner_bytes=4_000)
    stream = store.create(ALICE, 0.0)
    stream.format = "responses"

    def delta(n: int) -> bytes:
        data = {"type": "response.output_text.delta", "sequence_number": n, "delta": "x" * 400}
        return _named("response.output_text.delta", data)

    first, rest = await _overtaken(stream, delta)
    assert first == b"id: 1\n" + delta(0) + b"\n\n"
    message = _TRIMMED_MESSAGE.format(trimmed=stream.trimmed)
    assert rest == (
        b'event: error\ndata: {"type":"error","sequence_number":41,'
        b'"code":"stream_history_trimmed","message":"%s","param":null}\n\n' % message.encode()
    )


async def test_a_reader_left_behind_a_messages_stream_gets_an_anthropic_error_event() -> None:
    store = StreamStore(max_total_bytes=8_000, max_age_s=1e9, max_owner_bytes=4_000)
    stream = store.create(ALICE, 0.0)
    stream.format = "messages"

    def delta(n: int) -> bytes:
        text = {"type": "text_delta", "text": "x" * 400}
        return _named("content_block_delta", {"type": "content_block_delta", "delta": text})

    first, rest = await _overtaken(stream, delta)
    assert first == b"id: 1\n" + delta(0) + b"\n\n"
    message = _TRIMMED_MESSAGE.format(trimmed=stream.trimmed)
    assert rest == (
        b'event: error\ndata: {"type":"error","error":{"type":"api_error","message":"%s",'
        b'"code":"stream_history_trimmed"}}\n\n' % message.encode()
    )


async def test_a_reader_left_behind_an_unnumbered_responses_stream_gets_no_number() -> None:
    # An upstream that numbers nothing: no number is made up for the error either.
    store = StreamStore(max_total_bytes=8_000, max_age_s=1e9, max_owner_bytes=4_000)
    stream = store.create(ALICE, 0.0)
    stream.format = "responses"

    def delta(n: int) -> bytes:
        return _named("response.output_text.delta", {"type": "response.output_text.delta",
                                                     "delta": "x" * 400})

    _, rest = await _overtaken(stream, delta)
    assert rest.startswith(b'event: error\ndata: {"type":"error","code":"stream_history_trimmed",')


def test_smaller_bounds_on_reload_are_applied_at_the_next_tick() -> None:
    store = StreamStore(max_total_bytes=10_000, max_age_s=1e9, max_owner_bytes=5_000)
    stream = store.create(ALICE, 0.0)
    for _ in range(4):
        stream.append(b"a" * 1_000, 0.0)
    assert store.trimmed_events == 0
    store.set_bounds(max_total_bytes=3_000, max_age_s=1e9, max_owner_bytes=1_000)
    store.evict(1.0)
    assert store.total_bytes <= 3_000
    # The store's excess and an eighth of her share: 4 x 1,080 - 3,000 + 125 bytes, two
    # events.
    assert store.owner_bytes(ALICE) == 2 * (1_000 + EVENT_OVERHEAD_BYTES)
    assert stream.trimmed == 2


def test_a_live_stream_survives_another_key_filling_the_store() -> None:
    store = StreamStore(max_total_bytes=20_000, max_age_s=1e9, max_owner_bytes=20_000)
    bob = store.create(BOB, 0.0)
    bob.append(b"b" * 100, 0.0)
    refused = 0
    for i in range(100):  # Alice fills the store with detached streams and big events
        bob.append(b"b" * 100, float(i))  # Bob's stream goes on meanwhile
        if store.make_room(ALICE, float(i)) is not None:
            refused += 1
            continue
        stream = store.create(ALICE, float(i))
        stream.append(b"a" * 2_000, float(i))
    assert refused > 0
    assert not bob.evicted
    assert store.get(bob.id, BOB) is bob
    assert bob.last_seq == 101


def _full_store(n: int) -> StreamStore:
    """A store at its byte bound with ``n`` finished streams of ~200 bytes."""
    size = 200 + EVENT_OVERHEAD_BYTES * 2 + len(DONE_DATA)
    store = StreamStore(max_total_bytes=n * size, max_age_s=1e9)
    for i in range(n):
        stream = store.create(ALICE, float(i))
        stream.append(b"x" * 200, float(i))
        stream.finish(float(i))
    assert store.total_bytes == store.max_total_bytes
    assert len(store) == n
    return store


def _seconds_per_new_stream(store: StreamStore, streams: int, t0: float) -> float:
    """Time to make room for, create and finish one stream in a full store (best of 3)."""
    best = math.inf
    for round_ in range(3):
        start = time.perf_counter()
        for i in range(streams):
            now = t0 + round_ * streams + i
            assert store.make_room(BOB, now) is None
            stream = store.create(BOB, now)
            stream.append(b"x" * 200, now)
            stream.finish(now)
        best = min(best, (time.perf_counter() - start) / streams)
    return best


def test_a_new_stream_in_a_full_store_costs_the_same_at_1k_and_50k_streams() -> None:
    small, large = _full_store(1_000), _full_store(50_000)
    before = large.evictions
    per_small = _seconds_per_new_stream(small, 500, 1e6)
    per_large = _seconds_per_new_stream(large, 500, 1e6)
    # Each new stream evicts exactly one (the oldest finished): the work is one drop.
    assert large.evictions - before == 3 * 500
    assert len(large) == 50_000
    # Same run, same code: 50x the streams may not cost 50x per stream (sorting every
    # stream on every create did: ~60x here). 4x leaves room for cache effects and noise.
    assert per_large < 4 * per_small, (per_small, per_large)


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


async def test_a_reader_behind_takes_the_store_a_bounded_batch_at_a_time() -> None:
    """A reader far behind (a resume of a long stream, a client that stopped reading) takes
    at most BATCH_BYTES of events at once, the next when the last was sent: what its
    connection has not taken stays in the store's bounds, not in the server's buffer."""
    store = StreamStore(max_total_bytes=1 << 30, max_age_s=60)
    stream = store.create(ALICE, 0.0)
    for _ in range(200):  # ~200 KB of backlog
        stream.append(b"x" * 1_000, 0.0)
    stream.finish(0.0)
    batches = [batch async for batch in follow(stream, 0, idle_s=5)]
    assert [e.seq for batch in batches for e in batch] == list(range(1, 202))  # all, once
    assert len(batches) >= 200_000 // BATCH_BYTES
    assert all(sum(len(e.data) for e in batch) <= BATCH_BYTES for batch in batches)
    big = store.create(ALICE, 0.0)  # an event bigger than a batch still goes, alone
    big.append(b"y" * (2 * BATCH_BYTES), 0.0)
    big.finish(0.0)
    assert [len(b) for b in [batch async for batch in follow(big, 0, idle_s=5)]] == [1, 1]


async def test_a_reader_behind_an_evicted_stream_sends_no_more_of_it() -> None:
    """Evicted (its age, the store's bytes), a stream's events are out of the store's count:
    a reader still behind on it ends instead of sending them on (it resumes to a 404)."""
    store = StreamStore(max_total_bytes=1 << 30, max_age_s=10)
    stream = store.create(ALICE, 0.0)
    for _ in range(200):
        stream.append(b"x" * 1_000, 0.0)
    reader = follow(stream, 0, idle_s=5)
    first = await reader.__anext__()
    assert store.evict(11.0) == [stream]
    assert [batch async for batch in reader] == []
    assert first[-1].seq < 200


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


async def test_waits_time_out_each_at_their_own_deadline() -> None:
    """Waits of different timeouts on one stream each end at their own deadline (not before,
    not at another's), and a cancelled one leaves nothing behind."""
    loop = asyncio.get_running_loop()
    store = StreamStore(max_total_bytes=1 << 20, max_age_s=60)
    stream = store.create(ALICE, 0.0)
    ended: dict[str, float] = {}

    async def waiting(name: str, timeout_s: float | None) -> bool:
        got = await stream.wait(0, timeout_s)
        ended[name] = loop.time()
        return got

    start = loop.time()
    long, short = (asyncio.create_task(waiting(n, t)) for n, t in (("long", 0.4), ("short", 0.1)))
    forever = asyncio.create_task(waiting("forever", None))
    assert await short is False
    assert not long.done()
    assert await long is False
    # Never before its deadline (the upper side is the machine's load, not the code's).
    assert ended["short"] - start >= 0.1
    assert ended["long"] - start >= 0.4
    assert not forever.done()

    forever.cancel()
    await asyncio.gather(forever, return_exceptions=True)
    assert stream._waiters == []


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


def test_stream_ids_are_unique_and_a_forked_child_draws_its_own() -> None:
    # Ids come from a pool of the OS's random bytes: 1,000 of them span several draws.
    ids = {new_stream_id() for _ in range(1000)}
    assert len(ids) == 1000
    assert all(len(i) == 22 and "=" not in i for i in ids)
    # URL-safe base64 of the bytes drawn, as base64.urlsafe_b64encode has it
    drawn = bytes([0xFB, 0xFF, 0xBF] * 5 + [0xFF])  # "+/" in standard base64
    streams._random._pool, streams._random._at = drawn, 0  # the next 16 bytes drawn
    assert new_stream_id() == base64.urlsafe_b64encode(drawn).rstrip(b"=").decode()
    streams._random.forget()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its first id, then gone
        os.write(write_end, new_stream_id().encode())
        os._exit(0)
    os.close(write_end)
    os.waitpid(pid, 0)
    child = os.read(read_end, 64).decode()
    os.close(read_end)
    # Without the fork hook the child hands out the parent's next id from the same pool.
    assert len(child) == 22
    assert child != new_stream_id()


def test_making_room_evicts_the_streams_past_their_age_first() -> None:
    # make_room looks at the oldest stream only: when it is within its age none is past it.
    store = StreamStore(max_total_bytes=1 << 20, max_age_s=60)
    old, young = store.create(ALICE, 0.0), store.create(BOB, 30.0)
    assert store.make_room(ALICE, 60.0) is None
    assert store.get(old.id, ALICE) is not None  # exactly its age: kept
    assert store.make_room(ALICE, 61.0) is None
    assert store.get(old.id, ALICE) is None
    assert store.get(young.id, BOB) is not None
    assert store.make_room(ALICE, 91.0) is None
    assert store.get(young.id, BOB) is None
    assert len(store) == 0


async def test_a_named_streams_done_is_left_out_whichever_batch_brings_it() -> None:
    # The [DONE] after a named stream's terminal event is never sent: in the batch of the
    # terminal event, in a batch of its own after a reader sent the events before it, and
    # to a reader resumed right after the terminal event (the one case where the reader
    # has sent none of the stream's events and looks back into the stream).
    terminal = _named("response.completed", {"type": "response.completed"})
    store = StreamStore(max_total_bytes=1 << 20, max_age_s=60)
    stream = store.create(ALICE, 0.0)
    stream.format = "responses"
    stream.append(_named("response.created", {"type": "response.created"}), 0.0)
    reader = sse_events(stream, 0, heartbeat_s=5)
    assert (await reader.__anext__()).startswith(b"id: 1\nevent: response.created\n")
    stream.append(terminal, 0.0)
    assert (await reader.__anext__()).startswith(b"id: 2\nevent: response.completed\n")
    resumed = sse_events(stream, 2, heartbeat_s=5)
    waiting = asyncio.ensure_future(resumed.__anext__())
    stream.finish(0.0)
    assert [piece async for piece in reader] == []  # its end: nothing more to send
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(waiting, 5)
    together = b"".join([piece async for piece in sse_events(stream, 1, heartbeat_s=5)])
    assert together.startswith(b"id: 2\nevent: response.completed\n")
    assert b"[DONE]" not in together
    assert stream.readers == 0
    # A chat stream's [DONE] goes out after the events a reader sent, and on a resume.
    chat = store.create(ALICE, 0.0)
    chat.append(b'{"a":1}', 0.0)
    reader = sse_events(chat, 0, heartbeat_s=5)
    assert await reader.__anext__() == b'id: 1\ndata: {"a":1}\n\n'
    chat.finish(0.0)
    assert [piece async for piece in reader] == [b"id: 2\ndata: [DONE]\n\n"]
    assert [piece async for piece in sse_events(chat, 1, heartbeat_s=5)] == [
        b"id: 2\ndata: [DONE]\n\n"
    ]


async def test_an_sse_reader_attaches_at_its_first_step_and_detaches_once_on_every_end() -> None:
    # The reader's attach and detach (the resume grace period counts from the detach) and
    # its tally, on each way a response ends: never stepped, closed mid-stream, read to its
    # [DONE] then closed, cancelled while waiting, overtaken by a trim.
    store = StreamStore(max_total_bytes=8_000, max_age_s=1e9, max_owner_bytes=4_000)
    ticks = iter(range(1, 1000))

    def clock() -> float:
        return float(next(ticks))

    def fresh() -> tuple[Stream, dict[str, int]]:
        stream = store.create(ALICE, 0.0)
        stream.append(b'{"a":1}', 0.0)
        return stream, {"direct": 0, "send": 0}

    stream, tally = fresh()
    reader = sse_events(stream, 0, heartbeat_s=5, clock=clock, tally=tally)
    await reader.aclose()  # never stepped: never attached
    assert (stream.readers, stream.last_reader_at, tally) == (0, 0.0, {"direct": 0, "send": 0})
    assert [piece async for piece in reader] == []  # closed: nothing more
    assert stream.readers == 0

    stream, tally = fresh()
    reader = sse_events(stream, 0, heartbeat_s=5, clock=clock, tally=tally)
    assert await reader.__anext__() == b'id: 1\ndata: {"a":1}\n\n'
    assert stream.readers == 1
    attached_at = stream.last_reader_at
    await reader.aclose()
    assert stream.readers == 0
    assert stream.last_reader_at == attached_at + 1  # the clock read once more, to detach
    assert tally == {"direct": 0, "send": 1}
    await reader.aclose()  # once only
    assert [piece async for piece in reader] == []
    assert (stream.readers, stream.last_reader_at) == (0, attached_at + 1)
    assert tally == {"direct": 0, "send": 1}

    stream, tally = fresh()
    reader = sse_events(stream, 0, heartbeat_s=5, clock=clock, tally=tally)
    assert await reader.__anext__() == b'id: 1\ndata: {"a":1}\n\n'
    stream.finish(0.0)
    assert await reader.__anext__() == b"id: 2\ndata: [DONE]\n\n"
    assert stream.readers == 1  # the last part is out: detached when closed
    await reader.aclose()
    assert stream.readers == 0
    assert tally == {"direct": 0, "send": 2}

    stream, tally = fresh()
    reader = sse_events(stream, 0, heartbeat_s=5, clock=clock, tally=tally)
    assert await reader.__anext__() == b'id: 1\ndata: {"a":1}\n\n'
    waiting = asyncio.ensure_future(reader.__anext__())
    await asyncio.sleep(0)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert stream.readers == 0
    assert tally == {"direct": 0, "send": 1}
    await reader.aclose()
    assert stream.readers == 0
    assert tally == {"direct": 0, "send": 1}

    stream, tally = fresh()
    behind = sse_events(stream, 0, heartbeat_s=5, clock=clock, tally=tally)
    assert await behind.__anext__() == b'id: 1\ndata: {"a":1}\n\n'
    for _ in range(40):
        stream.append(b"x" * 500, 1.0)
    assert stream.trimmed > 1
    assert b"stream_history_trimmed" in await behind.__anext__()
    assert stream.readers == 1
    assert [piece async for piece in behind] == []
    assert stream.readers == 0
    assert tally == {"direct": 0, "send": 1}
