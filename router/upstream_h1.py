"""HTTP/1.1 to the upstreams for streamed requests: a keep-alive pool of asyncio protocols.

Each received piece of a response goes from the socket (``data_received``) through
httptools' C parser (chunked decoding included) to a :class:`ResponseSink` in the same call:
no task wakes up per chunk and no Python-level HTTP parsing runs. It replaces httpx for the
router's streams because httpcore's pool scanned every connection it held on each request
start and end (a Python list comprehension over ``is_idle()``): with 500 streams that was
~40% of the router's CPU (py-spy), and the cost grew with load, which is what made the router
fall behind for good under sustained load (``firstbyte bench router_overhead``).

The pool hands out idle connections last-in first-out per origin (the warmest), drops a
connection that has been idle for ``keepalive_expiry_s`` when it reaches it (O(1): idle
lists are in release order), and holds at most ``max_connections`` open at once; a request
that finds them all busy waits for one (bounded by the connect timeout).

:func:`fetch` is one request whose answer is read whole, over the same kind of pool: the
backends' ``/metrics`` scrapes and the non-streamed requests to local upstreams (embeddings,
chat without ``stream``). Through httpx a whole answer cost the router 36-48 times the CPU
it costs this way at 100 in flight, httpcore's pool scanning again (``bench
router_overhead``'s ``whole_*``, docs/router.md).

Errors are httpx's exception classes (``ConnectError``, ``ConnectTimeout``, ``ReadError``,
``ReadTimeout``, ``RemoteProtocolError``, ``PoolTimeout``), so messages and handling match the
httpx paths the router keeps for its warmup probes and model lists and for peers (HTTP/2).
"""

from __future__ import annotations

import asyncio
import collections
import functools
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, cast

import httptools
import httpx
import msgspec

from . import chunkpath

__all__ = [
    "STALE_RETRIES", "Answer", "H1Connection", "H1Pool", "Origin", "ResponseSink",
    "encode_request", "encode_request_parts", "fetch",
]

STALE_RETRIES = 2
"""Times a request goes again after its kept-alive connection turned out to be closed."""

_LF = 10


class ResponseSink(Protocol):
    """Where one response goes, called from the connection's protocol callbacks.

    ``on_body`` is the parser's own callback (no call of the connection's in between): a
    sink ignores a body that comes after its ``on_end`` or ``on_error`` (bytes of a second,
    unasked-for response in the same read). ``on_read_end`` follows every read that reached
    the sink, once its ``on_body`` calls are made, but the read its ``on_end`` or
    ``on_error`` came in: a sink may hold the parts of one read and pass them on together
    (it must pass on what it holds at ``on_end`` and ``on_error``). A read whose body a
    taker took (:meth:`H1Connection.offer_fast`) has no ``on_read_end``: none of it was
    held."""

    def on_head(self, status: int) -> None: ...
    def on_body(self, data: bytes) -> None: ...
    def on_read_end(self) -> None: ...
    def on_end(self) -> None: ...
    def on_error(self, exc: Exception) -> None: ...


