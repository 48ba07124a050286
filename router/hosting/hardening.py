"""Defences hypercorn (0.17, 0.18) lacks, added as small patches on its protocol classes.

Each patch wraps one hypercorn method and says why; :mod:`.patches` lists them (with their
expected shapes and order) and applies them once per process, and they act only on a server
whose hypercorn ``Config`` carries
``firstbyte_limits`` (:class:`~firstbyte.router.hosting.limits.ClientLimits`), which
:func:`firstbyte.router.hosting.servers.serve` sets.

- connections: counted at their accept (:mod:`.accept`); a refused one gets a 503 after its
  first request's head (HTTP/2: a 503 for its first stream, then GOAWAY) and is closed;
- HTTP/1.1: a request head must be complete within ``header_timeout_s`` of its first byte
  (slowloris), and a request with both ``Content-Length`` and ``Transfer-Encoding`` is
  answered 400 and its connection closed (RFC 9112 section 6.1: request smuggling);
- a body the app answered without reading (401, 404, a 413 after 64 MiB) is read and dropped,
  so it cannot fill the app's queue and stall the connection;
- HTTP/2: a header block must end within ``header_timeout_s`` of its stream's first HEADERS
  bytes (GOAWAY PROTOCOL_ERROR); DATA for a stream already answered is acknowledged and the
  stream reset (NO_ERROR) instead of raising ``KeyError``; a rapid-reset flood gets GOAWAY
  (ENHANCE_YOUR_CALM) and the connection is closed, so the apps of its streams see a
  disconnect and cancel their work; a stream whose flow-control window stays shut for
  ``send_timeout_s`` is reset (CANCEL) alone (:mod:`.send_timeout`);
- HTTP/3 and QUIC (:mod:`.quic_hardening`): late DATA for an answered stream is dropped; a
  new connection is counted per address, closed when it has had no request for
  ``header_timeout_s``, and (under a handshake flood) asked to prove its address (Retry);
- WebSocket: a message over ``websocket_max_message_size`` is refused at its frame header
  (:mod:`.ws_frames`), and permessage-deflate is not offered (a compressed frame's header
  does not bound what it inflates to); a closing socket's unread messages are dropped, so
  its disconnect never waits behind them (that deadlock held the connection until shutdown).

Every refusal is one log line (``firstbyte.hosting``), throttled per reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from typing import Any

from .limits import ClientLimits, ConnectionCounter, HeaderBlockClock, ResetFlood, Throttle
from .ws_frames import FrameSizeGuard

__all__ = [
    "BUSY_BODY",
    "BUSY_H1",
    "LINGER_S",
    "TIMEOUT_H1",
    "WS_LINGER_MAX_S",
    "Linger",
    "busy_h1",
    "count_connection",
    "report",
]

log = logging.getLogger("firstbyte.hosting")

_throttle = Throttle(10.0)

LINGER_S = 1.0
"""After a refusal answered before the client's input ended, what the client still sends is
read and dropped until it has sent nothing for this long: closing with unread input makes the
kernel send a reset, which can destroy the answer (a 1009 close frame, a 413) before the
client reads it."""
WS_LINGER_MAX_S = 30.0
"""... and a WebSocket refused for a message too big closes this long after the refusal at
the latest, whatever the client still sends (nginx's ``lingering_time``)."""


class Linger:
    """When a connection that refused its client's input mid-way closes: once the client has
    sent nothing for ``quiet_s``, or ``max_s`` after the refusal at the latest (nginx's
    ``lingering_timeout`` and ``lingering_time``). A client still sending when it was refused
    reads the answer once it stops; one that never stops is cut at ``max_s``. Sans-IO: the
    times are the caller's clock."""

    __slots__ = ("ends", "last_input", "quiet_s")

    def __init__(self, now: float, quiet_s: float = LINGER_S, max_s: float = WS_LINGER_MAX_S):
        self.quiet_s = quiet_s
        self.last_input = now
        self.ends = now + max_s

    def heard(self, now: float) -> None:
        """The client sent something (read and dropped)."""
        self.last_input = now

    def wait_s(self, now: float) -> float:
        """How long to wait before asking again; 0 when the connection is to close now."""
        return max(0.0, min(self.last_input + self.quiet_s, self.ends) - now)

BUSY_BODY = (
    b'{"error":{"message":"Too many connections; retry later.",'
    b'"type":"server_error","param":null,"code":"overloaded"}}'
)
_BUSY_HEAD = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
    b"retry-after: 1\r\nconnection: close\r\ncontent-length: %d\r\n" % len(BUSY_BODY)
)
BUSY_H1 = _BUSY_HEAD + b"\r\n" + BUSY_BODY


