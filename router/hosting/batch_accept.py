"""Accept many waiting connections each event-loop turn, on uvloop too.

libuv, under uvloop, accepts one connection per event-loop turn since libuv 1.45 ("unix:
don't accept() connections in a loop", so that processes sharing one listening socket share
its connections). A turn of a busy router relays every chunk ready then, so in a burst of new
connections the accept rate is the turn rate, and the rest wait in the kernel's accept queue
before any code of the router's has seen them: 1,000 connections arriving at once on a loop
whose turns take 2 ms were all accepted after 2.1 s on uvloop's own server, after 0.09 s on
asyncio's loop (which accepts up to the backlog a turn) and after 0.11-0.13 s on this server,
64 a turn (measured with plain sockets on loopback; ``tests/router/hosting/test_batch_accept.py``
counts the turns). The router's workers each listen on their own socket (``SO_REUSEPORT``),
so the kernel, not the order of accepts, spreads connections over processes: accepting many
at once takes no other process's share.

:func:`uvloop_factory` makes uvloop's loop with one change: ``create_server`` given a
listening TCP ``sock`` (how both hypercorn and uvicorn serve the sockets
:func:`~.servers.bind` opened) and no TLS returns a :class:`BatchAcceptServer`, which reads
the listening socket itself and accepts those that wait, up to :data:`ACCEPTS_PER_TURN`,
each time it is readable; every other call is uvloop's own. Each accepted socket becomes
the protocol's transport through the loop's public ``connect_accepted_socket``. A
connection's TLS is the protocol's (:mod:`.accept`, :mod:`.uvicorn_limits`), after it is
counted, so this server never needs to run a handshake.

A batch spends descriptors before any protocol has counted them: a router near its
descriptor limit refuses each new connection in its ``connection_made`` (closing it at once
in the last half of ``reserved_fds``), which only works if that runs before the next accept.
So from the descriptor number :func:`one_at_a_time_from` names (the router's: where its
reserve begins), the server accepts one connection and waits until it has reached its
protocol before it accepts the next, as libuv's own server does.
"""

from __future__ import annotations

import asyncio
import asyncio.trsock
import contextlib
import contextvars
import errno
import functools
import logging
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

from .limits import Throttle

__all__ = [
    "ACCEPTS_PER_TURN",
    "ACCEPT_RETRY_S",
    "BatchAcceptServer",
    "one_at_a_time_from",
    "uvloop_factory",
]

log = logging.getLogger("firstbyte.hosting")

ACCEPTS_PER_TURN = 64
"""The most connections accepted each time the listening socket is readable (it stays
readable while more wait, so the next turn takes the next ones). Every connection accepted
in a turn has its request head read and admitted a turn or two later, together: 800
connections arriving at once on a router relaying 200 streams made turns of 143-153 ms
with no cap, 36-69 ms with 64 a turn, 86-94 ms with libuv's one a turn (and its queue),
and the burst's responses began no later (P50 303-353 ms against 582-613 with no cap,
the sim's batching queue included)."""

ACCEPT_RETRY_S = 0.1
"""After ``accept()`` failed for want of descriptors or memory, the server stops reading its
socket this long (asyncio's loop stops for 1 s): a socket left readable would make every turn
retry at once. The router's connection counter refuses new connections well before the
process runs out of descriptors (``reserved_fds``), so this is the last line, not the limit."""

_RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
# A connection the client reset while queued, or a firewall's refusal: that one is lost,
# the next is accepted as usual (asyncio and libuv skip these too).
_SKIPPED_ERRNOS = frozenset({errno.ECONNABORTED, errno.EPERM, errno.EPROTO})

_throttle = Throttle(10.0)

_LOOP_TLS_ARGUMENTS = ("ssl", "ssl_handshake_timeout", "ssl_shutdown_timeout")


_one_at_a_time_from: contextvars.ContextVar[Callable[[], int] | None] = contextvars.ContextVar(
    "firstbyte_one_at_a_time_from", default=None
)


@contextlib.contextmanager
def one_at_a_time_from(descriptor: Callable[[], int]) -> Iterator[None]:
    """Within the block, servers made on this task's loop (and tasks it starts) accept
    one connection at a time once a new socket's descriptor number reaches
    ``descriptor()``: the next is accepted after the last one's ``connection_made`` ran."""
    token = _one_at_a_time_from.set(descriptor)
    try:
        yield
    finally:
        _one_at_a_time_from.reset(token)


