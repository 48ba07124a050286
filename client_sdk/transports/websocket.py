"""WebSocket transport (``/v1/ws``, docs/protocol.md) with a small pool of warm sockets.

A socket carries one stream at a time and goes back to the pool when its stream ended
cleanly; a socket abandoned mid-stream is closed (late messages would confuse the next user).
The connect is done in steps so each is timed: DNS (our resolver), TCP (our own socket),
TLS (until the protocol's ``connection_made``) and the HTTP upgrade (``ws_upgrade``).
Keep-warm uses WebSocket ping frames. A request refused ``503`` ``draining`` closes its socket
and the pool's idle ones (a balancer may have put them on the same draining router process),
so the request sent again opens a new socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import time
from typing import Any

import msgspec
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import (
    ConnectionClosed,
    InvalidHandshake,
    InvalidMessage,
    InvalidStatus,
)
from websockets.protocol import State

from firstbyte.client_sdk._core.timing import TimingRecorder
from firstbyte.client_sdk.errors import (
    AuthenticationError,
    ConnectError,
    StreamBrokenError,
    api_error_from_response,
)
from firstbyte.client_sdk.resolver import Origin, Resolver
from firstbyte.client_sdk.transports.base import (
    Event,
    Opened,
    Refusal,
    Source,
    TransportCut,
    draining_refusal,
)
from firstbyte.client_sdk.transports.tls_port import plaintext_to_tls_port, tls_failure
from firstbyte.protocol import paths
from firstbyte.protocol import ws as messages
from firstbyte.protocol.sse import DONE

__all__ = ["WebSocketPool", "websocket_source"]

CLOSE_TIMEOUT_S = 1.0
"""How long closing a socket waits for the router's close frame (websockets' default is
10 s): a router gone silent (stopped, a path black-holed) answers none, and the pool's reset
and keep-warm close such sockets. A live router answers in a round trip."""


class _TimedConnection(ClientConnection):
    made_at: float = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # For a TLS transport asyncio calls this once the handshake has completed.
        self.made_at = time.perf_counter()
        super().connection_made(transport)


class WebSocketPool:
    """Open, idle WebSocket connections to one origin's ``{prefix}/ws``."""

    http_version = "HTTP/1.1"

    def __init__(
        self,
        origin: Origin,
        headers: dict[str, str],
        ssl_context: ssl.SSLContext,
        resolver: Resolver,
        *,
        ping_interval_s: float = 20.0,
        connect_timeout_s: float = 10.0,
    ) -> None:
        self.origin = origin
        self._headers = headers
        self._ssl = ssl_context if origin.tls else None
        self._resolver = resolver
        self._ping_interval_s = ping_interval_s
        self._connect_timeout_s = connect_timeout_s
        self._idle: list[ClientConnection] = []
        self._busy: set[ClientConnection] = set()
        """Sockets carrying a stream now: open connections that :meth:`prewarm` counts."""

    @property
    def url(self) -> str:
        scheme = "wss" if self.origin.tls else "ws"
        path = paths.at_base(paths.WEBSOCKET, self.origin.prefix)
        return f"{scheme}://{self.origin.host_header}{path}"

    async def _connect(self, recorder: TimingRecorder | None) -> ClientConnection:
        origin = self.origin
        address = await self._resolver.resolve(origin.host, origin.port, recorder)
        loop = asyncio.get_running_loop()
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        t0 = time.perf_counter()
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                await loop.sock_connect(sock, (address, origin.port))
        except (OSError, TimeoutError) as exc:
            sock.close()
            raise ConnectError(f"cannot connect to {origin.host}:{origin.port}: {exc}") from exc
        t1 = time.perf_counter()
        if recorder is not None:
            recorder.feed("tcp_connect.started", t0)
            recorder.feed("tcp_connect.complete", t1)
        kw: dict[str, Any] = {}
        if self._ssl is not None:
            kw = {"ssl": self._ssl, "server_hostname": origin.host}
        try:
            ws = await connect(
                self.url, sock=sock, additional_headers=self._headers,
                create_connection=_TimedConnection, open_timeout=self._connect_timeout_s,
                ping_interval=self._ping_interval_s, ping_timeout=self._connect_timeout_s,
                close_timeout=CLOSE_TIMEOUT_S, max_size=16 << 20, compression=None, **kw,
            )
        except InvalidStatus as exc:
            sock.close()
            body = bytes(exc.response.body or b"")
            status = exc.response.status_code
            # A 429 or 503 to the upgrade says when to come back, as to any request.
            retry_after = exc.response.headers.get("retry-after")
            raise api_error_from_response(status, body, retry_after=retry_after) from None
        except ssl.SSLError as exc:
            sock.close()
            raise tls_failure(origin.host, origin.port, exc) from exc
        except InvalidMessage as exc:
            sock.close()
            mistake = await plaintext_to_tls_port(origin, address, self._connect_timeout_s)
            if mistake is not None:
                raise mistake from None
            # The connection ended before the upgrade's answer (reset, closed): a cut, sent
            # again within max_resumes as an SSE or long-poll request cut there is.
            raise TransportCut(f"WebSocket upgrade cut: {exc}") from exc
        except (OSError, TimeoutError, InvalidHandshake) as exc:
            sock.close()
            mistake = await plaintext_to_tls_port(origin, address, self._connect_timeout_s)
            if mistake is not None:
                raise mistake from None
            raise ConnectError(f"WebSocket connect to {self.url} failed: {exc!r}") from exc
        t3 = time.perf_counter()
        assert isinstance(ws, _TimedConnection)
        if recorder is not None:
            if self._ssl is not None:
                recorder.feed("tls_handshake.started", t1)
                recorder.feed("tls_handshake.complete", ws.made_at)
            recorder.feed("ws_upgrade.started", ws.made_at)
            recorder.feed("ws_upgrade.complete", t3)
        return ws

    async def acquire(self, recorder: TimingRecorder | None) -> ClientConnection:
        """An idle open connection (warm), else a new one (cold, timed into ``recorder``);
        give it back with :meth:`release` (or :meth:`forget` once closed)."""
        while self._idle:
            ws = self._idle.pop()
            if ws.state is State.OPEN:
                if recorder is not None:
                    recorder.feed("pool_wait.started", time.perf_counter())
                    recorder.feed("pool_wait.complete", time.perf_counter())
                self._busy.add(ws)
                return ws
        ws = await self._connect(recorder)
        self._busy.add(ws)
        return ws

    def release(self, ws: ClientConnection) -> None:
        self._busy.discard(ws)
        if ws.state is State.OPEN:
            self._idle.append(ws)

    def forget(self, ws: ClientConnection) -> None:
        """``ws`` is being closed: no longer the pool's."""
        self._busy.discard(ws)

    def take_idle(self) -> list[ClientConnection]:
        """The idle sockets, no longer the pool's: the caller closes them."""
        idle, self._idle = self._idle, []
        return idle

    async def prewarm(self, connections: int = 1) -> Refusal | None:
        """Open sockets until ``connections`` are open, counting those carrying a stream now
        (a re-probe while a stream runs must not open a second socket for the same need).
        Never a refusal: an upgrade says nothing of the router's health (as a pong)."""
        opened_now = sum(1 for ws in (*self._idle, *self._busy) if ws.state is State.OPEN)
        missing = max(connections, 1) - opened_now
        if missing > 0:
            opened = await asyncio.gather(*(self._connect(None) for _ in range(missing)))
            self._idle.extend(opened)
        return None

    async def keepalive(self) -> Refusal | None:
        """A ping frame on each idle socket; a pong says nothing of the router's health, so
        never a refusal (with several regions and the re-probe on, the client keeps the
        re-probe's HTTP connection warm too, and its ``/healthz`` answers count)."""
        for ws in list(self._idle):
            try:
                pong = await ws.ping()
                async with asyncio.timeout(self._connect_timeout_s):
                    await pong
            except (ConnectionClosed, TimeoutError):
                with contextlib.suppress(ValueError):
                    self._idle.remove(ws)
                await ws.close()
        return None

    async def reset(self) -> None:
        idle, self._idle = self._idle, []
        # Together: each waits up to CLOSE_TIMEOUT_S for a peer that may be gone.
        await asyncio.gather(*(ws.close() for ws in idle))

    async def aclose(self) -> None:
        await self.reset()


