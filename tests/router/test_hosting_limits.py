"""The sans-IO cores of the connection limits: frame-size guard, connection counter,
rapid-reset detector, log throttle and memory guard."""

from __future__ import annotations

import os
import struct

from hypothesis import given
from hypothesis import strategies as st

from firstbyte.router.hosting.limits import (
    ClientLimits,
    ConnectionCounter,
    HeaderBlockClock,
    ResetFlood,
    Throttle,
)
from firstbyte.router.hosting.ws_frames import FrameSizeGuard
from firstbyte.router.overload import MemoryGuard


def frame(length: int, *, opcode: int = 0x2, fin: bool = True, payload: bool = True) -> bytes:
    if length < 126:
        size = bytes([0x80 | length])
    elif length < 1 << 16:
        size = bytes([0x80 | 126]) + struct.pack("!H", length)
    else:
        size = bytes([0x80 | 127]) + struct.pack("!Q", length)
    head = bytes([(0x80 if fin else 0) | opcode]) + size + os.urandom(4)
    return head + (b"\0" * length if payload else b"")


def feed_split(guard: FrameSizeGuard, data: bytes, cuts: list[int]) -> bool:
    ok = True
    start = 0
    for cut in [*sorted({c % (len(data) + 1) for c in cuts}), len(data)]:
        ok = guard.feed(data[start:cut]) and ok
        start = cut
    return ok


@given(st.lists(st.integers(0, 300), max_size=8), st.lists(st.integers(0, 10_000), max_size=20))
def test_frames_within_the_limit_pass_whatever_the_split(lengths: list[int], cuts: list[int]) -> None:
    data = b"".join(frame(n) for n in lengths) + frame(0, opcode=0x9)  # and a ping
    assert feed_split(FrameSizeGuard(300), data, cuts)


@given(st.lists(st.integers(0, 10_000), max_size=20))
def test_oversized_frame_refused_at_its_header(cuts: list[int]) -> None:
    guard = FrameSizeGuard(1 << 20)
    data = frame(10) + frame(128 << 20, payload=False)  # only the header is ever sent
    assert not feed_split(guard, data, cuts)
    assert guard.declared_bytes == 128 << 20
    assert not guard.feed(b"more")  # refused for good


def test_message_made_of_fragments_counts_them_all() -> None:
    guard = FrameSizeGuard(100)
    assert guard.feed(frame(60, fin=False))
    assert guard.feed(frame(0, opcode=0x9))  # a control frame between fragments
    assert not guard.feed(frame(60, opcode=0x0))
    again = FrameSizeGuard(100)
    assert again.feed(frame(60) + frame(60))  # two messages of 60 each are fine


def test_connection_counter_caps_per_address_only_under_pressure() -> None:
    """With room, one address opens any number of connections; with descriptors near their
    budget, an address over the cap gets no more while a lighter one still connects; the
    reserve refuses everyone."""
    counter = ConnectionCounter(ClientLimits(max_connections_per_client=2, reserved_fds=10), 100)
    # Budget 90, margin max(10, 90 // 8) = 11: pressure from descriptor 79 on.
    assert counter.pressure_fd == 79
    for fd in range(5, 50):
        assert counter.open("a", fd) is None
    assert counter.count("a") == 45
    refusal = counter.open("a", 80)
    assert refusal is not None
    assert "max_connections_per_client" in refusal
    assert "descriptors near their budget" in refusal
    assert counter.open("b", 80) is None
    assert counter.open("b", 81) is None
    assert counter.open("b", 82) is not None  # b is now at the cap too
    refusal = counter.open("c", 90)
    assert refusal is not None
    assert "file descriptors short" in refusal
    counter.close("a")
    assert counter.count("a") == 44
    assert counter.count("c") == 0  # a refused connection is not counted


