"""Defences hypercorn (0.17, 0.18) lacks, added as small patches on its protocol classes.

Each patch wraps one hypercorn method and says why; :func:`harden_hypercorn` applies them
all once per process, and they act only on a server whose hypercorn ``Config`` carries
``firstbyte_limits`` (:class:`~firstbyte.router.hosting.limits.ClientLimits`), which
:func:`firstbyte.router.hosting.servers.serve` sets.

- connections: per-client-address cap and descriptor reserve, checked when a connection
  starts; a refused one gets a 503 (HTTP/1.1) or GOAWAY (HTTP/2) and is closed at once;
- HTTP/1.1: a request head must be complete within ``header_timeout_s`` of its first byte
  (slowloris), and a request with both ``Content-Length`` and ``Transfer-Encoding`` is
  answered 400 and its connection closed (RFC 9112 section 6.1: request smuggling);
- a body the app answered without reading (401, 404, a 413 after 64 MiB) is read and dropped,
  so it cannot fill the app's queue and stall the connection;
- HTTP/2: DATA for a stream already answered is acknowledged and the stream reset
  (NO_ERROR) instead of raising ``KeyError``; a rapid-reset flood gets GOAWAY
  (ENHANCE_YOUR_CALM) and the connection is closed, so the apps of its streams see a
  disconnect and cancel their work;
- HTTP/3: DATA (or trailers) for a stream already answered is dropped and the client asked
  to stop sending it (STOP_SENDING, H3_NO_ERROR) instead of raising ``KeyError``, which
  ended hypercorn's UDP server task and with it HTTP/3 for the life of the process;
- QUIC: a new connection counts against the per-address cap and the descriptor reserve as a
  TCP one does (refused with CONNECTION_REFUSED); one with no request for
  ``header_timeout_s`` is closed, PINGs or not; while new handshakes arrive faster than
  ``quic_retry_above_handshakes_per_s`` each must first prove its address with a Retry;
- WebSocket: a message over ``websocket_max_message_size`` is refused at its frame header
  (:mod:`.ws_frames`), and permessage-deflate is not offered (a compressed frame's header
  does not bound what it inflates to).

Every refusal is one log line (``firstbyte.hosting``), throttled per reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from typing import Any

from .limits import (
    ClientLimits,
    ConnectionCounter,
    HandshakeRate,
    ResetFlood,
    Throttle,
    admit_quic,
)
from .ws_frames import FrameSizeGuard

__all__ = [
    "BUSY_H1",
    "LINGER_S",
    "TIMEOUT_H1",
    "count_connection",
    "harden_hypercorn",
    "refuse_connection",
    "release_quic_connections",
    "report",
]

log = logging.getLogger("firstbyte.hosting")

_throttle = Throttle(10.0)

LINGER_S = 1.0
"""After refusing a WebSocket message, what the client still sends is read and dropped this
long before the connection closes: closing with unread input makes the kernel send a reset,
which can destroy the 1009 close frame before the client reads it."""

_BUSY_BODY = (
    b'{"error":{"message":"Too many connections; retry later.",'
    b'"type":"server_error","param":null,"code":"overloaded"}}'
)
BUSY_H1 = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
    b"retry-after: 1\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s"
    % (len(_BUSY_BODY), _BUSY_BODY)
)
TIMEOUT_H1 = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


def _limits(config: Any) -> ClientLimits | None:
    limits: ClientLimits | None = getattr(config, "firstbyte_limits", None)
    return limits


def report(level: int, reason: str, client: object, detail: str = "") -> None:
    """Log one line for ``reason`` unless one was logged in the last 10 s (uvicorn's guards,
    :mod:`.uvicorn_limits`, report through it too)."""
    held = _throttle.allow(reason, time.monotonic())
    if held is None:
        return
    more = f" ({held} more since the last report)" if held else ""
    log.log(level, "%s from %s%s%s", reason, client, f": {detail}" if detail else "", more)


def harden_hypercorn() -> None:
    """Apply the patches (idempotent)."""
    from hypercorn.asyncio import run

    if getattr(run, "_firstbyte_hardened", False):
        return
    _guard_connections(run)
    _time_request_heads()
    _reject_ambiguous_framing()
    _discard_unread_bodies()
    _close_finished_h2_streams()
    _drop_late_h3_data()
    _guard_quic_connections()
    _guard_websocket_frames()
    run._firstbyte_hardened = True  # type: ignore[attr-defined]


def _guard_connections(run: Any) -> None:
    """Count connections per client address and keep descriptors in reserve.

    hypercorn accepts every connection until ``accept()`` fails with EMFILE; asyncio then
    stops accepting for a second at a time and every new client hangs in the backlog, the
    ones that held the descriptors included or not. Refusing at ``limit - reserved_fds``
    answers new clients at once and leaves room for streams in flight to reach upstreams.
    """

    class GuardedTCPServer(run.TCPServer):  # type: ignore[misc]
        async def run(self) -> None:
            limits = _limits(self.config)
            counter: ConnectionCounter | None = getattr(self.config, "firstbyte_connections", None)
            if limits is None or counter is None:
                await super().run()
                return
            client = count_connection(counter, self.writer.get_extra_info)
            if client is None:
                await refuse_connection(self.writer)
                return
            try:
                await super().run()
            finally:
                counter.close(client)

        async def _read_data(self) -> None:
            await super()._read_data()
            # The client has gone, but hypercorn's keep-alive timer is still in the
            # connection's task group, which keeps the socket (and its descriptor) until the
            # timer fires: a client that connects and closes at once held a descriptor for
            # the whole keep-alive timeout. Stop it, so the connection closes now.
            await self.idle_task.stop()

    run.TCPServer = GuardedTCPServer


def count_connection(counter: ConnectionCounter, get_extra_info: Any) -> str | None:
    """Count a new connection for its client's address (``get_extra_info`` is its transport's
    or stream writer's): the address, or None if the per-client cap or the descriptor reserve
    refuses it (one throttled log line). The caller answers a refused connection 503 and
    closes it; an admitted one ends with ``counter.close(address)``."""
    peer = get_extra_info("peername")
    client = str(peer[0]) if peer else "?"
    sock = get_extra_info("socket")
    refusal = counter.open(client, sock.fileno() if sock is not None else 0)
    if refusal is not None:
        report(logging.WARNING, "connection refused", client, refusal)
        return None
    return client


async def refuse_connection(writer: asyncio.StreamWriter) -> None:
    """Answer 503 (or, on a connection that chose HTTP/2 by ALPN, GOAWAY) and close."""
    ssl_object = writer.get_extra_info("ssl_object")
    if ssl_object is not None and ssl_object.selected_alpn_protocol() == "h2":
        import h2.config
        import h2.connection
        import h2.errors

        h2_connection = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
        h2_connection.initiate_connection()
        h2_connection.close_connection(error_code=h2.errors.ErrorCodes.ENHANCE_YOUR_CALM)
        data = h2_connection.data_to_send()
    else:
        data = BUSY_H1
    with contextlib.suppress(Exception):
        writer.write(data)
        await asyncio.wait_for(writer.drain(), 1.0)
    writer.close()
    with contextlib.suppress(Exception):
        await asyncio.wait_for(writer.wait_closed(), 1.0)


def _time_request_heads() -> None:
    """Close an HTTP/1.1 connection whose request head is not complete in time.

    hypercorn's only clock on a connection is its keep-alive timer, running from the end of
    one request to the head of the next; a client that sends a byte of head now and then
    (slowloris) holds the connection that long whatever the head's pace. nginx's
    ``client_header_timeout`` counts from the head's first byte: so does this.
    """
    import h11
    from hypercorn.events import Closed, RawData
    from hypercorn.protocol.h11 import H11Protocol

    handle = H11Protocol.handle
    create_stream = H11Protocol._create_stream

    async def timed_handle(self: Any, event: Any) -> None:
        limits = _limits(self.config)
        if limits is not None:
            timer: asyncio.TimerHandle | None = getattr(self, "_firstbyte_head_timer", None)
            if (
                isinstance(event, RawData)
                and event.data
                and self.stream is None
                and timer is None
                and isinstance(self.connection, h11.Connection)  # not a WebSocket's
            ):
                self._firstbyte_head_timer = asyncio.get_running_loop().call_later(
                    limits.header_timeout_s, _head_expired, self
                )
            elif isinstance(event, Closed) and timer is not None:
                timer.cancel()
        await handle(self, event)

    async def stop_timer(self: Any, request: Any) -> None:
        _stop_head_timer(self)
        await create_stream(self, request)

    def _head_expired(self: Any) -> None:
        async def close() -> None:
            report(logging.INFO, "request head timed out", self.client)
            await self.send(RawData(data=TIMEOUT_H1))
            await self.send(Closed())

        self._firstbyte_closing = asyncio.ensure_future(close())

    H11Protocol.handle = timed_handle  # type: ignore[method-assign]
    H11Protocol._create_stream = stop_timer  # type: ignore[method-assign]


def _stop_head_timer(protocol: Any) -> None:
    timer: asyncio.TimerHandle | None = getattr(protocol, "_firstbyte_head_timer", None)
    if timer is not None:
        timer.cancel()
        protocol._firstbyte_head_timer = None


def _reject_ambiguous_framing() -> None:
    """400 and close for a request with both ``Content-Length`` and ``Transfer-Encoding``.

    h11 frames such a body by ``Transfer-Encoding`` and keeps the connection, so the bytes a
    front proxy counted by ``Content-Length`` as this body become a second request here
    (request smuggling). RFC 9112 section 6.1: reject, or close after responding.
    """
    from hypercorn.events import Closed
    from hypercorn.protocol.h11 import H11Protocol

    create_stream = H11Protocol._create_stream

    async def checked(self: Any, request: Any) -> None:
        if _limits(self.config) is not None:
            names = {name.lower() for name, _ in request.headers}
            if b"content-length" in names and b"transfer-encoding" in names:
                _stop_head_timer(self)
                report(logging.INFO, "request with Content-Length and Transfer-Encoding",
                        self.client)
                await self._send_error_response(400)
                await self.send(Closed())
                return
        await create_stream(self, request)

    H11Protocol._create_stream = checked  # type: ignore[method-assign]


_DISCARD_LIMIT_S = 60.0
"""The longest a discarded body is read for; it ends sooner, at the stream's close."""
_discarding: set[asyncio.Task[None]] = set()


