"""Bind sockets and run an ASGI app under hypercorn, uvicorn or granian: the one place where
firstbyte's servers (the router and the sim) meet the network.

- :func:`bind` opens the listening TCP socket and, for HTTP/3, a UDP socket on the same port.
- :func:`serve` runs an app on them in the running event loop until a shutdown trigger
  returns (default: SIGINT or SIGTERM), then drains within ``graceful_timeout_s``.
  hypercorn serves HTTP/1.1 and HTTP/2 (ALPN over TLS, h2c prior knowledge without) and,
  with a UDP socket, HTTP/3 with a session-ticket store so clients can resume with 0-RTT
  (:mod:`firstbyte.router.hosting.quic`); uvicorn serves HTTP/1.1 with httptools, the least
  CPU per streamed chunk on this machine; ``auto`` is hypercorn handing every HTTP/1.1
  connection to uvicorn's protocol (:mod:`firstbyte.router.hosting.http1_split`).
- :func:`running` is :func:`serve` for the duration of an ``async with`` block: tests and
  benchmarks start a real server inside their own event loop with it.
- :func:`run_granian` runs an app factory under granian (Rust HTTP stack), which only runs as
  its own process and imports the app by name.

What is served (the app, its config and lifespan) is the caller's: :mod:`firstbyte.router.serve`
for the router, :mod:`firstbyte.router.sim.server` for the sim.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from firstbyte.tasks import cancel_and_wait

from .batch_accept import one_at_a_time_from
from .gc_tuning import tune_for_serving
from .limits import ClientLimits, ConnectionCounter
from .proxy_protocol import ProxyProtocol
from .refusal_cors import RefusalCors

if TYPE_CHECKING:
    from .goaway import ConnectionRegistry
    from .quic import Http3Status, SessionTicketStore

__all__ = [
    "DEFAULT_BACKLOG",
    "IN_PROCESS_SERVERS",
    "KEEP_ALIVE_MAX_REQUESTS",
    "ClientLimits",
    "Listeners",
    "ProxyProtocol",
    "ServerOptions",
    "bind",
    "loop_factory",
    "raise_descriptor_limit",
    "run_granian",
    "running",
    "serve",
    "signal_event",
    "uvicorn_config",
]

IN_PROCESS_SERVERS = ("auto", "hypercorn", "uvicorn")
"""The servers :func:`serve` runs in this event loop (granian needs its own process);
``auto`` is hypercorn with HTTP/1.1 handed to uvicorn's protocol (:mod:`.http1_split`)."""

DEFAULT_BACKLOG = 4096
"""Connections the kernel queues before the server accepts them (``listen()``), capped by
``net.core.somaxconn``. hypercorn's default is 100 and asyncio re-``listen()``s a socket it is
given with the server's value: 500 clients connecting at once overflowed it here (kernel
``ListenOverflows``; each dropped SYN is retried after 1 s, then 3 s). nginx and uvicorn
ask for more (uvicorn 2048); this is Linux's default ``somaxconn``."""

KEEP_ALIVE_MAX_REQUESTS = 1_000_000
"""Requests one client connection may carry before hypercorn closes it. hypercorn's default
(1000) closes an HTTP/1.1 connection or sends GOAWAY on an HTTP/2 one after 1000 requests:
an SDK multiplexing 100 streams over one prewarmed HTTP/2 connection would lose it every
~15 s, and the requests started during the new handshake (2-3 round trips on a WAN) would
all pay it. A million is ~4.5 hours of that load."""

log = logging.getLogger("firstbyte.hosting")

# hpack and h2 log decoded header values (the API key among them) at DEBUG: keep them above it
# whatever level the application sets, so a debug run cannot leak secrets.
for _name in ("hpack", "h2"):
    logging.getLogger(_name).setLevel(logging.INFO)


