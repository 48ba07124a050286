"""Prewarmed, kept-warm connections per (origin, protocol).

The pool owns everything that outlives one request: the resolver cache, one HTTP session per
(origin, HTTP version), one WebSocket pool per origin, the QUIC session tickets, and the
keep-warm task. Keep-warm exercises idle connections every ``keepalive_interval_s`` (HTTP/1.1,
HTTP/2 and HTTP/3: ``GET /healthz``; WebSocket: ping frames) so that neither side's
idle timer closes them, and stops after ``keepalive_expiry_s`` without a request, so an idle
application does not hold connections open forever. A ping's ``/healthz`` answered ``429`` or
``503`` (the router draining, its shared state away, no healthy backend), or a prewarm's, is
handed to :attr:`ConnectionPool.on_refusal` with its origin: the client sets that region aside
(WebSocket pongs say nothing of the router's health). A ``draining`` answer is handed on only
if a new connection, which the session opens and asks at once in place of the one that heard
it, hears it too: behind a balancer the new one may reach another of the region's processes.

The keep-warm loop is the pool's one scheduler: other periodic work (the client's region
re-probe) is registered with :meth:`ConnectionPool.every` and runs from the same loop, only
while the client is in use.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from firstbyte.client_sdk.errors import FirstbyteError
from firstbyte.client_sdk.resolver import Origin, Resolver
from firstbyte.client_sdk.tickets import MemoryTicketStore, TicketStore
from firstbyte.client_sdk.transports.base import Refusal, Session
from firstbyte.client_sdk.transports.http import HttpxSession
from firstbyte.client_sdk.transports.websocket import WebSocketPool

__all__ = ["ConnectionPool"]


@dataclass
class _Job:
    interval_s: float
    run: Callable[[], Awaitable[None]]
    due: float = 0.0
    task: asyncio.Task[None] | None = None


class ConnectionPool:
    """Sessions and sockets shared by every request of one client."""

    def __init__(
        self,
        ssl_context: ssl.SSLContext,
        *,
        verify: bool | ssl.SSLContext = True,
        ca_file: str | None = None,
        keepalive_expiry_s: float = 120.0,
        keepalive_interval_s: float = 15.0,
        connect_timeout_s: float = 10.0,
        max_connections: int = 256,
        tickets: TicketStore | None = None,
        keylog_file: str | None = None,
    ) -> None:
        self.ssl_context = ssl_context
        self._keylog_file = keylog_file
        """Where QUIC connections append their TLS secrets (the ``ssl_context`` has its own)."""
        self.resolver = Resolver()
        self.tickets: TicketStore = MemoryTicketStore() if tickets is None else tickets
        """QUIC session tickets, shared by every HTTP/3 session (:mod:`.tickets`)."""
        self._verify = verify
        self._ca_file = ca_file
        self._keepalive_expiry_s = keepalive_expiry_s
        self._keepalive_interval_s = keepalive_interval_s
        self._connect_timeout_s = connect_timeout_s
        self._max_connections = max_connections
        self._sessions: dict[tuple[Origin, str], Session] = {}
        self._websockets: dict[Origin, WebSocketPool] = {}
        self._last_used = time.monotonic()
        self._keepalive_task: asyncio.Task[None] | None = None
        self._jobs = [_Job(keepalive_interval_s, self._ping_idle)]
        self._start_on_use = False
        self._closed = False
        """After :meth:`aclose`: no session is opened again (it would never be closed)."""
        self.on_refusal: Callable[[Origin, Refusal], None] | None = None
        """Called with the origin and the answer when a keep-warm ping or a prewarm was
        refused."""

    def touch(self) -> None:
        """A request is being made: extend the keep-warm lifetime (and, once :meth:`every`
        registered a job, start the loop if it is not running)."""
        self._last_used = time.monotonic()
        if self._start_on_use:
            self._ensure_loop()

    def every(self, interval_s: float, job: Callable[[], Awaitable[None]]) -> None:
        """Run ``job`` every ``interval_s`` from the keep-warm loop, so only while the client
        is in use (a request or :meth:`prewarm` within ``keepalive_expiry_s``). A run that is
        still going when the next is due makes that one skip: a job never runs twice at once.
        Its exceptions are swallowed (a job records its own failures)."""
        if interval_s <= 0:
            raise ValueError("interval_s must be positive")
        self._jobs.append(_Job(interval_s, job))
        self._start_on_use = True

    @property
    def in_use(self) -> bool:
        """Whether the client made a request (or prewarmed) within ``keepalive_expiry_s``."""
        return not self._closed and (
            time.monotonic() - self._last_used < self._keepalive_expiry_s)

    @property
    def connect_timeout_s(self) -> float:
        """The connection set-up limit; also how long a probe or keep-warm ping may take."""
        return self._connect_timeout_s

    def _check_open(self) -> None:
        if self._closed:
            raise FirstbyteError("the client is closed (aclose()): make a new one to send more")

    def session(self, origin: Origin, http: str) -> Session:
        self._check_open()
        key = (origin, http)
        session = self._sessions.get(key)
        if session is None:
            if http == "3":
                # aioquic (and the cryptography it pulls in) loads only for HTTP/3 (an
                # AsyncClient asking for it imports it when built), so HTTP/1.1 and HTTP/2
                # users never pay its import time.
                from firstbyte.client_sdk.transports.h3 import H3Session

                session = H3Session(
                    origin, self.resolver, self.tickets, verify=self._verify,
                    ca_file=self._ca_file, idle_timeout_s=self._keepalive_expiry_s,
                    connect_timeout_s=self._connect_timeout_s, keylog_file=self._keylog_file,
                )
            else:
                session = HttpxSession(
                    origin, http, self.ssl_context, self.resolver,
                    keepalive_expiry_s=self._keepalive_expiry_s,
                    max_connections=self._max_connections,
                    connect_timeout_s=self._connect_timeout_s,
                )
            self._sessions[key] = session
        return session

    def heard(self, origin: Origin) -> tuple[str | None, float | None]:
        """What this client's sessions to ``origin`` learnt of it: the last ``Accept-Encoding``
        one was answered with, and the smallest round trip measured (None: not yet)."""
        accept_encoding: str | None = None
        rtts: list[float] = []
        for (of, _), session in self._sessions.items():
            if of == origin:
                accept_encoding = session.accept_encoding or accept_encoding
                if session.rtt_s is not None:
                    rtts.append(session.rtt_s)
        return accept_encoding, min(rtts, default=None)

    def websockets(self, origin: Origin, headers: dict[str, str]) -> WebSocketPool:
        self._check_open()
        pool = self._websockets.get(origin)
        if pool is None:
            pool = WebSocketPool(
                origin, headers, self.ssl_context, self.resolver,
                ping_interval_s=self._keepalive_interval_s,
                connect_timeout_s=self._connect_timeout_s,
            )
            self._websockets[origin] = pool
        return pool

    async def prewarm(
        self, target: Session | WebSocketPool, connections: int = 1
    ) -> Refusal | None:
        """Open connections now and keep them (and every other open one) warm. A refusal
        heard on them (``/healthz`` ``429`` or ``503``, ``draining`` from a new connection
        too) goes to :attr:`on_refusal`, as a keep-warm ping's, and is returned."""
        self.touch()
        refused = await target.prewarm(connections)
        self._ensure_loop()
        if refused is not None and self.on_refusal is not None:
            self.on_refusal(target.origin, refused)
        return refused

    def _ensure_loop(self) -> None:
        if self._keepalive_task is None or self._keepalive_task.done():
            # Each job's first run is one interval after the loop (re)starts.
            now = time.monotonic()
            for job in self._jobs:
                job.due = now + job.interval_s
            self._keepalive_task = asyncio.get_running_loop().create_task(self._keepalive())

    async def release(self, origin: Origin, http: str | None = None) -> None:
        """Close ``origin``'s connections (only its ``http`` session if given); not kept warm.

        For regions a probe connected to that are neither the primary nor the standby: keep-warm
        would otherwise hold a connection to every region open.
        """
        keys = [key for key in self._sessions if key[0] == origin and http in (None, key[1])]
        targets: list[Session | WebSocketPool] = [self._sessions.pop(key) for key in keys]
        if http is None and origin in self._websockets:
            targets.append(self._websockets.pop(origin))
        for target in targets:
            with contextlib.suppress(Exception):
                await target.aclose()

    async def _keepalive(self) -> None:
        loop = asyncio.get_running_loop()
        while time.monotonic() - self._last_used < self._keepalive_expiry_s:
            await asyncio.sleep(max(0.0, min(job.due for job in self._jobs) - time.monotonic()))
            now = time.monotonic()
            for job in self._jobs:
                if job.due > now:
                    continue
                job.due = now + job.interval_s
                if job.task is None or job.task.done():
                    job.task = loop.create_task(self._run(job))

    @staticmethod
    async def _run(job: _Job) -> None:
        with contextlib.suppress(Exception):
            await job.run()

    async def _ping_idle(self) -> None:
        """Ping every target's idle connections at once, each within ``connect_timeout_s``:
        a warm connection to a router that stopped answering would hold its ping for ever
        (reads have no timeout: a stream may wait long for its next event), and one after
        the other, it held keep-warm of every other region with it."""
        await self.ping()

    async def ping(self, origin: Origin | None = None) -> None:
        """Ping the idle connections now, ``origin``'s only if given (the client asks again
        of a region a ping found refusing, once it may serve again); a refusal goes to
        :attr:`on_refusal`."""
        targets: list[tuple[Origin, Session | WebSocketPool]] = [
            *((of, session) for (of, _), session in self._sessions.items()),
            *self._websockets.items(),
        ]

        async def ping(of: Origin, target: Session | WebSocketPool) -> None:
            # One failed ping must not stop keep-warm of the others.
            with contextlib.suppress(Exception):  # TimeoutError included
                async with asyncio.timeout(self._connect_timeout_s):
                    refused = await target.keepalive()
                if refused is not None and self.on_refusal is not None:
                    self.on_refusal(of, refused)

        await asyncio.gather(*(ping(of, target) for of, target in targets
                               if origin in (None, of)))

    async def aclose(self) -> None:
        self._closed = True
        self._start_on_use = False
        task, self._keepalive_task = self._keepalive_task, None
        tasks = [t for t in (task, *(job.task for job in self._jobs)) if t is not None]
        for job in self._jobs:
            job.task = None
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        targets: list[Session | WebSocketPool] = [*self._sessions.values(),
                                                  *self._websockets.values()]
        for target in targets:
            with contextlib.suppress(Exception):
                await target.aclose()
        self._sessions.clear()
        self._websockets.clear()
