"""free_port: below the ephemeral range, picked at random, and free for TCP (and UDP when
asked) when it is handed out."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from firstbyte.benchmarks import ports
from firstbyte.benchmarks.ports import LOWEST_PORT, free_port


def _ephemeral_low() -> int:
    return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])


def test_a_free_port_lies_below_the_ephemeral_range_and_binds() -> None:
    """Outgoing connections take their source ports from the ephemeral range: a router's port
    picked there was once taken before the router bound it ("Address already in use")."""
    ports = {free_port() for _ in range(20)}
    assert all(LOWEST_PORT <= port < _ephemeral_low() for port in ports), ports
    assert len(ports) > 1  # picked at random, not one fixed port
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports.pop()))


def test_a_port_asked_for_udp_too_binds_both() -> None:
    port = free_port(udp=True)
    assert LOWEST_PORT <= port < _ephemeral_low()
    with socket.socket() as tcp, socket.socket(type=socket.SOCK_DGRAM) as udp:
        tcp.bind(("127.0.0.1", port))
        udp.bind(("127.0.0.1", port))


def test_a_port_whose_udp_side_is_taken_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    """Asked for both, a port free for TCP but held for UDP is not handed out: the next pick
    is."""
    with socket.socket(type=socket.SOCK_DGRAM) as held:
        held.bind(("127.0.0.1", free_port(udp=True)))
        taken = held.getsockname()[1]
        other = free_port(udp=True)
        picks = iter([taken, other])

        class Picks:
            def randrange(self, start: int, stop: int) -> int:
                return next(picks)

        monkeypatch.setattr(ports.random, "Random", Picks)
        assert free_port() == taken  # TCP alone: free
        picks = iter([taken, other])
        assert free_port(udp=True) == other