@dataclass(frozen=True, slots=True)
class ServerOptions:
    """How one server runs an app (everything but the app and the sockets)."""

    server: str = "hypercorn"
    """One of :data:`IN_PROCESS_SERVERS` (the router's config defaults to ``auto``)."""
    certfile: str | None = None
    """TLS certificate chain (PEM); with ``keyfile``, the TCP listener speaks TLS."""
    keyfile: str | None = None
    keep_alive_timeout_s: float = 30.0
    graceful_timeout_s: float = 5.0
    """How long a shutdown waits for in-flight requests before closing them."""
    lifespan: bool = True
    """Send the ASGI lifespan events (uvicorn; hypercorn always sends them)."""
    ws_max_message_bytes: int | None = None
    """Largest WebSocket message accepted (larger: close 1009); None: the app takes no
    WebSockets (uvicorn loads no WebSocket protocol)."""
    backlog: int = DEFAULT_BACKLOG
    """The listening socket's accept queue (:data:`DEFAULT_BACKLOG`)."""
    limits: ClientLimits = field(default_factory=ClientLimits)
    """What client connections may hold (:mod:`firstbyte.router.hosting.limits`), enforced
    under every server (:mod:`.hardening` for hypercorn, :mod:`.uvicorn_limits` for uvicorn)."""
    memory_pressed: Callable[[], bool] | None = None
    """Whether memory is near its budget now (the router's ``limits.max_rss_bytes``): the
    per-address connection cap then applies (:class:`.limits.ConnectionCounter`)."""
    refusal_cors: RefusalCors | None = None
    """The CORS headers of the refusals the server writes after a request's head, before
    the app (a connection over its cap, an HTTP/2 or HTTP/3 head over its bounds), for the
    request's origin: the app's CORS policy (:mod:`.refusal_cors`); None: none."""
    proxy_protocol: ProxyProtocol | None = None
    """Read a PROXY protocol header (v1 or v2) at the start of every TCP connection from
    the balancers it lists, and serve the connection as the client's it names
    (:mod:`.proxy_protocol`); None: no connection may send one (today's behaviour, but a
    header is served as the bytes it is)."""
    http3_advertised_port: int | None = None
    """The port ``alt-svc`` names for HTTP/3; None: the bound UDP port (behind a port mapping
    or a balancer, clients reach another)."""
    tune_gc: bool = False
    """Tune the cyclic GC for latency once listening
    (:func:`firstbyte.router.hosting.gc_tuning.tune_for_serving`): process-wide, so only for
    a process that is this server."""

    @property
    def tls(self) -> bool:
        return self.certfile is not None


@dataclass(frozen=True, slots=True)
class Listeners:
    """Bound listening sockets: TCP, and UDP on the same port number for HTTP/3 (or None)."""

    host: str
    """The address asked for (as given: a name, IPv4 or IPv6 address)."""
    tcp: socket.socket
    quic: socket.socket | None = None

    @property
    def port(self) -> int:
        port: int = self.tcp.getsockname()[1]
        return port

    @property
    def h3_port(self) -> int | None:
        return None if self.quic is None else int(self.quic.getsockname()[1])

    def url(self, *, tls: bool) -> str:
        """``https://HOST:PORT`` (``http://`` without TLS), the IPv6 host in brackets."""
        name = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if tls else 'http'}://{name}:{self.port}"

    def close(self) -> None:
        self.tcp.close()
        if self.quic is not None:
            self.quic.close()


