"""An httpcore network backend on plain asyncio protocols, for the router's upstream pools.

httpx's default backend goes through anyio, which per read enters a cancel scope with a
timer, resumes the transport's reading and pauses it again afterwards (two ``epoll_ctl``
calls per upstream chunk), and per idle connection in every pool scan polls the socket to
see whether the server closed it. Here the transport keeps reading into a bounded buffer
(paused only above :data:`HIGH_WATER_BYTES`), a read that finds data returns it at once, a
read that waits parks on one future with one timer, and "is the idle connection readable"
is a look at that buffer.

The promises are httpcore's: ``read`` returns ``b""`` at EOF, raises ``ReadTimeout`` /
``ReadError``; ``write`` raises ``WriteTimeout`` / ``WriteError``; connecting raises
``ConnectTimeout`` / ``ConnectError`` (TLS failures included). Unix sockets are not offered
(upstreams are URLs with a host).
"""

from __future__ import annotations

import asyncio
import collections
import socket
import ssl
from collections.abc import Iterable
from typing import Any, cast

import httpcore
import httpx
from httpcore import AsyncNetworkBackend, AsyncNetworkStream

__all__ = ["HIGH_WATER_BYTES", "AsyncioBackend", "install"]

HIGH_WATER_BYTES = 256 << 10
"""Unread bytes at which the transport stops reading from the socket (TCP pushes back)."""
_LOW_WATER_BYTES = 64 << 10

SocketOption = (
    tuple[int, int, int] | tuple[int, int, bytes | bytearray] | tuple[int, int, None, int]
)


class _Protocol(asyncio.Protocol):
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.buffer: collections.deque[bytes] = collections.deque()
        self.buffered = 0
        self.eof = False
        self.error: BaseException | None = None
        self.lost = False
        self.read_paused = False
        self.reader: asyncio.Future[None] | None = None
        self.writable: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, only alike.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.buffer.append(data)
        self.buffered += len(data)
        if self.buffered > HIGH_WATER_BYTES and not self.read_paused and self.transport:
            self.read_paused = True
            self.transport.pause_reading()
        self._wake_reader()

    def eof_received(self) -> bool:
        self.eof = True
        self._wake_reader()
        return False  # close the transport: httpcore never writes after the server's EOF

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.error = exc
        self._wake_reader()
        if self.writable is not None and not self.writable.done():
            self.writable.set_result(None)

    def pause_writing(self) -> None:
        if self.writable is None or self.writable.done():
            self.writable = self.loop.create_future()

    def resume_writing(self) -> None:
        if self.writable is not None and not self.writable.done():
            self.writable.set_result(None)

    def _wake_reader(self) -> None:
        if self.reader is not None and not self.reader.done():
            self.reader.set_result(None)


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError())