def busy_h1(cors_lines: bytes = b"") -> bytes:
    """The HTTP/1.1 503 ``overloaded`` of a refused connection, with ``cors_lines`` (header
    lines ending CRLF, :func:`.refusal_cors.h1_cors_lines`) among its headers."""
    return _BUSY_HEAD + cors_lines + b"\r\n" + BUSY_BODY if cors_lines else BUSY_H1
TIMEOUT_H1 = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


def _limits(config: Any) -> ClientLimits | None:
    limits: ClientLimits | None = getattr(config, "firstbyte_limits", None)
    return limits


def report(level: int, reason: str, client: object, detail: str = "") -> None:
    """Log one line for ``reason`` unless one was logged in the last 10 s (uvicorn's guards,
    :mod:`.uvicorn_limits`, report through it too)."""
    more = _throttle.report(reason, time.monotonic())
    if more is None:
        return
    log.log(level, "%s from %s%s%s", reason, client, f": {detail}" if detail else "", more)


def _guard_connections(run: Any) -> None:
    """Answer connections refused at their accept (:mod:`.accept` counts them there, per
    client address, and keeps descriptors in reserve).

    hypercorn accepts every connection until ``accept()`` fails with EMFILE; asyncio then
    stops accepting for a second at a time and every new client hangs in the backlog, the
    ones that held the descriptors included or not. Refusing before ``limit - reserved_fds``
    answers new clients at once and leaves room for streams in flight to reach upstreams.
    """

    class GuardedTCPServer(run.TCPServer):  # type: ignore[misc]
        async def run(self) -> None:
            from .accept import answer_refused

            admission = getattr(self.reader, "admission", None)
            if admission is not None and admission.refusal is not None:
                await answer_refused(
                    self.reader, self.writer, deadline_s=admission.deadline_s,
                    cors=getattr(self.config, "firstbyte_refusal_cors", None),
                )
                return
            await super().run()

        async def _read_data(self) -> None:
            await super()._read_data()
            # The client has gone, but hypercorn's keep-alive timer is still in the
            # connection's task group, which keeps the socket (and its descriptor) until the
            # timer fires: a client that connects and closes at once held a descriptor for
            # the whole keep-alive timeout. Stop it, so the connection closes now.
            await self.idle_task.stop()

    run.TCPServer = GuardedTCPServer


def count_connection(counter: ConnectionCounter, get_extra_info: Any) -> str | None:
    """The former one-call count: the client's address if the connection is admitted (then
    ``counter.close(address)`` must follow), None if refused (logged). New code takes an
    :class:`.accept.Admission` with :func:`.accept.admit`, and answers a refusal after the
    request's head (:func:`.accept.answer_refused`)."""
    from .accept import admit

    admission = admit(counter, get_extra_info)
    return admission.client if admission.refusal is None else None


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


_HEADERS_FRAME, _CONTINUATION_FRAME = 0x1, 0x9


def pending_header_block(connection: Any) -> int | None:
    """The stream whose header block h2's ``connection`` holds unfinished: a HEADERS frame
    whose END_HEADERS has not come, or the first bytes of a HEADERS or CONTINUATION frame
    not whole yet (:attr:`HeaderBlockClock.UNKNOWN` before they name their stream); None if
    there is none."""
    frames = connection.incoming_buffer
    if frames._headers_buffer:
        return int(frames._headers_buffer[0].stream_id)
    # The unparsed bytes, from a frame's first byte (h2 drops each frame it parsed): ``_data``
    # since h2 4.2, ``data`` in 4.1.
    data = frames._data if hasattr(frames, "_data") else frames.data
    if len(data) < 4 or data[3] not in (_HEADERS_FRAME, _CONTINUATION_FRAME):
        return None
    if len(data) < 9:
        return HeaderBlockClock.UNKNOWN
    return int.from_bytes(data[5:9], "big") & 0x7FFFFFFF