def _discard_unread_bodies() -> None:
    """Read and drop the rest of a body its app answered without reading.

    hypercorn hands a request body to its app through a queue of ``max_app_queue_size`` (10)
    messages, and the connection's reader waits while that queue is full. An app that answers
    before the whole body was read (a 401 or 404 to a POST, a 413 after 64 MiB) leaves the
    queue full while the client goes on sending: the reader waits for good, and so does the
    stream's ``http.disconnect``, inside the app's last ``send``. The connection serves nothing
    more (on HTTP/2, none of its other streams either). So when a response starts on a stream
    whose body is not all queued (or whose queue is full), what is queued for it from then on
    is read and dropped until its ``http.disconnect``. The router's apps read no body once
    they have started to answer.
    """
    from hypercorn.protocol.events import EndBody
    from hypercorn.protocol.http_stream import HTTPStream

    handle = HTTPStream.handle
    app_send = HTTPStream.app_send

    async def noting_the_end(self: Any, event: Any) -> None:
        if isinstance(event, EndBody):
            self._firstbyte_body_queued = True
        await handle(self, event)

    async def discarding(self: Any, message: Any) -> None:
        if (
            message is not None
            and message["type"] == "http.response.start"
            and _limits(self.config) is not None
        ):
            queue = getattr(self.app_put, "__self__", None)
            queued = getattr(self, "_firstbyte_body_queued", False)
            if isinstance(queue, asyncio.Queue) and (not queued or queue.full()):
                task = asyncio.get_running_loop().create_task(_discard_until_disconnect(queue))
                _discarding.add(task)
                task.add_done_callback(_discarding.discard)
        await app_send(self, message)

    HTTPStream.handle = noting_the_end  # type: ignore[method-assign]
    HTTPStream.app_send = discarding  # type: ignore[method-assign]


