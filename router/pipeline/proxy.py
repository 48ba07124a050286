"""The proxy stage: the one stage that does IO. Sends the request to the chosen upstream
and, for streams, feeds the stream store.

A streamed completion is produced apart from the client's connection: in the callbacks of
its upstream connection where the router's pool had one idle to give it (no task: see
:meth:`_Producer.start`), else by a task of its own. The upstream's answer goes through the
sans-IO relay core (:mod:`.relay`), whose actions this module carries out: append the
events to the :class:`Stream` (re-framed with ``id: SEQ`` by whichever reader sends them
on), release the client's response head, switch backend at the first-token deadline,
finish. Local upstreams are spoken to over the router's own HTTP/1.1
pool (:mod:`firstbyte.router.upstream_h1`: the relay core runs in the socket's data callback,
no task per chunk); peer regions over httpx's HTTP/2 client. A client that disconnects does
not lose the stream; the upstream request goes on into the store for ``resume_grace_s`` and
is cancelled (closing the upstream connection, which a vLLM-like server treats as an abort)
only if no reader comes back in that time (see
:meth:`firstbyte.router.app.RouterState.maintain`).

A local backend that refuses the connection (or does not accept it in time) never saw the
request: the routing stage takes it out of rotation and names another backend of the region,
and the request goes there (:meth:`~firstbyte.router.multiregion.RegionRouting.fail_over`).
So does a request whose local backend closed or reset the connection before any byte of its
answer, or sent none by the first-byte deadline (from the backend's observed TTFT; either way
the backend is ejected), or answered 5xx (its run of 5xx ejects it): nothing had reached the
client yet (passive health, as Envoy's outlier detection).
Errors after the stream started become an ``{"error": {...}}`` event followed by ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import certifi
import httpx
import msgspec

from firstbyte.protocol import error_codes
from firstbyte.protocol.openai import encode, error_body

from .. import aionet, chunkpath
from ..config import LimitsConfig
from ..metrics import Metrics
from ..observability.access import stream_usage
from ..observability.logs import describe_error
from ..observability.usage import TokenUsage, with_usage_option
from ..streams import EVENT_OVERHEAD_BYTES, Stream, StreamEvent
from ..upstream_h1 import (
    STALE_RETRIES,
    H1Connection,
    H1Pool,
    Origin,
    encode_request,
    encode_request_parts,
    fetch,
)
from .backend import PEER_PREFIX, Backend
from .context import FailCause, Observer, RequestContext
from .deadlines import Deadlines
from .relay import (
    Action,
    Append,
    Finish,
    FirstToken,
    Relay,
    ReleaseHead,
    SwitchBackend,
    error_event,
)

__all__ = ["DRAIN_CANCEL", "Proxy", "UpstreamHead", "UpstreamReply", "error_event"]

DRAIN_CANCEL = "draining"
"""The message a producer is cancelled with when the drain timed out: the stream then ends
with a ``draining`` error event instead of ``cancelled``."""

_MAX_ERROR_BODY_BYTES = 64 << 10

_DRAIN_AFTER_DONE_S = 1.0
"""How long to read on after ``[DONE]`` for the body's end before dropping the connection."""

SCRAPE_CONNECTIONS = 64
"""Connections the backends' ``/metrics`` scrapes may hold open at once (one a backend,
scraped together each interval; a region of more backends waits its turn for one)."""

MAX_ANSWER_BYTES = 256 << 20
"""The largest non-streamed answer read from a local upstream (an embeddings batch of 2,048
inputs of 3,072 dimensions is ~130 MB of JSON floats): past it, ``502 upstream_error``."""

_MAX_FAILOVERS = 3
"""Backends a request may move to after the one it was sent to refused the connection (each
refusal takes that backend out of rotation, so this bounds only a region flapping back)."""


class UpstreamStatusError(Exception):
    """A local backend answered a 5xx status (passive health counts it, and the request is
    placed again when nothing reached its client yet)."""

    def __init__(self, status: int) -> None:
        super().__init__(f"HTTP {status}")
        self.status = status


class UpstreamHead(msgspec.Struct, frozen=True, gc=False):
    """How the upstream answered a streamed request: 200, or an error status with its body.

    A msgspec Struct: one a stream, and a frozen dataclass's ``__init__`` is a Python call
    setting each field through ``object.__setattr__``."""

    status: int
    body: bytes = b""
    elapsed_ms: float = 0.0
    """From sending the upstream request to its response headers."""


@dataclass(frozen=True, slots=True)
class UpstreamReply:
    """A whole (non-streamed) upstream answer."""

    status: int
    body: bytes
    content_type: str
    elapsed_ms: float


