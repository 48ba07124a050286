"""The compiled per-chunk path (``router/_chunkpath.c``) against the Python path it stands in for.

Sans sockets: the compiled SSE writer writes the same bytes, counts the same events and
refuses in the same states as the Python writer over uvicorn's body writer. Over sockets: an
upstream whose every write is scripted (whole chunks, several in one read, chunks cut in
their size line, payload or trailing CRLF, two events in one chunk, events of other shapes,
a usage chunk) gives a client the same bytes through the router with the compiled path as
with the Python path alone, and the compiled path takes most reads; the reads it cuts but
hands to the relay (the first content, the usage chunk, ``[DONE]``, the body's end) give
the same bytes, usage and metrics too. The module is built by
the project's install (``pip install -e``); a missing build fails here, it is not skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import re
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import httpx
import pytest

from firstbyte.router import chunkpath
from firstbyte.router import streams as streams_module
from firstbyte.router.hosting.body_writer import uvicorn_writer
from firstbyte.router.hosting.prometheus import GapTimer, Histogram
from firstbyte.router.pipeline.relay import EventFramer, Relay
from firstbyte.router.readers import SSEFramer
from firstbyte.router.streams import EVENT_OVERHEAD_BYTES, Stream, StreamEvent, StreamStore, _Tap
from firstbyte.router.upstream_h1 import H1Connection, H1Pool, Origin
from tests.router.conftest import RouterFactory, auth
from tests.router.streamtext import sse_text
from tests.router.upstream import read_request


def test_the_compiled_path_is_built() -> None:
    # `pip install -e .` compiles it (gcc and Python's headers are on every machine it is
    # installed on here); the router would run, slower, without it: this says so.
    assert chunkpath.BUILT, "firstbyte.router._chunkpath was not built by the install"
    assert chunkpath.READ_PATH is not None
    assert chunkpath.SSE_WRITER is not None
    assert chunkpath.SSE_FRAMES is not None
    assert chunkpath.PACK_XADDS is not None
    assert chunkpath.MIRROR is not None
    assert chunkpath.CONN_READER is not None
    assert chunkpath.RECEIVE_NOW is not None
    assert chunkpath.ELAPSED_MS is not None
    assert chunkpath.HUNDREDTHS_TEXT is not None


# -- the SSE writer, sans sockets -------------------------------------------------------


class _Transport:
    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.closing = False
        self.fail = False

    def write(self, data: bytes) -> None:
        if self.fail:
            raise RuntimeError("transport gone")
        self.parts.append(data)

    def is_closing(self) -> bool:
        return self.closing


class _Flow:
    write_paused = False


class _Cycle:
    """The fields of uvicorn's request cycle that both writers read."""

    def __init__(self) -> None:
        self.transport = _Transport()
        self.flow = _Flow()
        self.disconnected = False
        self.chunked_encoding: bool | None = True
        self.response_complete = False


def _writers() -> list[tuple[_Cycle, SSEFramer, Callable[[list[StreamEvent]], bool]]]:
    """A compiled and a Python writer, each on its own cycle."""
    out = []
    for compiled in (True, False):
        cycle, framer = _Cycle(), SSEFramer()
        write = uvicorn_writer(cycle)
        if not compiled:
            del write.cycle  # type: ignore[attr-defined]  # what the Python path gets
        live = framer.writer(write)
        assert (type(live).__name__ == "SSEWriter") is compiled
        out.append((cycle, framer, live))
    return out


BATCHES = [
    [StreamEvent(1, b'{"a":1}')],
    [StreamEvent(2, b'{"b":2}'), StreamEvent(3, b'{"c":3}'), StreamEvent(4, b"")],
    [StreamEvent(12345678901, b"x" * 5000)],
    [StreamEvent(5, b"two\nlines")],  # a line end: the Python framer's
    [StreamEvent(6, b'{"d":4}'), StreamEvent(7, b"event: done\ndata: {}")],  # a named one
    [StreamEvent(8, b"carriage\rreturn")],
]


def test_the_compiled_writer_writes_what_the_python_writer_writes() -> None:
    pair = _writers()
    results: list[list[bool]] = [[], []]
    for batch in BATCHES:
        for index, (_, _, live) in enumerate(pair):
            results[index].append(live(batch))
    (compiled, framer_c, _), (python, framer_p, _) = pair
    assert results[0] == results[1] == [True] * len(BATCHES)
    assert compiled.transport.parts == python.transport.parts
    assert framer_c.direct == framer_p.direct == sum(map(len, BATCHES))
    assert framer_c.named == framer_p.named


def test_the_compiled_frames_are_the_python_framers(monkeypatch: pytest.MonkeyPatch) -> None:
    # A reader's batch from the store (SSEFramer.frame): the same bytes and the same framer
    # state with sse_frames as with encode_event alone, whatever the batch holds.
    batches = [
        *BATCHES,
        [StreamEvent(9, b"[DONE]")],
        [StreamEvent(0, b"zero"), StreamEvent(10, "text")],  # not bytes: Python's
        [StreamEvent(-1, b"{}")],  # not a sequence number C writes: Python's
        [StreamEvent(n, b"e" * n) for n in range(1, 300)],  # more than C keeps on its stack
    ]
    framed: list[list[bytes]] = []
    for frames in (chunkpath.SSE_FRAMES, None):
        monkeypatch.setattr(chunkpath, "SSE_FRAMES", frames)
        framer = SSEFramer()
        framed.append([framer.frame(batch) for batch in batches])
        assert not framer.named
    assert framed[0] == framed[1]
    assert framed[0][0] == b'id: 1\ndata: {"a":1}\n\n'


@pytest.mark.parametrize(
    "state",
    ["paused", "disconnected", "not_chunked", "complete", "closing", "write_fails"],
)
def test_the_compiled_writer_refuses_when_the_python_writer_does(state: str) -> None:
    pair = _writers()
    for cycle, _, _ in pair:
        if state == "paused":
            cycle.flow.write_paused = True
        elif state == "disconnected":
            cycle.disconnected = True
        elif state == "not_chunked":
            cycle.chunked_encoding = None
        elif state == "complete":
            cycle.response_complete = True
        elif state == "closing":
            cycle.transport.closing = True
        else:
            cycle.transport.fail = True
    batch = [StreamEvent(1, b'{"a":1}')]
    assert [live(batch) for _, _, live in pair] == [False, False]
    assert [framer.direct for _, framer, _ in pair] == [0, 0]
    assert [cycle.transport.parts for cycle, _, _ in pair] == [[], []]