def bind(
    host: str,
    port: int,
    *,
    udp: bool = False,
    reuse_port: bool = False,
    backlog: int = DEFAULT_BACKLOG,
) -> Listeners:
    """A listening TCP socket and (if ``udp``) a UDP socket on the same port number.

    With ``port`` 0 the kernel picks the TCP port; the UDP bind on that number is retried
    with a fresh port if it happens to be taken. ``OSError`` if the address cannot be bound.

    With ``reuse_port`` both sockets set ``SO_REUSEPORT``: several processes bind the same
    port and the kernel spreads connections over them by a hash of the 4-tuple. For UDP that
    hash keeps every datagram of one QUIC connection on one process as long as the client's
    address and port stay the same (a client that migrates, e.g. Wi-Fi to cellular, lands on
    another process, which does not know the connection: the client reconnects, with 0-RTT
    when tickets are shared).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    last_error: OSError | None = None
    for _ in range(20):
        # proto=IPPROTO_TCP matters: asyncio only sets TCP_NODELAY on accepted sockets whose
        # proto says TCP, and without it Nagle + delayed ACK hold small SSE writes back ~40 ms.
        tcp = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        try:
            tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuse_port:
                tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            tcp.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # inherited when accepted
            tcp.bind((host, port))
            tcp.listen(backlog)
            tcp.setblocking(False)
        except OSError:
            tcp.close()
            raise
        if not udp:
            return Listeners(host, tcp)
        quic = socket.socket(family, socket.SOCK_DGRAM)
        try:
            if reuse_port:
                quic.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            quic.bind((host, tcp.getsockname()[1]))
            quic.setblocking(False)
            return Listeners(host, tcp, quic)
        except OSError as exc:
            quic.close()
            tcp.close()
            last_error = exc
            if port != 0:
                raise
    assert last_error is not None
    raise last_error


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The event loop a server process runs on: uvloop when installed (it comes with the
    ``router`` extra through ``uvicorn[standard]``), else asyncio's default (``None``).

    uvloop's C loop cuts the router's CPU per relayed chunk by roughly a tenth (measured
    with ``firstbyte bench router_overhead``); every stream costs a loop turn per chunk. Its
    servers on the sockets :func:`bind` opens accept up to 64 waiting connections a turn, not
    libuv's one (:mod:`.batch_accept`).
    """
    from .batch_accept import uvloop_factory

    return uvloop_factory()


def signal_event() -> asyncio.Event:
    """An event set on SIGINT or SIGTERM (handlers on the running loop)."""
    import signal

    event = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, event.set)
    return event


async def serve(
    app: Any,
    listeners: Listeners,
    options: ServerOptions,
    *,
    shutdown: Callable[[], Awaitable[Any]] | None = None,
    started: Callable[[], None] | None = None,
    tickets: SessionTicketStore | None = None,
    connections: ConnectionRegistry | None = None,
    http3: Http3Status | None = None,
) -> None:
    """Serve the ASGI ``app`` on ``listeners`` until ``shutdown()`` returns (default: SIGINT or
    SIGTERM), then drain and return; the sockets are closed when it returns.

    ``started`` is called once the server accepts connections. A UDP socket in ``listeners``
    serves HTTP/3 (hypercorn with TLS only), advertised by ``Alt-Svc``; ``tickets`` is the
    store of its QUIC session tickets (default: a new one). ``connections`` (hypercorn) is
    filled with the open HTTP/2 and HTTP/3 connections, for a GOAWAY before ``shutdown()``
    returns (:mod:`firstbyte.router.hosting.goaway`). ``http3`` follows the HTTP/3 server:
    if its task ends on an error it is logged at once (ERROR), restarted after a delay, and
    ``Alt-Svc`` is not sent while it is down.
    """
    from .patches import apply_all

    apply_all()  # every library patch, checked first (PatchShapeError: refuse to start)
    stop = _once(shutdown or signal_event().wait)
    raise_descriptor_limit()

    def on_started() -> None:
        if options.tune_gc:
            # Start-up is over (imports, app, listener): freeze it out of every later collection.
            tune_for_serving()
        if started is not None:
            started()

    try:
        if options.server == "uvicorn":
            if listeners.quic is not None:
                raise ValueError("HTTP/3 needs the hypercorn server")
            await _serve_uvicorn(app, listeners.tcp, options, stop, on_started)
        elif options.server in ("hypercorn", "auto"):
            await _serve_hypercorn(
                app, listeners, options, stop, on_started, tickets, connections, http3
            )
        else:
            raise ValueError(
                f"server {options.server!r} cannot run in-process; use auto, hypercorn or uvicorn"
            )
    finally:
        listeners.close()


@contextlib.asynccontextmanager
async def running(
    app: Any,
    listeners: Listeners,
    options: ServerOptions,
    *,
    tickets: SessionTicketStore | None = None,
    http3: Http3Status | None = None,
) -> AsyncIterator[None]:
    """:func:`serve` in the running loop for the duration of the block: entered once the
    server accepts connections (its start-up error raised if it failed), drained on exit."""
    stop = asyncio.Event()
    ready = asyncio.Event()
    task = asyncio.ensure_future(
        serve(
            app, listeners, options, shutdown=stop.wait, started=ready.set, tickets=tickets,
            http3=http3,
        )
    )
    waiter = asyncio.ensure_future(ready.wait())
    try:
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            task.result()  # start-up failed: raise its error
            raise RuntimeError("the server stopped before it started")
        yield
    finally:
        waiter.cancel()
        stop.set()
        try:
            async with asyncio.timeout(options.graceful_timeout_s + 5):
                await asyncio.shield(task)
        except TimeoutError:
            await cancel_and_wait(task)
        listeners.close()


