"""Connections counted from their accept, and refused with an answer the client can read.

A TCP connection holds a descriptor and memory from the moment it is accepted, before any
TLS byte; counting it only once its handshake is done let a client hold thousands of
sockets that never send a byte (each up to the handshake timeout) outside every limit. So:

- :func:`count_at_accept` makes hypercorn accept its TCP sockets itself, without TLS, count
  the connection for its client address (:class:`~.limits.ConnectionCounter`), and only then
  run the TLS handshake (``loop.start_tls``) under ``header_timeout_s``; the stream it hands
  hypercorn's connection task is a :class:`CountedReader` carrying the :class:`Admission`.
  uvicorn's protocol does the same at its ``connection_made`` (:mod:`.uvicorn_limits`).
- A connection refused at its accept is not closed there (a client reads a close, or a 503
  that arrives before its request, as a broken connection, httpx's ``ReadError``): it is
  served just enough to answer its first request, after that request's head:
  :func:`answer_refused` writes HTTP/1.1 ``503`` ``overloaded`` with ``Retry-After``, or on
  HTTP/2 a 503 for the first stream and GOAWAY, then closes. A refused connection has
  :data:`REFUSED_DEADLINE_S` in all for its handshake and that head
  (:data:`RESERVE_REFUSED_DEADLINE_S` past the descriptor reserve).
- Behind an L4 balancer (``ServerOptions.proxy_protocol``), :class:`ProxyRead` first reads
  the PROXY header of a balancer's connection (within ``header_timeout_s``), and the
  connection is counted, and served, as the client's it names; anyone else's connection
  that starts with such a header is closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import ssl
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, cast

from .hardening import BUSY_BODY, busy_h1, report
from .limits import ConnectionCounter
from .proxy_protocol import NEED_MORE, HeaderWait, Proxied, ProxyError, ProxyProtocol, with_client
from .refusal_cors import RefusalCors, cors_fields, h1_cors_lines
from .send_timeout import SendTimer

__all__ = [
    "H2_PREFACE",
    "REFUSED_DEADLINE_S",
    "RESERVE_REFUSED_DEADLINE_S",
    "Admission",
    "CountedReader",
    "ProxyRead",
    "TlsStart",
    "accepting",
    "admit",
    "answer_refused",
    "count_at_accept",
]

log = logging.getLogger("firstbyte.hosting")

H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
"""What an HTTP/2 client sends first on a plain connection (RFC 9113 section 3.4)."""

REFUSED_DEADLINE_S = 10.0
"""The longest a refused connection is held for its TLS handshake and its first request's
head (a client that means to ask sends them within a few round trips); then it is closed."""

RESERVE_REFUSED_DEADLINE_S = 2.0
"""The same for a connection refused because descriptors reached ``reserved_fds``: each one
held spends a descriptor the reserve keeps for streams in flight, so a flood of them may
hold at most its rate times this; a client 150 ms away still sends its handshake and its
request's head well within it. In the last half of the reserve a refused connection is
closed at once, unanswered: that half stays for streams in flight whatever the flood."""

MAX_REFUSED_HEAD_BYTES = 64 * 1024
"""What is read of a refused connection's request head at most before answering anyway."""

_LINGER_S = 1.0
"""After the answer, what the client still sends is read and dropped this long (or to its
close): closing with unread input makes the kernel reset the connection, which can destroy
the answer before the client reads it."""


@dataclass(eq=False)
class Admission:
    """One accepted connection's place in its server's :class:`~.limits.ConnectionCounter`:
    its client address and, if refused, why. :meth:`release` gives the count back, once,
    whichever of the connection's owners (the accept, uvicorn's protocol, a WebSocket it
    became) sees its end first."""

    counter: ConnectionCounter
    client: str
    refusal: str | None
    deadline_s: float = REFUSED_DEADLINE_S
    """A refused connection's time for its handshake and its request's head; 0: closed at
    once, unanswered (its descriptor is in the last half of the reserve)."""
    _counted: bool = field(default=False, repr=False)

    def release(self) -> None:
        if self._counted:
            self._counted = False
            self.counter.close(self.client)


