"""Starting the sim: configuration, the ASGI server under it, and an in-process helper.

Three ASGI servers can run the same :class:`~firstbyte.router.sim.app.SimApp` (``--server``):

- ``uvicorn`` (httptools parser; HTTP/1.1 only, TLS optional): the default for plain HTTP, the
  fastest per streamed chunk on this machine (see ``benchmarks/scenarios/sim_cpu.py``);
- ``hypercorn`` (HTTP/1.1, HTTP/2 over TLS with ALPN, h2c prior knowledge): the default when
  ``certfile``/``keyfile`` are given, so clients can negotiate HTTP/2;
- ``granian`` (Rust HTTP stack, HTTP/1.1 and HTTP/2): only as a separate process started by
  ``firstbyte sim --server granian`` (it imports the app by name, configured through the
  ``FIRSTBYTE_SIM_CONFIG`` environment variable).

Tests and benchmarks start a real sim inside their own event loop with :func:`running_sim`::

    async with running_sim(profile="h100-7b", max_num_seqs=2) as url:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused")

and use :func:`sim_server` when they also want the engine (metrics, cache state).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from firstbyte.router.sim.app import DEFAULT_MAX_BODY_BYTES, SimApp, SimOptions, quiet_drop_logs
from firstbyte.router.sim.engine import Engine
from firstbyte.router.sim.faults import FaultPlan, parse_fault
from firstbyte.router.sim.profiles import get_profile

__all__ = [
    "SERVERS",
    "SimConfig",
    "SimServer",
    "build_app",
    "granian_app",
    "running_sim",
    "serve",
    "sim_server",
]

SERVERS = ("uvicorn", "hypercorn", "granian")
CONFIG_ENV = "FIRSTBYTE_SIM_CONFIG"


class SimConfig(msgspec.Struct, kw_only=True):
    """Everything that defines one sim replica (the ``firstbyte sim`` options)."""

    profile: str = "instant"
    max_num_seqs: int | None = None
    """None: the profile's default."""
    prefix_cache_blocks: int | None = None
    """None: the profile's default."""
    queue_limit: int = 1024
    faults: list[str] = msgspec.field(default_factory=list)
    """``--fault`` SPECs (see :mod:`firstbyte.router.sim.faults`)."""
    seed: int = 0
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES


def build_app(config: SimConfig) -> SimApp:
    """A ready app for ``config``; ``KeyError``/``ValueError`` with a clear message if invalid."""
    profile = get_profile(config.profile)
    engine = Engine(
        profile,
        max_num_seqs=config.max_num_seqs,
        queue_limit=config.queue_limit,
        prefix_cache_blocks=config.prefix_cache_blocks,
    )
    plan = FaultPlan([parse_fault(spec) for spec in config.faults], seed=config.seed)
    options = SimOptions(max_body_bytes=config.max_body_bytes, seed=config.seed, faults=plan)
    return SimApp(engine, options)