def _once(trigger: Callable[[], Awaitable[Any]]) -> Callable[[], Awaitable[None]]:
    """``trigger`` run once however many wait on it (the server and the QUIC waker do; a
    router's trigger is its drain, which must not run twice)."""
    task: asyncio.Future[Any] | None = None

    async def wait() -> None:
        nonlocal task
        if task is None:
            task = asyncio.ensure_future(trigger())
        await asyncio.shield(task)

    return wait


async def _serve_uvicorn(
    app: Any,
    tcp: socket.socket,
    options: ServerOptions,
    stop: Callable[[], Awaitable[Any]],
    on_started: Callable[[], None],
) -> None:
    import uvicorn

    counter = ConnectionCounter(options.limits, _descriptor_limit(), options.memory_pressed)
    config = uvicorn_config(app, options, counter, tls=options.tls, proxy=options.proxy_protocol)
    server = uvicorn.Server(config)
    # Signals belong to whoever owns the loop (serve's shutdown trigger), not to uvicorn.
    server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign,assignment]
    with one_at_a_time_from(lambda: counter.reserve_fd):  # the task copies the context
        task = asyncio.ensure_future(server.serve(sockets=[tcp]))
    try:
        # uvicorn exposes start-up only as a flag, no event to wait on.
        while not server.started:
            if task.done():
                task.result()
                return
            await asyncio.sleep(0.005)
        on_started()
        stopping = asyncio.ensure_future(stop())
        await asyncio.wait({task, stopping}, return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
    finally:
        server.should_exit = True
        if not task.done():
            try:
                async with asyncio.timeout(options.graceful_timeout_s + 5):
                    await asyncio.shield(task)
            except TimeoutError:
                server.force_exit = True
        await asyncio.wait([task])  # raises only a cancel of our own
        if not task.cancelled():
            task.result()


def uvicorn_config(
    app: Any,
    options: ServerOptions,
    counter: ConnectionCounter,
    *,
    tls: bool,
    proxy: ProxyProtocol | None = None,
) -> Any:
    """A ``uvicorn.Config`` serving ``app`` with hypercorn's connection limits on uvicorn's
    httptools and WebSocket protocols (:mod:`.uvicorn_limits`), ``counter`` counting its
    connections from their accept; with ``tls``, the protocol runs the TLS handshake itself
    (uvicorn's own would run before the connection is counted); with ``proxy``, it reads
    the PROXY header of its balancers' connections (when it accepts them itself)."""
    import uvicorn

    from .uvicorn_limits import guarded_protocols

    # The TLS handshake is the protocol's (after the connection is counted), not uvicorn's.
    http, ws = guarded_protocols(
        options.limits, counter, _tls_context(options) if tls else None, proxy,
        options.refusal_cors,
    )
    return uvicorn.Config(
        app,
        http=http,  # its heads bounded by options.limits.heads
        ws="none" if options.ws_max_message_bytes is None else ws,
        ws_max_size=options.ws_max_message_bytes or 16 * 1024 * 1024,
        ws_per_message_deflate=False,  # as under hypercorn: see hardening's WebSocket guard
        lifespan="on" if options.lifespan else "off",
        loop="none",
        access_log=False,  # request lines could carry stream ids: no access log
        # uvicorn would rewrite the client's address from X-Forwarded-For sent from 127.0.0.1;
        # which forwarding header to believe, and from whom, is the router's (geo config).
        proxy_headers=False,
        server_header=False,  # as under hypercorn: no server name and version for probes
        log_config=None,  # uvicorn's lines go through the process's logging, as hypercorn's do
        log_level="warning",
        # a float, as hypercorn takes it (uvicorn's annotation says int; its timer takes any)
        timeout_keep_alive=options.keep_alive_timeout_s,  # type: ignore[arg-type]
        timeout_graceful_shutdown=max(1, round(options.graceful_timeout_s)),
        backlog=options.backlog,
    )


async def _serve_hypercorn(
    app: Any,
    listeners: Listeners,
    options: ServerOptions,
    stop: Callable[[], Awaitable[Any]],
    on_started: Callable[[], None],
    tickets: SessionTicketStore | None,
    connections: ConnectionRegistry | None,
    http3: Http3Status | None,
) -> None:
    from hypercorn.asyncio.run import worker_serve
    from hypercorn.config import Config, Sockets
    from hypercorn.utils import wrap_app

    from .accept import accepting
    from .http1_split import Http1Handoff

    config: Any = Config()
    if connections is not None:
        config.firstbyte_connections_registry = connections
    config.firstbyte_limits = options.limits
    config.firstbyte_refusal_cors = options.refusal_cors
    counter = ConnectionCounter(options.limits, _descriptor_limit(), options.memory_pressed)
    config.firstbyte_connections = counter
    # hypercorn listens again with its own backlog (default 100) on the socket it is given.
    config.backlog = options.backlog
    # A TLS handshake is part of the head a client must send in time (from the accept:
    # .accept runs it, and counts the connection first).
    config.ssl_handshake_timeout = options.limits.header_timeout_s
    config.keep_alive_timeout = options.keep_alive_timeout_s
    config.keep_alive_max_requests = KEEP_ALIVE_MAX_REQUESTS
    config.errorlog = logging.getLogger("hypercorn.error")  # via logging: INFO lines stay quiet
    config.accesslog = None  # request lines could carry stream ids: no access log
    config.include_server_header = False
    config.graceful_timeout = options.graceful_timeout_s
    config.alpn_protocols = ["h2", "http/1.1"]
    if options.limits.heads is not None:
        from .head_guards import h2_header_list_size, h11_incomplete_size

        # Room for any head the bounds let through: the guards, not the parsers, refuse.
        config.h11_max_incomplete_size = h11_incomplete_size(options.limits.heads)
        config.h2_max_header_list_size = h2_header_list_size(options.limits.heads)
    if options.ws_max_message_bytes is not None:
        config.websocket_max_message_size = options.ws_max_message_bytes
    if options.tls:
        config.certfile = options.certfile
        config.keyfile = options.keyfile
    quic = listeners.quic
    if quic is not None:
        if not options.tls:
            raise ValueError("HTTP/3 needs TLS (certfile and keyfile)")
        from .quic import Http3Status, TicketStore

        config.firstbyte_ticket_store = tickets if tickets is not None else TicketStore()
        port = options.http3_advertised_port or listeners.h3_port
        config.alt_svc_headers = [f'h3=":{port}"; ma=86400']
        http3 = http3 if http3 is not None else Http3Status()
        config.firstbyte_http3 = http3
    handoff = None
    if options.server == "auto":
        # HTTP/1.1 on uvicorn's protocol; the TLS handshake stays hypercorn's (ALPN decides).
        h1_config = uvicorn_config(app, options, counter, tls=False)
        h1_config.headers = [("alt-svc", value) for value in config.alt_svc_headers]
        h1_config.load()
        handoff = Http1Handoff(h1_config, counter)
        config.firstbyte_http1 = handoff
    if http3 is not None and quic is not None:
        # Up from here: the socket is bound, and what arrives before hypercorn's UDP task
        # runs waits in the socket's buffer.
        http3.set(True)
        _advertise_while_up(http3, config, handoff)
    sockets = Sockets(
        secure_sockets=[listeners.tcp] if options.tls else [],
        insecure_sockets=[] if options.tls else [listeners.tcp],
        quic_sockets=[quic] if quic is not None else [],
    )
    # The sockets are bound and listening already: connections made from here on are served.
    asyncio.get_running_loop().call_soon(on_started)
    if handoff is not None:
        handoff.start()
    poker = asyncio.create_task(_wake_quic_after(stop, quic)) if quic is not None else None
    try:
        with (
            accepting(counter, options.limits.header_timeout_s, options.proxy_protocol),
            one_at_a_time_from(lambda: counter.reserve_fd),
        ):
            await worker_serve(
                wrap_app(cast(Any, app), 0, "asgi"), config, sockets=sockets,
                shutdown_trigger=stop,
            )
    finally:
        if handoff is not None:
            handoff.stop()
        if poker is not None:
            await cancel_and_wait(poker)


async def _wake_quic_after(stop: Callable[[], Awaitable[Any]], quic: socket.socket) -> None:
    """After shutdown begins, poke the QUIC socket until the server has stopped.

    hypercorn's UDP loop re-checks "terminated and idle" only when a datagram arrives, so
    without traffic its shutdown waits the whole graceful timeout. A 1-byte datagram is
    dropped by the QUIC header parser and lets the loop notice.
    """
    await stop()
    address = quic.getsockname()[:2]
    with socket.socket(quic.family, socket.SOCK_DGRAM) as poke:
        while True:
            await asyncio.sleep(0.05)
            with contextlib.suppress(OSError):
                poke.sendto(b"\0", address)


def _tls_context(options: ServerOptions) -> ssl.SSLContext:
    """The server side of TLS for uvicorn's protocol: HTTP/1.1 by ALPN."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    assert options.certfile is not None
    context.load_cert_chain(options.certfile, options.keyfile)
    context.set_alpn_protocols(["http/1.1"])
    return context


def raise_descriptor_limit() -> int:
    """Raise this process's open-file soft limit to its hard limit (as nginx's
    ``worker_rlimit_nofile``, systemd's default of 1,024 soft is far below what one busy
    address opens) and return the soft limit now in force."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as exc:  # e.g. a hard limit the kernel caps lower
            log.warning("open-file limit stays %d: raising it to %d failed: %s", soft, hard, exc)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def _descriptor_limit() -> int:
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def _reset_unfinished_h2_streams() -> None:
    """Make hypercorn reset an HTTP/2 stream whose app failed mid-response.

    hypercorn (0.17, 0.18) forgets such a stream without sending END_STREAM or RST_STREAM, so
    the peer waits on it forever; over HTTP/1.1 it closes the connection, as it should. The
    sim's ``drop`` fault relies on that abrupt end, so on HTTP/2 the stream is reset
    (INTERNAL_ERROR, RFC 9113 section 5.4.2) and the connection's other streams go on.
    """
    import h2.errors
    import h2.exceptions
    from hypercorn.protocol.h2 import H2Protocol

    original = H2Protocol._close_stream

    async def _close_stream(self: Any, stream_id: int) -> None:
        buffer = self.stream_buffers.get(stream_id)
        if buffer is not None and not buffer.complete and stream_id in self.streams:
            if not self.closed:
                # Not once the connection is gone (its streams are closed one by one): a
                # flush there fails, and hypercorn's writer then handles Closed again while
                # it holds its send lock, which the next stream's flush waited for forever,
                # with every later stream's app blocked in its send (a client that closed
                # with streams in flight left their requests, and a drain, hanging).
                with contextlib.suppress(h2.exceptions.ProtocolError):
                    self.connection.reset_stream(stream_id, h2.errors.ErrorCodes.INTERNAL_ERROR)
                    await self._flush()
            await buffer.close()
            # Let the send loop visit the stream once more; it then drops its buffer.
            with contextlib.suppress(Exception):
                self.priority.unblock(stream_id)
            await self.has_data.set()
        await original(self, stream_id)

    H2Protocol._close_stream = _close_stream  # type: ignore[method-assign]


