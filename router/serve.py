"""Running the router: its app and config handed to :mod:`firstbyte.router.hosting`.

With TLS, the router serves HTTP/1.1 and HTTP/2 by ALPN on TCP and HTTP/3 on the same UDP
port (0-RTT through the hosting's session-ticket store). ``listen.server = "auto"`` (the
default) serves HTTP/2 and HTTP/3 with hypercorn and HTTP/1.1 with uvicorn's httptools
protocol (less CPU per request and chunk); ``"hypercorn"`` serves all three with hypercorn;
``"uvicorn"`` serves HTTP/1.1 only.

:func:`running_router` is the helper tests and benchmarks use: it binds ephemeral ports,
serves in the running event loop and yields the URLs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from firstbyte.protocol import paths

from .app import RouterApp, build_app
from .config import RouterConfig
from .drain import drain
from .hosting import (
    ClientLimits,
    Listeners,
    ProxyProtocol,
    ServerOptions,
    bind,
    heads,
    running,
)
from .hosting import serve as host
from .hosting.goaway import ConnectionRegistry
from .hosting.quic import Http3Status, SessionTicketStore, TicketStore
from .reload import Reloader

__all__ = [
    "CONFIG_ENV",
    "RouterEndpoints",
    "client_limits",
    "granian_app",
    "running_router",
    "serve",
    "ticket_store",
    "ws_max_message_bytes",
]

CONFIG_ENV = "FIRSTBYTE_ROUTER_CONFIG"
"""The router's config as JSON, for :func:`granian_app` (granian imports the app by name in
its own worker process)."""

log = logging.getLogger("firstbyte.router")


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
    tickets: SessionTicketStore | None = None
    http3: Http3Status | None = None
    """Whether HTTP/3 is being served now (None: not configured); ``/healthz`` reads it."""

    @property
    def openai_base_url(self) -> str:
        return self.base_url + paths.API_BASE


def ws_max_message_bytes(config: RouterConfig) -> int:
    """The largest WebSocket message either server accepts: one ``request`` message whose body
    is at the ``max_body_bytes`` limit, plus room for its envelope.

    Both servers default to 16 MiB, so a message far over the body limit would be buffered
    whole before the body check could answer it; above this the server closes with 1009.
    """
    return config.limits.max_body_bytes + 4096


def _options(config: RouterConfig, tune_gc: bool, app: RouterApp) -> ServerOptions:
    listen = config.listen
    return ServerOptions(
        server=listen.server,
        certfile=listen.certfile,
        keyfile=listen.keyfile,
        keep_alive_timeout_s=listen.keep_alive_timeout_s,
        graceful_timeout_s=5.0,
        lifespan=True,  # the app starts its background tasks (peers, warmup, metrics) there
        ws_max_message_bytes=ws_max_message_bytes(config),
        limits=client_limits(config),
        # Memory near limits.max_rss_bytes puts the per-address cap in force.
        memory_pressed=lambda: app.memory_refusal() is not None,
        # Refusals written before the app carry its CORS headers (the policy read at the
        # refusal: a reload changes it).
        refusal_cors=lambda origin, host: app.state.cors.refusal_headers(origin, host),
        tune_gc=tune_gc,
        backlog=listen.backlog,
        http3_advertised_port=listen.http3_advertised_port,
        proxy_protocol=(
            ProxyProtocol(listen.proxy_protocol_from) if listen.proxy_protocol else None
        ),
    )


def ticket_store(config: RouterConfig) -> SessionTicketStore:
    """Where HTTP/3 session tickets live: this process's memory, or (``state.redis_url``)
    Redis, so that a ticket issued by one process is accepted, once, by any of them."""
    if config.state.redis_url is None:
        return TicketStore()
    from .shared.keys import Keys
    from .shared.target import redis_target
    from .shared.tickets import RedisTicketStore

    return RedisTicketStore(redis_target(config.state), Keys(config.state.key_prefix))


def client_limits(config: RouterConfig) -> ClientLimits:
    """The connection-level part of ``[limits]``, which the hosting layer enforces."""
    limits = config.limits
    return ClientLimits(
        heads=head_limits(config),
        header_timeout_s=limits.client_header_timeout_s,
        send_timeout_s=limits.client_send_timeout_s,
        max_connections_per_client=limits.max_connections_per_client,
        hard_max_connections_per_client=limits.hard_max_connections_per_client,
        reserved_fds=limits.reserved_fds,
        h2_max_early_resets=limits.h2_max_early_resets,
        h2_early_resets_per_s=limits.h2_early_resets_per_s,
        quic_retry_above_handshakes_per_s=limits.quic_retry_above_handshakes_per_s,
    )


def head_limits(config: RouterConfig) -> heads.HeadLimits:
    """The request-head part of ``[limits]`` (:mod:`.hosting.heads`)."""
    limits = config.limits
    return heads.HeadLimits(
        max_request_line_bytes=limits.max_request_line_bytes,
        max_header_line_bytes=limits.max_header_line_bytes,
        max_header_bytes=limits.max_header_bytes,
        max_headers=limits.max_headers,
    )


def _bind(
    config: RouterConfig, app: RouterApp | None, reuse_port: bool = False
) -> tuple[Listeners, RouterEndpoints]:
    listen = config.listen
    tls = listen.certfile is not None
    want_h3 = tls and listen.http3 and listen.server != "uvicorn"
    listeners = bind(
        listen.host, listen.port, udp=want_h3, reuse_port=reuse_port, backlog=listen.backlog
    )
    try:
        endpoints = RouterEndpoints(
            base_url=listeners.url(tls=tls),
            host=listen.host,
            port=listeners.port,
            h3_port=listeners.h3_port,
            app=app or build_app(config),
            tickets=ticket_store(config) if want_h3 else None,
            http3=Http3Status() if want_h3 else None,
        )
        endpoints.app.state.http3 = endpoints.http3
    except BaseException:
        listeners.close()
        raise
    return listeners, endpoints


def describe(config: RouterConfig, endpoints: RouterEndpoints) -> str:
    """What is served where, e.g. ``https://127.0.0.1:8443 (HTTP/1.1, HTTP/2) and HTTP/3 on
    UDP 8443`` or ``http://127.0.0.1:8080 (HTTP/1.1, h2c; plain HTTP, no TLS)``."""
    listen = config.listen
    tls = listen.certfile is not None
    versions = ["HTTP/1.1"]
    if listen.server != "uvicorn":
        versions.append("HTTP/2" if tls else "h2c")
    text = f"{endpoints.base_url} ({', '.join(versions)}{'' if tls else '; plain HTTP, no TLS'})"
    if endpoints.h3_port is not None:
        text += f" and HTTP/3 on UDP {endpoints.h3_port}"
        if listen.http3_advertised_port not in (None, endpoints.h3_port):
            text += f" (advertised as {listen.http3_advertised_port})"
    return text