class BatchAcceptServer(asyncio.AbstractServer):
    """An ``asyncio.Server`` for one listening TCP socket that accepts, each time the socket
    is readable, the connections waiting (at most :data:`ACCEPTS_PER_TURN`), and hands each
    to a new protocol from ``protocol_factory`` as the loop's own server would; from the
    descriptor number :func:`one_at_a_time_from` names where the server is made, one at a
    time."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        protocol_factory: Callable[[], asyncio.BaseProtocol],
        sock: socket.socket,
        backlog: int,
    ) -> None:
        self._loop = loop
        self._protocol_factory = protocol_factory
        self._sock = sock
        self._fd = sock.fileno()
        self._backlog = max(1, backlog)
        self._per_turn = min(self._backlog, ACCEPTS_PER_TURN)
        self._serving = False
        self._closed = False
        self._closed_future: asyncio.Future[None] = loop.create_future()
        self._adopting: set[asyncio.Task[None]] = set()
        self._retry: asyncio.TimerHandle | None = None
        self._one_at_a_time_from = _one_at_a_time_from.get()
        self._awaiting_adoption = False
        # asyncio re-listen()s a socket it is given with the server's backlog: so does this.
        sock.listen(self._backlog)
        sock.setblocking(False)

    # -- asyncio.AbstractServer
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop_reading()
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        self._sock.close()
        if not self._closed_future.done():
            self._closed_future.set_result(None)

    def get_loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def is_serving(self) -> bool:
        return self._serving

    async def start_serving(self) -> None:
        self.start()

    async def serve_forever(self) -> None:
        self.start()
        await asyncio.shield(self._closed_future)

    async def wait_closed(self) -> None:
        # As asyncio's and uvloop's servers: returns once closed, without waiting for the
        # connections it accepted (the server that owns them drains those).
        await asyncio.shield(self._closed_future)

    @property
    def sockets(self) -> tuple[Any, ...]:
        return () if self._closed else (asyncio.trsock.TransportSocket(self._sock),)

    # -- the accepting
    def start(self) -> None:
        """Start accepting (once; a closed server stays closed)."""
        if self._serving or self._closed:
            return
        self._serving = True
        self._loop.add_reader(self._fd, self._accept_waiting)

    def _stop_reading(self) -> None:
        if self._serving:
            self._serving = False
            self._loop.remove_reader(self._fd)

    def _accept_waiting(self) -> None:
        for _ in range(self._per_turn):
            try:
                conn, _address = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in _SKIPPED_ERRNOS:
                    continue
                self._failed(exc)
                return
            conn.setblocking(False)
            task = self._loop.create_task(self._adopt(conn))
            self._adopting.add(task)
            task.add_done_callback(self._adopted)
            last_batched = self._one_at_a_time_from
            if last_batched is not None and conn.fileno() >= last_batched():
                # Near the descriptor limit: the protocols count (and refuse) these
                # connections before another descriptor is spent.
                self._stop_reading()
                self._awaiting_adoption = True
                return

    def _adopted(self, task: asyncio.Task[None]) -> None:
        self._adopting.discard(task)
        if self._awaiting_adoption and not self._adopting:
            self._awaiting_adoption = False
            if not self._closed and self._retry is None:
                self.start()

    def _failed(self, exc: OSError) -> None:
        if exc.errno in _RESOURCE_ERRNOS:
            self._stop_reading()
            self._retry = self._loop.call_later(ACCEPT_RETRY_S, self._resume)
        held = _throttle.allow(f"accept:{exc.errno}", time.monotonic())
        if held is not None:
            more = f" ({held} more since the last line)" if held else ""
            log.error("accept() failed on %s: %s%s", _name(self._sock), exc, more)

    def _resume(self) -> None:
        self._retry = None
        if not self._closed:
            self.start()

    async def _adopt(self, conn: socket.socket) -> None:
        try:
            await self._loop.connect_accepted_socket(self._protocol_factory, conn)
        except OSError as exc:  # the client went between the accept and the adoption
            conn.close()
            log.debug("connection lost before it was served: %s", exc)


def _name(sock: socket.socket) -> str:
    try:
        return str(sock.getsockname())
    except OSError:
        return "a closed socket"


def _batch_server_wanted(host: Any, port: Any, sock: Any, kwargs: dict[str, Any]) -> bool:
    """Whether a ``create_server`` call is one :class:`BatchAcceptServer` serves as the loop
    would: an open listening TCP socket given, no address to bind, no TLS by the loop."""
    return (
        host is None
        and port is None
        and isinstance(sock, socket.socket)
        and sock.fileno() >= 0
        and sock.type == socket.SOCK_STREAM
        and sock.family in (socket.AF_INET, socket.AF_INET6)
        and all(kwargs.get(name) is None for name in _LOOP_TLS_ARGUMENTS)
    )


@functools.cache
def uvloop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """A factory of uvloop loops whose ``create_server`` on a given TCP socket accepts every
    waiting connection a turn (:class:`BatchAcceptServer`); None without uvloop."""
    try:
        import uvloop
    except ImportError:
        return None

    class BatchAcceptLoop(uvloop.Loop):
        async def create_server(  # type: ignore[override]
            self,
            protocol_factory: Callable[[], asyncio.BaseProtocol],
            host: Any = None,
            port: Any = None,
            *,
            sock: Any = None,
            backlog: int = 100,
            start_serving: bool = True,
            **kwargs: Any,
        ) -> asyncio.AbstractServer:
            if not _batch_server_wanted(host, port, sock, kwargs):
                return await super().create_server(
                    protocol_factory,
                    host,
                    port,
                    sock=sock,
                    backlog=backlog,
                    start_serving=start_serving,
                    **kwargs,
                )
            server = BatchAcceptServer(self, protocol_factory, sock, backlog)
            if start_serving:
                server.start()
            return server

    return BatchAcceptLoop
