"""The soak's hostile HTTP/3 clients: early answers, idle QUIC connections, an Initial flood.

aioquic's client is used directly (its sans-IO ``QuicConnection`` for the flood's raw Initial
packets, its asyncio ``connect`` otherwise); every count is bounded and scaled by
``Target.scale``, and everything goes to 127.0.0.1 on the router's UDP port (its TCP port).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import time
from collections import Counter
from typing import Any

from aioquic.asyncio.client import connect
from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.h3.connection import H3_ALPN, H3Connection
from aioquic.h3.events import HeadersReceived
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from aioquic.quic.events import QuicEvent

from firstbyte.benchmarks.scenarios._soak_target import Target, bucket, many, rounds
from firstbyte.protocol import paths

__all__ = ["h3_early_answer", "quic_flood", "quic_idle"]

EARLY_BODY_BYTES = 8 * 1024
"""A no-key POST body large enough that the 401 goes out before the body is all read."""
FLOOD_INITIALS = 400
"""More than the router's default Retry threshold (200 handshakes a second) within one second,
in every run (measured: 400 at ~450/s, 169 got a Retry). Not scaled: each handshake answered
directly holds a place of 127.0.0.1's ``max_connections_per_client`` (which every soak client
shares) until ``client_header_timeout_s``, and more would crowd the good clients out."""
FLOOD_BATCH = 5
FLOOD_PAUSE_S = 0.01
"""The flood's pace: 5 Initials every 10 ms (up to 500 a second; faster, most of a burst is
dropped by hypercorn's queue of 10 datagrams and never counts as a handshake)."""


def _configuration(ca_file: str | None) -> QuicConfiguration:
    configuration = QuicConfiguration(alpn_protocols=H3_ALPN, is_client=True,
                                      server_name="localhost")
    if ca_file is None:
        configuration.verify_mode = ssl.CERT_NONE  # a handshake is the point, not the peer
    else:
        configuration.load_verify_locations(ca_file)
    return configuration