def admit(counter: ConnectionCounter, get_extra_info: Callable[[str], Any]) -> Admission:
    """Count a just-accepted connection (``get_extra_info`` is its transport's) for its
    client address; a refused one is not counted and logged (one throttled line). The
    caller answers a refused one with :func:`answer_refused` (or its protocol's equivalent)
    and calls :meth:`Admission.release` when the connection ends."""
    peer = get_extra_info("peername")
    client = str(peer[0]) if peer else "?"
    sock = get_extra_info("socket")
    fd = sock.fileno() if sock is not None else None
    refusal = counter.open(client, fd)
    if refusal is not None:
        report(logging.WARNING, "connection refused", client, refusal)
    deadline_s = REFUSED_DEADLINE_S
    if fd is not None and fd >= counter.reserve_fd:
        # The second half of the reserve is never spent on answering a refusal.
        at_once = fd >= counter.fd_limit - counter.limits.reserved_fds // 2
        deadline_s = 0.0 if at_once else RESERVE_REFUSED_DEADLINE_S
    return Admission(counter, client, refusal, deadline_s, _counted=refusal is None)


class CountedReader(asyncio.StreamReader):
    """The stream reader of a connection counted at its accept: carries its admission."""

    admission: Admission | None = None


class TlsStart:
    """The server side of a TLS handshake on a just-accepted connection (``loop.start_tls``).

    Whatever the protocol asks in ``connection_made``, uvloop starts reading right after it,
    so the first bytes of the ClientHello can reach the protocol before the TLS layer takes
    the transport over: the protocol hands them to :meth:`early` while :attr:`pending`, and
    they are passed on to the TLS layer, in order, before anything read after them.
    """

    def __init__(
        self,
        transport: asyncio.Transport,
        protocol: asyncio.BaseProtocol,
        context: ssl.SSLContext,
        timeout_s: float,
    ) -> None:
        self.transport = transport
        self.protocol = protocol
        self.context = context
        self.timeout_s = timeout_s
        self.pending = True
        self._early = bytearray()
        # asyncio's StreamReaderProtocol (hypercorn's) gets the handshake's failure through
        # connection_lost into its ``_closed`` future, which nobody awaits: retrieved here,
        # or its garbage collection logs "Future exception was never retrieved" with a
        # traceback for every client that does not finish its handshake in time.
        closed = getattr(protocol, "_closed", None)
        if isinstance(closed, asyncio.Future):
            closed.add_done_callback(_retrieve)

    def early(self, data: bytes) -> None:
        self._early += data

    async def run(self) -> asyncio.Transport | None:
        """The TLS transport once the handshake is done; None if it failed, timed out or the
        client went away (the connection is then closed)."""
        loop = asyncio.get_running_loop()
        starting = loop.create_task(
            loop.start_tls(
                self.transport, self.protocol, self.context, server_side=True,
                ssl_handshake_timeout=self.timeout_s,
            )
        )
        # One turn: start_tls has paused reading and installed its protocol, and has
        # scheduled the resumption after this task's next step.
        await asyncio.sleep(0)
        self.pending = False
        tls_protocol = self.transport.get_protocol()
        if self._early and tls_protocol is not self.protocol:
            _feed(tls_protocol, bytes(self._early))
        self._early.clear()
        try:
            return await starting
        except (OSError, RuntimeError, TimeoutError):  # SSLError is an OSError; a timeout:
            # ConnectionAbortedError; RuntimeError: the transport closed under start_tls
            self.transport.abort()
            return None


