"""The sans-IO parts of the QUIC limits: the handshake rate that turns Retry on, and QUIC
connections counted with TCP ones per address."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from firstbyte.router.hosting.limits import (
    ClientLimits,
    ConnectionCounter,
    HandshakeRate,
    admit_quic,
)


def test_retry_starts_above_the_threshold_and_stops_when_the_rate_falls() -> None:
    rate = HandshakeRate(10.0)
    # Ten handshakes in the first second: the tenth is at the threshold, not above it.
    assert [rate.observe(100.0 + i * 0.05) for i in range(10)] == [False] * 10
    assert rate.observe(100.5)  # the eleventh within a second
    # Half a second into the next second, half of the last second still counts (5.5).
    assert rate.rate(101.5) == 5.5
    assert not rate.observe(101.5)
    # Two seconds of silence: nothing counts any more.
    assert rate.rate(103.6) == 0.0
    assert not rate.observe(103.6)


def test_zero_threshold_always_asks_for_retry() -> None:
    rate = HandshakeRate(0.0)
    assert rate.observe(5.0)
    assert rate.observe(1000.0)


@given(st.lists(st.floats(min_value=0.0, max_value=0.999), min_size=1, max_size=200))
def test_a_steady_rate_below_the_threshold_never_asks(offsets: list[float]) -> None:
    """One handshake per second per entry of ``offsets``: 1/s, far below 5/s."""
    rate = HandshakeRate(5.0)
    assert not any(rate.observe(second + offset) for second, offset in enumerate(offsets))


def test_quic_and_tcp_connections_share_the_per_address_cap() -> None:
    counter = ConnectionCounter(ClientLimits(hard_max_connections_per_client=2), fd_limit=1024)
    assert counter.open("10.0.0.1", 10) is None  # a TCP connection
    assert admit_quic(counter, "10.0.0.1", 11) is None
    refusal = admit_quic(counter, "10.0.0.1", 11)
    assert refusal is not None
    assert "hard_max_connections_per_client" in refusal
    assert admit_quic(counter, "10.0.0.2", 11) is None  # another address
    counter.close("10.0.0.1")
    assert admit_quic(counter, "10.0.0.1", 11) is None


def test_the_default_cap_bites_quic_only_under_pressure() -> None:
    """Like a TCP connection's: many QUIC connections from one address (a NAT) are admitted
    while descriptors are plentiful, and refused once the next socket would be near the
    budget."""
    counter = ConnectionCounter(ClientLimits(max_connections_per_client=2, reserved_fds=64),
                                fd_limit=1024)
    assert [admit_quic(counter, "10.0.0.1", 20) for _ in range(5)] == [None] * 5
    refusal = admit_quic(counter, "10.0.0.1", counter.pressure_fd)
    assert refusal is not None
    assert "max_connections_per_client" in refusal
    assert admit_quic(counter, "10.0.0.2", counter.pressure_fd) is None  # a light address


def test_quic_connection_refused_when_descriptors_run_short() -> None:
    counter = ConnectionCounter(ClientLimits(reserved_fds=64), fd_limit=1024)
    assert admit_quic(counter, "10.0.0.1", 959) is None
    refusal = admit_quic(counter, "10.0.0.1", 960)
    assert refusal is not None
    assert "reserved_fds" in refusal