class Origin(msgspec.Struct, frozen=True, gc=False):
    """Scheme, host and port of an upstream base URL, plus the path prefix it carries.

    A msgspec Struct: the pool looks its idle connections up by origin twice a request,
    and a frozen dataclass's ``__hash__`` is a Python call; a Struct's is C."""

    scheme: str
    host: str
    port: int
    base_path: str = ""

    @classmethod
    def parse(cls, url: str) -> Origin:
        parsed = httpx.URL(url)
        scheme = parsed.scheme
        port = parsed.port or (443 if scheme == "https" else 80)
        return cls(scheme, parsed.host, port, parsed.path.rstrip("/"))

    @property
    def host_header(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        default = 443 if self.scheme == "https" else 80
        return host if self.port == default else f"{host}:{self.port}"


def encode_request(
    method: str, origin: Origin, path: str, headers: dict[str, str], body: bytes
) -> bytes:
    """An HTTP/1.1 request with ``content-length``; a header with CR or LF is refused."""
    lines = [f"{method} {origin.base_path}{path} HTTP/1.1", f"host: {origin.host_header}"]
    for name, value in headers.items():
        if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
            raise httpx.LocalProtocolError(f"invalid header {name!r}")
        lines.append(f"{name}: {value}")
    lines.append(f"content-length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


_MARK = "\0"


def encode_request_parts(
    method: str, origin: Origin, path: str, headers: dict[str, str], varying: str
) -> tuple[bytes, bytes] | None:
    """:func:`encode_request` made once for requests that differ only in header ``varying``
    (one of ``headers``) and their body: ``(head, tail)`` such that, for a value ``v``
    without CR or LF and any ``body``, the request is
    ``head + v.encode("latin-1") + tail + b"%d\r\n\r\n" % len(body) + body``. Cut out of
    :func:`encode_request`'s own bytes (a NUL in place of the value), so the two cannot
    differ; None where another part holds a NUL too. A header with CR or LF is refused."""
    marked = encode_request(method, origin, path, {**headers, varying: _MARK}, b"")
    head, mark, rest = marked.partition(_MARK.encode())
    if not mark or _MARK.encode() in rest:
        return None
    return head, rest[: -len(b"0\r\n\r\n")]


class H1Connection(asyncio.Protocol):
    """One kept-alive connection; one response at a time goes to its sink."""

    # Slots: the compiled read path (router/_chunkpath.c) writes _last_read at its offset.
    __slots__ = (
        "_boundary", "_callbacks", "_chunk_callbacks", "_chunked", "_ended", "_fast",
        "_fast_offer", "_framed_by_close", "_has_length", "_keep_alive", "_last_read",
        "_marks", "_parser", "_sink", "_split_head", "_timer", "answered", "closed",
        "complete", "content_type", "data_received", "idle_since", "origin", "pool", "reused",
        "transport",
    )

    def __init__(self, pool: H1Pool, origin: Origin) -> None:
        self.pool = pool
        self.origin = origin
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self.reused = False
        """Handed out from the idle list (the upstream may have closed it meanwhile)."""
        self.answered = False
        """A byte of the current response arrived."""
        self.content_type = b""
        """The current response's ``content-type`` (empty until its head, or without one)."""
        self._sink: ResponseSink | None = None
        self._parser: httptools.HttpResponseParser | None = None
        self.complete = True
        """No response under way: the last one ended (cleanly or not), or none was sent."""
        self._keep_alive = False
        self._last_read = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._ended: asyncio.Future[None] | None = None
        self._framed_by_close = False
        self._has_length = False
        self._fast: Callable[[bytes], bool] | None = None
        """Takes a read whole (the sink's compiled path, :meth:`offer_fast`), at a chunk
        boundary only."""
        self._fast_offer: Callable[[bytes], bool] | None = None
        self._boundary = False
        """The parser's last callback ended a chunk of the body, or the head of a body
        surely in chunks (:attr:`_chunked`): see :meth:`offer_fast`."""
        self._chunked: bool | None = None
        """The head's one ``transfer-encoding`` is exactly ``chunked`` and it has no
        ``content-length`` (None: neither header yet): the body is in chunks, as the parser
        reads it, whatever else the head says (a stricter test than the parser's own, which
        only means fewer heads qualify)."""
        self._split_head = False
        """The response's first read is to be cut after its head (the sink may
        :meth:`offer_fast`; see :meth:`_data_received`)."""
        # The parser's chunk callbacks (_ChunkCallbacks): each sets _boundary, and as
        # partials of setattr they are C calls, not a Python call per chunk's start and end
        # (ten a request of four chunks, before the compiled path takes its reads).
        self._marks = (
            functools.partial(setattr, self, "_boundary", False),  # a chunk's size line
            functools.partial(setattr, self, "_boundary", True),  # a chunk's end
        )
        # What each parser is made with, made once a connection (not a Python __init__
        # per response): :meth:`send` sets the response's ``on_body`` for the parser to
        # take, and takes it off again (the parser keeps what it took, not these).
        self._callbacks = _Callbacks(self)
        self._chunk_callbacks = _ChunkCallbacks(self)
        # data_received: a slot (the transport looks it up once, at its start), the read
        # taker's call in C where it was built (no Python call a read: ~750 instructions),
        # else the Python method, which asks the taker itself.
        reader = chunkpath.CONN_READER
        self.data_received = (  # type: ignore[method-assign]  # a callable in its place
            self._data_received if reader is None else reader(self)
        )

    # -- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def _data_received(self, data: bytes) -> None:
        """``data_received`` (the attribute: compiled where it could be, see __init__)."""
        fast = self._fast
        if fast is not None:
            if fast(data):
                return
            self._fast = None  # the parser's read: fast again at its next chunk boundary
        if self._parser is None:
            self.abort()  # bytes nobody asked for: the connection cannot be trusted again
            return
        self._last_read = self.pool.loop.time()
        self.answered = True
        sink = self._sink
        parser = self._parser
        try:
            if self._split_head:
                # The response's first read: its head alone first. A 200 head of a body in
                # chunks, whose sink offered a taker, leaves the parser at the body's first
                # chunk boundary: the rest of the read (the upstream's first event, as a
                # rule) goes to the taker as a read of its own would, rather than through
                # the parser's callbacks and the sink's Python path (~3k instructions). The
                # head ends at its first blank line: the parser takes CRLF line ends only
                # (tests/router/test_upstream_h1.py), so it parsed no byte of the body.
                self._split_head = False
                end = data.find(b"\r\n\r\n") + 4
                if 3 < end < len(data):
                    parser.feed_data(data[:end])
                    data = data[end:]
                    take = self._fast_offer
                    if take is not None and self._boundary:
                        self._fast = take
                        if take(data):
                            return  # no on_read_end: the head's part held no body
                        self._fast = None
            parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(httpx.RemoteProtocolError(f"invalid HTTP response: {exc}"))
        if sink is not None and sink is self._sink:  # else its on_end or on_error came
            sink.on_read_end()
        if self._fast_offer is not None and self._boundary and data[-1] == _LF:
            # The read ended with a chunk's end (its CRLF's LF), not in the next chunk's size
            # line: a size line whose line end came would have called on_chunk_header.
            self._fast = self._fast_offer

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._cancel_timer()
        self.pool._forget(self)
        if not self.complete:
            if self._framed_by_close and exc is None:
                self.on_message_complete()  # a body without length or chunks ends at the close
            else:
                self._fail(httpx.ReadError(str(exc) if exc else "connection closed"))
        self._resolve_ended()

    # -- httptools callbacks (the chunks' two: :attr:`_marks`)
    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"transfer-encoding":
            self._has_length = True
            self._chunked = self._chunked is None and value == b"chunked"
        elif name == b"content-length":
            self._has_length = True
            self._chunked = False
        elif name == b"content-type":
            self.content_type = value

    def on_headers_complete(self) -> None:
        if self._parser is None or self._sink is None:
            return  # a second response in the same read, after the first one's end
        self._keep_alive = self._parser.should_keep_alive()
        status = self._parser.get_status_code()
        self._framed_by_close = not self._has_length and status not in (204, 304)
        self._sink.on_head(status)
        # The body's first chunk boundary, for a taker the sink offered (offer_fast).
        self._boundary = self._chunked is True

    def on_message_complete(self) -> None:
        self.complete = True
        self._parser = None
        self._fast = self._fast_offer = None
        # The read timer is left to run out (it stops when it finds no response under way):
        # the connection's next response, on a kept-alive connection soon, takes it over
        # instead of cancelling one and making another (~5k instructions a request).
        sink, self._sink = self._sink, None
        if sink is not None:
            sink.on_end()
        ended = self._ended  # _resolve_ended inlined: a call a response
        if ended is not None and not ended.done():
            ended.set_result(None)

    # -- the shell's side
    def send(self, request: bytes, sink: ResponseSink, *, chunks: bool = False) -> None:
        """Write ``request``; its response goes to ``sink``. ``chunks``: the sink may
        :meth:`offer_fast` (the parser then tells where its chunks end)."""
        assert self.transport is not None
        assert self.complete
        self._sink = sink
        self._fast = self._fast_offer = None
        self._boundary = False
        callbacks = self._chunk_callbacks if chunks else self._callbacks
        callbacks.on_body = sink.on_body
        self._parser = httptools.HttpResponseParser(callbacks)
        callbacks.on_body = None  # the parser has it: the connection keeps no sink
        self.complete = False
        self._keep_alive = False
        self._framed_by_close = False  # known at the head's end
        self._has_length = False
        self._chunked = None
        self._split_head = chunks
        self.answered = False
        self.content_type = b""
        self._ended = None
        self._last_read = self.pool.loop.time()
        if self._timer is None:  # else the last response's, which re-arms for the rest
            self._arm_timer(self.pool.read_timeout_s)
        self.transport.write(request)

    @property
    def stale(self) -> bool:
        """A kept-alive connection that failed before any byte of its response: the
        upstream closed it while idle (keep-alive race), so it never saw the request and
        sending it again on another connection is safe."""
        return self.reused and not self.answered

    @property
    def reusable(self) -> bool:
        """The last response ended cleanly and the upstream keeps the connection open."""
        return self.complete and self._keep_alive and not self.closed

    async def wait_end(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the response's end; True if it ended cleanly."""
        if not self.complete and not self.closed:
            if self._ended is None:
                self._ended = self.pool.loop.create_future()
            try:
                async with asyncio.timeout(timeout_s):
                    await asyncio.shield(self._ended)
            except TimeoutError:
                return False
        return self.reusable

    def wait_end_then(self, timeout_s: float, callback: Callable[[], object]) -> None:
        """:meth:`wait_end` for a caller without a task: ``callback()`` once, at the
        response's end (clean or not) or in ``timeout_s``, whichever comes first."""
        loop = self.pool.loop
        ended = self._ended
        if ended is None:
            ended = self._ended = loop.create_future()
        fired = False

        def once(_: object = None) -> None:
            nonlocal fired
            if not fired:
                fired = True
                timer.cancel()
                ended.remove_done_callback(once)
                callback()

        timer = loop.call_later(timeout_s, once)
        ended.add_done_callback(once)

    def offer_fast(self, take: Callable[[bytes], bool]) -> None:
        """From the next read that starts at a chunk boundary of the body, ``take(data)``
        is asked first: True means it took the read whole (nothing goes to the parser; the
        taker gives the sink what it must, and calls :meth:`on_message_complete` as the
        parser would when the read held the body's last chunk), False that the read goes the
        usual way. Only whole chunks may be taken: the parser, not fed them, stays at the
        boundary where it was."""
        self._fast_offer = take

    @property
    def fast_offered(self) -> bool:
        """A read taker was offered for the response under way (:meth:`offer_fast`)."""
        return self._fast_offer is not None

    def detach(self) -> None:
        """The shell is done with the response: no more callbacks to its sink."""
        self._sink = None
        self._fast = self._fast_offer = None

    def abort(self) -> None:
        """Drop the connection now (the upstream sees the request aborted)."""
        self._sink = None
        self._fast = self._fast_offer = None
        self._cancel_timer()
        if self.transport is not None and not self.closed:
            self.transport.abort()
        self.closed = True
        self.pool._forget(self)

    # -- internals
    def _fail(self, exc: Exception) -> None:
        sink, self._sink = self._sink, None
        self._fast = self._fast_offer = None
        self.complete = True
        self._keep_alive = False
        self._cancel_timer()
        if self.transport is not None and not self.closed:
            self.transport.abort()
        self.closed = True
        if sink is not None:
            sink.on_error(exc)

    def _resolve_ended(self) -> None:
        if self._ended is not None and not self._ended.done():
            self._ended.set_result(None)

    def _arm_timer(self, delay_s: float) -> None:
        self._timer = self.pool.loop.call_later(delay_s, self._check_read_timeout)

    def _check_read_timeout(self) -> None:
        # One timer per connection, re-armed for the rest of the window when it fires, rather
        # than rescheduled on every read (reads are per chunk, timeouts are rare) or made
        # again for every response; it stops when it finds none under way.
        self._timer = None
        if self.complete or self.closed:
            return
        silent_s = self.pool.loop.time() - self._last_read
        if silent_s >= self.pool.read_timeout_s:
            self._fail(httpx.ReadTimeout("no data from the upstream within the read timeout"))
        else:
            self._arm_timer(self.pool.read_timeout_s - silent_s)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class _Callbacks:
    """What the parser calls: the connection's callbacks, but a body goes straight to the
    response's sink (one Python call less per relayed chunk; ``on_body``, set by
    :meth:`H1Connection.send` while it makes the parser). httptools looks the callbacks up
    once, when the parser is made; the sink checks its own state (it ignores a body once
    its attempt is decided), and a connection whose sink is dropped is not fed again
    (aborted, or idle with no parser)."""

    __slots__ = ("on_body", "on_header", "on_headers_complete", "on_message_complete")

    def __init__(self, conn: H1Connection) -> None:
        self.on_header = conn.on_header
        self.on_headers_complete = conn.on_headers_complete
        self.on_body: Callable[[bytes], None] | None = None
        self.on_message_complete = conn.on_message_complete


class _ChunkCallbacks(_Callbacks):
    """:class:`_Callbacks` that also tell the connection where chunks end (two calls a
    chunk, paid only until the sink's fast path takes the reads)."""

    __slots__ = ("on_chunk_complete", "on_chunk_header")

    def __init__(self, conn: H1Connection) -> None:
        super().__init__(conn)
        self.on_chunk_header, self.on_chunk_complete = conn._marks


class H1Pool:
    """Kept-alive HTTP/1.1 connections to the upstreams (see the module docstring)."""

    loop: asyncio.AbstractEventLoop
    """The serving loop, taken by each :meth:`acquire` (the pool may be built before)."""

    def __init__(
        self,
        *,
        max_connections: int,
        keepalive_expiry_s: float,
        connect_timeout_s: float,
        read_timeout_s: float,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.max_connections = max_connections
        self.keepalive_expiry_s = keepalive_expiry_s
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self._ssl = ssl_context
        self._idle: dict[Origin, collections.deque[H1Connection]] = {}
        self._open: set[H1Connection] = set()
        self._connecting = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    def __repr__(self) -> str:
        idle = sum(len(q) for q in self._idle.values())
        return f"<H1Pool [Connections: {len(self._open) - idle} active, {idle} idle]>"

    async def acquire(
        self, origin: Origin, loop: asyncio.AbstractEventLoop | None = None
    ) -> H1Connection:
        """A connection to ``origin``: the most recently used idle one, else a new one.
        ``loop``: the running loop where the caller holds it (saves looking it up: on
        Python 3.11 a getpid() system call)."""
        self.loop = loop = loop if loop is not None else asyncio.get_running_loop()
        conn = self.take_idle(origin, loop)
        if conn is not None:
            return conn  # the common case: no deadline to arm and cancel
        connecting = False
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                while True:
                    conn = self.take_idle(origin, loop)
                    if conn is not None:
                        return conn
                    if len(self._open) + self._connecting < self.max_connections:
                        connecting = True
                        return await self._connect(origin)
                    if not self._close_oldest_idle():
                        waiter = self.loop.create_future()
                        self._waiters.append(waiter)
                        await waiter
        except TimeoutError:
            if connecting:
                message = f"connecting to {origin.host_header} timed out"
                raise httpx.ConnectTimeout(message) from None
            raise httpx.PoolTimeout("no upstream connection free in time") from None

    def take_idle(
        self, origin: Origin, loop: asyncio.AbstractEventLoop
    ) -> H1Connection | None:
        """:meth:`acquire` where it need not wait, from a callback: the most recently used
        idle connection to ``origin``, else None (nothing made, nothing waited for).
        ``loop``: the running loop."""
        self.loop = loop
        idle = self._idle.get(origin)
        now = loop.time()
        while idle:
            conn = idle.pop()
            if not conn.closed and now - conn.idle_since <= self.keepalive_expiry_s:
                conn.reused = True
                return conn
            conn.abort()
        return None

    def release(self, conn: H1Connection) -> None:
        """Give ``conn`` back after a response: kept if reusable, else closed."""
        # The connection's detach and reusable inlined (calls a request; same module).
        conn._sink = None
        conn._fast = conn._fast_offer = None
        if not (conn.complete and conn._keep_alive and not conn.closed):
            conn.abort()
            return
        conn.idle_since = self.loop.time()
        idle = self._idle.get(conn.origin)
        if idle is None:  # not setdefault: its default deque was made on every release
            idle = self._idle[conn.origin] = collections.deque()
        idle.append(conn)
        expiry = self.keepalive_expiry_s
        while idle and (idle[0].closed or conn.idle_since - idle[0].idle_since > expiry):
            idle.popleft().abort()
        if self._waiters:
            self._wake_one()

    async def aclose(self) -> None:
        for conn in list(self._open):
            conn.abort()
        self._idle.clear()

    def _close_oldest_idle(self) -> bool:
        oldest: collections.deque[H1Connection] | None = None
        for idle in self._idle.values():
            if idle and (oldest is None or idle[0].idle_since < oldest[0].idle_since):
                oldest = idle
        if oldest is None:
            return False
        oldest.popleft().abort()
        return True

    async def _connect(self, origin: Origin) -> H1Connection:
        self._connecting += 1
        tls = origin.scheme == "https"
        try:
            _, conn = await self.loop.create_connection(
                lambda: H1Connection(self, origin),
                origin.host,
                origin.port,
                ssl=(self._ssl or ssl.create_default_context()) if tls else None,
                server_hostname=origin.host if tls else None,
            )
        except OSError as exc:  # ssl.SSLError included
            raise httpx.ConnectError(str(exc)) from exc
        finally:
            self._connecting -= 1
        self._open.add(conn)
        return conn

    def _forget(self, conn: H1Connection) -> None:
        if conn in self._open:
            self._open.discard(conn)
            self._wake_one()

    def _wake_one(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return


class _BodySink:
    """A :class:`ResponseSink` that keeps a response whole: its status and at most
    ``max_bytes`` of body; ``done`` is resolved at the body's end, at an error, or (with
    ``too_large`` set) once the body passes ``max_bytes``."""

    __slots__ = ("done", "max_bytes", "parts", "size", "status", "too_large")

    def __init__(self, done: asyncio.Future[None], max_bytes: int) -> None:
        self.done = done
        self.max_bytes = max_bytes
        self.parts: list[bytes] = []
        self.size = 0
        self.status = 0
        self.too_large = False

    def on_head(self, status: int) -> None:
        self.status = status

    def on_body(self, data: bytes) -> None:
        if self.done.done():
            return
        self.size += len(data)
        if self.size > self.max_bytes:
            self.too_large = True
            self.parts.clear()
            self.done.set_result(None)
            return
        self.parts.append(data)

    def on_read_end(self) -> None:
        pass

    def on_end(self) -> None:
        if not self.done.done():
            self.done.set_result(None)

    def on_error(self, exc: Exception) -> None:
        if not self.done.done():
            self.done.set_exception(exc)


@dataclass(frozen=True, slots=True)
class Answer:
    """A whole answer (:func:`fetch`)."""

    status: int
    content_type: str
    """Its ``content-type`` header (empty without one)."""
    body: bytes | None
    """None: over the bound, and not read further."""


async def fetch(
    pool: H1Pool,
    origin: Origin,
    path: str,
    *,
    max_bytes: int,
    timeout_s: float | None,
    method: str = "GET",
    body: bytes = b"",
    headers: dict[str, str] | None = None,
) -> Answer:
    """Send one request to ``origin`` over ``pool`` and read its answer whole: at most
    ``max_bytes`` of body, past which :attr:`Answer.body` is None and the rest is not read
    (its connection is dropped, unless the read that passed the bound also ended it).

    ``timeout_s`` bounds the whole exchange, the wait for a connection included
    (``httpx.ReadTimeout``); with None, the pool's connect and read timeouts alone do. A
    kept-alive connection the upstream had closed while idle (no byte of the answer) is
    sent again on another one, at most :data:`STALE_RETRIES` times: the upstream never saw
    the request. Other errors are the pool's (``ConnectError``, ``ConnectTimeout``,
    ``PoolTimeout``, ``ReadError``, ``ReadTimeout``, ``RemoteProtocolError``)."""
    request = encode_request(method, origin, path, headers or {}, body)
    try:
        async with asyncio.timeout(timeout_s):
            for attempt in range(STALE_RETRIES + 1):
                conn = await pool.acquire(origin)
                sink = _BodySink(pool.loop.create_future(), max_bytes)
                try:
                    conn.send(request, sink)
                    await sink.done
                    content_type = conn.content_type
                except httpx.ReadError:
                    if not conn.stale or attempt == STALE_RETRIES:
                        raise
                    continue
                finally:
                    pool.release(conn)  # kept if the answer ended cleanly, else dropped
                return Answer(
                    sink.status,
                    content_type.decode("latin-1"),
                    None if sink.too_large else b"".join(sink.parts),
                )
    except TimeoutError:
        raise httpx.ReadTimeout(f"no whole answer within {timeout_s:g} s") from None
    raise AssertionError("unreachable")  # the loop returns or raises
