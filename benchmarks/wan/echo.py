"""Echo servers and probes that measure round trips through the emulator.

Run inside emulated hosts (``python -m firstbyte.benchmarks.wan.echo ...`` under ``ip netns
exec``), so every measurement crosses the forwarder. Each command prints one JSON object on stdout:

- ``serve --proto udp|tcp --bind IP``: prints ``{"port": N}`` (an ephemeral port), then echoes
  every datagram (UDP) or every read of every connection (TCP) until killed, each followed by
  how long the server held it.
- ``udp-ping --to IP --port N --count C [--interval-ms I]``: sends ``C`` numbered datagrams
  ``I`` ms apart (several may be in flight) and prints ``{"rtt_ms": [...], "lost": L}``.
- ``tcp-probe --to IP --port N --count C``: ``C`` times: opens a connection (``connect_ms``,
  SYN to SYN-ACK = 1 RTT), sends one line and waits for its echo (``request_ms`` = 1 RTT),
  closes. Prints ``{"connect_ms": [...], "request_ms": [...]}``.

They measure the emulator, not the machine's scheduler: on a busy or virtualised machine a
process can wait milliseconds to run after its packet arrived (a virtual CPU halted through a
75 ms wait woke 0.5-1.3 ms late). So an arrival time is the kernel's receive timestamp
(``SO_TIMESTAMPNS``, on UDP and TCP alike), not the time the probe woke up, and the echo server
puts in its reply how long it held the data (its kernel receive timestamp to its send), which
the probe subtracts, as TWAMP does. A connect is the round trip the kernel itself measured from
SYN to SYN-ACK (``TCP_INFO``'s ``tcpi_rtt``), not the time ``connect()`` took to return. Each
process compares only its own timestamps, so no clocks are compared. The probes and servers
also run at a low SCHED_FIFO priority when allowed (below the forwarder's).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import socket
import struct
import sys
import threading
import time
from typing import Any

from firstbyte.benchmarks._parent import exit_with_parent

PROBE_PRIORITY = 5  # below the forwarder's, so it is never starved by a probe
_PING = struct.Struct("!Iq")  # sequence number, send time (ns, CLOCK_REALTIME)
_HOLD = struct.Struct("!q")  # appended by the echo server: how long it held the ping (ns)
SO_TIMESTAMPNS = 35  # <asm-generic/socket.h>; Python's socket module does not export it
_TIMESPEC = struct.Struct("@qq")  # struct timespec of a 64-bit Linux


def _stamped_socket() -> socket.socket:
    """A UDP socket whose datagrams carry the kernel's receive time (CLOCK_REALTIME)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
    return sock


def _recv_stamped(sock: socket.socket) -> tuple[bytes, Any, int]:
    """One datagram (or one read of a stream), its sender and when the kernel received it
    (ns); the time of this call when the kernel gave no timestamp."""
    data, ancdata, _flags, addr = sock.recvmsg(65535, socket.CMSG_SPACE(_TIMESPEC.size))
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS:
            sec, nsec = _TIMESPEC.unpack_from(payload)
            return data, addr, sec * 1_000_000_000 + nsec
    return data, addr, time.time_ns()


def serve(proto: str, bind: str) -> None:
    if proto == "udp":
        sock = _stamped_socket()
        sock.bind((bind, 0))
        _announce(sock)
        while True:
            data, addr, received = _recv_stamped(sock)
            sock.sendto(data + _HOLD.pack(time.time_ns() - received), addr)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)  # accepted connections inherit it
    sock.bind((bind, 0))
    sock.listen(128)
    _announce(sock)
    while True:
        conn, _ = sock.accept()
        threading.Thread(target=_echo_stream, args=(conn,), daemon=True).start()


def _announce(sock: socket.socket) -> None:
    sys.stdout.write(json.dumps({"port": sock.getsockname()[1]}) + "\n")
    sys.stdout.flush()


def _echo_stream(conn: socket.socket) -> None:
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    with conn:
        while True:
            data, _, received = _recv_stamped(conn)
            if not data:
                return
            conn.sendall(data + _HOLD.pack(time.time_ns() - received))


