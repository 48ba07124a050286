"""HTTP/1.1 and HTTP/2 sessions on httpx, timed from httpcore's trace events.

One ``httpx.AsyncClient`` per origin for HTTP/1.1 and per HTTP/2 connection, with
``keepalive_expiry`` far beyond httpx's 5 s default, the client's one ``SSLContext``, and
requests sent to the address the SDK resolved itself (``sni_hostname`` and ``Host`` keep
the name) so DNS is its own phase.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

# httpcore imports its HTTP/2 connection and network backend on the first connection; left
# to it, tens of milliseconds of one-time import CPU would land in the first request's phases.
import anyio
import anyio._backends._asyncio
import anyio.streams.tls
import httpcore
import httpcore._async.http2
import httpcore._backends.anyio
import httpx

from firstbyte.client_sdk._core.timing import TimingRecorder
from firstbyte.client_sdk.errors import ConnectError
from firstbyte.client_sdk.resolver import Origin, Resolver
from firstbyte.client_sdk.transports.base import (
    HTTPResponse,
    Refusal,
    TransportCut,
    note_response_headers,
    noted_accept_encoding,
    refusal,
)
from firstbyte.client_sdk.transports.tls_port import plaintext_to_tls_port, tls_failure
from firstbyte.protocol import paths

__all__ = ["STREAMS_PER_H2_CONNECTION", "HttpxSession", "connect_error"]

STREAMS_PER_H2_CONNECTION = 100
"""Requests one HTTP/2 connection carries before the next is opened: the smallest
``SETTINGS_MAX_CONCURRENT_STREAMS`` RFC 9113 recommends, and hypercorn's (so the router's)
default. httpcore puts every request on its first HTTP/2 connection and makes those beyond the
server's limit wait for a free stream, without bound and never opening another: 2,000 streams
ran 100 at a time on one connection, their TTFT seconds while the router's was 56 ms."""


class _ClosingStream(httpcore.AsyncNetworkStream):
    """A TCP stream that is closed when its TLS handshake does not complete, cancelled too,
    and whose failed writes are httpcore's ``WriteError`` (a cut), whatever anyio raised.

    httpcore closes the socket when ``start_tls`` raises an ``Exception``, not when it is
    cancelled (``CancelledError`` is a ``BaseException``): a request cancelled mid-handshake
    (the application cancels its stream, the idle watchdog gives up on a server that accepted
    the connection but never answers) would leave its socket open for the garbage collector
    ("unclosed transport"), one file descriptor per such request."""

    def __init__(self, stream: httpcore.AsyncNetworkStream) -> None:
        self._stream = stream

    # httpcore's stream and backend interfaces take ``timeout`` arguments (ASYNC109).
    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:  # noqa: ASYNC109
        return await self._stream.read(max_bytes, timeout)

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:  # noqa: ASYNC109
        try:
            await self._stream.write(buffer, timeout)
        except anyio.EndOfStream as exc:
            # A TLS write that meets the peer's unexpected EOF (a cut connection) raises
            # anyio's EndOfStream, which httpcore maps on reads but not on writes: it reached
            # the application as itself instead of a cut the SDK resumes.
            raise httpcore.WriteError(f"connection closed while writing: {exc!r}") from exc

    async def aclose(self) -> None:
        await self._stream.aclose()

    async def start_tls(
        self, ssl_context: ssl.SSLContext, server_hostname: str | None = None,
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> httpcore.AsyncNetworkStream:
        try:
            return await self._stream.start_tls(ssl_context, server_hostname, timeout)
        except BaseException:
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await self._stream.aclose()
            raise

    def get_extra_info(self, info: str) -> Any:
        return self._stream.get_extra_info(info)


class _ClosingBackend(httpcore.AsyncNetworkBackend):
    """httpcore's network backend, with :class:`_ClosingStream` TCP streams."""

    def __init__(self, backend: httpcore.AsyncNetworkBackend) -> None:
        self._backend = backend

    async def connect_tcp(
        self, host: str, port: int, timeout: float | None = None,  # noqa: ASYNC109
        local_address: str | None = None, socket_options: Any = None,
    ) -> httpcore.AsyncNetworkStream:
        return _ClosingStream(await self._backend.connect_tcp(
            host, port, timeout, local_address, socket_options))

    async def connect_unix_socket(
        self, path: str, timeout: float | None = None,  # noqa: ASYNC109
        socket_options: Any = None,
    ) -> httpcore.AsyncNetworkStream:
        return await self._backend.connect_unix_socket(path, timeout, socket_options)

    async def sleep(self, seconds: float) -> None:
        await self._backend.sleep(seconds)


def connect_error(
    exc: BaseException, origin: Origin, timeout_s: float | None = None
) -> ConnectError:
    """Our typed error for a failure to connect (TLS problems become :class:`TLSError`).

    A connection that got no answer within ``timeout_s`` is a plain :class:`ConnectError`
    saying so, whether the TCP connect or the TLS handshake waited: a server that accepts
    connections but never answers (stopped, overloaded) has no certificate problem, though
    the timed-out handshake leaves an ``ssl.SSLWantReadError`` behind ("The operation did
    not complete")."""
    where = f"{origin.host}:{origin.port}"
    tls = False
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, ssl.SSLError):
            tls = True
            break
        cause = cause.__cause__ or cause.__context__
    if isinstance(exc, httpx.ConnectTimeout):
        after = "" if timeout_s is None else f" after {timeout_s:g} s"
        stage = "TLS handshake" if tls else "TCP connect"
        return ConnectError(f"cannot connect to {where}: {stage} timed out{after}")
    if isinstance(cause, ssl.SSLError):
        return tls_failure(origin.host, origin.port, cause)
    text = str(exc) or type(exc).__name__
    return ConnectError(f"cannot connect to {where}: {text}")