def granian_app() -> SimApp:
    """Factory for granian (``firstbyte.router.sim.server:granian_app``), configured from the
    env."""
    quiet_drop_logs()
    return build_app(msgspec.json.decode(os.environ.get(CONFIG_ENV, "{}"), type=SimConfig))


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket (port 0: an ephemeral port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto=IPPROTO_TCP matters: asyncio only sets TCP_NODELAY on accepted sockets whose proto
    # says TCP, and without it Nagle + delayed ACK hold small SSE writes back for ~40 ms.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # inherited by accepted sockets
    sock.bind((host, port))
    sock.listen(1024)
    sock.setblocking(False)
    return sock


async def serve(
    app: SimApp,
    sock: socket.socket,
    *,
    server: str = "uvicorn",
    certfile: str | None = None,
    keyfile: str | None = None,
    shutdown: asyncio.Event,
    started: Callable[[], None] | None = None,
) -> None:
    """Serve ``app`` on ``sock`` in this event loop until ``shutdown`` is set."""
    quiet_drop_logs()
    app.driver.start()
    try:
        if server == "uvicorn":
            await _serve_uvicorn(app, sock, certfile, keyfile, shutdown, started)
        elif server == "hypercorn":
            await _serve_hypercorn(app, sock, certfile, keyfile, shutdown, started)
        else:
            raise ValueError(f"server {server!r} cannot run in-process; use uvicorn or hypercorn")
    finally:
        await app.driver.stop()


async def _serve_uvicorn(
    app: SimApp,
    sock: socket.socket,
    certfile: str | None,
    keyfile: str | None,
    shutdown: asyncio.Event,
    started: Callable[[], None] | None,
) -> None:
    import uvicorn

    config = uvicorn.Config(
        app,
        http="httptools",
        lifespan="off",
        log_level="warning",
        access_log=False,
        ssl_certfile=certfile,
        ssl_keyfile=keyfile,
        timeout_graceful_shutdown=1,
        timeout_keep_alive=30,
    )
    userver = uvicorn.Server(config)
    # Signals belong to whoever owns the loop (the CLI, or pytest), not to the server.
    userver.capture_signals = contextlib.nullcontext  # type: ignore[method-assign,assignment]
    task = asyncio.ensure_future(userver.serve(sockets=[sock]))
    try:
        while not userver.started:
            if task.done():
                task.result()
                return
            await asyncio.sleep(0.005)
        if started is not None:
            started()
        await asyncio.wait(
            [task, asyncio.ensure_future(shutdown.wait())], return_when=asyncio.FIRST_COMPLETED
        )
    finally:
        userver.should_exit = True
        if not task.done():
            try:
                await asyncio.wait_for(task, 5)
            except TimeoutError:
                userver.force_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def _serve_hypercorn(
    app: SimApp,
    sock: socket.socket,
    certfile: str | None,
    keyfile: str | None,
    shutdown: asyncio.Event,
    started: Callable[[], None] | None,
) -> None:
    from hypercorn.asyncio import serve as hypercorn_serve
    from hypercorn.config import Config

    _reset_unfinished_h2_streams()
    config = Config()
    # hypercorn takes ownership of (and closes) the descriptor it is given: give it a copy.
    config.bind = [f"fd://{os.dup(sock.fileno())}"]
    config.accesslog = None
    config.errorlog = "-"
    config.loglevel = "WARNING"
    config.graceful_timeout = 1.0
    config.keep_alive_timeout = 30.0
    if certfile is not None:
        config.certfile = certfile
        config.keyfile = keyfile
    if started is not None:
        asyncio.get_running_loop().call_soon(started)
    app_any: Any = app
    await hypercorn_serve(app_any, config, shutdown_trigger=shutdown.wait, mode="asgi")


def _reset_unfinished_h2_streams() -> None:
    """Make hypercorn reset an HTTP/2 stream whose app failed mid-response.

    hypercorn (0.17, 0.18) forgets such a stream without sending END_STREAM or RST_STREAM, so
    the peer waits on it forever; over HTTP/1.1 it closes the connection, as it should. The
    ``drop`` fault relies on that abrupt end, so on HTTP/2 the stream is reset
    (INTERNAL_ERROR, RFC 9113 section 5.4.2) and the connection's other streams go on.
    """
    from hypercorn.protocol.h2 import H2Protocol

    if getattr(H2Protocol, "_firstbyte_resets", False):
        return
    import h2.errors
    import h2.exceptions

    original = H2Protocol._close_stream

    async def _close_stream(self: Any, stream_id: int) -> None:
        buffer = self.stream_buffers.get(stream_id)
        if buffer is not None and not buffer.complete and stream_id in self.streams:
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
    H2Protocol._firstbyte_resets = True  # type: ignore[attr-defined]


@dataclass(slots=True)
class SimServer:
    """A sim running in this process: its base URL (no ``/v1``), app and engine."""

    url: str
    app: SimApp
    port: int

    @property
    def engine(self) -> Engine:
        return self.app.engine


@contextlib.asynccontextmanager
async def sim_server(
    profile: str = "instant",
    *,
    host: str = "127.0.0.1",
    server: str | None = None,
    certfile: str | None = None,
    keyfile: str | None = None,
    **options: Any,
) -> AsyncIterator[SimServer]:
    """Start a real sim on ``host``:ephemeral port in the running loop; stop it on exit.

    ``options`` are :class:`SimConfig` fields (``max_num_seqs``, ``prefix_cache_blocks``,
    ``queue_limit``, ``faults``, ``seed``, ``max_body_bytes``). With ``certfile`` the server
    is hypercorn (HTTP/2 via ALPN) unless ``server`` says otherwise, and the URL is https.
    """
    config = SimConfig(profile=profile, **options)
    app = build_app(config)
    chosen = server or ("hypercorn" if certfile else "uvicorn")
    sock = bind_socket(host, 0)
    port = sock.getsockname()[1]
    shutdown = asyncio.Event()
    ready = asyncio.Event()
    task = asyncio.ensure_future(
        serve(
            app,
            sock,
            server=chosen,
            certfile=certfile,
            keyfile=keyfile,
            shutdown=shutdown,
            started=ready.set,
        )
    )
    try:
        waiter = asyncio.ensure_future(ready.wait())
        await asyncio.wait([task, waiter], return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            waiter.cancel()
            task.result()
            raise RuntimeError("the sim server stopped during start-up")
        scheme = "https" if certfile else "http"
        name = f"[{host}]" if ":" in host else host
        yield SimServer(url=f"{scheme}://{name}:{port}", app=app, port=port)
    finally:
        shutdown.set()
        try:
            await asyncio.wait_for(task, 10)
        finally:
            sock.close()


@contextlib.asynccontextmanager
async def running_sim(profile: str = "instant", **options: Any) -> AsyncIterator[str]:
    """Start a real sim in the running loop and yield its base URL (see :func:`sim_server`)."""
    async with sim_server(profile, **options) as sim:
        yield sim.url
