"""HTTP/3 over QUIC (aioquic), with a small connection manager of our own.

One QUIC connection per origin carries every request (QUIC multiplexes streams). The manager
resolves the name itself (the ``dns`` phase), times the handshake from aioquic's
``HandshakeCompleted`` event (``quic_handshake``), keeps the session tickets the server issues
per host so that a reconnect resumes the TLS session and sends its request as 0-RTT early data
when the ticket allows it, and keeps the connection warm with a ``GET /healthz`` each
keep-warm interval (servers time idle connections by requests, not by PING frames).

A ``503`` ``draining`` retires the connection it came on (aioquic's client ignores the
router's HTTP/3 GOAWAY, so a request can still reach a draining router on it): the next
request opens a new one, and the old one closes once its streams in flight end.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import ssl
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, TextIO, cast

import msgspec
from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.h3.connection import H3_ALPN, ErrorCode, H3Connection
from aioquic.h3.events import DataReceived, HeadersReceived
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from aioquic.quic.events import (
    ConnectionTerminated,
    HandshakeCompleted,
    PingAcknowledged,
    QuicEvent,
    StreamReset,
)
from aioquic.tls import CipherSuite, SessionTicket

from firstbyte.client_sdk._core.timing import TimingRecorder
from firstbyte.client_sdk.errors import ConnectError, FirstbyteError, TLSError
from firstbyte.client_sdk.resolver import Origin, Resolver
from firstbyte.client_sdk.tickets import TicketStore
from firstbyte.client_sdk.transports.base import (
    HTTPResponse,
    Refusal,
    TransportCut,
    note_response_headers,
    noted_accept_encoding,
    refusal,
)
from firstbyte.protocol import paths

TICKET_WAIT_S = 0.25
"""How long closing a session waits for a session ticket the server has not sent yet."""

__all__ = ["H3Session", "decode_ticket", "encode_ticket", "quic_trust"]

_END = object()
# aioquic logs a failed handshake as a WARNING on its "quic" logger; with no handler configured
# Python's last-resort handler would print it to stderr. A library must not print: the error
# reaches the application as TLSError / ConnectError, and an application that configures
# logging still sees aioquic's records (they propagate to its handlers).
logging.getLogger("quic").addHandler(logging.NullHandler())
ICMP_PROBE_MIN_S, ICMP_PROBE_RTTS, ICMP_PROBE_MAX_S = 0.2, 4, 2.0
"""After an ICMP port unreachable on a connection the server has spoken on: how long a PING
waits for any answer before the connection counts as dead (4 round trips, 0.2 to 2 s)."""
MAX_UNREAD_BYTES = 16 << 20
"""Response bytes one HTTP/3 stream may hold unread. aioquic grants the server more flow
control credit as data arrives, not as it is read, so past this the stream is cut (reset;
the client resumes) rather than let a server fill memory."""


class _Ticket(msgspec.Struct, array_like=True):
    """aioquic's :class:`SessionTicket`, field for field, as bytes a :class:`TicketStore`
    keeps (msgpack: no code runs when a stored ticket is read back, unlike pickle)."""

    age_add: int
    cipher_suite: int
    not_valid_after: datetime.datetime
    not_valid_before: datetime.datetime
    resumption_secret: bytes
    server_name: str
    ticket: bytes
    max_early_data_size: int | None
    other_extensions: list[tuple[int, bytes]]


def _min_rtt_s(quic: QuicConnection) -> float | None:
    """QUIC's smallest RTT sample on the connection (aioquic's loss recovery keeps it; None
    before a sample, or if a release moved it)."""
    loss = getattr(quic, "_loss", None)
    if loss is None or not getattr(loss, "_rtt_initialized", False):
        return None
    rtt = getattr(loss, "_rtt_min", None)
    return float(rtt) if isinstance(rtt, int | float) and 0 < rtt < float("inf") else None


def encode_ticket(ticket: SessionTicket) -> bytes:
    return msgspec.msgpack.encode(_Ticket(
        ticket.age_add, int(ticket.cipher_suite), ticket.not_valid_after,
        ticket.not_valid_before, ticket.resumption_secret, ticket.server_name, ticket.ticket,
        ticket.max_early_data_size, list(ticket.other_extensions)))


def decode_ticket(data: bytes) -> SessionTicket | None:
    """The ticket, or None for bytes that are not one (a store may hold anything)."""
    try:
        t = msgspec.msgpack.decode(data, type=_Ticket)
        suite = CipherSuite(t.cipher_suite)
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError):
        return None
    return SessionTicket(t.age_add, suite, t.not_valid_after, t.not_valid_before,
                         t.resumption_secret, t.server_name, t.ticket, t.max_early_data_size,
                         list(t.other_extensions))


def quic_trust(
    config: QuicConfiguration, verify: bool | ssl.SSLContext, ca_file: str | None
) -> None:
    """Give aioquic the same trust as the client's ``SSLContext`` (aioquic has its own TLS)."""
    if verify is False:
        config.verify_mode = ssl.CERT_NONE
        return
    config.verify_mode = ssl.CERT_REQUIRED
    if ca_file is not None:
        config.load_verify_locations(cafile=ca_file)
    elif isinstance(verify, ssl.SSLContext):
        if verify.verify_mode == ssl.CERT_NONE:
            config.verify_mode = ssl.CERT_NONE
            return
        ders = verify.get_ca_certs(binary_form=True)
        if ders:
            pem = "".join(ssl.DER_cert_to_PEM_cert(der) for der in ders)
            config.load_verify_locations(cadata=pem.encode())