# -- the read path's store and metric, sans sockets ---------------------------------------


class _Conn:
    _last_read = 0.0


class _Framer:
    idle = True


class _Relay:
    """What the read path reads of a relay past its first content, cutting reads itself."""

    def __init__(self) -> None:
        self._fast = True
        self._framer = _Framer()
        self.appended = 0


OWNER = b"o" * 32


class _Side:
    """One stream in its own store, with a direct reader, a mirror and the ITL histogram:
    fed by the compiled read path or by what it stands in for (Stream.add, GapTimer.tick)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, **bounds: int) -> None:
        self.store = StreamStore(max_age_s=60, **{"max_total_bytes": 10**9, **bounds})
        self.stream = self.store.create(OWNER, 0.0)
        self.mirrored: list[StreamEvent] = []
        self.stream.mirror = lambda _stream, event: self.mirrored.append(event)
        self.written: list[list[StreamEvent]] = []
        self.refuse_from = 10**9
        self.tap = _Tap(self._write, 0, loop.create_future(), 0.0, loop)
        self.stream._taps.append(self.tap)
        self.waiter = loop.create_future()
        self.stream._waiters.append(self.waiter)
        self.gaps = GapTimer(Histogram([0.001, 0.01, 0.1]))
        self.relay = _Relay()
        self.outcome = loop.create_future()
        self.path = chunkpath.READ_PATH(
            _Conn(), self.outcome, self.relay, self.stream, StreamEvent,
            EVENT_OVERHEAD_BYTES, self.gaps, lambda: 1.0,
        )

    def _write(self, events: list[StreamEvent]) -> bool:
        if events[0].seq >= self.refuse_from:
            return False
        self.written.append(list(events))
        return True

    def feed_python(self, payloads: list[bytes], now: float) -> None:
        with _python_store():
            self.stream.add(payloads, now)
        self.gaps.tick(now)

    def state(self) -> tuple[object, ...]:
        owner = self.store._owners.get(OWNER)
        hist = self.gaps.hist
        return (
            self.stream.events, self.stream.trimmed, self.stream.size_bytes,
            self.store.total_bytes, None if owner is None else owner.bytes,
            self.store.trimmed_events, self.store.evictions, self.mirrored, self.written,
            self.tap.seq, self.tap.released, self.stream._taps == [self.tap],
            self.waiter.done(), hist.count, sum(hist.counts),
        )


@contextlib.contextmanager
def _python_store() -> Iterator[None]:
    """Stream.add and Stream.append as their Python defines them, without the C that does
    their work where it can (streams._compiled_add)."""
    compiled, streams_module._compiled_add = streams_module._compiled_add, None
    try:
        yield
    finally:
        streams_module._compiled_add = compiled


def _reads(count: int, size: int = 40) -> list[list[bytes]]:
    """The payloads of ``count`` reads: one event each, and three in every fifth."""
    out = []
    for n in range(count):
        events = 3 if n % 5 == 4 else 1
        out.append([b'{"n":%d,"p":"%b"}' % (n * 10 + i, b"x" * size) for i in range(events)])
    return out


def _as_read(payloads: list[bytes]) -> bytes:
    return b"".join(_chunk(b"data: %b\n\n" % payload) for payload in payloads)


@pytest.mark.parametrize(
    "case", ["plain", "refused", "over_share", "two_owners", "finished"]
)
def test_the_compiled_read_path_adds_as_stream_add_does(case: str) -> None:
    # Same reads on both sides; the compiled side's every read is taken. Where Stream.add
    # would trim or reclaim (an owner over its share, a full store), the compiled path
    # hands the read to Stream.add itself: the end state is the same either way.
    loop = asyncio.new_event_loop()
    try:
        bounds = {
            "over_share": {"max_total_bytes": 1_500, "max_owner_bytes": 600},
            "two_owners": {"max_total_bytes": 2_500, "max_owner_bytes": 1_500},
        }.get(case, {})
        compiled, python = _Side(loop, **bounds), _Side(loop, **bounds)
        for side in (compiled, python):
            if case == "refused":
                side.refuse_from = 7
            if case == "finished":
                side.stream.finish(0.5)
            if case == "two_owners":  # another owner's stream, within its share
                other = side.store.create(b"p" * 32, 0.0)
                other.add([b"y" * 900], 0.0)
        taken = []
        for n, payloads in enumerate(_reads(12)):
            now = 1.0 + n * 0.004
            taken.append(compiled.path(_as_read(payloads)))
            python.feed_python(payloads, now)
        assert taken == [True] * 12
        assert compiled.path.reads == 12
        assert compiled.relay.appended == compiled.path.events == sum(map(len, _reads(12)))
        assert compiled.state() == python.state()
        if case == "plain":
            assert compiled.written
            assert compiled.mirrored
            assert compiled.waiter.done()
            assert compiled.gaps.hist.count == 11
        if case == "refused":
            assert compiled.tap.released
            assert compiled.stream._taps == []
        if case in ("over_share", "two_owners"):  # the store went full: trimmed to share
            assert compiled.stream.trimmed > 0
            assert compiled.store.total_bytes <= compiled.store.max_total_bytes
        if case == "finished":
            assert compiled.stream.events[-1].data == b"[DONE]"
            assert [event.data for event in compiled.mirrored] == [b"[DONE]"]  # nothing after
    finally:
        loop.close()


@pytest.mark.parametrize(
    "case", ["plain", "refused", "over_share", "two_owners", "finished"]
)
def test_stream_add_and_append_in_c_do_what_their_python_does(
    case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Stream.add and Stream.append called from Python (the events the producer relays
    # itself: a stream's role chunk, its first content) do their work in C where they can:
    # the same store, readers, mirror and wake-ups as their Python alone.
    loop = asyncio.new_event_loop()
    try:
        bounds = {
            "over_share": {"max_total_bytes": 1_500, "max_owner_bytes": 600},
            "two_owners": {"max_total_bytes": 2_500, "max_owner_bytes": 1_500},
        }.get(case, {})
        compiled, python = _Side(loop, **bounds), _Side(loop, **bounds)
        in_c: list[StreamEvent] = []
        adder = streams_module._compiled_add
        assert adder is not None

        def counted(stream: Stream, payloads: list[bytes], read_at: float | None) -> Any:
            last = adder(stream, payloads, read_at)
            if last is not None:
                in_c.append(last)
            return last

        monkeypatch.setattr(streams_module, "_compiled_add", counted)
        for side in (compiled, python):
            if case == "refused":
                side.refuse_from = 7
            if case == "finished":
                side.stream.finish(0.5)
            if case == "two_owners":  # another owner's stream, within its share
                other = side.store.create(b"p" * 32, 0.0)
                other.add([b"y" * 900], 0.0)
        in_c.clear()
        appended: list[list[StreamEvent | None]] = [[], []]
        for n, payloads in enumerate(_reads(12)):
            now = 1.0 + n * 0.004
            for index, side in enumerate((compiled, python)):
                with contextlib.nullcontext() if side is compiled else _python_store():
                    if len(payloads) == 1:
                        appended[index].append(side.stream.append(payloads[0], now))
                    else:
                        side.stream.add(payloads, now)
        assert appended[0] == appended[1]
        state = compiled.state(), python.state()
        assert state[0][:-2] == state[1][:-2]  # but the ITL histogram, not fed here
        if case in ("plain", "refused"):
            assert len(in_c) == 12  # every one in C
            assert compiled.written
            assert compiled.waiter.done()
        if case == "finished":
            assert in_c == []
            assert appended[0] == [None] * len(appended[0])
        if case == "over_share":  # the store went full: Python trims
            assert compiled.stream.trimmed > 0
            assert len(in_c) < 12
    finally:
        loop.close()


@pytest.mark.parametrize("events", [3, 100])
def test_stream_add_in_c_writes_its_readers_as_its_python_does(events: int) -> None:
    # A batch for a direct reader (a compiled SSE writer) and for a Python writer, more
    # events than the C keeps on its stack too: the same frames, store and readers.
    loop = asyncio.new_event_loop()
    try:
        sides, frames = [], []
        for compiled in (True, False):
            side, (cycle, framer, live) = _Side(loop), _writers()[0]
            side.stream._taps.append(_Tap(live, 0, loop.create_future(), 0.0, loop))
            payloads = [b'{"n":%d}' % n for n in range(events)]
            with contextlib.nullcontext() if compiled else _python_store():
                side.stream.add(payloads, 1.0)
                side.stream.add([b"two\nlines", b"{}"], 1.5)  # the Python framer's
            sides.append(side)
            frames.append((cycle.transport.parts, framer.direct))
        assert sides[0].state() == sides[1].state()
        assert frames[0] == frames[1]
        assert frames[0][1] == events + 2
        assert len(sides[0].written) == 2
    finally:
        loop.close()


def test_a_read_path_event_made_with_other_data_is_framed_by_what_it_holds() -> None:
    # The read path's direct writer does not look for line ends in a read's payloads (cut
    # with none), but only where the event holds that same payload: an event type that
    # makes other data of it has it framed by the Python framer, as SSEWriter frames it.
    def lined(seq: int, data: bytes) -> StreamEvent:
        return StreamEvent(seq, data + b"\nmore")

    loop = asyncio.new_event_loop()
    try:
        parts = []
        for event_type in (StreamEvent, lined):
            side, (cycle, _, live) = _Side(loop), _writers()[0]
            side.stream._taps[:] = [_Tap(live, 0, loop.create_future(), 0.0, loop)]
            side.path = chunkpath.READ_PATH(
                _Conn(), side.outcome, side.relay, side.stream, event_type,
                EVENT_OVERHEAD_BYTES, side.gaps, lambda: 1.0,
            )
            assert side.path(_as_read([b'{"n":1}', b'{"n":2}'])) is True
            expected = SSEFramer().frame(side.stream.events)
            assert b"".join(cycle.transport.parts).endswith(expected + b"\r\n")
            parts.append(cycle.transport.parts)
        assert parts[0] != parts[1]
    finally:
        loop.close()


def _extend_by_appends(stream: Stream, payloads: list[bytes], now: float) -> None:
    """Stream.extend as it was defined: append each, the direct readers held meanwhile and
    handed the batch after."""
    taps, stream._taps = stream._taps, []
    added = []
    try:
        for data in payloads:
            event = stream.append(data, now)
            if event is None:
                break
            added.append(event)
    finally:
        stream._taps = taps
    if added and taps:
        stream._feed_taps(added)


@pytest.mark.parametrize("case", ["plain", "refused", "over_share", "finished", "done_inside"])
def test_stream_extend_does_what_its_appends_did(case: str) -> None:
    # Stream.extend of events that do not finish the stream is Stream.add's work (in C where
    # it can): the same store, readers, mirror and wake-ups as an append each.
    loop = asyncio.new_event_loop()
    try:
        bounds = {"over_share": {"max_total_bytes": 1_500, "max_owner_bytes": 600}}.get(case, {})
        extended, appended = _Side(loop, **bounds), _Side(loop, **bounds)
        for side in (extended, appended):
            if case == "refused":
                side.refuse_from = 7
            if case == "finished":
                side.stream.finish(0.5)
        reads = [[b"[DONE]" if case == "done_inside" and n == 9 and i == 1 else payload
                  for i, payload in enumerate(payloads)] for n, payloads in enumerate(_reads(12))]
        for n, payloads in enumerate(reads):
            now = 1.0 + n * 0.004
            extended.stream.extend(payloads, now)
            with _python_store():
                _extend_by_appends(appended.stream, payloads, now)
        assert extended.state()[:-2] == appended.state()[:-2]
        if case == "done_inside":
            assert extended.stream.done
    finally:
        loop.close()


def test_a_key_over_its_share_in_a_store_with_room_is_added_in_c(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # One key holding most of the store stays over its share (its quarter of the store by
    # default) while the store has room: its reads are added in C, and it is marked for
    # trimming as Stream.add marks it. Before, every such read went to Stream.add.
    loop = asyncio.new_event_loop()
    try:
        compiled, python = _Side(loop, max_owner_bytes=600), _Side(loop, max_owner_bytes=600)
        calls: list[Stream] = []
        add = Stream.add

        def counted(stream: Stream, payloads: list[bytes], read_at: float) -> None:
            calls.append(stream)
            add(stream, payloads, read_at)

        monkeypatch.setattr(Stream, "add", counted)
        for n, payloads in enumerate(_reads(12)):
            now = 1.0 + n * 0.004
            assert compiled.path(_as_read(payloads))
            python.feed_python(payloads, now)
        assert compiled.stream not in calls
        assert calls == [python.stream] * 12
        assert compiled.store.owner_bytes(OWNER) > compiled.store.max_owner_bytes
        assert list(compiled.store._over_share) == [OWNER]
        assert compiled.state() == python.state()
        assert compiled.stream.trimmed == 0  # the store has room: nothing is trimmed
        # Once the store is at its bound, the read goes to Stream.add, which trims.
        compiled.store.max_total_bytes = python.store.max_total_bytes = 1_500
        for payloads in _reads(3):
            assert compiled.path(_as_read(payloads))
            python.feed_python(payloads, 2.0)
        assert compiled.stream in calls
        assert compiled.stream.trimmed > 0
        assert compiled.state() == python.state()
    finally:
        loop.close()


def test_the_per_chunk_objects_keep_their_fields_in_slots() -> None:
    # The compiled path reads and writes these at their slots' offsets (any other object
    # through getattr: the same result, ~200 instructions an attribute more).
    loop = asyncio.new_event_loop()
    try:
        side = _Side(loop)
        objects = [side.stream, side.store, side.store._owners[OWNER], side.tap, side.gaps,
                   side.gaps.hist, Relay(), EventFramer(), SSEFramer()]
        conn = H1Connection(H1Pool(max_connections=1, keepalive_expiry_s=5,
                                   connect_timeout_s=1, read_timeout_s=60),
                            Origin("http", "127.0.0.1", 1))
        objects.append(conn)
        assert [type(o).__name__ for o in objects if hasattr(o, "__dict__")] == []
    finally:
        loop.close()


def test_a_method_the_compiled_path_calls_is_the_one_a_call_by_name_finds() -> None:
    # The compiled path calls its attempt's done (and its transport's write and is_closing)
    # as the function the type holds, found once; an instance attribute of that name, set
    # after, is still what it calls, as a call by name would.
    loop = asyncio.new_event_loop()
    try:
        side = _Side(loop)
        read = _as_read([b'{"n":1}'])
        assert side.path(read) is True
        side.outcome.done = lambda: True  # type: ignore[method-assign]
        assert side.path(read) is False  # decided: the Python path's
        del side.outcome.done
        assert side.path(read) is True
        side.outcome.set_result(None)
        assert side.path(read) is False
        assert side.path.reads == 2
    finally:
        loop.close()


def test_a_count_the_compiled_path_adds_to_is_changed_in_place_only_where_none_holds_it() -> None:
    # The ints and floats a read adds to are changed where they lie if their holder alone
    # has them: one held anywhere else keeps its value, and the holder gets a new one.
    loop = asyncio.new_event_loop()
    try:
        side = _Side(loop)
        side.relay.appended = 1000  # past the ints CPython keeps made
        hist = side.gaps.hist
        for n in range(3):
            assert side.path(_as_read([b'{"n":%d}' % n])) is True
        where = id(side.stream.size_bytes), id(hist.total)
        assert side.path(_as_read([b'{"n":3}'])) is True
        if sys.version_info[:2] == (3, 11):  # the int layout it changes in place
            assert (id(side.stream.size_bytes), id(hist.total)) == where
        held = [side.relay.appended, side.stream.size_bytes, side.store.total_bytes,
                side.store._owners[OWNER].bytes, hist.total, *hist.counts]
        seen = [repr(value) for value in held]
        for n in range(4, 7):
            assert side.path(_as_read([b'{"n":%d}' % n])) is True
        assert [repr(value) for value in held] == seen
        assert (side.relay.appended, hist.count, sum(hist.counts)) == (1007, 6, 6)
        assert side.stream.size_bytes == side.store.total_bytes == 7 * (7 + EVENT_OVERHEAD_BYTES)
        assert side.store._owners[OWNER].bytes == side.store.total_bytes
        assert hist.total > held[4]
    finally:
        loop.close()


# -- the Redis writer's packing, sans sockets ---------------------------------------------


def _writer_batch() -> list[tuple[Stream, StreamEvent | None]]:
    """A write's queue with every kind of item, more than a script call's operations."""
    from firstbyte.router.shared.streams import _TRIM

    streams = [Stream(f"id-{n}", b"owner", 0.0, subject="user-7" if n == 1 else None,
                      format="completions" if n == 2 else "chat") for n in range(5)]
    batch: list[tuple[Stream, StreamEvent | None]] = [(s, None) for s in streams]
    for seq in range(1, 140):
        for n, stream in enumerate(streams):
            batch.append((stream, StreamEvent(seq, b'{"n":%d,"seq":%d}' % (n, seq))))
            if seq == 70 and n == 3:
                stream.trimmed = 12
                batch.append((stream, _TRIM))
    streams[0].upstream_ttft_ms = 41.25  # [DONE] with its TTFT, and without
    batch += [(streams[0], StreamEvent(140, b"[DONE]")), (streams[4], StreamEvent(140, b"[DONE]")),
              (streams[1], StreamEvent(2**70, b"beyond 64 bits")),  # the loop's to pack
              (streams[2], StreamEvent(141, bytearray(b"not bytes"))),  # type: ignore[arg-type]
              (streams[3], StreamEvent(140, b""))]
    return batch


def test_the_compiled_packer_packs_what_the_python_loop_packs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The script calls go to Redis as packed here: the same bytes, split into the same
    # calls, with the same stream behind each operation (a refused XADD fences it).
    from firstbyte.router.shared import streams as shared_streams
    from firstbyte.router.shared.keys import Keys

    assert chunkpath.PACK_XADDS is not None
    batch = _writer_batch()
    packed = {}
    for path, packer in (("compiled", chunkpath.PACK_XADDS), ("python", None)):
        monkeypatch.setattr(shared_streams, "PACK_XADDS", packer)
        writer = shared_streams._Writer(None, Keys("fb:"), "proc-1", 60_000, 1000)  # type: ignore[arg-type]
        packed[path] = [writer._pack(batch), writer._pack(batch)]  # keys made, then kept
        assert sorted(writer._names) == [f"id-{n}" for n in range(5)]
    (first, producers), again = packed["compiled"]
    assert packed["python"] == packed["compiled"]
    assert again == (first, producers)
    assert len(producers) == 3
    assert [len(ops) for ops in producers] == [256, 256, 196]
    assert first.count(b"$4\r\nEVAL\r\n") == 3
    assert b"$1\r\nX\r\n$3\r\n1-0\r\n" in first
    assert b"$1\r\nx\r\n$4\r\n63-0\r\n" in first
    assert b"$1\r\ny\r\n$4\r\n64-0\r\n" in first  # every 64th bounds the stream's length
    assert first.count(b"$1\r\ny\r\n") == 5 * 2 + 1  # 64 and 128 of each stream, 2**70
    assert b"$1\r\nt\r\n$6\r\n41.250\r\n" in first
    assert b"$1\r\ny\r\n$24\r\n1180591620717411303424-0\r\n" in first


async def test_the_compiled_mirror_queues_and_wakes_as_push_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A shared stream's every event goes through its mirror: queued in order, in the list the
    # writer's next write takes, and the writer woken by the first one only.
    from firstbyte.router.shared import streams as shared_streams
    from firstbyte.router.shared.keys import Keys

    assert chunkpath.MIRROR is not None
    seen = {}
    for path, mirror in (("compiled", chunkpath.MIRROR), ("python", None)):
        monkeypatch.setattr(shared_streams, "MIRROR", mirror)
        writer = shared_streams._Writer(None, Keys("fb:"), "proc-1", 60_000, 1000)  # type: ignore[arg-type]
        assert (type(writer.mirror).__name__ == "Mirror") is (mirror is not None)
        wakes = []
        for round_ in range(2):
            writer._idle.set()
            writer._wake = asyncio.get_running_loop().create_future()
            stream = Stream(f"s{round_}", b"owner", 0.0, mirror=writer.mirror)
            stream.append(b"one", 0.0)
            wakes.append((writer._wake.done(), writer._idle.is_set()))
            writer._wake = asyncio.get_running_loop().create_future()
            stream.append(b"two", 0.0)  # queued behind the first: no wake-up
            wakes.append((writer._wake.done(), writer._idle.is_set()))
            if round_ == 0:  # the write takes the queue; the next event wakes it again
                batch = writer._queue.copy()
                writer._queue.clear()
        seen[path] = (wakes, [(s.id, e.seq, e.data) for s, e in batch],  # type: ignore[union-attr]
                      [(s.id, e.seq) for s, e in writer._queue])  # type: ignore[union-attr]
    assert seen["compiled"] == seen["python"]
    assert seen["compiled"] == (
        [(True, False), (False, False), (True, False), (False, False)],
        [("s0", 1, b"one"), ("s0", 2, b"two")], [("s1", 1), ("s1", 2)])


def test_the_compiled_packer_stops_where_the_loop_must_pack() -> None:
    from firstbyte.router.shared.streams import _TRIM

    assert chunkpath.PACK_XADDS is not None
    stream = Stream("s", b"owner", 0.0)
    names: dict[str, bytes] = {}
    made: list[str] = []

    def name_of(stream_id: str) -> bytes:
        made.append(stream_id)
        return b"$3\r\nk:s\r\n"

    plain = [(stream, StreamEvent(seq, b"d%d" % seq)) for seq in (1, 2, 3)]
    pack = chunkpath.PACK_XADDS
    for stop in (None, _TRIM, StreamEvent(4, b"[DONE]")):
        end, keys, values, ops = pack([*plain, (stream, stop)], 0, 256, names, name_of,
                                      _TRIM, b"[DONE]", 64)
        assert (end, keys, ops) == (3, b"$3\r\nk:s\r\n" * 3, [stream] * 3)
        assert values == (b"$1\r\nX\r\n$3\r\n1-0\r\n$2\r\nd1\r\n"
                          b"$1\r\nx\r\n$3\r\n2-0\r\n$2\r\nd2\r\n"
                          b"$1\r\nx\r\n$3\r\n3-0\r\n$2\r\nd3\r\n")
    assert made == ["s"]  # made once, then kept in `names`
    assert pack(plain, 1, 1, names, name_of, _TRIM, b"[DONE]", 64)[0] == 2  # at most `limit`
    assert pack(plain, 3, 9, names, name_of, _TRIM, b"[DONE]", 64)[1:] == (b"", b"", [])
    assert pack(plain, 0, 9, names, name_of, _TRIM, b"[DONE]", 2)[2] == (  # every 2nd bounds
        b"$1\r\nX\r\n$3\r\n1-0\r\n$2\r\nd1\r\n$1\r\ny\r\n$3\r\n2-0\r\n$2\r\nd2\r\n"
        b"$1\r\nx\r\n$3\r\n3-0\r\n$2\r\nd3\r\n")
    with pytest.raises(ValueError, match="every must be at least 1"):
        pack(plain, 0, 9, names, name_of, _TRIM, b"[DONE]", 0)
    with pytest.raises(TypeError, match="must return bytes"):
        pack(plain, 0, 9, {}, lambda stream_id: "str", _TRIM, b"[DONE]", 64)
    with pytest.raises(ZeroDivisionError):  # name_of's own error reaches the writer
        pack(plain, 0, 9, {}, lambda stream_id: 1 / 0, _TRIM, b"[DONE]", 64)


# -- the read path, over sockets ----------------------------------------------------------


def _event(n: int) -> bytes:
    delta = {"content": f"w{n} "}
    chunk = {"id": "c", "object": "chat.completion.chunk", "choices": [{"index": 0,
             "delta": delta, "finish_reason": None}]}
    return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


ROLE = _event(-1).replace(b'"content":"w-1 "', b'"role":"assistant","content":""')
USAGE = (
    b'data: {"id":"c","object":"chat.completion.chunk","choices":[],'
    b'"usage":{"prompt_tokens":3,"completion_tokens":40,"total_tokens":43}}\n\n'
)


def _script() -> list[bytes]:
    """The upstream's writes, one per read where the router keeps up (5 ms apart). The
    events of other shapes come last: the relay's framer hands the rest of a stream to the
    full decoder after one, and the fast paths (Python's and the compiled) step aside."""
    n = iter(range(1000))

    def one() -> bytes:
        return _chunk(_event(next(n)))

    writes = [_chunk(ROLE), one(), one(), one()]
    writes += [one() + one() + one()]  # several chunks in one read
    cut = one()
    writes += [cut[:20], cut[20:]]  # cut in the payload
    cut = one()
    end = cut.index(b"\r\n") + 2
    writes += [cut[:end], cut[end:]]  # cut after the size line
    cut = one()
    writes += [cut[:-2], cut[-2:], one()]  # cut before the chunk's CRLF
    cut = one()
    writes += [one() + cut[:1], cut[1:], one()]  # a read ends in the next size line
    writes += [_chunk(_event(next(n)) + _event(next(n))), one()]  # two events in one chunk
    writes += [_chunk(b'data: {"x":{"y":1}}\n\n'), one()]  # ends with }} mid-stream
    writes += [one() for _ in range(20)]
    writes += [_chunk(b": a comment\n" + _event(next(n))), one()]  # another shape of event
    writes += [_chunk(b'data: {"id":"c",\ndata: "choices":[]}\n\n'), one()]  # two lines
    writes += [_chunk(_event(next(n)).replace(b"\n", b"\r\n")), one()]  # CRLF line ends
    writes += [_chunk(USAGE), _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"]
    return writes


@contextlib.asynccontextmanager
async def _scripted_upstream(
    writes: list[bytes], gap_s: float = 0.005, *, with_head: bool = False
) -> AsyncIterator[str]:
    """``with_head``: the first write goes out with the response head, in one write."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while True:
                request = await read_request(reader)
                if request.startswith(b"GET /v1/models "):
                    listing = json.dumps({"data": [{"id": "test-model"}]}).encode()
                    writer.write(
                        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                        b"content-length: %d\r\n\r\n%b" % (len(listing), listing)
                    )
                    continue
                if not request.startswith(b"POST /v1/chat/completions "):
                    writer.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
                    continue
                head = (
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                    b"transfer-encoding: chunked\r\n\r\n"
                )
                if with_head:
                    writer.write(head + writes[0])
                else:
                    writer.write(head)
                for data in writes[1:] if with_head else writes:
                    await asyncio.sleep(gap_s)
                    writer.write(data)
                    await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()


async def _relayed(
    start_router: RouterFactory,
    writes: list[bytes],
    gap_s: float = 0.005,
    *,
    usage: bool = False,
    with_head: bool = False,
    metrics: list[str] | None = None,
    prefixes: tuple[str, ...] = (
        "firstbyte_router_requests", "firstbyte_key_", "firstbyte_route_",
        "firstbyte_router_ttft_seconds_count",
    ),
) -> bytes:
    """The client's body; ``usage``: the client asks for the usage chunk; ``metrics``: gets
    the metrics page's samples after the stream (those of ``prefixes``: by default all of
    the request's but which path the reads took)."""
    body: dict[str, Any] = {"model": "test-model", "stream": True,
                            "messages": [{"role": "user", "content": "hi"}]}
    if usage:
        body["stream_options"] = {"include_usage": True}
    async with (
        _scripted_upstream(writes, gap_s, with_head=with_head) as url,
        start_router([url], tls=False) as router,
        httpx.AsyncClient(timeout=30) as client,
    ):
        response = await client.post(
            router.base_url + "/v1/chat/completions", json=body, headers=auth()
        )
        if metrics is not None:
            page = (await client.get(router.base_url + "/metrics", headers=auth())).text
            metrics += [
                # the backend: its port changes from one upstream to the next
                re.sub(r'backend="[^"]*"', "", line)
                for line in page.splitlines()
                # times' buckets and sums move from run to run: their counts do not
                if line.startswith(prefixes) and "_bucket{" not in line and "_sum" not in line
            ]
    assert response.status_code == 200, response.text
    return response.content


async def test_a_scripted_stream_reaches_the_client_the_same_on_both_paths(
    start_router: RouterFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    writes = _script()
    taken: list[bool] = []
    written: list[int] = []
    real_read, real_writer = chunkpath.READ_PATH, chunkpath.SSE_WRITER

    class CountingRead:
        def __init__(self, *args: Any) -> None:
            self.path = real_read(*args)

        def __call__(self, data: bytes) -> bool:
            ok: bool = self.path(data)
            taken.append(ok)
            return ok

        @property
        def reads(self) -> int:
            return int(self.path.reads)

        @property
        def events(self) -> int:
            return int(self.path.events)

    def counting_writer(*args: Any) -> Callable[[list[StreamEvent]], bool]:
        write = real_writer(*args)

        def live(events: list[StreamEvent]) -> bool:
            written.append(len(events))
            ok: bool = write(events)
            return ok

        return live

    monkeypatch.setattr(chunkpath, "READ_PATH", CountingRead)
    monkeypatch.setattr(chunkpath, "SSE_WRITER", counting_writer)
    compiled = await _relayed(start_router, writes)
    monkeypatch.setattr(chunkpath, "READ_PATH", None)
    monkeypatch.setattr(chunkpath, "SSE_WRITER", None)
    python = await _relayed(start_router, writes)

    assert compiled == python
    text, ids = sse_text(compiled)
    assert ids == [str(i) for i in range(1, len(ids) + 1)]
    assert text.startswith("w0 w1 w2 w3 ")
    assert "w30 " in text
    assert b'"usage"' not in compiled  # the client did not ask for it: dropped on both
    # The compiled path took the plain reads and left the others to the parser; the
    # compiled writer wrote what was taken.
    assert sum(taken) >= 20, taken
    assert taken.count(False) >= 5, taken
    assert sum(written) >= sum(taken)


def _made_read_paths(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The compiled read paths the router makes from now on (one per streamed answer),
    listed as they are made."""
    paths: list[Any] = []
    real_read = chunkpath.READ_PATH

    def counting(*args: Any) -> Any:
        path = real_read(*args)
        paths.append(path)
        return path

    monkeypatch.setattr(chunkpath, "READ_PATH", counting)
    return paths


async def test_every_token_after_the_first_goes_the_compiled_way(
    start_router: RouterFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The read with the first content goes through the relay's actions (its first-token
    # hooks, the response head); the compiled path is offered before it, so the second
    # token's read is taken in C too, not left to the Python fast path (however the reads
    # come: a token's read that waited for the next one is taken with it).
    paths = _made_read_paths(monkeypatch)
    tokens = [_chunk(_event(n)) for n in range(3)]
    writes = [_chunk(ROLE), *tokens, _chunk(USAGE), _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"]
    reads: list[str] = []
    body = await _relayed(
        start_router, writes, gap_s=0.05, metrics=reads,
        prefixes=("firstbyte_router_relay_reads_total",),
    )
    assert sse_text(body)[0] == "w0 w1 w2 "
    assert len(paths) == 1
    assert paths[0].events >= 1  # w2's read, and w1's unless it came with w0
    assert 'firstbyte_router_relay_reads_total{path="fast"} 0' in reads, reads


_DONE_END = _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"


@pytest.mark.parametrize("with_head", [False, True])
async def test_the_first_event_goes_the_compiled_way_with_its_head_or_after_it(
    start_router: RouterFactory, monkeypatch: pytest.MonkeyPatch, with_head: bool
) -> None:
    # The role chunk's read, whether it came with the response head (the parser reads the
    # head alone, the rest is offered) or after it (the head's end is a chunk boundary),
    # is cut in C: the framer is idle at the stream's start. The client and the metrics are
    # as the Python path alone has them.
    paths = _made_read_paths(monkeypatch)
    writes = [_chunk(ROLE), _chunk(_event(0)), _chunk(USAGE) + _DONE_END]
    seen: dict[str, list[str]] = {"compiled": [], "python": []}
    compiled = await _relayed(
        start_router, writes, 0.05, with_head=with_head, metrics=seen["compiled"]
    )
    assert len(paths) == 1
    assert paths[0].handed == 3  # the role chunk's read, the first content's, the end's
    monkeypatch.setattr(chunkpath, "READ_PATH", None)
    python = await _relayed(
        start_router, writes, 0.05, with_head=with_head, metrics=seen["python"]
    )
    assert compiled == python
    assert seen["compiled"] == seen["python"]
    assert sse_text(compiled)[0] == "w0 "


@pytest.mark.parametrize(
    ("case", "writes"),
    [
        ("usage, [DONE] and the end together",
         [_chunk(ROLE), _chunk(_event(0)), _chunk(_event(1)), _chunk(USAGE) + _DONE_END]),
        ("the first content with the end",
         [_chunk(ROLE), _chunk(_event(0)) + _chunk(USAGE) + _DONE_END]),
        ("a token with the usage",
         [_chunk(ROLE), _chunk(_event(0)), _chunk(_event(1)) + _chunk(USAGE), _DONE_END]),
        ("[DONE], then the end alone",
         [_chunk(ROLE), _chunk(_event(0)), _chunk(USAGE), _chunk(b"data: [DONE]\n\n"),
          b"0\r\n\r\n"]),
        ("the end without [DONE]",
         [_chunk(ROLE), _chunk(_event(0)), _chunk(_event(1)) + b"0\r\n\r\n"]),
        ("several events a chunk, [DONE] with the usage (the sim's shape)",
         [_chunk(ROLE), _chunk(_event(0)), _chunk(_event(1) + _event(2)),
          _chunk(_event(3) + USAGE + b"data: [DONE]\n\n") + b"0\r\n\r\n"]),
        ("an event past the [DONE]",
         [_chunk(ROLE), _chunk(_event(0)), _DONE_END[:-5] + _chunk(_event(1)) + b"0\r\n\r\n"]),
    ],
)
@pytest.mark.parametrize("usage", [False, True])
async def test_reads_cut_in_c_but_not_taken_are_relayed_as_the_python_path_relays_them(
    start_router: RouterFactory,
    monkeypatch: pytest.MonkeyPatch,
    case: str,
    writes: list[bytes],
    usage: bool,
) -> None:
    # A read of whole chunks of one-line events that the compiled path does not take on its
    # own (the first content, a usage chunk, [DONE], the body's end) is cut in C and handed
    # to the producer's on_events: the client, the usage and the metrics are as the Python
    # path alone has them.
    paths = _made_read_paths(monkeypatch)
    seen: dict[str, list[str]] = {"compiled": [], "python": []}
    compiled = await _relayed(start_router, writes, 0.05, usage=usage, metrics=seen["compiled"])
    monkeypatch.setattr(chunkpath, "READ_PATH", None)
    python = await _relayed(start_router, writes, 0.05, usage=usage, metrics=seen["python"])
    assert compiled == python
    assert seen["compiled"] == seen["python"]
    assert (b'"usage"' in compiled) is (usage and USAGE[6:-2] in b"".join(writes))
    assert sum(path.handed for path in paths) >= 1
    if case != "the end without [DONE]":
        assert b"upstream_eof" not in compiled
        assert any('outcome="ok"' in line for line in seen["compiled"])


# -- when a connection offers its reads: only at a chunk's end ---------------------------


class _Sink:
    def __init__(self) -> None:
        self.body: list[bytes] = []

    def on_head(self, status: int) -> None:
        pass

    def on_body(self, data: bytes) -> None:
        self.body.append(data)

    def on_read_end(self) -> None:
        pass

    def on_end(self) -> None:
        pass

    def on_error(self, exc: Exception) -> None:
        raise AssertionError(exc)


class _Sent:
    def write(self, data: bytes) -> None:
        pass


def _connection() -> tuple[H1Connection, _Sink, list[bytes]]:
    loop = asyncio.new_event_loop()
    pool = H1Pool(max_connections=1, keepalive_expiry_s=5, connect_timeout_s=1, read_timeout_s=60)
    pool.loop = loop
    conn = H1Connection(pool, Origin("http", "127.0.0.1", 1))
    conn.connection_made(_Sent())  # type: ignore[arg-type]
    sink = _Sink()
    conn.send(b"", sink, chunks=True)
    offered: list[bytes] = []

    def take(data: bytes) -> bool:
        offered.append(data)
        return False  # not taken: the parser reads it, as the compiled path leaves reads

    conn.offer_fast(take)
    loop.close()
    return conn, sink, offered


HEAD = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"


@pytest.mark.parametrize(
    ("reads", "offered_last"),
    [
        ([HEAD + b"3\r\nabc\r\n", b"3\r\ndef\r\n"], True),  # after a chunk's end
        ([HEAD + b"3\r\nabc\r\n3", b"\r\ndef\r\n"], False),  # in the next size line
        ([HEAD + b"3\r\nabc\r\n3\r\n", b"def\r\n"], False),  # after its size line
        ([HEAD + b"3\r\nab", b"c\r\n"], False),  # in a payload
        ([HEAD + b"3\r\nabc", b"\r\n"], False),  # before a chunk's CRLF
        ([HEAD + b"3\r\nabc\r", b"\n", b"3\r\ndef\r\n"], True),  # the CRLF itself cut
    ],
)
def test_a_read_is_offered_only_from_a_chunk_boundary(
    reads: list[bytes], offered_last: bool
) -> None:
    conn, sink, offered = _connection()
    for data in reads:
        conn.data_received(data)
    assert (reads[-1] in offered) is offered_last
    assert b"".join(sink.body) in (b"abcdef", b"abc")  # the parser read every byte as sent


@pytest.mark.parametrize(
    ("head", "offered"),
    [
        (HEAD, True),
        (HEAD.replace(b"chunked", b"Chunked"), False),  # the parser's chunks, but not ours
        (HEAD.replace(b"chunked", b"gzip, chunked"), False),
        (HEAD[:-2] + b"transfer-encoding: chunked\r\n\r\n", False),  # two of them
    ],
)
def test_a_first_read_is_offered_from_its_heads_end_where_the_body_is_surely_in_chunks(
    head: bytes, offered: bool
) -> None:
    # The response's first read: the rest after a head whose one transfer-encoding is
    # exactly chunked (and no content-length) is offered as a read of its own; so is the
    # next read after a read of the head alone. Elsewhere the parser reads it all.
    conn, sink, seen = _connection()
    conn.data_received(head + b"3\r\nabc\r\n")
    assert (seen == [b"3\r\nabc\r\n"]) is offered, seen
    assert b"".join(sink.body) == b"abc"
    conn, sink, seen = _connection()
    conn.data_received(head)
    conn.data_received(b"3\r\nabc\r\n")
    assert (seen == [b"3\r\nabc\r\n"]) is offered, seen
    assert b"".join(sink.body) == b"abc"


# -- a connection's data_received: its taker first, in C --------------------------------


@pytest.mark.parametrize("compiled", [True, False])
def test_a_read_goes_to_the_taker_then_to_the_parser_as_the_python_reader_sends_it(
    monkeypatch: pytest.MonkeyPatch, compiled: bool
) -> None:
    # data_received is ConnReader where it was built: a read goes to the connection's taker
    # first; one it takes goes nowhere else (the taker kept), one it leaves drops the taker
    # and goes to the parser; without a taker the parser reads it. The Python method does
    # the same where ConnReader is not there.
    if not compiled:
        monkeypatch.setattr(chunkpath, "CONN_READER", None)
    conn, sink, offered = _connection()
    assert (type(conn.data_received).__name__ == "ConnReader") is compiled

    def taken(data: bytes) -> bool:
        offered.append(data)
        return True

    conn.data_received(HEAD)
    assert conn._fast is not None  # a head of a body in chunks: the next read is offered
    conn._fast = taken
    conn.data_received(b"not a chunk")
    assert offered[-1] == b"not a chunk"
    assert conn._fast is taken
    assert sink.body == []
    conn.offer_fast(lambda data: offered.append(data) or False)
    conn._fast = conn._fast_offer
    conn.data_received(b"3\r\nabc")  # left: the taker is dropped, the parser reads it
    assert offered[-1] == b"3\r\nabc"
    assert conn._fast is None
    assert sink.body == [b"abc"]
    conn.data_received(b"\r\n3\r\ndef\r\n")  # no taker: the parser's
    assert offered[-1] == b"3\r\nabc"
    assert sink.body == [b"abc", b"def"]

    def failing(data: bytes) -> bool:
        raise ValueError("taker")

    conn._fast = failing
    with pytest.raises(ValueError, match="taker"):
        conn.data_received(b"3\r\nghi\r\n")


def test_a_connection_and_its_compiled_reader_are_collected_together() -> None:
    assert chunkpath.CONN_READER is not None, "the compiled module is not built"

    def readers() -> int:
        return sum(type(o) is chunkpath.CONN_READER for o in gc.get_objects())

    gc.collect()
    before = readers()
    conn, _, _ = _connection()
    assert readers() == before + 1
    del conn
    gc.collect()
    assert readers() == before
def test_the_compiled_types_are_made_alike_by_position_or_keyword() -> None:
    """ReadPath and SSEWriter are made without argument parsing when called as the relay and
    the reader call them (by position); any other call is parsed as before: the same objects,
    the same refusals."""
    from firstbyte.router import _chunkpath  # type: ignore[attr-defined]

    class Cycle:
        transport = "transport"
        flow = "flow"

    args = ("conn", "outcome", "relay", "stream", StreamEvent, 6, None, len)
    names = ("conn", "outcome", "relay", "stream", "event_type", "event_overhead", "gaps",
             "loop_time")
    made = [
        _chunkpath.ReadPath(*args),
        _chunkpath.ReadPath(*args, None),
        _chunkpath.ReadPath(*args[:4], **dict(zip(names[4:], args[4:], strict=True))),
        _chunkpath.ReadPath(**dict(zip(names, args, strict=True)), on_events=None),
    ]
    assert {(type(path), path.reads, path.events, path.handed) for path in made} == {
        (_chunkpath.ReadPath, 0, 0, 0)}
    with pytest.raises(TypeError, match="missing required argument 'relay'"):
        _chunkpath.ReadPath("conn", "outcome")
    with pytest.raises(TypeError):
        _chunkpath.ReadPath(*args[:5], "6", *args[6:])
    with pytest.raises(OverflowError):
        _chunkpath.ReadPath(*args[:5], 2**70, *args[6:])
    with pytest.raises(TypeError):
        _chunkpath.ReadPath(*args, None, None)
    assert type(_chunkpath.ReadPath(*args[:5], True, *args[6:])) is _chunkpath.ReadPath
    for writer in (_chunkpath.SSEWriter(Cycle(), "framer", len),
                   _chunkpath.SSEWriter(Cycle(), framer="framer", fallback=len)):
        assert type(writer) is _chunkpath.SSEWriter
    with pytest.raises(AttributeError, match="transport"):
        _chunkpath.SSEWriter(object(), "framer", len)
    with pytest.raises(TypeError, match="missing required argument 'fallback'"):
        _chunkpath.SSEWriter(Cycle(), "framer")