async def _discard_until_disconnect(queue: asyncio.Queue[Any]) -> None:
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(_DISCARD_LIMIT_S):
            while (await queue.get())["type"] != "http.disconnect":
                pass


def _close_finished_h2_streams() -> None:
    """Handle DATA for answered streams, and rapid-reset floods, on HTTP/2.

    hypercorn forgets a stream once its app has answered; DATA the client still sends for it
    (a POST answered 401, 404 or 413 before its body was read) raised ``KeyError`` and took
    the connection down with a traceback. Such DATA is now acknowledged (flow control) and
    the stream reset with NO_ERROR, which RFC 9113 section 8.1 provides for exactly this.

    A client that opens streams and resets them before their response (HEADERS, RST_STREAM,
    again, fifty thousand times in three seconds) makes the server start a request's work per
    stream for free. Each connection counts streams reset before their response was done;
    past ``h2_max_early_resets`` (and more than half of all streams) it gets GOAWAY
    ENHANCE_YOUR_CALM and is closed, as nginx, Envoy and h2o did in October 2023.
    """
    import h2.errors
    import h2.events
    import h2.exceptions
    from hypercorn.events import Closed
    from hypercorn.protocol.h2 import H2Protocol

    handle_events = H2Protocol._handle_events

    async def guarded(self: Any, events: list[Any]) -> None:
        limits = _limits(self.config)
        if limits is None:
            await handle_events(self, events)
            return
        for event in events:
            if isinstance(event, h2.events.DataReceived) and event.stream_id not in self.streams:
                # Give the connection's window back even once the stream is closed (h2 refuses
                # to acknowledge data of a closed stream): the data in flight when the stream
                # was reset would otherwise shrink the window for every later request.
                if event.flow_controlled_length:
                    with contextlib.suppress(h2.exceptions.ProtocolError, ValueError):
                        self.connection.increment_flow_control_window(
                            event.flow_controlled_length
                        )
                with contextlib.suppress(h2.exceptions.ProtocolError):
                    self.connection.reset_stream(event.stream_id, h2.errors.ErrorCodes.NO_ERROR)
                await self._flush()
                continue
            if limits.h2_max_early_resets is not None and await _count_resets(self, event, limits):
                return
            await handle_events(self, [event])

    async def _count_resets(self: Any, event: Any, limits: ClientLimits) -> bool:
        """True if ``event`` made this connection a flood (then it is closed)."""
        assert limits.h2_max_early_resets is not None
        flood: ResetFlood | None = getattr(self, "_firstbyte_reset_flood", None)
        if flood is None:
            flood = self._firstbyte_reset_flood = ResetFlood(limits.h2_max_early_resets)
        if isinstance(event, h2.events.RequestReceived):
            flood.stream_opened()
        elif (
            isinstance(event, h2.events.StreamReset)
            and event.stream_id in self.streams
            and flood.stream_reset_early()
        ):
            report(
                logging.WARNING,
                "HTTP/2 rapid reset: GOAWAY",
                self.client,
                f"{flood.early_resets} of {flood.opened} streams reset before their"
                " response (limits.h2_max_early_resets)",
            )
            with contextlib.suppress(h2.exceptions.ProtocolError):
                self.connection.close_connection(
                    error_code=h2.errors.ErrorCodes.ENHANCE_YOUR_CALM
                )
                await self._flush()
            await self.send(Closed())
            return True
        return False

    H2Protocol._handle_events = guarded  # type: ignore[method-assign]


