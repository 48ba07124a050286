"""Server start-up: TLS with HTTP/1.1 and HTTP/2 (ALPN) on TCP, HTTP/3 on the same UDP port.

hypercorn serves all three (HTTP/3 through aioquic, with the session-ticket store from
:mod:`firstbyte.router.quic` so clients can resume with 0-RTT). ``listen.server = "uvicorn"`` serves
HTTP/1.1 only, with httptools (less CPU per chunk, see the README's figures).

:func:`running_router` is the helper tests and benchmarks use: it binds ephemeral ports,
serves in the running event loop and yields the URLs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, cast

from firstbyte.protocol import paths

from .app import RouterApp, build_app
from .config import RouterConfig
from .gc_tuning import tune_for_serving
from .quic import TicketStore, enable_session_tickets

__all__ = [
    "KEEP_ALIVE_MAX_REQUESTS",
    "RouterEndpoints",
    "bind_sockets",
    "loop_factory",
    "running_router",
    "serve",
    "ws_max_message_bytes",
]

log = logging.getLogger("firstbyte.router")

KEEP_ALIVE_MAX_REQUESTS = 1_000_000
"""Requests one client connection may carry before hypercorn closes it. hypercorn's default
(1000) closes an HTTP/1.1 connection or sends GOAWAY on an HTTP/2 one after 1000 requests:
an SDK multiplexing 100 streams over one prewarmed HTTP/2 connection would lose it every
~15 s, and the requests started during the new handshake (2-3 round trips on a WAN) would
all pay it. A million is ~4.5 hours of that load."""
# hpack and h2 log decoded header values (the API key among them) at DEBUG: keep them above it
# whatever level the application sets, so a debug run cannot leak secrets.
for _name in ("hpack", "h2"):
    logging.getLogger(_name).setLevel(logging.INFO)


@dataclass(frozen=True)
class RouterEndpoints:
    """Where a started router listens."""

    base_url: str
    """``https://HOST:PORT`` (or ``http://`` for plain HTTP), without ``/v1``."""
    host: str
    port: int
    h3_port: int | None
    """The UDP port serving HTTP/3 (same number as ``port``), or None."""
    app: RouterApp
    tickets: TicketStore | None = None

    @property
    def openai_base_url(self) -> str:
        return self.base_url + paths.API_BASE


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The event loop a router process runs on: uvloop when installed (it comes with the
    ``router`` extra through ``uvicorn[standard]``), else asyncio's default (``None``).

    uvloop's C loop cuts the router's CPU per relayed chunk by roughly a tenth (measured
    with ``firstbyte bench router_overhead``); every stream costs a loop turn per chunk.
    """
    try:
        import uvloop
    except ImportError:
        return None
    new_loop: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return new_loop


def ws_max_message_bytes(config: RouterConfig) -> int:
    """The largest WebSocket message either server accepts: one ``request`` message whose body
    is at the ``max_body_bytes`` limit, plus room for its envelope.

    Both servers default to 16 MiB, so a message far over the body limit would be buffered
    whole before the body check could answer it; above this the server closes with 1009.
    """
    return config.limits.max_body_bytes + 4096


def bind_sockets(host: str, port: int, *, udp: bool) -> tuple[socket.socket, socket.socket | None]:
    """A listening TCP socket and (if ``udp``) a UDP socket on the same port number.

    With ``port`` 0 the kernel picks the TCP port; the UDP bind on that number is retried
    with a fresh port if it happens to be taken.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    last_error: OSError | None = None
    for _ in range(20):
        tcp = socket.socket(family, socket.SOCK_STREAM)
        try:
            tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            tcp.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            tcp.bind((host, port))
            tcp.listen(1024)
            tcp.setblocking(False)
        except OSError:
            tcp.close()
            raise
        if not udp:
            return tcp, None
        chosen = tcp.getsockname()[1]
        quic = socket.socket(family, socket.SOCK_DGRAM)
        try:
            quic.bind((host, chosen))
            quic.setblocking(False)
            return tcp, quic
        except OSError as exc:
            quic.close()
            tcp.close()
            last_error = exc
            if port != 0:
                raise
    assert last_error is not None
    raise last_error


def _hypercorn_config(config: RouterConfig, h3_port: int | None, tickets: TicketStore) -> Any:
    from hypercorn.config import Config

    listen = config.listen
    hc: Any = Config()
    hc.keep_alive_timeout = listen.keep_alive_timeout_s
    hc.keep_alive_max_requests = KEEP_ALIVE_MAX_REQUESTS
    hc.errorlog = logging.getLogger("hypercorn.error")  # via logging: INFO lines stay quiet
    hc.accesslog = None  # request lines could carry stream ids: no access log by default
    hc.include_server_header = False
    hc.graceful_timeout = 5.0
    hc.alpn_protocols = ["h2", "http/1.1"]
    hc.websocket_max_message_size = ws_max_message_bytes(config)
    if listen.certfile is not None:
        hc.certfile = listen.certfile
        hc.keyfile = listen.keyfile
    if h3_port is not None:
        hc.alt_svc_headers = [f'h3=":{h3_port}"; ma=86400']
    hc.firstbyte_ticket_store = tickets
    return hc