def _advertise_while_up(http3: Http3Status, config: Any, handoff: Any) -> None:
    """Send ``Alt-Svc`` (hypercorn's responses, and uvicorn's under ``auto``) only while the
    HTTP/3 server is up: a client told of a UDP port nobody answers waits a handshake
    timeout there before it falls back."""
    advertised = list(config.alt_svc_headers)
    h1_headers = list(handoff.config.encoded_headers) if handoff is not None else []

    def follow(up: bool) -> None:
        # In place: hypercorn reads the list on every response.
        config.alt_svc_headers[:] = advertised if up else []
        if handoff is not None:
            handoff.config.encoded_headers = (
                h1_headers if up else [(n, v) for n, v in h1_headers if n != b"alt-svc"]
            )
            # Now, not at the handoff's next Date tick: its default headers are the Date
            # and the config's headers.
            state = handoff.state
            date = [(n, v) for n, v in state.default_headers if n == b"date"]
            state.default_headers = [*date, *handoff.config.encoded_headers]

    if not http3.up:
        follow(False)
    http3.watch(follow)


def _supervise_quic_servers() -> None:
    """Keep hypercorn's QUIC server running, and close its datagram transport when it stops.

    hypercorn (0.17, 0.18) runs HTTP/3 as one task per UDP socket; an exception anywhere in
    it (one connection's bad event) ended that task, silently until shutdown, and HTTP/3 with
    it for the life of the process while TCP went on. Now the end is logged at once (one
    ERROR line), the listener's :class:`~.quic.Http3Status` goes down (so ``Alt-Svc`` and
    ``/healthz`` stop promising HTTP/3) and the server is restarted on the same socket after
    :meth:`~.quic.Http3Status.restart_delay_s`; the connections it had are lost (their clients
    reconnect). hypercorn also left the transport registered with the event loop after
    shutdown, so closing the UDP socket afterwards (as :func:`serve` does with every socket
    it was given) would leave a transport on a closed descriptor, and the next socket to get
    that number fails.
    """
    import time

    from hypercorn.asyncio import run

    from .quic import Http3Status
    from .quic_hardening import release_quic_connections

    hypercorn_run: Any = run

    class SupervisedUDPServer(hypercorn_run.UDPServer):  # type: ignore[misc]
        async def run(self) -> None:
            status = getattr(self.config, "firstbyte_http3", None) or Http3Status()
            in_a_row = 0
            try:
                while True:
                    started = time.monotonic()
                    status.set(True)
                    try:
                        await super().run()
                        return  # shut down, and idle
                    except Exception as exc:  # logged, then restarted
                        # Its connections are gone: what they counted per address too.
                        release_quic_connections(getattr(self, "protocol", None))
                        if self.context.terminated.is_set():
                            return
                        status.set(False)
                        status.failures += 1
                        # A server that served a while failed afresh: start the backoff over.
                        in_a_row = 1 if time.monotonic() - started > 60 else in_a_row + 1
                        delay = status.restart_delay_s(in_a_row)
                        log.error(
                            "HTTP/3 server stopped on %s; not advertised, restarting in %.0f s",
                            _where(exc), delay,
                        )
                    # A shutdown meanwhile ends the wait (and the server) at once.
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(delay):
                            await self.context.terminated.wait()
                    if self.context.terminated.is_set():
                        return
            finally:
                status.set(False)
                if self.transport is not None:
                    self.transport.close()

    hypercorn_run.UDPServer = SupervisedUDPServer


def _where(exc: BaseException) -> str:
    """``KeyError: 5 at h3.py:69``: an exception and the line that raised it, in one line
    (the innermost of an exception group's first)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    where = f" at {tb.tb_frame.f_code.co_filename.rsplit('/', 1)[-1]}:{tb.tb_lineno}" if tb else ""
    return f"{type(exc).__name__}: {exc}{where}"


def run_granian(
    factory: str,
    host: str,
    port: int,
    *,
    certfile: str | None = None,
    keyfile: str | None = None,
    backlog: int = DEFAULT_BACKLOG,
) -> None:
    """Serve the app that ``factory`` (``"module:function"``, called with no arguments in the
    server's own process) returns, under granian, until SIGINT or SIGTERM."""
    from pathlib import Path

    from granian import Granian

    kwargs: dict[str, object] = {}
    if certfile is not None and keyfile is not None:
        kwargs.update(ssl_cert=Path(certfile), ssl_key=Path(keyfile))
    server = Granian(
        factory,
        address=host,
        port=port,
        interface="asgi",  # type: ignore[arg-type]
        factory=True,
        workers=1,
        backlog=backlog,
        log_enabled=False,
        **kwargs,  # type: ignore[arg-type]
    )
    server.serve()