class Proxy:
    """Upstream IO for one router: the connection pools and the stream producers."""

    def __init__(
        self,
        limits: LimitsConfig,
        metrics: Metrics,
        clock: Callable[[], float] = time.monotonic,
        *,
        max_connections: int,
        ca_file: str | None = None,
    ) -> None:
        self.limits = limits
        # TLS contexts built once (they also share TLS session state): the public bundle
        # (certifi, as httpx's default) unless ``ca_file``. The streams' pool has its own, as
        # it offers only HTTP/1.1 by ALPN; httpx sets ALPN on the context it is given.
        cafile = ca_file if ca_file is not None else certifi.where()
        tls = ssl.create_default_context(cafile=cafile)
        h1_tls = ssl.create_default_context(cafile=cafile)
        h1_tls.set_alpn_protocols(["http/1.1"])
        self.metrics = metrics
        self.clock = clock
        # Streams and whole answers from local upstreams: the router's own HTTP/1.1 pool
        # (see upstream_h1).
        self.streams_pool = _h1_pool(limits, max_connections, h1_tls)
        # The backends' /metrics scrapes (router/warmup.py): a second of each backend's, a
        # tenth of httpx's CPU each; a pool of their own, so they never wait for the streams'.
        self.scrape_pool = _h1_pool(limits, SCRAPE_CONNECTIONS, h1_tls)
        # The routing stages' warmup probes and model lists (non-streamed requests to local
        # upstreams go over the streams' pool: fetch in forward).
        self.client = self._new_client(limits, max_connections, tls)
        # Peer regions' routers: HTTP/2 (negotiated by ALPN with a TLS peer), so one connection
        # per peer carries the status polls that keep it warm and every request forwarded
        # there at once; over HTTP/1.1 a forward during a poll or another forward opened a new
        # TCP+TLS connection across the inter-region RTT (+2 RTT, measured in bench routing).
        # A plain-HTTP peer speaks HTTP/1.1, one stream per connection, so the pool must be as
        # large as the upstreams': with 4 connections the 5th concurrent spill waited in the
        # pool for a whole stream to end (spilled TTFT 300+ ms where the peer answers in 30).
        self.peer_client = self._new_client(limits, max_connections, tls, http2=True)
        self.producers: set[asyncio.Task[None]] = set()
        self._untasked: set[_Producer] = set()
        """The producers running without a task (:meth:`_Producer.start`), for :meth:`aclose`."""
        self._origins: dict[str, Origin] = {}
        self._stream_heads: dict[tuple[Origin, str, str | None], tuple[bytes, bytes] | None] = {}
        """A stream request's bytes but its traceparent and length, by origin, path and key
        (:meth:`_stream_request`)."""
        self._first_bytes: Deadlines | None = None
        """The producers' first-byte deadlines, on the loop they run in (see
        :meth:`first_byte_deadlines`)."""

    def first_byte_deadlines(self, loop: asyncio.AbstractEventLoop) -> Deadlines:
        """The first-byte deadlines of the producers running on ``loop``: one loop timer for
        all of them (nearly every one is cancelled by its answer's head, seconds early)."""
        deadlines = self._first_bytes
        if deadlines is None or deadlines.loop is not loop:
            deadlines = self._first_bytes = Deadlines(loop)
        return deadlines

    @staticmethod
    def _new_client(
        limits: LimitsConfig,
        max_connections: int,
        verify: ssl.SSLContext,
        *,
        http2: bool = False,
    ) -> httpx.AsyncClient:
        client = httpx.AsyncClient(
            verify=verify,
            http2=http2,
            limits=httpx.Limits(
                max_connections=max_connections,
                max_keepalive_connections=max_connections,
                keepalive_expiry=limits.upstream_keepalive_expiry_s,
            ),
            timeout=httpx.Timeout(
                connect=limits.upstream_connect_timeout_s,
                read=limits.upstream_read_timeout_s,
                write=limits.upstream_connect_timeout_s,
                pool=limits.upstream_connect_timeout_s,
            ),
            # Upstreams come from the config only: no proxy or netrc from the environment.
            trust_env=False,
            follow_redirects=False,
        )
        if not http2:  # aionet does not negotiate ALPN; HTTP/2 keeps httpx's own backend
            aionet.install(client)  # asyncio transports instead of anyio: less CPU per chunk
        return client

    def _headers(self, ctx: RequestContext, backend: Backend, accept: str) -> dict[str, str]:
        headers = {
            "content-type": "application/json",
            "accept": accept,
            "traceparent": ctx.traceparent.header(),
        }
        if backend.api_key:
            headers["authorization"] = f"Bearer {backend.api_key}"
        # Set by the multi-region stage when the "backend" is a peer region's router.
        headers.update(ctx.upstream_headers)
        return headers

    def _stream_request(
        self, ctx: RequestContext, backend: Backend, origin: Origin, body: bytes
    ) -> bytes:
        """A stream's request to local ``backend``: ``encode_request("POST", origin, path,
        self._headers(...), body)``. Only its traceparent and its body change from one
        request to the next, so the rest is encoded once (:func:`encode_request_parts`):
        encoding the whole head (~15k instructions) and its headers' dict cost as much as
        the relay of a chunk."""
        path = ctx.codec.path
        traceparent = ctx.traceparent.header()
        if not ctx.upstream_headers and "\r" not in traceparent and "\n" not in traceparent:
            key = (origin, path, backend.api_key)
            try:
                parts = self._stream_heads[key]
            except KeyError:
                parts = self._stream_heads[key] = encode_request_parts(
                    "POST", origin, path, self._headers(ctx, backend, "text/event-stream"),
                    "traceparent",
                )
            if parts is not None:
                head, tail = parts
                return b"%b%b%b%d\r\n\r\n%b" % (
                    head, traceparent.encode("latin-1"), tail, len(body), body
                )
        headers = self._headers(ctx, backend, "text/event-stream")
        return encode_request("POST", origin, path, headers, body)

    def start_stream(
        self, ctx: RequestContext, stream: Stream, loop: asyncio.AbstractEventLoop | None = None
    ) -> asyncio.Future[UpstreamHead]:
        """Start producing ``stream`` from the upstream; the future resolves with its head.
        ``loop``: the running loop where the caller holds it."""
        # The loop looked up at most once for the request, then handed on (the producer, its
        # pool acquire, the stream's readers): on Python 3.11 each lookup is a getpid()
        # system call.
        if loop is None:
            loop = asyncio.get_running_loop()
        head: asyncio.Future[UpstreamHead] = loop.create_future()
        producer = _Producer(self, ctx, stream, head, loop)
        if stream.loop is None:
            stream.loop = loop
        if producer.untasked:
            # Its first step a loop turn from now, as a task's would be, without the task
            # (~21k instructions a request: the task, its two steps, its registry's weak
            # set and its done callback).
            producer.handle = loop.call_soon(producer.start)
            self._untasked.add(producer)
            stream.cancel_producer = producer.cancel
            return head
        task = loop.create_task(producer.run())
        self.producers.add(task)
        task.add_done_callback(self.producers.discard)
        stream.cancel_producer = task.cancel
        return head

    def origin(self, backend: Backend) -> Origin:
        origin = self._origins.get(backend.url)
        if origin is None:
            origin = self._origins[backend.url] = Origin.parse(backend.url)
        return origin

    async def forward(
        self, ctx: RequestContext, method: str, path: str, body: bytes | None = None
    ) -> UpstreamReply:
        """Send one request upstream and return the whole answer (502 if it fails); a local
        backend that refuses the connection hands the request to another, as for streams."""
        backend: Backend = ctx.backend
        backend.in_flight += 1
        self.metrics.in_flight += 1
        sent_at = time.perf_counter()
        observer = ctx.observer
        ok = False
        ctx.upstream_sent_at = sent_at
        failovers = 0
        try:
            while True:
                local = not backend.name.startswith(PEER_PREFIX)
                cause: FailCause = "refused"
                try:
                    headers = self._headers(ctx, backend, "application/json")
                    if local:  # the router's own pool, as streams: a fraction of httpx's CPU
                        answer = await fetch(
                            self.streams_pool, self.origin(backend), path, method=method,
                            body=body or b"", headers=headers, max_bytes=MAX_ANSWER_BYTES,
                            timeout_s=None,
                        )
                        if answer.body is None:
                            raise httpx.RemoteProtocolError(
                                f"answer over {MAX_ANSWER_BYTES >> 20} MiB"
                            )
                        status, content, content_type = (
                            answer.status, answer.body, answer.content_type
                        )
                    else:
                        response = await self.peer_client.request(
                            method, backend.url + path, content=body, headers=headers
                        )
                        status, content = response.status_code, response.content
                        content_type = response.headers.get("content-type", "")
                    if status < 500 or not local:
                        break
                    failed: Exception = UpstreamStatusError(status)
                    cause = "5xx"
                except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                    failed = exc
                ctx.upstream_error = describe_error(failed)
                moved = None
                if observer is not None and local and failovers < _MAX_FAILOVERS:
                    failovers += 1
                    moved = await observer.fail_over(ctx, failed, cause)
                if moved is None:
                    if cause == "5xx":
                        break  # the backend's own answer goes to the client
                    raise failed
                backend.failures += 1
                backend.in_flight -= 1
                backend = moved
                backend.in_flight += 1
            ok = status == 200
            return UpstreamReply(
                status,
                content,
                content_type or "application/json",
                (time.perf_counter() - sent_at) * 1000,
            )
        except httpx.HTTPError as exc:
            backend.failures += 1
            ctx.upstream_error = describe_error(exc)
            message = f"Upstream failed: {type(exc).__name__}."
            return UpstreamReply(
                502,
                encode(error_body(message, "server_error", code=error_codes.UPSTREAM_ERROR)),
                "application/json",
                (time.perf_counter() - sent_at) * 1000,
            )
        finally:
            backend.in_flight -= 1
            self.metrics.in_flight -= 1
            if observer is not None:
                observer.finished(ctx, ok)

    async def aclose(self) -> None:
        """Cancel every producer and close the pool."""
        for producer in list(self._untasked):
            producer.cancel()
        for task in list(self.producers):
            task.cancel()
        await asyncio.gather(*self.producers, return_exceptions=True)
        if self._untasked:  # each ends at its outcome's callback, which its cancel scheduled
            await asyncio.sleep(0)
        if self._first_bytes is not None:
            self._first_bytes.close()
        for client in (self.client, self.peer_client):
            await client.aclose()
        await self.streams_pool.aclose()
        await self.scrape_pool.aclose()