def _retrieve(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


def _feed(protocol: Any, data: bytes) -> None:
    if not hasattr(protocol, "get_buffer"):
        protocol.data_received(data)
        return
    view = memoryview(data)
    while view:
        buffer = protocol.get_buffer(len(view))
        size = min(len(buffer), len(view))
        buffer[:size] = view[:size]
        protocol.buffer_updated(size)
        view = view[size:]


class ProxyRead:
    """A just-accepted connection's wait for its PROXY header (from a balancer of ``policy``)
    or for first bytes that show none (from anyone else), within ``timeout_s`` of its accept.

    The protocol hands it what it reads (:meth:`feed`) while :attr:`waiting`; at the end
    ``done`` gets the :class:`~.proxy_protocol.Proxied` outcome (the client's address, the
    bytes after the header). A header from an address not listed, a malformed or oversized
    one, or a balancer silent past the timeout: one throttled log line, and the connection
    is closed unanswered (no HTTP byte can be trusted to follow)."""

    def __init__(
        self,
        policy: ProxyProtocol,
        transport: asyncio.BaseTransport,
        timeout_s: float,
        done: Callable[[Proxied], None],
    ) -> None:
        peer = transport.get_extra_info("peername")
        self.peer = str(peer[0]) if peer else "?"
        self.wait = HeaderWait(policy.trusts(self.peer))
        self.transport = transport
        self.waiting = True
        self._done = done
        loop = asyncio.get_running_loop()
        self.deadline = loop.time() + timeout_s
        self._timer = loop.call_at(self.deadline, self._expired)

    @property
    def trusted(self) -> bool:
        """From a listed balancer: the connection is counted once its header names the client."""
        return self.wait.trusted

    def remaining_s(self) -> float:
        """What is left of the timeout (for the TLS handshake that follows)."""
        # Never 0: the loop refuses a handshake timeout of 0 (it is over at once anyway).
        return max(0.01, self.deadline - asyncio.get_running_loop().time())

    def feed(self, data: bytes) -> None:
        outcome = self.wait.feed(data)
        if outcome is NEED_MORE:
            return
        self.stop()
        if isinstance(outcome, ProxyError):
            if self.peer != "?":
                report(logging.WARNING, "PROXY protocol error", self.peer, outcome.reason)
            # else the socket was gone before its address could be read (a balancer's health
            # check that sends its header and closes at once): nothing to say, or trust.
            self.transport.close()
            return
        assert isinstance(outcome, Proxied)
        self._done(outcome)

    def stop(self) -> None:
        self.waiting = False
        self._timer.cancel()

    def _expired(self) -> None:
        self.waiting = False
        if self.wait.trusted:  # a client that says nothing is closed quietly, as before
            report(logging.WARNING, "PROXY header timed out", self.peer)
        self.transport.close()


@dataclass(frozen=True)
class _Gate:
    counter: ConnectionCounter
    handshake_timeout_s: float
    proxy: ProxyProtocol | None = None


_gate: contextvars.ContextVar[_Gate | None] = contextvars.ContextVar(
    "firstbyte_accept_gate", default=None
)


@contextlib.contextmanager
def accepting(
    counter: ConnectionCounter, handshake_timeout_s: float, proxy: ProxyProtocol | None = None
) -> Iterator[None]:
    """Within the block, hypercorn servers started (by this task) count their connections at
    accept in ``counter`` and bound TLS handshakes by ``handshake_timeout_s``; with ``proxy``,
    they read the PROXY header of their balancers' connections first (:class:`ProxyRead`)."""
    token = _gate.set(_Gate(counter, handshake_timeout_s, proxy))
    try:
        yield
    finally:
        _gate.reset(token)


class _AcceptProtocol(asyncio.StreamReaderProtocol):
    """A stream protocol that counts its connection at accept, then (with ``tls``) runs the
    handshake before the stream's callback sees the connection. With PROXY protocol on, a
    balancer's connection is counted for the client its header names, once it is read."""

    def __init__(
        self,
        reader: CountedReader,
        callback: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
        gate: _Gate,
        tls: ssl.SSLContext | None,
    ) -> None:
        super().__init__(reader, callback)
        self._counted_reader = reader
        self._gate = gate
        self._tls = tls
        self._admission: Admission | None = None
        self._tls_start: TlsStart | None = None
        self._handshake: asyncio.Task[None] | None = None
        self._proxy: ProxyRead | None = None
        self._client: tuple[str, int] | None = None
        self._send: SendTimer | None = None
        self._served: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)  # uvloop's is not asyncio's class
        if self._gate.proxy is not None:
            timeout = self._gate.handshake_timeout_s
            self._proxy = ProxyRead(self._gate.proxy, transport, timeout, self._proxied)
            if self._proxy.trusted:
                return  # counted once its header names the client
        if self._count(transport) and self._proxy is None:
            self._serve(transport)

    def _count(self, transport: asyncio.Transport) -> bool:
        """Count the connection; False if it was closed at once (refused in the reserve)."""
        admission = self._admission = admit(self._gate.counter, transport.get_extra_info)
        self._counted_reader.admission = admission
        if admission.refusal is not None and not admission.deadline_s:
            transport.close()
            return False
        return True

    def _proxied(self, proxied: Proxied) -> None:
        assert self._proxy is not None
        transport = cast(asyncio.Transport, self._proxy.transport)
        self._client = proxied.source
        if self._admission is None and not self._count(with_client(transport, self._client)):
            return
        self._serve(transport, proxied.rest)

    def _serve(self, transport: asyncio.Transport, early: bytes = b"") -> None:
        """Hand the connection to the stream, after its TLS handshake with ``tls``; ``early``:
        its bytes already read (after a PROXY header)."""
        if self._tls is None:
            self._connected(transport)
            if early:
                super().data_received(early)
            return
        timeout = self._gate.handshake_timeout_s
        if self._proxy is not None:  # the header's wait and the handshake share the timeout
            timeout = self._proxy.remaining_s()
        assert self._admission is not None
        if self._admission.refusal is not None:
            timeout = min(timeout, self._admission.deadline_s)
        self._tls_start = TlsStart(transport, self, self._tls, timeout)
        if early:
            self._tls_start.early(early)
        self._handshake = asyncio.get_running_loop().create_task(self._start_tls())

    async def _start_tls(self) -> None:
        assert self._tls_start is not None
        tls = await self._tls_start.run()
        if tls is None:
            if self._admission is not None:
                self._admission.release()
            return
        self._connected(tls)

    def _connected(self, transport: asyncio.Transport) -> None:
        """The stream's connection is made: over ``transport`` (TLS done, if any)."""
        self._served = transport
        super().connection_made(with_client(transport, self._client))

    def data_received(self, data: bytes) -> None:
        if self._proxy is not None and self._proxy.waiting:
            self._proxy.feed(data)
            return
        if self._tls_start is not None and self._tls_start.pending:
            self._tls_start.early(data)
            return
        super().data_received(data)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._served is not None:  # else the handshake's own writes, under its timeout
            self._send = SendTimer.paused(
                self._send, asyncio.get_running_loop(), self._gate.counter.limits.send_timeout_s,
                self._served, self._admission.client if self._admission is not None else "?",
            )

    def resume_writing(self) -> None:
        if self._send is not None:
            self._send.resumed()
        super().resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._send is not None:
            self._send.stop()
        if self._proxy is not None:
            self._proxy.stop()
        if self._admission is not None:
            self._admission.release()
        super().connection_lost(exc)