def _drop_late_h3_data() -> None:
    """Drop HTTP/3 DATA for a stream hypercorn has already forgotten.

    hypercorn's ``H3Protocol.handle`` looks every DATA frame's stream up with
    ``self.streams[stream_id]``, and forgets a stream once its app has answered. A POST
    answered before its body was read (401 to a long prompt without a key, 404 to a keyed
    POST to an unknown path) gets the rest of its body afterwards: ``KeyError``, raised into
    the UDP server's loop, which ended it: every later QUIC handshake timed out, for the life
    of the process. Such frames are now dropped, and the client is asked to stop sending the
    body (STOP_SENDING with H3_NO_ERROR, as RFC 9114 section 4.1 provides for a response
    sent before the request was complete).
    """
    from aioquic.h3.connection import ErrorCode
    from aioquic.h3.events import DataReceived, HeadersReceived
    from hypercorn.protocol.events import Body, EndBody
    from hypercorn.protocol.h3 import H3Protocol

    if not all(hasattr(H3Protocol, name) for name in ("handle", "_create_stream")):
        raise RuntimeError("hypercorn's H3Protocol has changed shape: review _drop_late_h3_data")
    handle = H3Protocol.handle

    async def tolerant(self: Any, quic_event: Any) -> None:
        if _limits(self.config) is None:
            await handle(self, quic_event)
            return
        for event in self.connection.handle_event(quic_event):
            if isinstance(event, HeadersReceived):
                if self.context.terminated.is_set():
                    continue
                await self._create_stream(event)
                if event.stream_ended:
                    await _to_stream(self, event.stream_id, EndBody(stream_id=event.stream_id))
            elif isinstance(event, DataReceived):
                body = Body(stream_id=event.stream_id, data=event.data)
                if await _to_stream(self, event.stream_id, body) and event.stream_ended:
                    await _to_stream(self, event.stream_id, EndBody(stream_id=event.stream_id))

    async def _to_stream(self: Any, stream_id: int, event: Any) -> bool:
        """Hand ``event`` to its stream; False (and the rest of the body refused) if the
        stream is gone."""
        stream = self.streams.get(stream_id)
        if stream is not None:
            await stream.handle(event)
            return True
        # Once per stream: aioquic remembers the STOP_SENDING it was asked for. None: aioquic
        # has forgotten the stream too (its whole body was received), nothing left to stop.
        quic = self.connection._quic
        quic_stream = quic._streams.get(stream_id)
        if quic_stream is not None and getattr(quic_stream.receiver, "_stop_error_code", 0) is None:
            with contextlib.suppress(ValueError):
                quic.stop_stream(stream_id, ErrorCode.H3_NO_ERROR)
                await self.send()
        return False

    H3Protocol.handle = tolerant  # type: ignore[method-assign]