def _time_h2_header_blocks() -> None:
    """Close an HTTP/2 connection whose header block does not end in time.

    h2 holds a HEADERS frame without END_HEADERS, and its CONTINUATION frames, until the
    block's end (at most 64 frames), and hypercorn sees nothing of it: its only clock, the
    keep-alive timer, closed a connection sending one CONTINUATION byte every 20 s at
    ``keep_alive_timeout_s`` (75 s), and never while another stream of it was open. nginx
    applies ``client_header_timeout`` to an HTTP/2 request's header: so does this, from the
    block's first HEADERS bytes (:class:`HeaderBlockClock`), and then closes the connection
    with GOAWAY PROTOCOL_ERROR, as nginx does when a client times out.
    """
    import h2.errors
    from hypercorn.events import Closed, RawData
    from hypercorn.protocol.h2 import H2Protocol

    handle = H2Protocol.handle

    async def timed(self: Any, event: Any) -> None:
        limits = _limits(self.config)
        if limits is None:
            await handle(self, event)
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        await handle(self, event)
        timer: asyncio.TimerHandle | None = getattr(self, "_firstbyte_block_timer", None)
        if isinstance(event, Closed) or self.closed:
            if timer is not None:
                timer.cancel()
            return
        if not isinstance(event, RawData):
            return
        clock: HeaderBlockClock | None = getattr(self, "_firstbyte_block_clock", None)
        if clock is None:
            clock = self._firstbyte_block_clock = HeaderBlockClock(limits.header_timeout_s)
        due = clock.read(pending_header_block(self.connection), now)
        if timer is not None and (due is None or timer.when() != due):
            timer.cancel()
            timer = self._firstbyte_block_timer = None
        if due is not None and timer is None:
            self._firstbyte_block_timer = loop.call_at(due, _expired, self, clock)

    def _expired(self: Any, clock: HeaderBlockClock) -> None:
        report(
            logging.INFO,
            "HTTP/2 request head timed out: GOAWAY",
            self.client,
            f"a header block{_of_stream(clock.stream)} unfinished after"
            f" {clock.timeout_s:g} s (limits.client_header_timeout_s)",
        )
        self._firstbyte_closing = asyncio.ensure_future(
            goaway_and_close(self, h2.errors.ErrorCodes.PROTOCOL_ERROR)
        )

    H2Protocol.handle = timed  # type: ignore[method-assign]


def _of_stream(stream: int | None) -> str:
    return "" if stream is None or stream == HeaderBlockClock.UNKNOWN else f" of stream {stream}"


async def goaway_and_close(protocol: Any, error_code: int) -> None:
    """Send GOAWAY ``error_code`` on the HTTP/2 connection ``protocol`` (hypercorn's), then
    close it: the apps of its streams see a disconnect."""
    from hypercorn.events import Closed

    from .goaway import send_h2_goaway

    await send_h2_goaway(protocol, error_code)
    await protocol.send(Closed())


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


def _refuse_streams_past_the_limit() -> None:
    """Refuse an HTTP/2 stream past ``SETTINGS_MAX_CONCURRENT_STREAMS`` alone.

    h2 raises ``TooManyStreamsError`` for the HEADERS that opens one stream too many, a
    connection error: hypercorn answers GOAWAY PROTOCOL_ERROR and the connection's other
    streams, every one of them within the limit, are lost with it. RFC 9113 section 5.1.2
    makes it a stream error; that stream is now reset with REFUSED_STREAM (which tells the
    client it may send it again) and the connection goes on. Its header block is still
    decoded: HPACK's table is the connection's, and a block skipped would corrupt the next.
    """
    import h2.connection
    import h2.errors
    import h2.exceptions
    from h2.stream import StreamClosedBy
    from hyperframe.frame import RstStreamFrame

    receive = h2.connection.H2Connection._receive_headers_frame

    def refusing(self: Any, frame: Any) -> Any:
        try:
            return receive(self, frame)
        except h2.exceptions.TooManyStreamsError:
            if self.config.client_side or frame.stream_id <= self.highest_inbound_stream_id:
                raise  # not a new stream of a client: h2's own error stands
            h2.connection._decode_headers(self.decoder, frame.data)
            self.highest_inbound_stream_id = frame.stream_id
            # Closed by our reset: its DATA still in flight is acknowledged (the
            # connection's window) and answered by h2 with RST_STREAM, not a GOAWAY.
            self._closed_streams[frame.stream_id] = StreamClosedBy.SEND_RST_STREAM
            refused = RstStreamFrame(frame.stream_id)
            refused.error_code = h2.errors.ErrorCodes.REFUSED_STREAM
            return [refused], []

    h2.connection.H2Connection._receive_headers_frame = refusing  # type: ignore[method-assign]


