"""The forwarder's timing, without TUN devices: the wake margin it polls through before a
release, and the time it dates a packet by."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest

from firstbyte.benchmarks.wan.delayline import DelayLine, LinkParams
from firstbyte.benchmarks.wan.forwarder import MAX_SPIN_NS, SPIN_NS, Forwarder, WakeMargin

MS = 1_000_000


def test_the_wake_margin_follows_how_late_sleeps_woke() -> None:
    margin = WakeMargin(window=4)
    assert margin.ns == SPIN_NS  # nothing seen yet: the least margin
    margin.woke(75 * MS, 75 * MS + 40_000)  # 40 us late: still the least
    assert margin.ns == SPIN_NS
    margin.woke(75 * MS, 76 * MS)  # a virtual CPU woken 1 ms late
    assert margin.ns == 1_250_000
    margin.woke(10 * MS, 10 * MS - 5_000)  # woke early (never less than 0)
    assert margin.ns == 1_250_000
    margin.woke(75 * MS, 85 * MS)  # a 10 ms stall: capped
    assert margin.ns == MAX_SPIN_NS
    for _ in range(4):  # prompt again for a whole window: back to the least
        margin.woke(5 * MS, 5 * MS + 10_000)
    assert margin.ns == SPIN_NS


@pytest.fixture
def pipe() -> Iterator[tuple[int, int]]:
    r, w = os.pipe()
    os.set_blocking(r, False)
    yield r, w
    os.close(r)
    os.close(w)


def test_a_packet_is_dated_when_read_so_never_released_early(pipe: tuple[int, int]) -> None:
    r, w = pipe
    delay = 50 * MS
    fwd = Forwarder.__new__(Forwarder)  # no TUN devices: a pipe stands in for host 0's
    fwd.line = DelayLine({(0, 1): LinkParams(delay_ns=delay)})
    fwd.index_of_fd = {r: 0}
    fwd.host_of_ip = {bytes([198, 51, 100, 10]): 1}
    fwd.non_ipv4 = fwd.unknown_host = fwd.max_in_flight = 0
    # an IPv4 header to 198.51.100.10, written after select would have returned
    packet = bytes([0x45]) + bytes(15) + bytes([198, 51, 100, 10]) + b"payload"
    written = time.perf_counter_ns()
    os.write(w, packet)
    fwd._read_from(r)
    deadline = fwd.line.next_deadline()
    assert deadline is not None
    assert deadline >= written + delay
    assert fwd.line.pop_due(written + delay - 1) == []