def test_connection_counter_memory_pressure_and_hard_cap() -> None:
    pressed = False
    counter = ConnectionCounter(
        ClientLimits(max_connections_per_client=2, hard_max_connections_per_client=4),
        1000,
        memory_pressed=lambda: pressed,
    )
    assert [counter.open("a") for _ in range(3)] == [None, None, None]
    pressed = True
    refusal = counter.refusal("a")
    assert refusal is not None
    assert "memory" in refusal
    assert counter.refusal("b") is None
    pressed = False
    assert counter.open("a") is None
    refusal = counter.open("a")
    assert refusal is not None
    assert "hard_max_connections_per_client" in refusal


def test_reset_budget_lets_cancellers_through() -> None:
    """The defaults (200 at once, 20 a second): a page closing with its 100 streams open,
    twice in a row, then an app cancelling 15 streams a second for ten minutes."""
    flood = ResetFlood(200, 20.0)
    assert not any(flood.stream_reset_early(0.0) for _ in range(200))
    now = 10.0
    for _ in range(600 * 15):
        now += 1 / 15
        assert not flood.stream_reset_early(now)


def test_reset_budget_stops_a_flood_whatever_completes_between() -> None:
    """1,000 resets a second: the 201st is past the budget; requests that complete in
    between (cheap GETs) refill nothing."""
    flood = ResetFlood(200, 20.0)
    results = []
    for i in range(400):
        flood.stream_opened()
        flood.stream_opened()  # a GET /v1/edge/warm, answered
        results.append(flood.stream_reset_early(i / 1000))
    assert results.index(True) in range(200, 210)
    assert flood.opened == 800


def test_reset_budget_refills_with_time_up_to_its_burst() -> None:
    flood = ResetFlood(10, 1.0)
    assert not any(flood.stream_reset_early(0.0) for _ in range(10))
    assert flood.stream_reset_early(0.0)
    assert not flood.stream_reset_early(1.5)  # refilled by 1.5, one spent
    assert not any(flood.stream_reset_early(1000.0) for _ in range(10))  # at most the burst
    assert flood.stream_reset_early(1000.0)


def test_header_block_clock_counts_from_the_first_headers_bytes() -> None:
    clock = HeaderBlockClock(60.0)
    assert clock.read(None, 0.0) is None
    assert clock.read(HeaderBlockClock.UNKNOWN, 1.0) == 61.0  # 4 bytes of a HEADERS frame
    assert clock.read(1, 2.0) == 61.0  # they name stream 1: the same block
    assert clock.read(1, 40.0) == 61.0  # a CONTINUATION byte moves nothing
    assert clock.read(HeaderBlockClock.UNKNOWN, 41.0) == 61.0
    assert clock.read(3, 42.0) == 102.0  # stream 1's block ended, stream 3's began
    assert clock.read(None, 43.0) is None  # it ended
    assert clock.read(5, 44.0) == 104.0


def test_throttle_reports_what_it_held_back() -> None:
    throttle = Throttle(10.0)
    assert throttle.allow("x", 0.0) == 0
    assert throttle.allow("x", 1.0) is None
    assert throttle.allow("x", 2.0) is None
    assert throttle.allow("y", 2.0) == 0
    assert throttle.allow("x", 10.5) == 2


def test_throttle_report_is_the_end_of_the_log_line_it_allows() -> None:
    throttle = Throttle(10.0)
    assert throttle.report("x", 0.0) == ""  # the first: nothing held back
    assert throttle.report("x", 1.0) is None  # quiet
    assert throttle.report("x", 2.0, "failures") is None
    assert throttle.report("x", 10.5, "failures") == " (2 more failures since the last report)"
    throttle.report("y", 0.0)
    throttle.report("y", 1.0)
    assert throttle.report("y", 20.0) == " (1 more since the last report)"


def test_memory_guard_reads_at_most_once_per_interval() -> None:
    now = [0.0]
    readings = iter([100, 300, 100])
    guard = MemoryGuard(200, lambda: now[0], read_rss=lambda: next(readings), interval_s=1.0)
    assert guard.refusal() is None
    now[0] = 0.5
    assert guard.refusal() is None  # not read again yet
    now[0] = 1.0
    assert guard.refusal() is not None
    now[0] = 2.0
    assert guard.refusal() is None
    assert MemoryGuard(None, lambda: 0.0).refusal() is None