class _QuicGuard:
    """One QUIC listener's accounting: its handshake rate, Retry tokens, the connections it
    counted (to give back when they end) and their idle timers."""

    def __init__(self, limits: ClientLimits, counter: ConnectionCounter | None) -> None:
        from aioquic.quic.retry import QuicRetryTokenHandler

        self.limits = limits
        self.counter = counter
        threshold = limits.quic_retry_above_handshakes_per_s
        self.rate = HandshakeRate(threshold) if threshold is not None else None
        self.tokens = QuicRetryTokenHandler()
        self.counted: dict[int, tuple[Any, str]] = {}
        """id(connection) -> (connection, client address), until it ends."""
        self.closing: set[asyncio.Task[None]] = set()

    def release(self, connection: Any) -> None:
        entry = self.counted.pop(id(connection), None)
        timer: asyncio.TimerHandle | None = connection.__dict__.pop("_firstbyte_idle", None)
        if timer is not None:
            timer.cancel()
        if entry is not None and self.counter is not None:
            self.counter.close(entry[1])

    def release_all(self) -> None:
        for connection, _ in list(self.counted.values()):
            self.release(connection)


def release_quic_connections(protocol: Any) -> None:
    """Give back what the connections of a QUIC protocol that has stopped counted (its
    server task ended: its connections are gone without their ends being seen)."""
    guard: _QuicGuard | None = getattr(protocol, "_firstbyte_quic", None)
    if guard is not None:
        guard.release_all()


def _lowest_free_fd() -> int:
    """The descriptor the next socket would get (Linux hands out the lowest free one)."""
    import os

    try:
        fd = os.open(os.devnull, os.O_RDONLY)
    except OSError:
        return 1 << 30  # none free at all
    os.close(fd)
    return fd