class _H3(QuicConnectionProtocol):
    """One request's status over HTTP/3 (the body is not kept)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.h3 = H3Connection(self._quic)
        self.status = 0
        self.done = asyncio.Event()

    def quic_event_received(self, event: QuicEvent) -> None:
        for h3_event in self.h3.handle_event(event):
            if isinstance(h3_event, HeadersReceived):
                self.status = next((int(v) for k, v in h3_event.headers if k == b":status"),
                                   self.status)
            if getattr(h3_event, "stream_ended", False):
                self.done.set()


async def _h3_status(target: Target, method: str, path: str, headers: dict[str, str],
                     body: bytes = b"", timeout_s: float = 10.0) -> str:
    """The status of one request over a new QUIC connection, or what went wrong."""
    try:
        async with asyncio.timeout(timeout_s), connect(
            target.host, target.port, configuration=_configuration(target.ca_file),
            create_protocol=_H3,
        ) as protocol:
            client: _H3 = protocol  # type: ignore[assignment]
            stream_id = client._quic.get_next_available_stream_id()
            client.h3.send_headers(stream_id, [
                (b":method", method.encode()), (b":scheme", b"https"),
                (b":authority", f"localhost:{target.port}".encode()), (b":path", path.encode()),
                *((k.encode(), v.encode()) for k, v in headers.items())], end_stream=not body)
            if body:
                client.h3.send_data(stream_id, body, end_stream=True)
            client.transmit()
            await client.done.wait()
            return str(client.status)
    except TimeoutError:
        return f"no answer in {timeout_s:g} s"
    except ConnectionError as exc:
        return f"connection refused: {type(exc).__name__}"


async def h3_early_answer(target: Target, until: float) -> Counter[str]:
    """A no-key POST with an :data:`EARLY_BODY_BYTES` body (answered 401 before its body is
    read), then a normal request on a new connection: HTTP/3 must still serve."""
    found: Counter[str] = Counter()
    body = b"x" * EARLY_BODY_BYTES
    for n in rounds(until):
        if n == 3 * target.scale:
            break
        status = await _h3_status(target, "POST", paths.CHAT_COMPLETIONS,
                                  {"content-type": "application/json"}, body)
        found[f"no-key POST with {EARLY_BODY_BYTES // 1024} KiB: {status}"] += 1
        found[f"/healthz after it: {await _served_after(target)}"] += 1
    return found


async def _served_after(target: Target, attempts: int = 3) -> str:
    """``/healthz``'s status over a new QUIC connection, a new connection tried up to
    ``attempts`` times: on two shared cores a handshake's datagrams can be lost while the
    router's loop is busy with the other phases (seen once in CI: no answer in 10 s). A
    server task that an early answer ended would log an ERROR (the run's router-log check
    fails on it) and would not answer any of the attempts within their 30 s."""
    status = ""
    for attempt in range(attempts):
        status = await _h3_status(target, "GET", "/healthz", {})
        if status == "200":
            return status if attempt == 0 else f"200 (attempt {attempt + 1})"
    return status


async def quic_idle(target: Target, until: float) -> Counter[str]:
    """QUIC connections from one address kept alive by PINGs, never a request."""

    async def one() -> str:
        started = time.monotonic()
        try:
            async with contextlib.AsyncExitStack() as stack:
                client = await asyncio.wait_for(stack.enter_async_context(
                    connect(target.host, target.port, configuration=_configuration(None))), 10)
                return await _ping_until(client, until, started)
        except TimeoutError:
            return "handshake not done in 10 s"
        except ConnectionError:
            return "refused at the handshake"

    return await many(30 * target.scale, one)


async def _ping_until(client: QuicConnectionProtocol, until: float, started: float) -> str:
    closed = asyncio.ensure_future(client.wait_closed())
    try:
        while not closed.done() and time.monotonic() < until:
            with contextlib.suppress(ConnectionError, TimeoutError):
                await asyncio.wait_for(client.ping(), 1.0)
            await asyncio.wait([closed], timeout=1.0)
        if closed.done():
            return f"closed by router after {bucket(time.monotonic() - started)}"
        return "held until the end"
    finally:
        closed.cancel()


async def quic_flood(target: Target, until: float) -> Counter[str]:
    """:data:`FLOOD_INITIALS` new-connection Initials from one UDP socket at up to 500 a
    second, never followed up; then a real client must still be served. Counted by the client
    connection id each answer names: a Retry (no server state) or a direct answer (a
    half-open handshake)."""
    del until  # bounded by count: FLOOD_INITIALS, about a second of sending
    count = FLOOD_INITIALS
    found: Counter[str] = Counter()
    loop = asyncio.get_running_loop()
    initials = []
    for n in range(count):  # made beforehand (key schedules cost CPU): the flood is the send
        initials.append(_initial(target))
        if n % 10 == 9:
            await asyncio.sleep(0)  # the good clients share this event loop
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.setblocking(False)
        sock.bind((target.host, 0))
        answers = asyncio.ensure_future(_receive(sock, count * FLOOD_PAUSE_S + 3.0))
        sent = 0
        started = time.monotonic()
        for n in range(0, count, FLOOD_BATCH):
            for datagram in initials[n:n + FLOOD_BATCH]:
                with contextlib.suppress(BlockingIOError):
                    await loop.sock_sendto(sock, datagram, (target.host, target.port))
                    sent += 1
            await asyncio.sleep(FLOOD_PAUSE_S)
        rate = sent / max(time.monotonic() - started, 1e-3)
        got = await answers
    retried = {_client_cid(a) for a in got if _is_retry(a)}
    direct = {_client_cid(a) for a in got if not _is_retry(a)} - {b""} - retried
    found[f"Initials sent (at {rate:,.0f}/s)"] = sent
    found["answered with Retry"] = len(retried)
    found["answered with a handshake"] = len(direct)
    found["not answered"] = sent - len(retried) - len(direct)
    found[f"real client after the flood: {await _h3_status(target, 'GET', '/healthz', {})}"] += 1
    return found


def _initial(target: Target) -> bytes:
    """The first datagram of a new client connection: an Initial padded to 1,200 bytes."""
    connection = QuicConnection(configuration=_configuration(None))
    connection.connect((target.host, target.port), now=time.monotonic())
    datagram, _ = connection.datagrams_to_send(now=time.monotonic())[0]
    return datagram


def _is_retry(datagram: bytes) -> bool:
    """A QUIC v1 long-header packet of type Retry (RFC 9000 section 17.2.5)."""
    return bool(datagram) and datagram[0] & 0x80 != 0 and (datagram[0] & 0x30) >> 4 == 3


def _client_cid(datagram: bytes) -> bytes:
    """The Destination Connection ID of a server's long-header packet: the Source Connection
    ID its client chose, one per client connection (empty for a short header)."""
    if not datagram or not datagram[0] & 0x80:
        return b""
    return datagram[6:6 + datagram[5]]


async def _receive(sock: socket.socket, seconds: float) -> list[bytes]:
    loop = asyncio.get_running_loop()
    got: list[bytes] = []
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            while True:
                got.append(await loop.sock_recv(sock, 65536))
    return got