class _Stream(AsyncNetworkStream):
    def __init__(self, transport: asyncio.Transport, protocol: _Protocol) -> None:
        self._transport = transport
        self._protocol = protocol

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:  # noqa: ASYNC109
        p = self._protocol
        if not p.buffer and not p.eof and not p.lost:
            waiter = p.reader = p.loop.create_future()
            timer = None if timeout is None else p.loop.call_later(timeout, _expire, waiter)
            try:
                await waiter
            except TimeoutError:
                raise httpcore.ReadTimeout("timed out reading from the upstream") from None
            finally:
                p.reader = None
                if timer is not None:
                    timer.cancel()
        if p.buffer:
            chunk = p.buffer.popleft()
            if len(chunk) > max_bytes:
                chunk, rest = chunk[:max_bytes], chunk[max_bytes:]
                p.buffer.appendleft(rest)
            p.buffered -= len(chunk)
            if p.read_paused and p.buffered <= _LOW_WATER_BYTES and not p.lost:
                p.read_paused = False
                self._transport.resume_reading()
            return chunk
        if p.error is not None:
            raise httpcore.ReadError(str(p.error) or type(p.error).__name__)
        return b""

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:  # noqa: ASYNC109
        if not buffer:
            return
        p = self._protocol
        if p.lost or self._transport.is_closing():
            raise httpcore.WriteError("the upstream connection is closed")
        self._transport.write(buffer)
        writable = p.writable
        if writable is not None and not writable.done():
            try:
                async with asyncio.timeout(timeout):
                    await asyncio.shield(writable)
            except TimeoutError:
                raise httpcore.WriteTimeout("timed out writing to the upstream") from None
            if p.lost:
                raise httpcore.WriteError("the upstream connection was lost while writing")

    async def aclose(self) -> None:
        self._transport.close()

    async def start_tls(
        self,
        ssl_context: ssl.SSLContext,
        server_hostname: str | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 (httpcore's interface)
    ) -> AsyncNetworkStream:
        p = self._protocol
        try:
            async with asyncio.timeout(timeout):
                transport = await p.loop.start_tls(
                    self._transport, p, ssl_context, server_hostname=server_hostname
                )
        except TimeoutError:
            self._transport.close()
            raise httpcore.ConnectTimeout("timed out in the TLS handshake") from None
        except (OSError, ssl.SSLError, ConnectionError) as exc:
            self._transport.close()
            raise httpcore.ConnectError(str(exc)) from exc
        if transport is None:
            raise httpcore.ConnectError("the upstream closed during the TLS handshake")
        p.transport = transport
        return _Stream(transport, p)

    def get_extra_info(self, info: str) -> Any:
        if info == "ssl_object":
            return self._transport.get_extra_info("ssl_object")
        if info == "client_addr":
            return self._transport.get_extra_info("sockname")
        if info == "server_addr":
            return self._transport.get_extra_info("peername")
        if info == "socket":
            return self._transport.get_extra_info("socket")
        if info == "is_readable":
            # The transport reads continuously: on an idle connection, anything buffered, an
            # EOF or a lost connection is what a poll() would have reported as readable.
            p = self._protocol
            return bool(p.buffer) or p.eof or p.lost
        return None


class AsyncioBackend(AsyncNetworkBackend):
    """httpcore's network backend interface on asyncio transports (see the module doc)."""

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,  # noqa: ASYNC109 (httpcore's interface)
        local_address: str | None = None,
        socket_options: Iterable[SocketOption] | None = None,
    ) -> AsyncNetworkStream:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout):
                transport, protocol = await loop.create_connection(
                    lambda: _Protocol(loop),
                    host,
                    port,
                    local_addr=(local_address, 0) if local_address else None,
                )
        except TimeoutError:
            raise httpcore.ConnectTimeout(f"timed out connecting to {host}:{port}") from None
        except OSError as exc:
            raise httpcore.ConnectError(str(exc)) from exc
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for option in socket_options or ():
                sock.setsockopt(*option)
        return _Stream(transport, protocol)

    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,  # noqa: ASYNC109 (httpcore's interface)
        socket_options: Iterable[SocketOption] | None = None,
    ) -> AsyncNetworkStream:
        raise httpcore.ConnectError("unix sockets are not supported for upstreams")

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


def install(client: httpx.AsyncClient) -> bool:
    """Make ``client``'s default transport connect through :class:`AsyncioBackend`.

    httpx has no public switch for httpcore's network backend, so this sets the pool's
    (the router checks at start that httpx and httpcore have that layout: patch
    ``httpcore-asyncio-backend`` of :mod:`firstbyte.router.hosting.patches`); where they do
    not, it returns False and the client keeps httpx's own backend (slower, same behaviour).
    """
    pool = getattr(getattr(client, "_transport", None), "_pool", None)
    if not isinstance(pool, httpcore.AsyncConnectionPool) or not hasattr(pool, "_network_backend"):
        return False
    pool._network_backend = AsyncioBackend()
    return True