async def _start_server(
    callback: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
    **kwargs: Any,
) -> asyncio.Server:
    """``asyncio.start_server`` as hypercorn calls it, counting at accept inside
    :func:`accepting` (and otherwise unchanged)."""
    gate = _gate.get()
    if gate is None:
        return await asyncio.start_server(callback, **kwargs)
    loop = asyncio.get_running_loop()
    tls: ssl.SSLContext | None = kwargs.pop("ssl", None)
    kwargs.pop("ssl_handshake_timeout", None)

    def factory() -> _AcceptProtocol:
        return _AcceptProtocol(CountedReader(limit=2**16), callback, gate, tls)

    return await loop.create_server(factory, **kwargs)


class _HypercornAsyncio:
    """The ``asyncio`` module as hypercorn's ``run`` module sees it: the same but for
    ``start_server``."""

    start_server = staticmethod(_start_server)

    def __getattr__(self, name: str) -> Any:
        return getattr(asyncio, name)


def count_at_accept() -> None:
    """Make hypercorn's ``worker_serve`` accept TCP connections through :func:`_start_server`
    (once per process, by :mod:`.patches`). hypercorn (0.17, 0.18) calls
    ``asyncio.start_server`` with its TLS context, so the loop's handshake ran before any code
    of hypercorn's saw the connection."""
    from hypercorn.asyncio import run

    hypercorn_run: Any = run
    hypercorn_run.asyncio = _HypercornAsyncio()