def _h1_pool(limits: LimitsConfig, max_connections: int, tls: ssl.SSLContext) -> H1Pool:
    """An HTTP/1.1 pool to the upstreams with the configured keep-alive and timeouts."""
    return H1Pool(
        max_connections=max_connections,
        keepalive_expiry_s=limits.upstream_keepalive_expiry_s,
        connect_timeout_s=limits.upstream_connect_timeout_s,
        read_timeout_s=limits.upstream_read_timeout_s,
        ssl_context=tls,
    )


def _stream_body(ctx: RequestContext) -> bytes:
    """The body to send upstream: the client's bytes, with ``stream`` forced on when the
    client did not ask for it (``POST /v1/streams``, WebSocket), and the final usage chunk
    asked for (``stream_options.include_usage``) when the client did not: the key's usage
    is counted from it (:mod:`firstbyte.router.observability.usage`), and the relay drops it
    from what this client reads (its ``strip_usage``). Formats of named events (Responses,
    Messages) report usage in their own events and are sent as they came."""
    request = ctx.request
    if ctx.codec.named_events:
        if request is not None and request.stream:
            return ctx.body
        data = msgspec.json.decode(ctx.body)
        data["stream"] = True
        return encode(data)
    if request is not None and request.stream:
        if request.stream_options is None:  # the usual case: one member put in, no re-encode
            return with_usage_option(ctx.body)
        if request.wants_usage_chunk:
            return ctx.body
    data = msgspec.json.decode(ctx.body)
    data["stream"] = True
    options = data.get("stream_options")
    data["stream_options"] = {**(options if isinstance(options, dict) else {}),
                              "include_usage": True}
    return encode(data)