def udp_ping(
    to: str, port: int, count: int, interval_ms: float, timeout_s: float
) -> dict[str, object]:
    """Paced pings; a reply later than ``timeout_s`` after the last send counts as lost."""
    sock = _stamped_socket()
    sock.connect((to, port))
    sock.setblocking(False)
    rtts: dict[int, float] = {}
    interval_ns = int(interval_ms * 1e6)
    start = time.perf_counter_ns()
    sent = 0
    give_up = None
    while len(rtts) < count:
        now = time.perf_counter_ns()
        if sent < count and now >= start + sent * interval_ns:
            sock.send(_PING.pack(sent, time.time_ns()))
            sent += 1
            if sent == count:
                give_up = now + int(timeout_s * 1e9)
            continue
        if give_up is not None and now >= give_up:
            break
        next_send = start + sent * interval_ns if sent < count else give_up
        assert next_send is not None
        ready, _, _ = select.select([sock], [], [], max(0.0, (next_send - now) / 1e9))
        if ready:
            data, _, received = _recv_stamped(sock)
            seq, sent_at = _PING.unpack_from(data)
            (held,) = _HOLD.unpack_from(data, _PING.size)
            rtts[seq] = (received - sent_at - held) / 1e6
    sock.close()
    return {"rtt_ms": [rtts[k] for k in sorted(rtts)], "lost": count - len(rtts)}


def tcp_probe(to: str, port: int, count: int, timeout_s: float) -> dict[str, object]:
    connect_ms: list[float] = []
    request_ms: list[float] = []
    line = b"ping\n"
    for _ in range(count):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.settimeout(timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
        sock.connect((to, port))
        connect_ms.append(_handshake_rtt_ms(sock))
        sent = time.time_ns()
        sock.sendall(line)
        got = b""
        received = sent
        while len(got) < len(line) + _HOLD.size:
            chunk, _, received = _recv_stamped(sock)
            if not chunk:
                raise ConnectionError("echo server closed the connection")
            got += chunk
        sock.close()
        if not got.startswith(line):
            raise ConnectionError(f"echo server answered {got!r}")
        (held,) = _HOLD.unpack_from(got, len(line))
        request_ms.append((received - sent - held) / 1e6)
    return {"connect_ms": connect_ms, "request_ms": request_ms}


_TCPI_RTT = struct.Struct("@I")
_TCPI_RTT_OFFSET = 68  # struct tcp_info: 8 one-byte fields, then u32s; tcpi_rtt is the 16th


def _handshake_rtt_ms(sock: socket.socket) -> float:
    """The round trip the kernel measured from SYN to SYN-ACK (``tcpi_rtt``, in us): read
    right after ``connect()``, when the handshake's is the connection's only RTT sample."""
    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
    (rtt_us,) = _TCPI_RTT.unpack_from(info, _TCPI_RTT_OFFSET)
    return float(rtt_us) / 1000.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m firstbyte.benchmarks.wan.echo")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("serve")
    p.add_argument("--proto", choices=["udp", "tcp"], required=True)
    p.add_argument("--bind", required=True)
    p = sub.add_parser("udp-ping")
    p.add_argument("--to", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--count", type=int, default=20)
    p.add_argument("--interval-ms", type=float, default=20.0)
    p.add_argument("--timeout", type=float, default=5.0)
    p = sub.add_parser("tcp-probe")
    p.add_argument("--to", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--count", type=int, default=5)
    p.add_argument("--timeout", type=float, default=10.0)
    args = parser.parse_args(argv)
    # Unprivileged: measure anyway, with the scheduler's noise.
    with contextlib.suppress(OSError, AttributeError):
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(PROBE_PRIORITY))
    if args.cmd == "serve":
        exit_with_parent()  # a run killed with SIGKILL must not leave its echo servers behind
        serve(args.proto, args.bind)
        return 0
    if args.cmd == "udp-ping":
        result = udp_ping(args.to, args.port, args.count, args.interval_ms, args.timeout)
    else:
        result = tcp_probe(args.to, args.port, args.count, args.timeout)
    sys.stdout.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