async def websocket_source(
    pool: WebSocketPool,
    *,
    body: bytes | None,
    stream_id: str | None,
    after: int,
    recorder: TimingRecorder | None,
    endpoint: messages.Endpoint | None = None,
) -> Source:
    """Start a stream (``{"type": "request"}``; ``endpoint`` names its format, None: chat) or
    resume one (``{"type": "resume"}``)."""
    ws = await pool.acquire(recorder)
    clean = False
    draining = False
    try:
        message: messages.ClientMessage
        if stream_id is None:
            if body is None:
                raise ValueError("a new WebSocket stream needs a request body")
            message = (messages.Request(msgspec.Raw(body)) if endpoint is None
                       else messages.Request(msgspec.Raw(body), endpoint))
        else:
            message = messages.Resume(stream_id, after)
        await ws.send(messages.encode(message).decode())
        if recorder is not None:
            recorder.feed("request_sent", time.perf_counter())
            recorder.record.http_version = "HTTP/1.1"
        first = True
        async for raw in ws:
            if first and recorder is not None:
                recorder.feed("first_byte", time.perf_counter())
            first = False
            try:
                msg = messages.decode_server_message(raw)
            except msgspec.DecodeError as exc:
                raise StreamBrokenError(f"invalid WebSocket message: {exc}") from None
            if isinstance(msg, messages.Start):
                if recorder is not None:
                    rec = recorder.record
                    rec.stream_id = msg.stream
                    if msg.region is not None:
                        rec.region = msg.region
                    if msg.better_region is not None:  # as note_response_headers does
                        rec.better_region = msg.better_region
                        rec.better_region_url = msg.better_region_url
                yield Opened(msg.stream)
            elif isinstance(msg, messages.Event):
                yield Event(msg.seq, bytes(msg.data))
            elif isinstance(msg, messages.Done):
                clean = True
                yield Event(msg.seq, DONE)
                return
            elif isinstance(msg, messages.Error):
                # With its HTTP status (a newer router's): a 429 or 503 before the stream
                # started sends the request to the next region, as over SSE, and its
                # ``retry_after`` is waited for and sets the region aside as SSE's
                # Retry-After is (None from an older router: the backoff).
                error = api_error_from_response(
                    msg.status, {"error": msgspec.json.decode(msg.error)},
                    retry_after=msg.retry_after,
                )
                draining = draining_refusal(error)
                raise error
        raise TransportCut("WebSocket closed before the stream ended")
    except ConnectionClosed as exc:
        rcvd = exc.rcvd
        if rcvd is not None and rcvd.code == messages.CLOSE_POLICY:
            raise AuthenticationError(rcvd.reason or "WebSocket closed by policy (1008)") from None
        if rcvd is not None and rcvd.code == messages.CLOSE_INVALID_PAYLOAD:
            raise StreamBrokenError(f"router rejected the message: {rcvd.reason}") from None
        raise TransportCut(f"WebSocket connection lost: {exc}") from exc
    finally:
        if clean:
            pool.release(ws)
        else:
            pool.forget(ws)
            # Its router process is draining: so may be the one behind each idle socket.
            closing = [ws, *(pool.take_idle() if draining else ())]
            with contextlib.suppress(Exception):
                async with asyncio.timeout(CLOSE_TIMEOUT_S):
                    await asyncio.gather(*(each.close() for each in closing))