def _announce(config: RouterConfig, endpoints: RouterEndpoints) -> None:
    upstreams = len(config.upstreams)
    traces = config.telemetry.otlp_endpoint
    log.info(
        "firstbyte router (%s) serving %s; %d upstream%s%s",
        config.region,
        describe(config, endpoints),
        upstreams,
        "" if upstreams == 1 else "s",
        f"; traces to {traces}" if traces else "",
    )


async def serve(
    config: RouterConfig,
    *,
    shutdown: Callable[[], Awaitable[Any]] | None = None,
    started: Callable[[RouterEndpoints], None] | None = None,
    app: RouterApp | None = None,
    tune_gc: bool = True,
    reuse_port: bool = False,
    reload: Callable[[], RouterConfig] | None = None,
) -> None:
    """Serve ``config`` until ``shutdown()`` returns; by default until SIGTERM or SIGINT,
    then drain (:mod:`firstbyte.router.drain`). SIGHUP reloads the config from ``reload()``
    (:mod:`firstbyte.router.reload`; without ``reload`` SIGHUP is ignored).

    With ``tune_gc`` (the default: this is a router process) the cyclic GC is tuned for
    latency once the listener is up (:func:`firstbyte.router.hosting.gc_tuning.tune_for_serving`).
    With ``reuse_port`` the sockets share their port with the other workers
    (:mod:`firstbyte.router.workers`).
    """
    listeners, endpoints = _bind(config, app, reuse_port)
    connections = ConnectionRegistry()
    loader = Reloader(endpoints.app, reload) if reload is not None else None
    stop = asyncio.Event()
    if shutdown is None:
        # Before the listener is announced, not once it serves: a reload (SIGHUP) or a drain
        # sent as soon as the log says "serving" must not be lost (a worker ignores SIGHUP
        # until its loop handles it; a SIGHUP in between was, and its reload never ran).
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        if loader is not None:
            loop.add_signal_handler(signal.SIGHUP, loader.signalled)
        else:
            signal.signal(signal.SIGHUP, signal.SIG_IGN)

    def on_started() -> None:
        _announce(config, endpoints)
        if started is not None:
            started(endpoints)

    await host(
        endpoints.app,
        listeners,
        _options(config, tune_gc, endpoints.app),
        shutdown=shutdown or (lambda: _until_drained(endpoints.app, connections, stop)),
        started=on_started,
        tickets=endpoints.tickets,
        connections=connections,
        http3=endpoints.http3,
    )


async def _until_drained(
    app: RouterApp, connections: ConnectionRegistry, stop: asyncio.Event
) -> None:
    """Once ``stop`` is set (SIGTERM or SIGINT, handled from before the start), drain and
    return; a second signal cuts the drain short."""
    await stop.wait()
    stop.clear()  # set again by a second signal: the drain then ends at once
    await drain(app, connections, hurry=stop)


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
    listeners, endpoints = _bind(config, None)
    options = _options(config, tune_gc, endpoints.app)
    async with running(
        endpoints.app, listeners, options, tickets=endpoints.tickets, http3=endpoints.http3
    ):
        _announce(config, endpoints)
        yield endpoints


def granian_app() -> RouterApp:
    """Factory for granian (``firstbyte.router.serve:granian_app``): the router for the config
    in the ``FIRSTBYTE_ROUTER_CONFIG`` environment variable (JSON), with the GC tuned as
    ``firstbyte router`` has it. granian serves HTTP/1.1 and HTTP/2; HTTP/3 stays hypercorn's.
    """
    import os

    import msgspec

    from .config import parse_config
    from .hosting.gc_tuning import tune_for_serving

    config = parse_config(msgspec.json.decode(os.environ[CONFIG_ENV]), f"${CONFIG_ENV}")
    app = build_app(config)
    tune_for_serving()
    return app