def _retrieve(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


class _Stream:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.headers: asyncio.Future[tuple[list[tuple[bytes, bytes]], float]] = loop.create_future()
        self.data: asyncio.Queue[bytes | object | BaseException] = asyncio.Queue()
        self.ended = False
        self.unread = 0
        self.overflowed = False


class _H3Protocol(QuicConnectionProtocol):
    def __init__(self, quic: QuicConnection, **kw: Any) -> None:
        super().__init__(quic, **kw)
        self.h3 = H3Connection(quic)
        self.streams: dict[int, _Stream] = {}
        self.handshake: HandshakeCompleted | None = None
        self.handshake_at: float | None = None
        self.terminated: ConnectionTerminated | None = None
        self.handshake_waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        # Its outcome is read by whoever waits; after a timeout nobody does, and asyncio would
        # print "Future exception was never retrieved" when the connection is then closed.
        self.handshake_waiter.add_done_callback(_retrieve)
        self.heard = False
        """True once any datagram came from the server."""
        self._datagrams = 0
        self._probe: asyncio.TimerHandle | None = None
        self._pings: dict[int, asyncio.Future[None]] = {}

    @property
    def usable(self) -> bool:
        return self.terminated is None

    def send_ping(self) -> asyncio.Future[None]:
        """A QUIC PING: the future is done when it is acknowledged, failed when the connection
        ends. (aioquic's ``ping()`` leaves a waiter whose failure asyncio prints once the
        caller stopped waiting; this one's outcome is always retrieved.)"""
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiter.add_done_callback(_retrieve)
        self._pings[id(waiter)] = waiter
        self._quic.send_ping(id(waiter))
        self.transmit()
        return waiter

    def datagram_received(self, data: bytes | str, addr: Any) -> None:
        self.heard = True
        self._datagrams += 1
        super().datagram_received(data, addr)

    def error_received(self, exc: Exception) -> None:
        # ICMP port unreachable: nothing listens on that UDP port, the QUIC analogue of a TCP
        # reset. Believed at once only before the server has said anything: RFC 9000 lets
        # endpoints ignore ICMP, which is easy to spoof. Later, it is checked instead (a
        # server that went away, e.g. a router restarted or killed, would otherwise hold a
        # request on this connection until QUIC's idle timeout or the keep-warm's failure).
        if not isinstance(exc, ConnectionRefusedError):
            return
        if not self.heard:
            if not self.handshake_waiter.done():
                self.handshake_waiter.set_exception(exc)
        elif self.terminated is None and self._probe is None:
            self._probe_server()

    def _probe_server(self) -> None:
        """A PING after an ICMP port unreachable: if no datagram at all comes from the server
        within a few round trips, the connection is ended here (its requests cut, so they
        reconnect or fail over). A spoofed ICMP costs one PING a live server answers."""
        rtt = _min_rtt_s(self._quic) or 0.0
        wait_s = min(max(ICMP_PROBE_MIN_S, ICMP_PROBE_RTTS * rtt), ICMP_PROBE_MAX_S)
        self._probe = asyncio.get_running_loop().call_later(
            wait_s, self._probe_expired, self._datagrams)
        self.send_ping()

    def _probe_expired(self, datagrams: int) -> None:
        self._probe = None
        if self.terminated is not None or self._datagrams != datagrams:
            return  # ended meanwhile, or the server answered: alive
        reason = "the server is gone (ICMP port unreachable, no answer to a PING)"
        self._quic.close(reason_phrase=reason)
        self.transmit()
        self._ended(ConnectionTerminated(error_code=0, frame_type=None, reason_phrase=reason))

    def _ended(self, event: ConnectionTerminated) -> None:
        """The connection ended (by either side, or found dead): fail what waits on it."""
        if self.terminated is not None:
            return
        self.terminated = event
        if self._probe is not None:
            self._probe.cancel()
            self._probe = None
        pings, self._pings = self._pings, {}
        for ping in pings.values():
            if not ping.done():
                ping.set_exception(ConnectionError(event.reason_phrase))
        if not self.handshake_waiter.done():
            self.handshake_waiter.set_exception(ConnectionError(event.reason_phrase))
        cut = TransportCut(f"QUIC connection closed: {event.reason_phrase or event.error_code}")
        for stream in self.streams.values():
            if not stream.headers.done():
                stream.headers.set_exception(cut)
            stream.data.put_nowait(cut)

    def quic_event_received(self, event: QuicEvent) -> None:
        if isinstance(event, HandshakeCompleted):
            self.handshake, self.handshake_at = event, time.perf_counter()
            if not self.handshake_waiter.done():
                self.handshake_waiter.set_result(None)
        elif isinstance(event, PingAcknowledged):
            ping = self._pings.pop(event.uid, None)
            if ping is not None and not ping.done():
                ping.set_result(None)
        elif isinstance(event, ConnectionTerminated):
            self._ended(event)
        elif isinstance(event, StreamReset):
            reset = self.streams.get(event.stream_id)
            if reset is not None:
                stream = reset
                cut = TransportCut(f"HTTP/3 stream reset ({event.error_code})")
                if not stream.headers.done():
                    stream.headers.set_exception(cut)
                stream.data.put_nowait(cut)
        for h3_event in self.h3.handle_event(event):
            found = self.streams.get(getattr(h3_event, "stream_id", -1))
            if found is None:
                continue
            stream = found
            if isinstance(h3_event, HeadersReceived) and not stream.headers.done():
                stream.headers.set_result((list(h3_event.headers), time.perf_counter()))
            elif isinstance(h3_event, DataReceived) and h3_event.data and not stream.overflowed:
                stream.unread += len(h3_event.data)
                if stream.unread > MAX_UNREAD_BYTES:
                    stream.overflowed = True  # ignore the rest; the request's exit resets it
                    stream.data.put_nowait(TransportCut(
                        f"HTTP/3 response over {MAX_UNREAD_BYTES} bytes unread"))
                    continue
                stream.data.put_nowait(h3_event.data)
            if getattr(h3_event, "stream_ended", False):
                stream.ended = True
                if not stream.headers.done():
                    stream.headers.set_exception(TransportCut("HTTP/3 stream ended early"))
                stream.data.put_nowait(_END)


class _KeyLog:
    """aioquic's ``secrets_log_file``: each line appended to ``path`` as it comes (a few per
    handshake), so no file stays open and a long-lived client never holds a stale handle."""

    def __init__(self, path: str) -> None:
        self.path = path

    def write(self, text: str) -> int:
        with open(self.path, "a", encoding="ascii") as file:
            return file.write(text)

    def flush(self) -> None:
        pass


class H3Session:
    """Requests to one origin over HTTP/3, on one kept-warm QUIC connection."""

    http_version = "HTTP/3"

    def __init__(
        self,
        origin: Origin,
        resolver: Resolver,
        tickets: TicketStore,
        *,
        verify: bool | ssl.SSLContext = True,
        ca_file: str | None = None,
        idle_timeout_s: float = 120.0,
        connect_timeout_s: float = 10.0,
        keylog_file: str | None = None,
    ) -> None:
        if not origin.tls:
            raise ValueError("HTTP/3 needs an https:// base URL")
        self.origin = origin
        self._resolver = resolver
        self._tickets = tickets
        self._verify = verify
        self._ca_file = ca_file
        self._idle_timeout_s = idle_timeout_s
        self._connect_timeout_s = connect_timeout_s
        self._keylog = _KeyLog(keylog_file) if keylog_file else None
        self.accept_encoding: str | None = None
        self.rtt_s: float | None = None
        self._proto: _H3Protocol | None = None
        self._ticket_came = asyncio.Event()
        """Set when the current connection's server sent a session ticket."""
        self._transport: asyncio.DatagramTransport | None = None
        self._lock = asyncio.Lock()
        self._retired: dict[_H3Protocol, asyncio.DatagramTransport | None] = {}
        """Connections a ``503`` ``draining`` came on, with streams still in flight on them."""
        self._closing: set[asyncio.Task[None]] = set()

    def _config(self) -> QuicConfiguration:
        config = QuicConfiguration(
            is_client=True, alpn_protocols=list(H3_ALPN), server_name=self.origin.host,
            idle_timeout=self._idle_timeout_s,
        )
        quic_trust(config, self._verify, self._ca_file)
        stored = self._tickets.take(self._server)
        config.session_ticket = None if stored is None else decode_ticket(stored)
        config.secrets_log_file = cast(TextIO, self._keylog)
        return config

    @property
    def _server(self) -> str:
        return f"{self.origin.host}:{self.origin.port}"

    def _store_ticket(self, ticket: SessionTicket) -> None:
        self._tickets.put(self._server, encode_ticket(ticket),
                          ticket.not_valid_after.timestamp())
        self._ticket_came.set()

    async def _connection(self, recorder: TimingRecorder | None) -> tuple[_H3Protocol, bool]:
        """The open connection, or a new one; the flag is True when early data may be sent."""
        async with self._lock:
            proto = self._proto
            if proto is not None and proto.usable:
                if not proto.handshake_waiter.done():
                    await self._await_handshake(proto, recorder)
                return proto, False
            await self._drop()
            return await self._open(recorder)

    async def _open(self, recorder: TimingRecorder | None) -> tuple[_H3Protocol, bool]:
        import socket

        address = await self._resolver.resolve(
            self.origin.host, self.origin.port, recorder, kind=socket.SOCK_DGRAM)
        config = self._config()
        early = config.session_ticket is not None and (
            config.session_ticket.max_early_data_size or 0) > 0
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        if recorder is not None:
            recorder.feed("quic_handshake.started", started)
        self._ticket_came = asyncio.Event()
        quic = QuicConnection(configuration=config, session_ticket_handler=self._store_ticket)
        transport, proto = await loop.create_datagram_endpoint(
            lambda: _H3Protocol(quic), remote_addr=(address, self.origin.port))
        self._transport = transport
        self._proto = proto
        proto.connect((address, self.origin.port), transmit=True)
        if not early:
            await self._await_handshake(proto, recorder)
        return proto, early

    async def _await_handshake(self, proto: _H3Protocol, recorder: TimingRecorder | None) -> None:
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                await asyncio.shield(proto.handshake_waiter)
        except TimeoutError:
            await self._drop()
            raise ConnectError(
                f"QUIC handshake with {self.origin.host}:{self.origin.port} timed out after "
                f"{self._connect_timeout_s:g} s (is HTTP/3 served on UDP port {self.origin.port}?)"
            ) from None
        except ConnectionRefusedError:
            await self._drop()
            raise ConnectError(
                f"cannot connect to {self.origin.host}:{self.origin.port}: nothing listens on"
                f" UDP port {self.origin.port} (ICMP port unreachable)") from None
        except ConnectionError as exc:
            await self._drop()
            reason = str(exc)
            if "certificate" in reason.lower() or "verify" in reason.lower():
                raise TLSError(f"QUIC TLS handshake failed: {reason}") from None
            raise ConnectError(f"QUIC connection to {self.origin.host} failed: {reason}") from None
        if recorder is not None and proto.handshake_at is not None:
            recorder.feed("quic_handshake.complete", proto.handshake_at)
        self.rtt_s = _min_rtt_s(proto._quic) or self.rtt_s

    async def _drop(self) -> None:
        proto, transport = self._proto, self._transport
        self._proto, self._transport = None, None
        await _close(proto, transport)

    def _retire(self, proto: _H3Protocol) -> None:
        """A ``503`` ``draining`` came on ``proto``: the next request opens a new connection
        (behind a balancer it may reach another of the region's processes); ``proto`` closes
        when its last stream ends."""
        if self._proto is proto:
            self._retired[proto] = self._transport
            self._proto, self._transport = None, None

    def _close_retired(self, proto: _H3Protocol) -> None:
        """Close a retired connection whose streams have ended, in the background: the
        request whose answer retired it goes on without waiting for the goodbye."""
        task = asyncio.get_running_loop().create_task(_close(proto, self._retired.pop(proto)))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    @asynccontextmanager
    async def request(
        self,
        method: str,
        path: str,
        *,
        headers: dict[str, str],
        body: bytes | None,
        recorder: TimingRecorder | None,
    ) -> AsyncIterator[HTTPResponse]:
        proto, early = await self._connection(recorder)
        quic = proto._quic
        stream_id = quic.get_next_available_stream_id()
        stream = _Stream(asyncio.get_running_loop())
        proto.streams[stream_id] = stream
        fields = [
            (b":method", method.encode()), (b":scheme", b"https"),
            (b":authority", self.origin.host_header.encode()), (b":path", path.encode()),
            *((k.lower().encode(), v.encode()) for k, v in headers.items()),
        ]
        try:
            proto.h3.send_headers(stream_id, fields, end_stream=body is None)
            if body is not None:
                proto.h3.send_data(stream_id, body, end_stream=True)
            proto.transmit()
            if recorder is not None:
                sent = time.perf_counter()
                if early:
                    # 0-RTT: the request left with the first flight and the handshake completes
                    # while it is in flight. Only what came before the send is a connection
                    # phase, so the phases never overlap (Timings.zero_rtt says which it was).
                    recorder.feed("quic_handshake.complete", sent)
                recorder.feed("request_sent", sent)
                if early:
                    await self._await_handshake(proto, None)
                    hs = proto.handshake
                    recorder.record.zero_rtt = bool(hs is not None and hs.early_data_accepted)
            raw_headers, at = await stream.headers
            if recorder is not None:
                recorder.feed("first_byte", at)
            hdrs = {k.decode().lower(): v.decode() for k, v in raw_headers}
            status = int(hdrs.pop(":status", "0"))
            response = HTTPResponse(status, hdrs, "HTTP/3", self._chunks(stream),
                                    on_retire=lambda: self._retire(proto))
            note_response_headers(recorder, response)
            noted_accept_encoding(self, response)
            self.rtt_s = _min_rtt_s(quic) or self.rtt_s
            yield response
        finally:
            proto.streams.pop(stream_id, None)
            if not stream.ended and proto.usable:
                with contextlib.suppress(Exception):
                    quic.reset_stream(stream_id, ErrorCode.H3_REQUEST_CANCELLED)
                    proto.transmit()
            if proto in self._retired and not proto.streams:
                self._close_retired(proto)

    @staticmethod
    async def _chunks(stream: _Stream) -> AsyncIterator[bytes]:
        while True:
            item = await stream.data.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            assert isinstance(item, bytes)
            stream.unread -= len(item)
            yield item

    async def prewarm(self, connections: int = 1) -> Refusal | None:
        # The handshake only: no request, so no refusal heard (the first keep-warm asks).
        await self._connection(None)
        return None

    async def keepalive(self) -> Refusal | None:
        """``GET /healthz`` on the open connection, as over HTTP/1.1 and HTTP/2: a server times
        an idle QUIC connection by its requests, not by PINGs (the router closes one without
        a request for ``limits.client_header_timeout_s``). Dropped if it fails or times out.
        Returns the answer's refusal (``429``, ``503``), if it was one. Answered ``draining``,
        the connection is retired and a new one asked once: behind a balancer it may reach
        another of the region's processes, and its answer is the one returned."""
        proto = self._proto
        if proto is None or not proto.usable or not proto.handshake_waiter.done():
            return None
        answer = await self._ping(proto)
        if answer is None or not answer.draining:
            return answer
        try:
            return await self._ping(None)
        except FirstbyteError:  # the new connection failed: the next request tells
            return None

    async def _ping(self, proto: _H3Protocol | None) -> Refusal | None:
        """``GET /healthz`` on ``proto`` (the open connection; None: a new one) within the
        connect timeout; its refusal, if one. A ``draining`` answer retires the connection."""
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                async with self.request("GET", paths.HEALTHZ, headers={}, body=None,
                                        recorder=None) as response:
                    answer = refusal(response, await response.read())
                    if answer is not None and answer.draining:
                        response.retire_connection()
        except (TimeoutError, ConnectionError, TransportCut):
            async with self._lock:
                if proto is not None and self._proto is proto:
                    await self._drop()
            return None
        return answer

    async def reset(self) -> None:
        """Forget the current connection (e.g. after a stall); the next request reconnects."""
        async with self._lock:
            await self._drop()

    async def aclose(self) -> None:
        proto = self._proto
        if proto is not None and proto.heard and proto.handshake_waiter.done():
            # A process that makes one request and exits (a CLI, a serverless function) closes
            # right after its response; the server's ticket for the next 0-RTT start follows
            # the handshake and may still be in flight. A used ticket is refused (single use),
            # so without the new one the next process pays a full handshake.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(TICKET_WAIT_S):
                    await self._ticket_came.wait()
        await self.reset()
        retired, self._retired = self._retired, {}
        await asyncio.gather(*self._closing, *(_close(p, t) for p, t in retired.items()),
                             return_exceptions=True)


async def _close(proto: _H3Protocol | None, transport: asyncio.DatagramTransport | None) -> None:
    """Close a QUIC connection, waiting a little for the server's goodbye if it ever spoke."""
    if proto is not None:
        proto.close()
        if proto.heard:  # else there is no peer to say goodbye to
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.5):
                    await proto.wait_closed()
    if transport is not None:
        transport.close()
