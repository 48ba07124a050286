"""A port to tell a server to listen on, for benchmarks and tests that start servers as
processes with a port in their configuration.

A port from ``bind(0)`` lies in the kernel's ephemeral range, where the source port of any
outgoing connection on the machine may take it between the probe and the server's own bind
(the suite lost quick ``tenancy`` and ``router_workers`` runs so: "Address already in
use"). :func:`free_port` picks below that range instead, where no connection is given a port
unasked.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

__all__ = ["free_port"]

LOWEST_PORT = 20_000
"""The lowest port picked: above the registered services a machine may run."""


def free_port(host: str = "127.0.0.1", *, udp: bool = False) -> int:
    """A TCP port free on ``host`` right now (and the same UDP port, with ``udp``: a router
    serving HTTP/3 binds both), chosen at random below the ephemeral range; the kernel's
    choice if 200 tries found none there."""
    low = _ephemeral_low()
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(LOWEST_PORT, low)
        if _bindable(host, port, udp):
            return port
    with socket.socket() as s:  # no luck below the range: the kernel's choice
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _bindable(host: str, port: int, udp: bool) -> bool:
    kinds = (socket.SOCK_STREAM, socket.SOCK_DGRAM) if udp else (socket.SOCK_STREAM,)
    for kind in kinds:
        with socket.socket(type=kind) as s:
            try:
                s.bind((host, port))
            except OSError:
                return False
    return True


def _ephemeral_low() -> int:
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768  # Linux's default
    return max(low, LOWEST_PORT + 1000)