async def answer_refused(
    reader: Any,
    writer: asyncio.StreamWriter,
    first: bytes = b"",
    deadline_s: float = REFUSED_DEADLINE_S,
    cors: RefusalCors | None = None,
) -> None:
    """Answer a refused connection's first request after its head, then close it: HTTP/1.1
    ``503`` (``overloaded``, ``Retry-After: 1``), or on HTTP/2 (by ALPN, or the preface on
    a plain connection) a 503 for its first stream and GOAWAY; with the CORS headers
    ``cors`` gives the request's origin (:mod:`.refusal_cors`). ``first``: bytes already
    read from ``reader``. Within ``deadline_s`` (the admission's, from its accept); a client
    that sends nothing is closed then."""
    ssl_object = writer.get_extra_info("ssl_object")
    data = first
    with contextlib.suppress(TimeoutError, ConnectionError, OSError, ssl.SSLError):
        async with asyncio.timeout(deadline_s):
            if ssl_object is not None:
                h2 = ssl_object.selected_alpn_protocol() == "h2"
            else:
                while len(data) < len(H2_PREFACE) and H2_PREFACE.startswith(data):
                    chunk = await reader.read(65536)
                    if not chunk:
                        return
                    data += chunk
                h2 = data.startswith(H2_PREFACE)
            if h2:
                await _refuse_h2(reader, writer, data, cors)
            else:
                await _refuse_h1(reader, writer, data, cors)
        async with asyncio.timeout(_LINGER_S):
            while await reader.read(65536):
                pass
    writer.close()


async def _refuse_h1(
    reader: Any, writer: asyncio.StreamWriter, data: bytes, cors: RefusalCors | None
) -> None:
    while b"\r\n\r\n" not in data and len(data) < MAX_REFUSED_HEAD_BYTES:
        chunk = await reader.read(65536)
        if not chunk:
            return
        data += chunk
    writer.write(busy_h1(h1_cors_lines(cors, data)))
    await writer.drain()


async def _refuse_h2(
    reader: Any, writer: asyncio.StreamWriter, data: bytes, cors: RefusalCors | None
) -> None:
    import h2.config
    import h2.connection
    import h2.events
    import h2.exceptions

    connection = h2.connection.H2Connection(
        h2.config.H2Configuration(client_side=False, header_encoding=None)
    )
    connection.initiate_connection()
    while True:
        try:
            events = connection.receive_data(data) if data else []
        except h2.exceptions.ProtocolError:
            return
        for event in events:
            if isinstance(event, h2.events.RequestReceived):
                stream = event.stream_id
                connection.send_headers(stream, [
                    (b":status", b"503"),
                    (b"content-type", b"application/json"),
                    (b"retry-after", b"1"),
                    (b"content-length", b"%d" % len(BUSY_BODY)),
                    *cors_fields(cors, event.headers),
                ])
                connection.send_data(stream, BUSY_BODY, end_stream=True)
                # Every stream after this one was not processed: the client may retry them.
                connection.close_connection(last_stream_id=stream)
                writer.write(connection.data_to_send())
                await writer.drain()
                return
            if isinstance(event, h2.events.ConnectionTerminated):
                return
        writer.write(connection.data_to_send())
        await writer.drain()
        data = await reader.read(65536)
        if not data:
            return