def _close_finished_h2_streams() -> None:
    """Handle DATA for answered streams, and rapid-reset floods, on HTTP/2.

    hypercorn forgets a stream once its app has answered; DATA the client still sends for it
    (a POST answered 401, 404 or 413 before its body was read) raised ``KeyError`` and took
    the connection down with a traceback. Such DATA is now acknowledged (flow control) and
    the stream reset with NO_ERROR, which RFC 9113 section 8.1 provides for exactly this.

    A client that opens streams and resets them before their response (HEADERS, RST_STREAM,
    again, fifty thousand times in three seconds) makes the server start a request's work per
    stream for free. Each connection has a budget of streams reset before their response was
    done (:class:`ResetFlood`: ``h2_max_early_resets`` at once, ``h2_early_resets_per_s``
    after); past it the connection gets GOAWAY ENHANCE_YOUR_CALM and is closed, as nginx,
    Envoy and h2o did in October 2023.
    """
    import h2.errors
    import h2.events
    import h2.exceptions
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
            flood = self._firstbyte_reset_flood = ResetFlood(
                limits.h2_max_early_resets, limits.h2_early_resets_per_s
            )
        if isinstance(event, h2.events.RequestReceived):
            flood.stream_opened()
        elif (
            isinstance(event, h2.events.StreamReset)
            and event.stream_id in self.streams
            and flood.stream_reset_early(asyncio.get_running_loop().time())
        ):
            report(
                logging.WARNING,
                "HTTP/2 rapid reset: GOAWAY",
                self.client,
                f"{flood.early_resets} of {flood.opened} streams reset before their response,"
                f" over {flood.burst} at once and {flood.per_s:g} a second"
                " (limits.h2_max_early_resets, limits.h2_early_resets_per_s)",
            )
            await goaway_and_close(self, h2.errors.ErrorCodes.ENHANCE_YOUR_CALM)
            return True
        return False

    H2Protocol._handle_events = guarded  # type: ignore[method-assign]


def _drop_unread_messages(stream: Any) -> None:
    """Empty a closing WebSocket's app queue (hypercorn's, ``max_app_queue_size`` = 10), so
    the disconnect fits at once and is the app's next message: a gone client's unread
    requests are void. With the queue full, the connection's reader waited on the app while
    the app, done, waited on nothing: the connection was held until shutdown (12 messages
    sent at once, then a reset), and logged a traceback then."""
    queue = getattr(stream.app_put, "__self__", None)
    if isinstance(queue, asyncio.Queue):
        while not queue.empty():
            queue.get_nowait()


async def _discard(message: Any) -> None:
    """An app queue's ``put`` for a socket whose app was told it closed."""


def _ignore_later_messages(stream: Any) -> None:
    """After the disconnect, what is still parsed from the socket's last bytes is dropped:
    hypercorn goes on putting the messages of one read into the app queue, and once the app
    has returned nobody takes them (a full queue held the connection for good)."""
    if stream.app_put is not None:
        stream.app_put = _discard


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
        linger: Linger | None = getattr(self, "_firstbyte_linger", None)
        if linger is not None and isinstance(event, (Body, Data)):
            linger.heard(asyncio.get_running_loop().time())  # a refused message's rest
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
        elif isinstance(event, StreamClosed):
            _drop_unread_messages(self)
            await handle(self, event)
            _ignore_later_messages(self)
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
            _drop_unread_messages(self)
            await self.app_put({"type": "websocket.disconnect", "code": 1009})
            _ignore_later_messages(self)

        loop = asyncio.get_running_loop()
        linger = self._firstbyte_linger = Linger(loop.time())

        async def linger_then_close() -> None:
            while True:  # the client's input moves the deadline: ask again when it is due
                wait_s = linger.wait_s(loop.time())
                if wait_s <= 0:
                    break
                await asyncio.sleep(wait_s)
            await self.send(StreamClosed(stream_id=self.stream_id))

        self.task_group.spawn(linger_then_close)

    WSStream.handle = guarded  # type: ignore[method-assign]