_CANCELLED_EVENT = error_event("The upstream request was cancelled.", code=error_codes.CANCELLED)
_DRAINED_EVENT = error_event(
    "This router shut down before the stream ended (listen.drain_timeout_s); send the request"
    " again to get the rest (another router of the region takes it).",
    code=error_codes.DRAINING,
)


class _Producer:
    """The asyncio shell around one stream's :class:`Relay`: it moves bytes from the upstream
    into the relay (as the :class:`~firstbyte.router.upstream_h1.ResponseSink` of the
    connection, or from httpx's body iterator), carries out the relay's actions and arms
    the first-token timer and, for a local backend, the first-byte timer (passive health)."""

    def __init__(
        self,
        proxy: Proxy,
        ctx: RequestContext,
        stream: Stream,
        head: asyncio.Future[UpstreamHead],
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.proxy = proxy
        self.ctx = ctx
        self.stream = stream
        self.head = head
        self.observer: Observer | None = ctx.observer
        self.backend: Backend = ctx.backend
        deadline = None if self.observer is None else self.observer.first_token_deadline_s
        codec, request = ctx.codec, ctx.request
        self.relay = Relay(
            hold_head=deadline is not None,
            codec=codec,
            # The usage chunk is the router's unless the client asked for it too.
            # (stream_options tested first: without them, no call of wants_usage_chunk)
            strip_usage=not (
                codec.named_events
                or (
                    request is not None
                    and request.stream_options is not None
                    and request.wants_usage_chunk
                )
            ),
        )
        self.loop = loop  # the running loop, as start_stream looked it up
        self.outcome: asyncio.Future[str] = loop.create_future()
        self.ok = False
        self._refused: list[bytes] | None = None
        self._refused_status = 0
        self._read: list[bytes] = []
        """Body parts of the upstream read in progress (:meth:`on_read_end` relays them);
        the same list for every attempt (cleared), as :attr:`on_body` appends to it."""
        self.on_body: Callable[[bytes], None] = self._read.append
        """The :class:`~firstbyte.router.upstream_h1.ResponseSink`'s ``on_body``: each body
        part is held to the read's end, where :meth:`on_read_end` sees to the rest (a
        refused answer's body, an attempt already decided). The list's own ``append``, so
        the parser's call per part is a C call, not a Python one (four a request)."""
        self._timer: asyncio.TimerHandle | None = None
        self._conn: H1Connection | None = None
        self._unreachable: Exception | None = None
        """Why the last attempt could not connect (its result was ``unreachable``), or why
        its backend failed it (``failed``, :attr:`_cause`)."""
        self._cause: FailCause = "refused"
        self._first_byte: list[Any] | None = None
        """The attempt's first-byte deadline (:meth:`Proxy.first_byte_deadlines`), if set."""
        self._start_observed = False
        self._compiled = chunkpath.READ_PATH is not None and not ctx.codec.named_events
        """The compiled path (:mod:`~firstbyte.router.chunkpath`) may take this stream's
        reads once the relay's fast path applies (it cuts ``data:`` events only)."""
        self._compiled_paths: list[Any] = []
        """The compiled read paths offered (one an attempt): their counts, at the end."""
        self.untasked = deadline is None and not self.backend.name.startswith(PEER_PREFIX)
        """The producer starts without a task (:meth:`start`): a local backend and no
        first-token timer to switch at."""
        self.handle: asyncio.Handle | None = None
        """:meth:`start`, scheduled by :meth:`Proxy.start_stream` (until it runs)."""
        self._task: asyncio.Task[None] | None = None
        """The task :meth:`run` goes on in, once an untasked producer needs one (a failover,
        a stale connection's retry)."""
        self._begun = False
        """:meth:`run` began (its task took its first step)."""
        self._cancel: tuple[Any, ...] | None = None
        """The arguments of a :meth:`cancel` that :meth:`run` or :meth:`_decided` are
        still to act on."""
        self._ended = False
        self._draining = False
        """An untasked producer reads on to its body's end after ``[DONE]`` (:meth:`_drained`)."""

    async def run(self, resumed: H1Connection | None = None) -> None:
        """Produce the stream: each attempt, the failovers, the end. ``resumed``: the
        connection of the first attempt, made by :meth:`start` and decided, that the rest
        goes on from."""
        self._begun = True
        proxy, ctx = self.proxy, self.ctx
        metrics = proxy.metrics
        if resumed is None:
            self.backend.in_flight += 1
            self.backend.requests += 1
            metrics.in_flight += 1
        failovers = 0
        try:
            if resumed is None and self._cancel is not None:
                # Cancelled before this task's first step (see cancel): as if in its wait.
                raise asyncio.CancelledError(*self._cancel)
            while True:
                if resumed is not None:  # its attempt made and decided (start)
                    result = await self._via_h1(resumed)
                    resumed = None
                else:
                    # The first attempt has the outcome future and read list __init__ made;
                    # the others get their own at the loop's end.
                    observer = self.observer
                    if observer is not None and observer.first_token_deadline_s is not None:
                        self._arm_deadline()
                    elif self._timer is not None:  # _arm_deadline's work, without its call
                        self._cancel_deadline()
                    ctx.upstream_sent_at = sent_at = time.perf_counter()
                    self.relay.start(sent_at)
                    if self.backend.name.startswith(PEER_PREFIX):
                        result = await self._via_httpx(proxy.peer_client)
                    else:
                        result = await self._via_h1()
                if self._first_byte is not None:
                    self._cancel_first_byte()
                if result == "failed":
                    # The backend accepted the request and failed it before anything reached
                    # the client (no first byte by the deadline, or a 5xx): placed again on
                    # another backend of the region, else it fails as the backend failed it.
                    exc = self._unreachable
                    assert exc is not None
                    assert self.observer is not None
                    moved = None
                    if failovers < _MAX_FAILOVERS:
                        failovers += 1
                        moved = await self.observer.fail_over(ctx, exc, self._cause)
                    if moved is None:
                        self._fail_here(exc)
                        break
                    self.backend.failures += 1
                    self._move_to(moved)
                elif result == "switch":
                    # No first token by the deadline and the stage found somewhere better:
                    # nothing was sent to the client yet, so switch without a trace.
                    assert self.observer is not None
                    self._move_to(self.observer.switch(ctx))
                elif result == "unreachable":
                    # The backend refused the connection (or never accepted it): the request
                    # goes to another of the region if one can take it, else fails here.
                    exc = self._unreachable
                    assert exc is not None
                    moved = None
                    if self.observer is not None and failovers < _MAX_FAILOVERS:
                        failovers += 1
                        moved = await self.observer.fail_over(ctx, exc)
                    if moved is None:
                        self.on_error(exc)  # counts the failure, as any upstream error
                        break
                    self.backend.failures += 1
                    self._move_to(moved)
                else:
                    break
                self.outcome = self.loop.create_future()
                self._refused = None
                self._read.clear()
        except asyncio.CancelledError as exc:
            self._cancelled(exc.args)
            raise
        finally:
            self._end()

    def _cancelled(self, args: tuple[Any, ...]) -> None:
        """The producer was cancelled (``args``: its cancel's): the stream ends with an error
        event, ``draining`` if the drain timed out."""
        drained = args == (DRAIN_CANCEL,)
        ctx = self.ctx
        self.stream.append(self._cancelled_event(drained), self.proxy.clock())
        self.proxy.metrics.count(
            ctx.codec.name, "draining" if drained else "cancelled", ctx.model_label
        )

    def _end(self) -> None:
        """The producer's end, however it ended: timers, head, usage, counts, the stream's
        end."""
        proxy, ctx, stream = self.proxy, self.ctx, self.stream
        metrics = proxy.metrics
        self._ended = True
        self._task = None  # no cycle: the task's coroutine holds this producer
        if self.untasked:
            proxy._untasked.discard(self)
        if self._timer is not None:
            self._cancel_deadline()
        if self._first_byte is not None:
            self._cancel_first_byte()
        if not self.head.done():
            self.head.set_result(UpstreamHead(502, error_event("The upstream request failed.")))
        self._count_usage()  # before the stream ends: its access line reads the usage
        reads = metrics.relay_reads
        fast = self.relay.fast_reads
        for path in self._compiled_paths:  # their events are in the relay's count
            reads["compiled"] += path.reads
            fast -= path.events
        # Each path holds this producer (its on_events): dropped, so the two make no
        # cycle for the cyclic GC to find (the connection let go of it at its release).
        self._compiled_paths.clear()
        reads["fast"] += fast
        reads["full"] += self.relay.full_reads
        stream.finish(proxy.clock())
        # Nothing left to cancel: a finished stream kept for resumes no longer holds this
        # producer (its task, coroutine, context and what they refer to) until it is evicted.
        stream.cancel_producer = None
        self.backend.in_flight -= 1
        metrics.in_flight -= 1
        if self.observer is not None:
            self.observer.finished(ctx, self.ok)

    # -- an untasked producer (Proxy.start_stream)
    def start(self) -> None:
        """:meth:`run`'s first step (a loop turn after :meth:`Proxy.start_stream`, as a
        task's would be) without a task where the pool has an idle connection: the request
        is sent, and the rest happens in the connection's callbacks; :meth:`_decided` ends
        the producer when its attempt finished, else :meth:`run` goes on in a task from
        there (a failover, a stale connection's retry). Where the pool has none,
        :meth:`run` does it all in a task."""
        self.handle = None
        proxy, ctx = self.proxy, self.ctx
        backend = self.backend
        origin = proxy._origins.get(backend.url)  # Proxy.origin inlined (a call a request)
        if origin is None:
            origin = proxy.origin(backend)
        try:
            request = proxy._stream_request(ctx, backend, origin, _stream_body(ctx))
        except Exception:  # raised again in run, which ends the producer as it fails
            conn = None
        else:
            conn = proxy.streams_pool.take_idle(origin, self.loop)
        if conn is None:  # a connection to make or wait for: in a task
            self._continue(self.run())
            return
        metrics = proxy.metrics
        backend.in_flight += 1
        backend.requests += 1
        metrics.in_flight += 1
        ctx.upstream_sent_at = sent_at = time.perf_counter()
        self.relay.start(sent_at)
        self._conn = conn
        try:
            conn.send(request, self, chunks=self._compiled)
        except BaseException:
            self._conn = None
            proxy.streams_pool.release(conn)
            self._end()
            raise
        self._start_observed = True
        metrics.observe_start(time.perf_counter() - ctx.received_at)
        self._arm_first_byte()
        self.outcome.add_done_callback(self._decided)

    def _decided(self, outcome: asyncio.Future[str]) -> None:
        """The untasked attempt's outcome (a loop turn after it was decided, as a task would
        have woken): the producer ends here as :meth:`run` would have, after a ``finished``
        attempt or a cancel, else it goes on in a task."""
        conn = self._conn
        assert conn is not None
        if self._cancel is None:
            if outcome.result() != "finished":  # the rest of _via_h1 and run's loop
                self._continue(self.run(conn))
                return
            if self.relay.done and self._refused is None and not conn.complete:
                # After [DONE], read on to the end of the body (briefly), as _via_h1 does.
                self._draining = True
                conn.wait_end_then(_DRAIN_AFTER_DONE_S, self._drained)
                return
        # _close inlined (a call a request)
        self._conn = None
        self.proxy.streams_pool.release(conn)  # an unfinished one is dropped
        try:
            if self._cancel is not None:
                self._cancelled(self._cancel)
        finally:
            self._end()

    def _drained(self) -> None:
        """The body's end after ``[DONE]`` came, or the wait for it ran out, or a cancel
        came meanwhile (the first of them)."""
        if self._draining:
            self._draining = False
            self._close()

    def _close(self) -> None:
        """An untasked producer's end: its connection back to the pool (dropped if
        unfinished), and the stream's end, cancelled if a cancel came."""
        conn = self._conn
        assert conn is not None
        self._conn = None
        self.proxy.streams_pool.release(conn)
        try:
            if self._cancel is not None:
                self._cancelled(self._cancel)
        finally:
            self._end()

    def _continue(self, coro: Any) -> None:
        """The rest of the producer in a task of its own, as a tasked producer."""
        self.proxy._untasked.discard(self)
        self._task = task = self.loop.create_task(coro)
        producers = self.proxy.producers
        producers.add(task)
        task.add_done_callback(producers.discard)

    def cancel(self, msg: Any = None) -> bool:
        """An untasked producer's ``stream.cancel_producer``: what ``Task.cancel`` does to a
        tasked one's (its stream ends with an error event at its next step, a loop turn from
        now; before its first step, it never runs)."""
        if self._ended:
            return False
        task = self._task
        if task is not None and (self._begun or task.done()):
            return task.cancel(msg)
        handle = self.handle
        if handle is not None:  # start has not run: nothing of the producer will
            handle.cancel()
            self.handle = None
            self._ended = True
            self.proxy._untasked.discard(self)
            return True
        if self._cancel is not None:
            return False  # as a task's second cancel before its step
        # A task not begun raises it as it begins (run), an attempt under way is cancelled
        # as a task's wait would be (its callbacks take nothing more), a decided one is
        # ended as cancelled (_decided).
        self._cancel = () if msg is None else (msg,)
        if task is None and not self.outcome.cancel(msg) and self._draining:
            self.loop.call_soon(self._drained)  # as a task in wait_end wakes cancelled
        return True

    def _cancelled_event(self, drained: bool) -> bytes:
        """The error event a cancelled or drained stream ends with, in its own format."""
        codec = self.ctx.codec
        if not codec.named_events:
            return _DRAINED_EVENT if drained else _CANCELLED_EVENT
        detail = msgspec.json.decode(_DRAINED_EVENT if drained else _CANCELLED_EVENT)["error"]
        return codec.error_event(
            detail["message"], detail["type"], detail["code"], after=self.relay.last_event
        )

    def _fail_here(self, exc: Exception) -> None:
        """No other backend takes the request: it ends as its backend failed it (the 5xx
        answer passed on, or the first-byte timeout as an upstream error)."""
        self.outcome = self.loop.create_future()
        if isinstance(exc, UpstreamStatusError):
            body = b"".join(self._refused or [])[:_MAX_ERROR_BODY_BYTES]
            self._apply(self.relay.receive_head(exc.status, time.perf_counter(), body))
        else:
            self.on_error(exc)

    def _move_to(self, backend: Backend) -> None:
        """The request leaves its backend for ``backend`` (which counts it from now)."""
        self.backend.in_flight -= 1
        self.backend = backend
        self.backend.in_flight += 1
        self.backend.requests += 1

    def _request(self) -> tuple[bytes, dict[str, str]]:
        body = _stream_body(self.ctx)
        return body, self.proxy._headers(self.ctx, self.backend, "text/event-stream")

    async def _via_h1(self, resumed: H1Connection | None = None) -> str:
        """One attempt over the router's HTTP/1.1 pool; the relay runs in its callbacks.
        ``resumed``: the connection :meth:`start` sent the request on, its outcome decided.

        A kept-alive connection the upstream closed while it was idle fails before any byte
        of the answer: the request goes again on another one (at most
        :data:`~firstbyte.router.upstream_h1.STALE_RETRIES` times), as a browser would; the
        upstream never saw it.
        """
        proxy = self.proxy
        pool = proxy.streams_pool
        origin = proxy.origin(self.backend)
        request = proxy._stream_request(self.ctx, self.backend, origin, _stream_body(self.ctx))
        result = "retry"
        for _ in range(STALE_RETRIES + 1):
            sent = resumed
            if sent is not None:  # the request went on it; its outcome is decided
                conn, resumed = sent, None
            else:
                try:
                    self._conn = conn = await pool.acquire(origin, self.loop)
                except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                    if self.outcome.done():  # a first-token switch was claimed meanwhile
                        return self.outcome.result()
                    self._unreachable = exc  # the upstream never saw the request
                    self.ctx.upstream_error = describe_error(exc)
                    return "unreachable"
                except (httpx.HTTPError, OSError) as exc:
                    self.on_error(exc)
                    return "finished"
            try:
                if sent is None:
                    conn.send(request, self, chunks=self._compiled)
                    if not self._start_observed:  # once a stream, not again on a retry
                        self._start_observed = True
                        proxy.metrics.observe_start(
                            time.perf_counter() - self.ctx.received_at
                        )
                    # From here, not from the pool's wait: a full pool is not the backend's
                    # fault.
                    self._arm_first_byte()
                elif self._cancel is not None:
                    # Cancelled before this task's first step (see cancel): as in its wait.
                    raise asyncio.CancelledError(*self._cancel)
                result = await self.outcome
                if (
                    result == "finished"
                    and self.relay.done
                    and self._refused is None
                    and not conn.complete  # the body's end came with [DONE], as usual
                ):
                    # After [DONE], read on to the end of the body (briefly): dropping an
                    # unfinished response drops the kept-alive connection, and every stream
                    # would pay a new one.
                    await conn.wait_end(_DRAIN_AFTER_DONE_S)
            finally:
                self._conn = None
                pool.release(conn)  # an unfinished one is dropped: the upstream sees an abort
            if result != "retry":
                return result
            self.outcome = self.loop.create_future()
        self._apply(self.relay.fail("ReadError", time.perf_counter()))  # stale every time
        return "finished"

    async def _via_httpx(self, client: httpx.AsyncClient) -> str:
        """One attempt over an httpx client (peer regions: HTTP/2)."""
        body, headers = self._request()
        request = client.build_request(
            "POST", self.backend.url + self.ctx.codec.path, content=body, headers=headers
        )

        async def exchange() -> None:
            try:
                response = await client.send(request, stream=True)
                try:
                    self.on_head(response.status_code)
                    async for raw in response.aiter_raw():
                        self.on_body(raw)
                        self.on_read_end()
                        if self.outcome.done():
                            return
                    self.on_end()
                finally:
                    await asyncio.shield(response.aclose())
            except (httpx.HTTPError, OSError) as exc:
                self.on_error(exc)

        task = asyncio.ensure_future(exchange())
        try:
            return await self.outcome
        finally:
            if not task.done():
                task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    # -- ResponseSink: the upstream's answer, as it arrives. Once the attempt's outcome is
    # decided (finished, switch, retry) nothing more of this upstream reaches the stream: a
    # token arriving in the loop turn between a claimed switch and the switch is dropped.
    def on_head(self, status: int) -> None:
        if self.outcome.done():
            return
        deadline = self._first_byte
        if deadline is not None:  # _cancel_first_byte inlined (a call a request)
            deadline[1] = None  # Deadlines.cancel inlined (another)
            self._first_byte = None
        if status == 200:
            self._apply(self.relay.receive_head(200, time.perf_counter()))
            if self._compiled and self._conn is not None:
                self._take_reads(self._conn)
        else:
            self._refused, self._refused_status = [], status

    # on_body: the read list's append (see __init__). Held to the read's end, the HTTP
    # chunks one upstream read brought (several, when the router is busy) go through the
    # relay and out to a direct reader together, one write on the client's connection
    # instead of one per chunk.
    def on_read_end(self) -> None:
        parts = self._read
        if not parts:
            return
        data = parts[0] if len(parts) == 1 else b"".join(parts)
        parts.clear()  # the list is kept: one allocation less per read
        if self.outcome.done():
            return
        refused = self._refused
        if refused is not None:  # a refusal's body: kept (bounded) for its error event
            refused.append(data)
            if sum(map(len, refused)) > _MAX_ERROR_BODY_BYTES:
                self.on_end()
            return
        now = time.perf_counter()
        relay = self.relay
        payloads = relay.feed(data, now)
        # on_events carries out the same (a read the compiled path cut): kept alike.
        if payloads is None:  # more than events to append: the relay's actions
            self._apply(relay.take_actions(), now)
        elif payloads:
            # The fused path: the store appends, mirrors and writes to its direct readers
            # in one call; the inter-token metric from this read's one clock reading.
            self.stream.add(payloads, now)
            if self.observer is not None and relay.first_content:
                self.observer.chunk(self.ctx, now)

    def on_events(self, events: list[bytes]) -> None:
        """:meth:`on_read_end` for a read the compiled path cut into its ``events``'
        payloads (whole chunks of one-line ``data:`` events, as the relay's framer cuts
        them) but did not take on its own (the first content, the usage chunk, ``[DONE]``):
        the same from the relay on (:meth:`~.relay.Relay.feed_events`), without the
        parser's callbacks, the read's join and the framer. The compiled path calls it for
        an undecided attempt only, and before the parser's ``on_message_complete`` when the
        read ends the body."""
        now = time.perf_counter()
        relay = self.relay
        payloads = relay.feed_events(events, now)
        if payloads is None:
            self._apply(relay.take_actions(), now)
        elif payloads:
            self.stream.add(payloads, now)
            if self.observer is not None and relay.first_content:
                self.observer.chunk(self.ctx, now)

    def _take_reads(self, conn: H1Connection) -> None:
        """From the response's 200 head on, this attempt's reads of whole chunks of one-line
        events go the compiled way: taken in C where the relay's fast path applies
        (:meth:`on_read_end`'s fused path), else cut in C and handed to :meth:`on_events`;
        offered once an attempt."""
        if not conn.fast_offered:
            observer = self.observer
            path = chunkpath.READ_PATH(
                conn,
                self.outcome,
                self.relay,
                self.stream,
                StreamEvent,
                EVENT_OVERHEAD_BYTES,
                None if observer is None else observer.gaps,
                self.loop.time,
                self.on_events,
            )
            self._compiled_paths.append(path)
            conn.offer_fast(path)

    def on_end(self) -> None:
        if self._read:
            self.on_read_end()  # the body's last parts came in the read that ended it
        if self.outcome.done():
            return
        now = time.perf_counter()
        if self._refused is not None:
            status = self._refused_status
            if status >= 500 and self.observer is not None and self._local:
                self._fail(UpstreamStatusError(status), "5xx")
                return
            if status >= 500:
                self.ctx.upstream_error = describe_error(UpstreamStatusError(status))
            body = b"".join(self._refused)[:_MAX_ERROR_BODY_BYTES]
            self._apply(self.relay.receive_head(status, now, body))
        else:
            self._apply(self.relay.receive_end(now))

    def on_error(self, exc: Exception) -> None:
        if self._read:
            self.on_read_end()  # what arrived before the failure, as before it
        if self.outcome.done():
            return
        conn = self._conn
        closed = isinstance(exc, httpx.ReadError)  # not a timeout: that one is the upstream's
        if closed and conn is not None and conn.stale:
            self.outcome.set_result("retry")
            return
        if closed and conn is not None and not conn.answered and self.observer is not None:
            # A fresh connection closed or reset before any byte of the answer: the backend
            # is failing (passive health); nothing reached the client, so it goes elsewhere.
            self._fail(exc, "reset")
            return
        self.ctx.upstream_error = describe_error(exc)
        self._apply(self.relay.fail(type(exc).__name__, time.perf_counter()))

    # -- the relay's actions
    def _apply(self, actions: list[Action], now: float | None = None) -> None:
        """Carry out the relay's ``actions``; ``now``: the read's ``perf_counter`` time."""
        for action in actions:
            if type(action) is Append:
                payloads = action.payloads
                if len(payloads) == 1:  # one event a read, the common case: one call less
                    self.stream.append(payloads[0], self.proxy.clock())
                else:
                    self.stream.extend(payloads, self.proxy.clock())
                if self.observer is not None and self.relay.first_content:
                    self.observer.chunk(self.ctx, time.perf_counter() if now is None else now)
            elif type(action) is FirstToken:
                self._first_token(action)
            elif type(action) is ReleaseHead:
                if not self.head.done():
                    self.head.set_result(
                        UpstreamHead(action.status, action.body, action.elapsed_ms)
                    )
            elif type(action) is Finish:
                self._finish(action)

    def _first_token(self, action: FirstToken) -> None:
        if self._timer is not None:  # the first-token deadline no longer applies
            self._cancel_deadline()
        now = time.perf_counter()
        self.stream.upstream_ttft_ms = action.upstream_ttft_ms
        self.ctx.first_token_at = now
        self.proxy.metrics.observe_ttft(self.ctx.model_label, now - self.ctx.received_at)
        if self.observer is not None:
            self.observer.first_token(self.ctx, (now - self.ctx.received_at) * 1000)

    def _finish(self, action: Finish) -> None:
        if action.error is not None:
            self.stream.append(action.error, self.proxy.clock())
        if action.outcome not in ("ok", "upstream_eof"):
            self.backend.failures += 1
        self.ok = action.ok
        self.proxy.metrics.count(self.ctx.codec.name, action.outcome, self.ctx.model_label)
        if not self.outcome.done():
            self.outcome.set_result("finished")

    def _count_usage(self) -> None:
        """The completion's tokens, for the stream (its access line) and the key's usage
        metrics; once, however the stream ended (finished, failed, cancelled, drained)."""
        usage = self.relay.usage
        if usage is None:  # a usage chunk in another member order, or none: the content
            counted = stream_usage(event.data for event in self.stream.events)
            usage = TokenUsage(counted.input_tokens, counted.output_tokens)
        self.stream.usage = usage
        # _local inlined: a peer region's router counts what its backends serve
        if not self.backend.name.startswith(PEER_PREFIX):
            self.proxy.metrics.usage.record(
                self.ctx.owner, usage.input_tokens, usage.output_tokens
            )

    # -- passive health: the first-byte deadline and 5xx
    @property
    def _local(self) -> bool:
        return not self.backend.name.startswith(PEER_PREFIX)

    def _fail(self, exc: Exception, cause: FailCause) -> None:
        """The backend failed this attempt before anything reached the client."""
        if not self.outcome.done():
            self._unreachable, self._cause = exc, cause
            self.ctx.upstream_error = describe_error(exc)
            self.outcome.set_result("failed")

    def _arm_first_byte(self) -> None:
        """A local backend that sends no byte of its answer by its first-byte deadline
        (from its observed TTFT) is failing, not slow: the attempt ends there."""
        if self._first_byte is not None:
            self._cancel_first_byte()
        timeout_s = None if self.observer is None else self.observer.first_byte_timeout_s()
        if timeout_s is not None:
            deadlines = self.proxy._first_bytes  # first_byte_deadlines inlined (a call)
            if deadlines is None or deadlines.loop is not self.loop:
                deadlines = self.proxy.first_byte_deadlines(self.loop)
            self._first_byte = deadlines.call_later(timeout_s, self._first_byte_late, timeout_s)

    def _first_byte_late(self, timeout_s: float) -> None:
        self._first_byte = None
        late = httpx.ReadTimeout(f"no response within {timeout_s:.1f} s (first-byte deadline)")
        self._fail(late, "first_byte_timeout")

    # The request's own path tests each timer before calling to cancel it: most are None
    # there, and a call costs more than the test.
    def _cancel_first_byte(self) -> None:
        if self._first_byte is not None:
            Deadlines.cancel(self._first_byte)
            self._first_byte = None

    # -- the one timer: the first-token deadline
    def _arm_deadline(self) -> None:
        """At the observer's first-token deadline, switch if it claims a switch. Asking first
        (instead of a plain timeout) means a request with nowhere better to go, or no spill
        slot, keeps waiting on its upstream rather than being cut off. The claim holds the
        spill slot, so the deadlines of a burst that fire together cannot all spill."""
        if self._timer is not None:
            self._cancel_deadline()
        deadline_s = None if self.observer is None else self.observer.first_token_deadline_s
        if deadline_s is None:
            return
        elapsed_s = time.perf_counter() - self.ctx.received_at
        self._timer = self.loop.call_later(max(0.0, deadline_s - elapsed_s), self._deadline)

    def _deadline(self) -> None:
        self._timer = None
        actions = self.relay.deadline_fired(time.perf_counter())
        if any(type(a) is SwitchBackend for a in actions) and not self.outcome.done():
            assert self.observer is not None
            if self.observer.claim_switch(self.ctx):
                self.outcome.set_result("switch")

    def _cancel_deadline(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