def _guard_quic_connections() -> None:
    """Count, time and (under a handshake flood) validate new QUIC connections.

    hypercorn's ``QuicProtocol.handle`` makes a connection of every Initial datagram of 1,200
    bytes or more: no per-address cap, no descriptor reserve, and a client that PINGs is
    never idle for aioquic, so 2,000 connections from one address with no request were all
    held for minutes (RSS 62 -> 250 MB); 20,000 Initials at 2,000/s took the process to 100%
    CPU and 710 MB. Here a new connection's Initial is handled as hypercorn does, with:

    - Retry first (RFC 9000 section 8.1) while handshakes arrive faster than
      ``quic_retry_above_handshakes_per_s``: the client must echo a token bound to its
      address before any connection state exists, so a spoofed flood costs one small
      packet each (a client that already holds a valid token is served whatever the rate);
    - the per-address cap and the descriptor reserve of :func:`~.limits.admit_quic`
      (refused: CONNECTION_CLOSE with CONNECTION_REFUSED, one throttled log line);
    - a timer that closes the connection once it has had no request in flight for
      ``header_timeout_s`` (since it began or its last request ended), whatever it sends.
    """
    from aioquic.buffer import Buffer  # type: ignore[attr-defined]
    from aioquic.h3.connection import ErrorCode
    from aioquic.quic.packet import (
        PACKET_TYPE_INITIAL,
        QuicErrorCode,
        encode_quic_retry,
        pull_quic_header,
    )
    from hypercorn.events import RawData
    from hypercorn.protocol import quic
    from hypercorn.protocol.events import StreamClosed
    from hypercorn.protocol.h3 import H3Protocol

    from .quic import encode_initial_close

    hypercorn_quic: Any = quic  # its QuicConnection may be .quic's ticketing factory
    protocol_class: Any = hypercorn_quic.QuicProtocol
    needed = ("handle", "_handle_events", "send_all")
    if not all(hasattr(protocol_class, name) for name in needed) or not hasattr(
        hypercorn_quic, "_Connection"
    ):
        raise RuntimeError("hypercorn's QuicProtocol has changed shape: review hardening.py")
    handle = protocol_class.handle
    handle_events = protocol_class._handle_events
    stream_send = H3Protocol.stream_send

    def guard_of(self: Any, limits: ClientLimits) -> _QuicGuard:
        guard: _QuicGuard | None = getattr(self, "_firstbyte_quic", None)
        if guard is None:
            counter = getattr(self.config, "firstbyte_connections", None)
            guard = self._firstbyte_quic = _QuicGuard(limits, counter)
        return guard

    async def guarded(self: Any, event: Any) -> None:
        limits = _limits(self.config)
        if limits is None or not isinstance(event, RawData):
            await handle(self, event)
            return
        try:
            header = pull_quic_header(Buffer(data=event.data), host_cid_length=8)
        except ValueError:
            return
        if (
            header.packet_type != PACKET_TYPE_INITIAL
            or len(event.data) < 1200
            or header.destination_cid in self.connections
            or self.context.terminated.is_set()
            or header.version not in self.quic_config.supported_versions
        ):
            await handle(self, event)  # not a new connection: hypercorn's own way
            return
        await _new_connection(self, event, header, guard_of(self, limits))

    async def _new_connection(self: Any, event: Any, header: Any, guard: _QuicGuard) -> None:
        now = self.context.time()
        retry = guard.rate is not None and guard.rate.observe(now)
        original_cid, retry_cid = header.destination_cid, None
        if header.token:
            try:
                original_cid = guard.tokens.validate_token(
                    address=event.address,
                    destination_cid=header.destination_cid,
                    token=header.token,
                    now=now,
                )
                retry_cid = header.destination_cid
            except ValueError:
                if retry:  # a token of ours expired or forged: RFC 9000 section 8.1.3
                    await self.send(RawData(data=encode_initial_close(
                        version=header.version,
                        source_cid=header.destination_cid,
                        destination_cid=header.source_cid,
                        error_code=QuicErrorCode.INVALID_TOKEN,
                    ), address=event.address))
                    return
                # else: not one of ours (say, another server's NEW_TOKEN): as if none.
        elif retry:
            report(
                logging.WARNING,
                "QUIC handshakes above limits.quic_retry_above_handshakes_per_s: Retry",
                event.address[0],
                f"{guard.rate.rate(now):.0f}/s" if guard.rate is not None else "",
            )
            import os

            source_cid = os.urandom(8)
            token = guard.tokens.create_token(
                address=event.address,
                original_destination_connection_id=header.destination_cid,
                retry_source_connection_id=source_cid,
                now=now,
            )
            await self.send(RawData(data=encode_quic_retry(
                version=header.version,
                source_cid=source_cid,
                destination_cid=header.source_cid,
                original_destination_cid=header.destination_cid,
                retry_token=token,
            ), address=event.address))
            return
        client = str(event.address[0])
        if guard.counter is not None:
            refusal = admit_quic(guard.counter, client, _lowest_free_fd())
            if refusal is not None:
                report(logging.WARNING, "connection refused", client, f"QUIC: {refusal}")
                await self.send(RawData(data=encode_initial_close(
                    version=header.version,
                    source_cid=header.destination_cid,
                    destination_cid=header.source_cid,
                    error_code=QuicErrorCode.CONNECTION_REFUSED,
                ), address=event.address))
                return
        quic_connection = hypercorn_quic.QuicConnection(
            configuration=self.quic_config,
            original_destination_connection_id=original_cid,
            retry_source_connection_id=retry_cid,
        )
        connection: Any = hypercorn_quic._Connection(
            cids={header.destination_cid, quic_connection.host_cid},
            quic=quic_connection,
            task=self.context.single_task_class(),
        )
        self.connections[header.destination_cid] = connection
        self.connections[quic_connection.host_cid] = connection
        if guard.counter is not None:
            guard.counted[id(connection)] = (connection, client)
        connection._firstbyte_client = client
        connection._firstbyte_last_busy = time.monotonic()
        _arm_idle_timer(self, connection, guard, guard.limits.header_timeout_s)
        connection.quic.receive_datagram(event.data, event.address, now=self.context.time())
        await self._handle_events(connection, event.address)

    def _arm_idle_timer(self: Any, connection: Any, guard: _QuicGuard, delay_s: float) -> None:
        connection._firstbyte_idle = asyncio.get_running_loop().call_later(
            delay_s, _idle_check, self, connection, guard
        )

    def _idle_check(self: Any, connection: Any, guard: _QuicGuard) -> None:
        connection.__dict__.pop("_firstbyte_idle", None)
        if not connection.cids:  # ended meanwhile
            return
        timeout = guard.limits.header_timeout_s
        h3 = connection.h3
        now = time.monotonic()
        if h3 is not None and h3.streams:
            connection._firstbyte_last_busy = now
            _arm_idle_timer(self, connection, guard, timeout)
            return
        last = max(connection._firstbyte_last_busy, getattr(h3, "_firstbyte_last_busy", 0.0))
        if now - last < timeout:
            _arm_idle_timer(self, connection, guard, timeout - (now - last))
            return
        report(
            logging.INFO,
            "QUIC connection without a request: closed",
            connection._firstbyte_client,
            f"none for {timeout:g} s (limits.client_header_timeout_s)",
        )
        connection.quic.close(error_code=ErrorCode.H3_NO_ERROR, reason_phrase="idle")
        task = asyncio.ensure_future(self.send_all(connection))
        guard.closing.add(task)
        task.add_done_callback(guard.closing.discard)

    async def releasing(self: Any, connection: Any, client: Any = None) -> None:
        try:
            await handle_events(self, connection, client)
        finally:
            guard: _QuicGuard | None = getattr(self, "_firstbyte_quic", None)
            if not connection.cids and guard is not None:  # terminated: hypercorn forgot it
                guard.release(connection)

    async def noting_request_ends(self: Any, event: Any) -> None:
        if isinstance(event, StreamClosed):
            self._firstbyte_last_busy = time.monotonic()
        await stream_send(self, event)

    protocol_class.handle = guarded
    protocol_class._handle_events = releasing
    H3Protocol.stream_send = noting_request_ends  # type: ignore[method-assign]