async def serve(
    config: RouterConfig,
    *,
    shutdown: Callable[[], Awaitable[Any]] | None = None,
    started: Callable[[RouterEndpoints], None] | None = None,
    app: RouterApp | None = None,
    tune_gc: bool = True,
) -> None:
    """Serve ``config`` until ``shutdown()`` returns (default: SIGINT/SIGTERM).

    With ``tune_gc`` (the default: this is a router process) the cyclic GC is tuned for
    latency once the listener is up (:func:`firstbyte.router.gc_tuning.tune_for_serving`).
    """
    listen = config.listen
    tls = listen.certfile is not None
    want_h3 = tls and listen.http3 and listen.server == "hypercorn"
    tcp, quic = bind_sockets(listen.host, listen.port, udp=want_h3)
    port = tcp.getsockname()[1]
    h3_port = quic.getsockname()[1] if quic is not None else None
    app = app or build_app(config)
    host = f"[{listen.host}]" if ":" in listen.host else listen.host
    tickets = TicketStore()
    endpoints = RouterEndpoints(
        base_url=f"{'https' if tls else 'http'}://{host}:{port}",
        host=listen.host,
        port=port,
        h3_port=h3_port,
        app=app,
        tickets=tickets if want_h3 else None,
    )
    if listen.server == "uvicorn":
        await _serve_uvicorn(
            config, app, tcp, shutdown, lambda: _announce(started, endpoints, tune_gc)
        )
        return
    from hypercorn.asyncio.run import worker_serve
    from hypercorn.config import Sockets
    from hypercorn.utils import wrap_app

    enable_session_tickets()
    hc = _hypercorn_config(config, h3_port, tickets)
    sockets = Sockets(
        secure_sockets=[tcp] if tls else [],
        insecure_sockets=[] if tls else [tcp],
        quic_sockets=[quic] if quic is not None else [],
    )
    loop = asyncio.get_running_loop()
    loop.call_soon(_announce, started, endpoints, tune_gc)
    stop = shutdown or _signal_event().wait
    poker = asyncio.create_task(_wake_quic_after(stop, quic)) if quic is not None else None
    try:
        await worker_serve(
            wrap_app(cast(Any, app), 0, "asgi"), hc, sockets=sockets, shutdown_trigger=stop
        )
    finally:
        if poker is not None:
            poker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await poker


def _signal_event() -> asyncio.Event:
    """An event set on SIGINT or SIGTERM."""
    import signal

    event = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, event.set)
    return event


async def _wake_quic_after(stop: Callable[[], Awaitable[Any]], quic: socket.socket) -> None:
    """After shutdown begins, poke the QUIC socket until the server has stopped.

    hypercorn's UDP loop re-checks "terminated and idle" only when a datagram arrives, so
    without traffic its shutdown waits the whole graceful timeout. A 1-byte datagram is
    dropped by the QUIC header parser and lets the loop notice.
    """
    await stop()
    address = quic.getsockname()[:2]
    family = quic.family
    with socket.socket(family, socket.SOCK_DGRAM) as poke:
        while True:
            await asyncio.sleep(0.05)
            with contextlib.suppress(OSError):
                poke.sendto(b"\0", address)


def _announce(
    started: Callable[[RouterEndpoints], None] | None, ep: RouterEndpoints, tune_gc: bool
) -> None:
    if tune_gc:
        # Start-up is over (imports, app, listener): freeze it out of every later collection.
        tune_for_serving()
    log.info("router listening on %s (HTTP/3 on UDP %s)", ep.base_url, ep.h3_port)
    if started is not None:
        started(ep)


async def _serve_uvicorn(
    config: RouterConfig,
    app: RouterApp,
    tcp: socket.socket,
    shutdown: Callable[[], Awaitable[Any]] | None,
    on_started: Callable[[], None],
) -> None:
    import uvicorn

    listen = config.listen
    uv = uvicorn.Config(
        app,
        http="httptools",
        ws="websockets-sansio",
        ws_max_size=ws_max_message_bytes(config),
        lifespan="on",
        loop="none",
        access_log=False,
        log_level="warning",
        ssl_certfile=listen.certfile,
        ssl_keyfile=listen.keyfile,
        timeout_keep_alive=int(listen.keep_alive_timeout_s),
    )
    server = uvicorn.Server(uv)

    async def watch() -> None:
        # uvicorn exposes start-up only as a flag, no event to wait on.
        while not server.started:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        on_started()
        if shutdown is not None:
            await shutdown()
            server.should_exit = True

    watcher = asyncio.create_task(watch())
    try:
        await server.serve(sockets=[tcp])
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher


@contextlib.asynccontextmanager
async def running_router(
    config: RouterConfig, *, tune_gc: bool = False
) -> AsyncIterator[RouterEndpoints]:
    """Serve ``config`` in the running loop for the duration of the block.

    Use ``listen.port = 0`` for an ephemeral port; the yielded endpoints carry the base URL
    and the HTTP/3 port. The GC is left alone (this loop may belong to a test run or another
    program) unless ``tune_gc``: pass it where the process is the router, as a benchmark's
    router process is.
    """
    stop = asyncio.Event()
    ready: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

    def started(ep: RouterEndpoints) -> None:
        if not ready.done():
            ready.set_result(ep)

    task: asyncio.Future[Any] = asyncio.create_task(
        serve(config, shutdown=stop.wait, started=started, tune_gc=tune_gc)
    )
    try:
        done, _ = await asyncio.wait({task, ready}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            task.result()  # start-up failed: raise its error
            raise RuntimeError("router stopped before it started")
        yield ready.result()
    finally:
        stop.set()
        try:
            await asyncio.wait_for(task, 10)
        except TimeoutError:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
