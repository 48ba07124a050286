"""The connection limits for uvicorn's HTTP/1.1 (httptools) protocol, as hypercorn has them.

uvicorn (0.3x) bounds a request's head size and closes idle keep-alive connections, and has
a global connection cap, but no per-client one, no clock on a request head, and no
descriptor reserve. :func:`guarded_protocol` gives its ``HttpToolsProtocol`` the same rules
:mod:`.hardening` gives hypercorn, from the same :class:`~.limits.ClientLimits`:

- connections: counted for their client address at their accept, before the TLS handshake,
  which this protocol runs itself (``loop.start_tls``, bounded by ``header_timeout_s``) so
  that it can: uvicorn's server would hand it a connection only once its handshake is done.
  A refused one (:class:`~.limits.ConnectionCounter`) gets a 503 after its request's head
  and is closed (:mod:`.accept`);
- a connection that sends nothing is closed at the keep-alive timeout, as an idle one
  between requests is (uvicorn's clock starts only after a first response). One timer a
  connection serves every request (uvicorn makes one at each response's end and cancels it
  at the next byte, ~8k instructions a request): a byte makes the connection busy, a
  response's end idle, and the timer, when it fires, closes an idle connection past its
  timeout or moves to that timeout's end (``_keep_alive_due``);
- a request head must be complete within ``header_timeout_s`` of its first byte (slowloris),
  else 408 and close;
- with ``limits.heads``, every piece of a request head passes a :class:`~.heads.HeadScanner`
  before httptools sees it (:mod:`.head_guards` says why, and what the answer is). A head
  starts with the connection and after each request's end. A pipelined head that began in
  the read that ended the request before it went past the scanner in part, and httptools
  keeps no bytes one could rescan: it is bounded by its size alone
  (:class:`~.heads.UnalignedHead`), counted after each read, so by one read more (256 KiB at
  most under uvloop). Done in this one subclass, not a second one around it: each of
  httptools' callbacks then runs one layer of Python less, on every request. For the same
  reason the overrides do what uvicorn's own methods beneath them do, in line, not through
  ``super()`` (patch ``uvicorn-h1-in-line`` checks the shape of what they reproduce);
- after a response sent before its request's body was all received (a 401 at the head, a
  413, a 408 when the body is too slow), uvicorn reads the rest and drops it; the connection
  closes if the client pauses for 2 s before the body's end, or at the latest after 30 s, so
  a client holding the body back does not hold the connection, while one still sending it
  reads the answer and keeps its connection;
- a connection upgraded to a WebSocket stays counted for its client until it closes (uvicorn
  hands the socket to another protocol object, whose end the count follows), and a message
  over the bound, which the websockets library refuses at its frame header (close 1009), is
  one log line, as under hypercorn; so is a text message that is not UTF-8 (close 1007),
  which uvicorn logs as an ERROR with a traceback.

An HTTP/1.0 request's answer without a length goes out as HTTP/1.0 has it, delimited by the
connection's close, not chunked (:mod:`.http10`).

A request with both ``Content-Length`` and ``Transfer-Encoding`` needs nothing here:
httptools (llhttp) refuses it as invalid, and uvicorn answers 400 and closes. Every refusal
is one throttled log line, as hypercorn's are.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import ssl
from collections.abc import Callable
from typing import Any

from .accept import MAX_REFUSED_HEAD_BYTES, Admission, ProxyRead, TlsStart, admit
from .body_writer import EXTENSION as BODY_WRITER
from .body_writer import uvicorn_shape_ok, uvicorn_writer
from .disconnected import EXTENSION as DISCONNECTED
from .hardening import LINGER_S, TIMEOUT_H1, Linger, busy_h1, report
from .heads import HeadRefusal, HeadScanner, UnalignedHead, refusal_h1, too_many_fields
from .http10 import close_delimited
from .limits import ClientLimits, ConnectionCounter
from .proxy_protocol import Proxied, ProxyProtocol, with_client
from .refusal_cors import RefusalCors, h1_cors_lines
from .send_timeout import SendTimer
from .uvicorn_send import fast_send

__all__ = ["guarded_protocols"]

_LINGER_IDLE_S = 2.0
"""After a response sent before its request's body was all here, the connection closes once
the client has sent nothing for this long (nginx's ``lingering_timeout`` is 5 s)..."""
_LINGER_MAX_S = 30.0
"""... and at the latest this long after the response (nginx's ``lingering_time``)."""
_TIMER_GRAIN_S = 0.001
"""The event loop's timers count in milliseconds (uvloop's, libuv's): one due within this
is due now, as uvicorn's own keep-alive timer would have fired."""


def _client(protocol: Any) -> str:
    """The client address of a uvicorn protocol, for a log line."""
    return protocol.client[0] if protocol.client else "?"


def guarded_protocols(
    limits: ClientLimits,
    counter: ConnectionCounter,
    tls: ssl.SSLContext | None = None,
    proxy: ProxyProtocol | None = None,
    cors: RefusalCors | None = None,
) -> tuple[type[Any], type[Any]]:
    """uvicorn's ``HttpToolsProtocol`` enforcing ``limits`` and its sans-IO WebSocket
    protocol (``http=`` and ``ws=`` of its ``Config``); ``counter`` counts this server's
    connections; with ``tls`` the protocol runs the TLS handshake of the connections it
    accepts (uvicorn's own ``ssl`` must then be off); with ``proxy`` it reads the PROXY
    header of its balancers' connections first (:class:`.accept.ProxyRead`); ``cors`` gives
    a refused connection's 503 the CORS headers of its request's origin
    (:mod:`.refusal_cors`)."""
    from httptools import HttpParserError, HttpParserUpgrade
    from uvicorn.protocols.http.flow_control import service_unavailable
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    from uvicorn.protocols.http.httptools_impl import RequestResponseCycle as Cycle
    from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
    from websockets.exceptions import PayloadTooBig

    # Called on a new object: no class call with keywords. Its message event is ours.
    init_cycle: Callable[..., None] = Cycle.__init__
    uvicorns_receive = Cycle.receive

    class ReceivingCycle(Cycle):
        """uvicorn's request cycle, with a ``receive`` that takes a message already here
        without waiting: uvicorn's awaits its message event's ``wait()`` (a coroutine made
        and run) and calls its ``clear()`` and ``flow.resume_reading()`` for it, ~3k
        instructions a request whose body came with its head. A method, not a closure set
        on each cycle: nothing made per request, and no loop for the cyclic GC."""

        message_event: MessageEvent  # type: ignore[assignment]  # made by on_headers_complete

        async def receive(self) -> Any:
            event = self.message_event
            if event.value and not (
                self.waiting_for_100_continue or self.disconnected or self.response_complete
            ):
                # uvicorn's receive, where its wait() would return at once (patch
                # uvicorn-h1-in-line checks the shape of what this does)
                flow = self.flow
                if flow.read_paused:  # FlowControl.resume_reading's own test
                    flow.resume_reading()
                event.value = False  # its clear()
                message = {"type": "http.request", "body": bytes(self.body),
                           "more_body": self.more_body}
                self.body = bytearray()
                return message
            return await uvicorns_receive(self)  # it writes 100 Continue, waits, or says gone

    heads = limits.heads
    writer_ok: bool | None = None  # uvicorn's cycle has what the body writer reads? (once)
    # HeadScanner.feed's fast path, for a head's first read (below): a head that ends in it
    # under this many bytes is within every bound but the count of its fields.
    whole_under = (
        0 if heads is None else min(
            heads.max_request_line_bytes, heads.max_header_line_bytes, heads.max_header_bytes
        )
    )

    class SendTimeout:
        """The send timeout (:mod:`.send_timeout`) of a uvicorn protocol, ahead of it in the
        MRO: armed while the connection's writes are paused."""

        _send: SendTimer | None = None
        loop: asyncio.AbstractEventLoop
        transport: asyncio.Transport

        def pause_writing(self) -> None:
            super().pause_writing()  # type: ignore[misc]
            self._send = SendTimer.paused(
                self._send, self.loop, limits.send_timeout_s, self.transport, _client(self)
            )

        def resume_writing(self) -> None:
            if self._send is not None:
                self._send.resumed()
            super().resume_writing()  # type: ignore[misc]

        def _stop_send_timer(self) -> None:
            if self._send is not None:
                self._send.stop()

    class GuardedWebSocketProtocol(SendTimeout, WebSocketsSansIOProtocol):
        counted: Admission | None = None
        """The client whose count this connection holds, handed over at the upgrade."""
        _lingering: Linger | None = None
        """Set once a message was refused: the socket closes once the client is quiet."""
        ended: asyncio.Future[None] | None = None
        """Set when the connection closes (handed over at the upgrade, see below)."""

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_send_timer()
            _release(self.counted, self.ended)
            self.counted = None
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._lingering is None:
                super().data_received(data)
            else:  # after a refusal, what the client still sends is dropped
                self._lingering.heard(self.loop.time())

        def send_receive_event_to_app(self) -> None:
            """uvicorn's, but a text message that is not UTF-8 is one throttled line and a
            close 1007 (RFC 6455 section 8.1): uvicorn logs an ERROR with a traceback for it,
            one per socket, for what is a client's mistake."""
            if self.curr_msg_data_type == "text" and not self.close_sent:
                try:
                    b"".join(self.frames).decode()
                except UnicodeDecodeError as exc:
                    self.frames = []
                    report(
                        logging.INFO, "WebSocket text not UTF-8: close 1007", _client(self),
                        str(exc),
                    )
                    self.conn.send_close(1007, "invalid UTF-8")
                    self.handle_parser_exception()
                    return
            super().send_receive_event_to_app()

        def handle_parser_exception(self) -> None:
            """uvicorn's (the app told, the close frame sent), but the socket closes once
            the client has been quiet for a moment (:class:`.hardening.Linger`), not at
            once: closed with a frame's payload still arriving, the kernel would reset it
            and the client could lose the close frame (1009)."""
            if self._lingering is not None:  # uvicorn may call this again for the same error
                return
            exc = self.conn.parser_exc
            if isinstance(exc, PayloadTooBig):
                report(
                    logging.INFO, "WebSocket message too big: close 1009", _client(self), str(exc)
                )
            close = self.conn.close_sent
            assert close is not None  # the parser's error closed the connection
            self.queue.put_nowait(
                {"type": "websocket.disconnect", "code": close.code, "reason": close.reason}
            )
            self.transport.write(b"".join(self.conn.data_to_send()))
            self.close_sent = True
            self._lingering = Linger(self.loop.time())
            # uvicorn closes the socket when the app returns (told of the disconnect above,
            # it does at once) unless its close timer is set: the linger's timer is that.
            self.close_timer = self.loop.call_later(self._lingering.quiet_s, self._linger)

        def _linger(self) -> None:
            assert self._lingering is not None
            wait_s = self._lingering.wait_s(self.loop.time())
            if wait_s > 0 and not self.transport.is_closing():
                self.close_timer = self.loop.call_later(wait_s, self._linger)
                return
            self.close_timer = None
            self.transport.close()

    class GuardedHttpToolsProtocol(SendTimeout, HttpToolsProtocol):
        ended: asyncio.Future[None] | None = None
        """Set when the connection closes, for whoever serves it outside a uvicorn server
        (:mod:`.http1_split`); an upgraded connection's is set when its WebSocket closes."""
        admission: Admission | None = None
        """The connection's count; set before ``connection_made`` by whoever counted it at
        its accept (:mod:`.http1_split`), else taken there."""
        _head_timer: asyncio.TimerHandle | None = None
        _head_due = False
        """A head began in the read being parsed: its timer is armed once the read is parsed
        if the head did not end in it. Most heads come whole in one read: no timer for them
        (a timer made and cancelled in the same call cost ~5k instructions a request)."""
        _linger_timer: asyncio.TimerHandle | None = None
        _linger_ends = 0.0
        _last_data = 0.0
        _refused_head = b""
        _refused_answered = False
        _handshake: asyncio.Task[None] | None = None
        _tls_start: TlsStart | None = None
        _made = False
        _plain_early = b""
        _proxy: ProxyRead | None = None
        _proxy_client: tuple[str, int] | None = None
        _idle_from: float | None = None
        """Since when the connection has been idle (its last response complete, or its start,
        and no byte read since), for the keep-alive timer; None while a request is on."""
        _gone: tuple[tuple[Any, asyncio.Future[None]], ...] = ()
        """The ``firstbyte.disconnected`` futures (:mod:`.disconnected`) of the requests whose
        response may not be complete, with their request cycles: one, or more when requests
        were pipelined."""
        # The request head's bounds (limits.heads), when set: see the module's docstring.
        _head_scan: HeadScanner | None = None
        _unaligned: UnalignedHead | None = None
        _head_refused = False
        _feeding = False
        """In httptools' ``feed_data``: callbacks then come from the read being parsed."""
        _scan_began_in_read = False
        """The scanner was made (at a request's end) inside the read being parsed."""
        _head_fresh = True
        """The next bytes uvicorn's side reads begin a head that no scanner has seen yet (at
        the connection's start and after each request's end)."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            # What each request reads, on the instance from the start: a class attribute read
            # through an instance (the default above) costs ~240 instructions more.
            self._head_refused = False
            self._proxy = None
            self._tls_start = None
            self._head_timer = None
            self._linger_timer = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            if self.admission is not None:  # counted at its accept, handshake done
                self._connected(transport)
                return
            if proxy is not None:
                self._proxy = ProxyRead(proxy, transport, limits.header_timeout_s, self._proxied)
                if self._proxy.trusted:
                    return  # counted once its header names the client
            if self._count(transport) and self._proxy is None:
                self._serve(transport)

        def _count(self, transport: asyncio.Transport) -> bool:
            """Count the connection; False if closed at once (refused in the reserve)."""
            self.admission = admit(counter, transport.get_extra_info)
            if self.admission.refusal is not None and not self.admission.deadline_s:
                transport.close()  # the last half of the descriptor reserve: unanswered
                return False
            return True

        def _proxied(self, proxied: Proxied) -> None:
            assert self._proxy is not None
            transport: Any = self._proxy.transport
            self._proxy_client = proxied.source
            client = with_client(transport, proxied.source)
            if self.admission is None and not self._count(client):
                return
            self._serve(transport, proxied.rest)

        def _serve(self, transport: asyncio.Transport, early: bytes = b"") -> None:
            """Serve the connection (after its TLS handshake with ``tls``); ``early``: its
            bytes already read (after a PROXY header)."""
            if tls is None:
                self._connected(with_client(transport, self._proxy_client))
                if early:
                    self.data_received(early)
                return
            timeout = limits.header_timeout_s
            if self._proxy is not None:  # the header's wait and the handshake share it
                timeout = self._proxy.remaining_s()
            assert self.admission is not None
            if self.admission.refusal is not None:
                timeout = min(timeout, self.admission.deadline_s)
            self._tls_start = TlsStart(transport, self, tls, timeout)
            if early:
                self._tls_start.early(early)
            self._handshake = self.loop.create_task(self._start_tls())

        async def _start_tls(self) -> None:
            assert self._tls_start is not None
            wrapped = await self._tls_start.run()
            if wrapped is None:
                if self.admission is not None:
                    self.admission.release()
                return
            self._connected(with_client(wrapped, self._proxy_client))
            if self._plain_early:
                data, self._plain_early = self._plain_early, b""
                self.data_received(data)

        def _connected(self, transport: asyncio.Transport) -> None:
            self._made = True
            super().connection_made(transport)
            if self.admission is not None and self.admission.refusal is not None:
                # Answered after its head (in data_received), or closed at this deadline.
                self.timeout_keep_alive_task = self.loop.call_later(
                    self.admission.deadline_s, self.transport.close
                )
                return
            # uvicorn starts its keep-alive clock only after a response: a connection that
            # never sends a byte would stay open for good. hypercorn's idle timer runs from
            # the start; so does this one (the first byte makes the connection busy, as
            # between requests: _keep_alive_due).
            self._idle_from = self.loop.time()
            self.timeout_keep_alive_task = self.loop.call_later(
                self.timeout_keep_alive, self._keep_alive_due
            )

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_send_timer()
            if self._proxy is not None:
                self._proxy.stop()
            if not self._made:  # lost before its TLS handshake began: nothing of uvicorn's
                _release(self.admission, self.ended)
                self.admission = None
                return
            self._stop_head_timer()
            if self._linger_timer is not None:
                self._linger_timer.cancel()
                self._linger_timer = None
            _release(self.admission, self.ended)
            self.admission = None
            # uvicorn cancels it on a clean close only; kept across requests (see
            # _keep_alive_due), it may be pending whatever the cause.
            self._unset_keepalive_if_required()
            gone, self._gone = self._gone, ()
            for cycle, future in gone:
                _drop_writer(cycle)
                if not cycle.response_complete and not future.done():
                    future.set_result(None)
            super().connection_lost(exc)

        def _refused_data(self, data: bytes) -> None:
            """A refused connection: its request's head read, then 503 and close."""
            if self._refused_answered:
                return  # read and dropped until the close
            self._refused_head += data
            if (
                b"\r\n\r\n" not in self._refused_head
                and len(self._refused_head) < MAX_REFUSED_HEAD_BYTES
            ):
                return
            self._refused_answered = True
            self.transport.write(busy_h1(h1_cors_lines(cors, self._refused_head)))
            self.loop.call_later(LINGER_S, self.transport.close)

        def data_received(self, data: bytes) -> None:
            if self._head_refused:
                return  # answered: dropped until the connection closes
            if self._proxy is not None and self._proxy.waiting:
                self._proxy.feed(data)
                return
            if self._tls_start is not None and not self._made:
                if self._tls_start.pending:
                    self._tls_start.early(data)  # the TLS layer's, not yet in place
                else:  # decrypted, before the handshake's end reached this protocol
                    self._plain_early += data
                return
            # Past both, uvicorn's connection_made has run (flow is set) unless the connection
            # was closed at its count: bytes then are no head's.
            if heads is not None and self.flow is not None:
                if self._head_fresh and data:
                    # Most heads come whole and small in their first read: HeadScanner.feed's
                    # fast path (the same test) passes them without a scanner made for each.
                    self._head_fresh = False
                    end = data.find(b"\r\n\r\n") if data[0] > 0x0D else -1
                    if 0 <= end < whole_under:
                        if data.count(b"\n", 0, end) > heads.max_headers:
                            self._refuse_head(too_many_fields(heads))
                            return
                    else:
                        self._head_scan = HeadScanner(heads)
                scan = self._head_scan
                if scan is not None and not scan.complete:
                    refusal = scan.feed(data)
                    if refusal is not None:
                        self._refuse_head(refusal)
                        return
            if self.admission is not None and self.admission.refusal is not None:
                self._refused_data(data)
                return
            if self._linger_timer is not None:
                self._last_data = self.loop.time()  # the rest of a body answered already
            elif (
                self._head_timer is None
                and data
                and (self.cycle is None or self.cycle.response_complete)
                and not self.transport.is_closing()
            ):
                # The first bytes of a head (or of blank lines before one): its clock starts
                # (nginx's client_header_timeout).
                self._head_due = True
            self._feeding, self._scan_began_in_read = True, False
            # uvicorn's data_received, in line (one call a read fewer), but for its first
            # step, _unset_keepalive_if_required: the keep-alive timer stays, and finds the
            # connection busy if it fires before the next response's end (_keep_alive_due).
            self._idle_from = None
            try:
                self.parser.feed_data(data)
            except HttpParserError:
                msg = "Invalid HTTP request received."
                self.logger.warning(msg)
                self.send_400_response(msg)
            except HttpParserUpgrade:
                if self._should_upgrade():
                    self.handle_websocket_upgrade()
                else:
                    self._unsupported_upgrade_warning()
            finally:
                self._feeding = False
            if self._head_due:  # the head goes on in a later read: now it needs its timer
                self._head_due = False
                if self._head_timer is None and not self.transport.is_closing():
                    self._start_head_timer()
            unaligned = self._unaligned
            if unaligned is not None and not self._head_refused:
                refusal = unaligned.add(len(data))
                if refusal is not None:
                    self._refuse_head(refusal)

        def _refuse_head(self, refusal: HeadRefusal) -> None:
            self._head_refused = True
            self._stop_head_timer()  # the head is answered
            report(logging.INFO, f"request head refused: {refusal.status}", _client(self),
                   refusal.reason)
            if self.transport.is_closing():
                return
            cycle = self.cycle
            if cycle is not None and not cycle.response_complete:
                # A pipelined head, refused while the request before it is being answered:
                # that answer goes out whole, then the connection closes (a 431 written now
                # would land inside it).
                cycle.keep_alive = False
                return
            self.transport.write(refusal_h1(refusal))
            self.loop.call_later(LINGER_S, self.transport.close)

        def on_message_begin(self) -> None:
            if self._feeding and self._scan_began_in_read:
                # This head began in the read that ended the last request, after the point
                # the scanner had seen: its lines cannot be followed; bound its size.
                assert heads is not None  # the flag is set only with them
                self._head_scan, self._unaligned = None, UnalignedHead(heads)
                self._head_fresh = False
            if self._head_timer is None:  # a head that began where a dropped body ended
                self._head_due = True  # parsers call back from data_received only
            # uvicorn's on_message_begin, in line (a call a request fewer)
            self.url = b""
            self.expect_100_continue = False
            headers: list[tuple[bytes, bytes]] = []
            self.headers = headers
            self.scope = {  # type: ignore[typeddict-item]
                "type": "http",
                "asgi": {"version": self.asgi_version, "spec_version": "2.3"},
                "http_version": "1.1",
                "server": self.server,
                "client": self.client,
                "scheme": self.scheme,  # type: ignore[typeddict-item]
                "root_path": self.root_path,
                "headers": headers,
                "state": self.app_state.copy(),
            }

        def on_headers_complete(self) -> None:
            self._head_scan = self._unaligned = None
            self._head_fresh = self._head_due = False
            timer = self._head_timer  # _stop_head_timer inlined: once a request
            if timer is not None:
                timer.cancel()
                self._head_timer = None
            # uvicorn's on_headers_complete and _start_asgi_task, in line: the cycle made
            # without a keyword call (~4k instructions less), a URL parsed once (below), and
            # the writer, send and disconnect future set before its task starts.
            parser = self.parser
            scope = self.scope
            http_version = parser.get_http_version()
            scope["method"] = parser.get_method().decode("ascii")
            if http_version != "1.1":
                scope["http_version"] = http_version
            if parser.should_upgrade() and self._should_upgrade():
                return
            url = self.url
            parsed = _URLS.get(url)
            if parsed is None:
                parsed = _parse_url(url)
            path, raw_path, query = parsed
            root_path = self.root_path
            if root_path:
                scope["path"] = root_path + path
                scope["raw_path"] = root_path.encode("ascii") + raw_path
            else:  # the same values, without an encode() and two joins
                scope["path"] = path
                scope["raw_path"] = raw_path
            scope["query_string"] = query
            limit = self.limit_concurrency
            if limit is not None and (
                len(self.connections) >= limit or len(self.tasks) >= limit
            ):
                app = service_unavailable
                message = "Exceeded concurrency limit."
                self.logger.warning(message)
            else:
                app = self.app
            before = self.cycle
            cycle = self.cycle = new_cycle(ReceivingCycle)
            init_cycle(
                cycle, scope, self.transport, self.flow, self.logger, self.access_logger,
                self.access_log, self.server_state.default_headers, MessageEvent(),
                self.expect_100_continue, http_version != "1.0" and parser.should_keep_alive(),
                self.on_response_complete,
            )
            nonlocal writer_ok
            if writer_ok is None:
                writer_ok = uvicorn_shape_ok(cycle)
            if writer_ok:
                # Its task has not run yet: the app finds the writer in its scope, and the
                # cycle's send is still ours to change.
                extensions: dict[str, Any] = scope.setdefault("extensions", {})
                if http_version == "1.0":  # is_http10
                    close_delimited(cycle)  # no chunked coding: no chunk writer either
                else:
                    extensions[BODY_WRITER] = uvicorn_writer(cycle)
                    fast_send(cycle)
                gone = extensions[DISCONNECTED] = self.loop.create_future()
                live = [(cycle, gone)]
                for pair in self._gone:  # a loop, not a generator: that is a call per request
                    if not pair[0].response_complete:
                        live.append(pair)
                self._gone = tuple(live)
            if before is None or before.response_complete:  # uvicorn's _start_asgi_task
                if self.config.reset_contextvars:
                    task = self.loop.create_task(
                        cycle.run_asgi(app), context=contextvars.Context()
                    )
                else:
                    task = self.loop.create_task(cycle.run_asgi(app))
                task.add_done_callback(self.tasks.discard)
                self.tasks.add(task)
            else:  # pipelined: queued until the response before it is complete
                self.flow.pause_reading()
                self.pipeline.appendleft((cycle, app))

        def handle_websocket_upgrade(self) -> None:
            self._head_due = False
            self._stop_head_timer()
            self._unset_keepalive_if_required()  # the socket is the WebSocket's from here
            counted, self.admission = self.admission, None
            ended, self.ended = self.ended, None
            super().handle_websocket_upgrade()
            upgraded = self.transport.get_protocol()
            if isinstance(upgraded, GuardedWebSocketProtocol):
                upgraded.counted = counted
                upgraded.ended = ended
            else:  # not ours to follow: stop counting rather than leak
                _release(counted, ended)

        def on_response_complete(self) -> None:
            cycle = self.cycle
            if cycle is not None and cycle.more_body and not self.transport.is_closing():
                # Answered before its body was all here. uvicorn reads the rest and drops it,
                # then serves the next request; closing at once instead would make the kernel
                # reset a connection with a body still arriving, and the client would lose
                # the answer. But a client holding the body back would hold the connection,
                # so the rest must keep coming: a pause of 2 s, or 30 s in all, closes it
                # (nginx's lingering close).
                now = self.loop.time()
                self._last_data, self._linger_ends = now, now + _LINGER_MAX_S
                self._linger_timer = self.loop.call_later(_LINGER_IDLE_S, self._linger)
            if cycle is not None:  # _drop_writer, in line (once a request)
                extensions = cycle.scope.get("extensions")
                if extensions:
                    extensions.pop(BODY_WRITER, None)
                try:  # noqa: SIM105
                    del cycle.send
                except AttributeError:
                    pass
            # uvicorn's on_response_complete, in line, but for its keep-alive timer: a timer
            # made and cancelled for each request cost ~8k instructions; one made once and
            # moved on when it fires (_keep_alive_due) closes the connection at the same time.
            self.server_state.total_requests += 1
            if self.transport.is_closing():
                return
            flow = self.flow
            if flow.read_paused:  # FlowControl.resume_reading's own test, without its call
                flow.resume_reading()
            if self.pipeline:
                cycle, app = self.pipeline.pop()
                self._start_asgi_task(cycle, app)
            else:
                self._idle_from = self.loop.time()
                if self.timeout_keep_alive_task is None:
                    self.timeout_keep_alive_task = self.loop.call_later(
                        self.timeout_keep_alive, self._keep_alive_due
                    )

        def on_message_complete(self) -> None:
            if self._linger_timer is not None:  # the rest of the body came: serve on
                self._linger_timer.cancel()
                self._linger_timer = None
                if not self.pipeline:  # idle again (the read of this end made it busy)
                    self._idle_from = self.loop.time()
                    if self.timeout_keep_alive_task is None:
                        self.timeout_keep_alive_task = self.loop.call_later(
                            self.timeout_keep_alive, self._keep_alive_due
                        )
            # uvicorn's on_message_complete, in line
            cycle = self.cycle
            if not (
                (self.parser.should_upgrade() and self._should_upgrade())
                or cycle.response_complete
            ):
                cycle.more_body = False
                event: MessageEvent = cycle.message_event  # type: ignore[assignment]
                if not event.value:  # set already when the body's last part came (on_body)
                    event.set()
            if heads is not None:
                self._head_scan, self._head_fresh = None, True  # scanned from the next byte
                self._scan_began_in_read = self._feeding

        def _keep_alive_due(self) -> None:
            """The keep-alive timer: uvicorn's handler (the close) once the connection has
            been idle for ``timeout_keep_alive``; moved to that time if it became idle since
            the timer was set; gone if a request is on (its response's end sets it again)."""
            idle_from = self._idle_from
            if idle_from is None:
                self.timeout_keep_alive_task = None
                return
            left = idle_from + self.timeout_keep_alive - self.loop.time()
            if left > _TIMER_GRAIN_S:
                self.timeout_keep_alive_task = self.loop.call_later(left, self._keep_alive_due)
                return
            self.timeout_keep_alive_task = None
            self.timeout_keep_alive_handler()

        def _linger(self) -> None:
            until = min(self._last_data + _LINGER_IDLE_S, self._linger_ends)
            if self.loop.time() < until and not self.transport.is_closing():
                self._linger_timer = self.loop.call_at(until, self._linger)
                return
            self._linger_timer = None
            self.transport.close()

        def _head_expired(self) -> None:
            self._head_timer = None
            if self.transport.is_closing():
                return
            report(logging.INFO, "request head timed out", _client(self))
            self.transport.write(TIMEOUT_H1)
            self.transport.close()

        def _start_head_timer(self) -> None:
            self._head_timer = self.loop.call_later(limits.header_timeout_s, self._head_expired)

        def _stop_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

    return GuardedHttpToolsProtocol, GuardedWebSocketProtocol


_URLS: dict[bytes, tuple[str, bytes, bytes]] = {}
"""What uvicorn makes of a request target (its path, raw path and query string), by the
target's bytes: the same few come again and again, and ``httptools.parse_url`` makes an
object of seven fields for each (~2.5k instructions, the lookup ~0.1k)."""
_MAX_URLS = 512
"""A new target past this many kept empties the table first: a client sending made-up
targets (before any key is checked) cannot grow it, nor fill it for good so that the
targets every request uses are parsed each time; they are kept again on their next use..."""
_MAX_URL_BYTES = 64
"""... and longer targets are parsed each time, never kept."""
new_cycle = object.__new__


class MessageEvent:
    """What uvicorn's request cycle asks of its ``message_event`` (``asyncio.Event``'s
    ``set``, ``clear``, ``is_set`` and ``wait``, which behave as that one's), for one
    cycle: no deque and no loop-binding mixin made each request, and ``value`` in the
    open for :class:`ReceivingCycle`'s ``receive`` to test and clear without a call."""

    __slots__ = ("value", "waiters")

    def __init__(self) -> None:
        self.value = False
        """Set since the last ``clear()``."""
        self.waiters: list[asyncio.Future[bool]] | None = None
        """The futures of the ``wait()`` calls waiting (made at the first one)."""

    def is_set(self) -> bool:
        return self.value

    def set(self) -> None:
        if not self.value:
            self.value = True
            waiters = self.waiters
            if waiters:
                for future in waiters:
                    if not future.done():
                        future.set_result(True)

    def clear(self) -> None:
        self.value = False

    async def wait(self) -> bool:
        if self.value:
            return True
        future = asyncio.get_running_loop().create_future()
        waiters = self.waiters
        if waiters is None:
            waiters = self.waiters = []
        waiters.append(future)
        try:
            await future
            return True
        finally:
            waiters.remove(future)


def _parse_url(url: bytes) -> tuple[str, bytes, bytes]:
    """uvicorn's reading of a request target (``on_headers_complete``): its path, decoded
    and percent-unquoted; its raw path; its query string (``b""`` for none). Kept in
    :data:`_URLS` within its bounds; an invalid target raises as ``parse_url`` does."""
    from urllib.parse import unquote

    from httptools import parse_url

    parsed_url = parse_url(url)
    raw_path = parsed_url.path
    path = raw_path.decode("ascii")
    if "%" in path:
        path = unquote(path)
    parsed = (path, raw_path, parsed_url.query or b"")
    if len(url) <= _MAX_URL_BYTES:
        if len(_URLS) >= _MAX_URLS:
            _URLS.clear()
        _URLS[url] = parsed
    return parsed


def _drop_writer(cycle: Any) -> None:
    """Take the body writer out of ``cycle``'s scope once its response is over (or its
    connection lost): it refers to the cycle, whose scope refers to it, and that loop kept
    each request's scope, request context and what hangs off them (~45 objects, its body)
    for the cyclic GC, which a router tuned for serving runs rarely. Whoever still holds
    the writer keeps it working (it says False from now on); the scope no longer does.
    The cycle's own ``send`` (:mod:`.uvicorn_send`, :mod:`.http10`) goes too, for the same
    loop: whoever holds it (the application) keeps it, and uvicorn's is the cycle's again.
    At a response's end the protocol does this in line (``on_response_complete``)."""
    extensions = cycle.scope.get("extensions")
    if extensions:
        extensions.pop(BODY_WRITER, None)
    # try/except, not contextlib.suppress: no context manager made once a request
    try:  # noqa: SIM105
        del cycle.send  # not through vars(): that would make the instance keep a dict
    except AttributeError:
        pass  # uvicorn's own (a HEAD's), or taken already


def _release(admission: Admission | None, ended: asyncio.Future[None] | None) -> None:
    """A connection's end: its client's count given back, whoever waits on ``ended`` told."""
    if admission is not None:
        admission.release()
    if ended is not None and not ended.done():
        ended.set_result(None)