def _guard_websocket_frames() -> None:
    """Refuse an oversized WebSocket message at its frame header (:mod:`.ws_frames`)."""
    from hypercorn.protocol.events import Body, Data, Request, StreamClosed
    from hypercorn.protocol.ws_stream import WSStream
    from wsproto.events import CloseConnection
    from wsproto.frame_protocol import CloseReason

    handle = WSStream.handle

    async def guarded(self: Any, event: Any) -> None:
        if _limits(self.config) is None:
            await handle(self, event)
            return
        if isinstance(event, Request):
            # Offer no permessage-deflate: a small compressed frame can inflate to gigabytes.
            headers = [(n, v) for n, v in event.headers if n.lower() != b"sec-websocket-extensions"]
            event = dataclasses.replace(event, headers=headers)
        elif (
            isinstance(event, (Body, Data))
            and not self.closed
            and getattr(self, "handshake", None) is not None
            and self.handshake.accepted
        ):
            guard: FrameSizeGuard | None = getattr(self, "_firstbyte_frames", None)
            if guard is None:
                guard = self._firstbyte_frames = FrameSizeGuard(
                    self.config.websocket_max_message_size
                )
            if not guard.feed(event.data):
                await _refuse_message(self, guard)
                return
        await handle(self, event)

    async def _refuse_message(self: Any, guard: FrameSizeGuard) -> None:
        report(
            logging.INFO,
            "WebSocket message too big: close 1009",
            self.client,
            f"a frame of {guard.declared_bytes} bytes, limit {guard.max_message_bytes}",
        )
        await self._send_wsproto_event(
            CloseConnection(code=CloseReason.MESSAGE_TOO_BIG, reason="message too big")
        )
        # From here the stream ignores input (the bytes are read and dropped) and the app.
        self.closed = True
        if self.app_put is not None:
            await self.app_put({"type": "websocket.disconnect", "code": 1009})

        async def linger_then_close() -> None:
            await asyncio.sleep(LINGER_S)
            await self.send(StreamClosed(stream_id=self.stream_id))

        self.task_group.spawn(linger_then_close)

    WSStream.handle = guarded  # type: ignore[method-assign]