class HttpxSession:
    """Requests to one origin over HTTP/1.1 or HTTP/2 (``http`` is ``"1.1"`` or ``"2"``)."""

    def __init__(
        self,
        origin: Origin,
        http: str,
        ssl_context: ssl.SSLContext,
        resolver: Resolver,
        *,
        keepalive_expiry_s: float = 120.0,
        max_connections: int = 256,
        connect_timeout_s: float = 10.0,
    ) -> None:
        if http not in ("1.1", "2"):
            raise ValueError(f"httpx session speaks HTTP/1.1 or HTTP/2, not {http!r}")
        self.origin = origin
        self.http_version = "HTTP/1.1" if http == "1.1" else "HTTP/2"
        self._resolver = resolver
        self._http = http
        self._ssl_context = ssl_context
        self._limits = (max_connections, keepalive_expiry_s, connect_timeout_s)
        self._clients = [self._make_client()]
        """HTTP/1.1: one client, its pool of ``max_connections``. HTTP/2: one client per
        connection (up to ``max_connections``), each given at most
        :data:`STREAMS_PER_H2_CONNECTION` requests while another may be opened. Each client
        keeps a pool of ``max_connections`` too: httpcore carries every request on its first
        HTTP/2 connection while it can take them, and opens another only to replace one that
        cannot (GOAWAY, an error). Pools of one connection made requests wait in httpcore's
        queue, where a cancel at the wrong moment released a stream twice ("semaphore
        released too many times") and left the connection's pool full: a stream cancelled
        now and then hung the client's later requests until the pool timed out."""
        self._in_flight: dict[httpx.AsyncClient, int] = {}
        self._retired: set[httpx.AsyncClient] = set()
        """Clients a ``503`` ``draining`` came on (:meth:`_retire`): given no new request, and
        closed once their last request in flight ends."""
        self.accept_encoding: str | None = None
        self.rtt_s: float | None = None

    @property
    def _client(self) -> httpx.AsyncClient:
        return self._clients[0]

    def _pick_client(self) -> httpx.AsyncClient:
        """The client for the next request: HTTP/2's first with a free stream, else a new
        one while under ``max_connections``, else the least busy."""
        if self._http == "1.1":
            return self._clients[0]
        for client in self._clients:
            if self._in_flight.get(client, 0) < STREAMS_PER_H2_CONNECTION:
                return client
        if len(self._clients) < self._limits[0]:
            self._clients.append(self._make_client())
            return self._clients[-1]
        return min(self._clients, key=lambda c: self._in_flight.get(c, 0))

    def _make_client(self) -> httpx.AsyncClient:
        max_connections, keepalive_expiry_s, connect_timeout_s = self._limits
        client = httpx.AsyncClient(
            http1=self._http == "1.1",
            http2=self._http == "2",
            verify=self._ssl_context,
            trust_env=False,
            limits=httpx.Limits(
                max_connections=max_connections,
                max_keepalive_connections=max_connections,
                keepalive_expiry=keepalive_expiry_s,
            ),
            timeout=httpx.Timeout(
                connect=connect_timeout_s, read=None, write=connect_timeout_s,
                pool=connect_timeout_s,
            ),
        )
        pool = client._transport._pool  # type: ignore[attr-defined]
        pool._network_backend = _ClosingBackend(pool._network_backend)
        return client

    async def _url(self, path: str, recorder: TimingRecorder | None) -> httpx.URL:
        address = await self._resolver.resolve(self.origin.host, self.origin.port, recorder)
        host = f"[{address}]" if ":" in address else address
        return httpx.URL(f"{self.origin.scheme}://{host}:{self.origin.port}{path}")

    def request(
        self,
        method: str,
        path: str,
        *,
        headers: dict[str, str],
        body: bytes | None,
        recorder: TimingRecorder | None,
    ) -> contextlib.AbstractAsyncContextManager[HTTPResponse]:
        return self._send(self._pick_client(), method, path, headers, body, recorder)

    @asynccontextmanager
    async def _send(
        self,
        client: httpx.AsyncClient,
        method: str,
        path: str,
        headers: dict[str, str],
        body: bytes | None,
        recorder: TimingRecorder | None,
    ) -> AsyncIterator[HTTPResponse]:
        self._in_flight[client] = self._in_flight.get(client, 0) + 1
        try:
            async with self._exchange(client, method, path, headers, body, recorder) as response:
                yield response
        finally:
            self._in_flight[client] -= 1
            if not self._in_flight[client]:
                del self._in_flight[client]  # a client reset() dropped is not kept for it
                if client in self._retired:
                    self._retired.discard(client)
                    with contextlib.suppress(Exception):
                        await asyncio.shield(client.aclose())

    def _retire(self, client: httpx.AsyncClient) -> None:
        """A ``503`` ``draining`` came on ``client``'s connection: its router process takes no
        new work, though another behind the same balancer may. New requests go to another
        client (a new one, so a new connection, when none is left) and ``client`` closes once
        its requests in flight end (streams on it run to their end). Over HTTP/1.1 that is the
        session's one client, so its idle connections go too: the balancer may have put any
        of them on the draining process, and the request sent again must reach a new one."""
        if client not in self._clients:
            return  # already retired (or dropped by reset())
        self._clients.remove(client)
        if not self._clients:
            self._clients.append(self._make_client())
        self._retired.add(client)

    @asynccontextmanager
    async def _exchange(
        self,
        client: httpx.AsyncClient,
        method: str,
        path: str,
        headers: dict[str, str],
        body: bytes | None,
        recorder: TimingRecorder | None,
    ) -> AsyncIterator[HTTPResponse]:
        url = await self._url(path, recorder)
        connecting = 0.0

        async def trace(name: str, info: dict[str, Any]) -> None:
            nonlocal connecting
            now = time.perf_counter()
            # A TCP connect is one round trip (SYN, SYN-ACK): the RTT this session measures.
            if name == "connection.connect_tcp.started":
                connecting = now
            elif name == "connection.connect_tcp.complete" and connecting:
                rtt_s = now - connecting
                self.rtt_s = rtt_s if self.rtt_s is None else min(self.rtt_s, rtt_s)
            if recorder is not None:
                recorder.feed_httpcore(name, now)

        extensions: dict[str, Any] = {"sni_hostname": self.origin.host, "trace": trace}
        if recorder is not None:
            recorder.feed("pool_wait.started", time.perf_counter())
        request = client.build_request(
            method, url, headers={"host": self.origin.host_header, **headers}, content=body,
            extensions=extensions,
        )
        try:
            response = await client.send(request, stream=True)
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
            raise connect_error(exc, self.origin, self._limits[2]) from exc
        except httpx.TransportError as exc:
            mistake = await plaintext_to_tls_port(self.origin, url.host, self._limits[2])
            if mistake is not None:
                raise mistake from None
            raise TransportCut(f"connection lost before the response: {exc!r}") from exc
        try:
            result = HTTPResponse(
                status=response.status_code,
                headers={k.lower(): v for k, v in response.headers.items()},
                http_version=response.http_version,
                chunks=self._chunks(response),
                on_retire=lambda: self._retire(client),
            )
            note_response_headers(recorder, result)
            noted_accept_encoding(self, result)
            yield result
        finally:
            await response.aclose()

    @staticmethod
    async def _chunks(response: httpx.Response) -> AsyncIterator[bytes]:
        try:
            async for chunk in response.aiter_raw():
                yield chunk
        except httpx.TransportError as exc:
            raise TransportCut(f"connection lost mid-stream: {exc!r}") from exc

    async def _ping(self, client: httpx.AsyncClient | None = None) -> Refusal | None:
        """``GET /healthz`` on ``client``'s connection (else the next request's); the refusal
        it was, if one. A ``draining`` one retires that connection and asks once more on
        another (a new one, unless another HTTP/2 connection is open): behind a balancer it may
        reach another of the region's processes. That answer is the one returned, so the
        region is refused only when it says ``draining`` too."""
        answer = await self._ping_once(client)
        if answer is None or not answer.draining:
            return answer
        return await self._ping_once(None)

    async def _ping_once(self, client: httpx.AsyncClient | None) -> Refusal | None:
        try:
            async with self._send(client or self._pick_client(), "GET", paths.HEALTHZ, {},
                                  None, None) as response:
                answer = refusal(response, await response.read())
                if answer is not None and answer.draining:
                    response.retire_connection()
        except TransportCut:
            return None
        return answer

    async def prewarm(self, connections: int = 1) -> Refusal | None:
        """Open connections with ``GET /healthz`` pings; a refusal among their answers is
        returned as :meth:`keepalive` returns one (a connection warm on a router that refuses
        is no warmth: the caller sets its region aside)."""
        # HTTP/2 multiplexes: one connection carries every request. HTTP/1.1 needs one
        # connection per concurrent request, opened by concurrent cheap requests.
        # Connections carrying a response now count as open: a re-probe while a stream runs
        # must not open a second connection for the same need.
        if self.http_version == "HTTP/2":
            return await self._ping()
        pool = self._client._transport._pool  # type: ignore[attr-defined]
        alive = [c for c in pool.connections if not c.is_closed()]
        missing = max(connections, 1) - len(alive)
        if missing <= 0:
            return None
        # The idle ones take a ping each, so the rest open new connections.
        idle = sum(1 for c in alive if c.is_idle())
        answers = await asyncio.gather(*(self._ping() for _ in range(idle + missing)))
        return _longest([answer for answer in answers if answer is not None])

    async def keepalive(self) -> Refusal | None:
        """``GET /healthz`` on each idle connection (HTTP/1.1 and HTTP/2 alike); the refusal
        (``429``, ``503``) of the ping told to wait longest, if one was refused. A connection
        answered ``draining`` is replaced by a new one, whose answer counts (:meth:`_ping`).

        Not an HTTP/2 PING: servers commonly time idle connections by open streams, not frames
        (hypercorn, which the router runs on, closed an HTTP/2 connection after its keep-alive
        timeout although a PING arrived every 0.3 s), and httpcore has no public PING. A
        request resets every server's idle timer.
        """
        pings = []
        for client in self._clients:
            pool = client._transport._pool  # type: ignore[attr-defined]
            pings += [client] * sum(1 for c in pool.connections if c.is_idle())
        answers = await asyncio.gather(*(self._ping(client) for client in pings))
        return _longest([answer for answer in answers if answer is not None])

    async def reset(self) -> None:
        """Drop every pooled connection (e.g. after a stall); the next request reconnects."""
        old, self._clients = self._clients, [self._make_client()]
        await asyncio.gather(*(client.aclose() for client in old))

    async def aclose(self) -> None:
        retired, self._retired = self._retired, set()
        await asyncio.gather(*(client.aclose() for client in (*self._clients, *retired)))


def _longest(refused: list[Refusal]) -> Refusal | None:
    """The refusal that says to wait longest, if any."""
    return max(refused, key=lambda r: r.retry_after_s or 0.0, default=None)
