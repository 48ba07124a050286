"""The proxy stage: the one stage that does IO. Sends the request to the chosen upstream
through a pooled keep-alive ``httpx.AsyncClient`` and, for streams, feeds the stream store.

A streamed completion is produced by a task of its own, not by the client's connection:
the upstream's SSE is decoded with the SDK's :class:`SSEDecoder`, and each event's payload
is appended to the :class:`Stream` (re-framed with ``id: SEQ`` by whichever reader sends it
on). So a client that disconnects does not lose the stream; the upstream request goes on
into the store for ``resume_grace_s`` and is cancelled (closing the upstream connection,
which a vLLM-like server treats as an abort) only if no reader comes back in that time (see
:meth:`firstbyte.router.app.RouterState.maintain`).

Errors after the stream started become an ``{"error": {...}}`` event followed by ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import msgspec

from firstbyte.protocol import error_codes, paths
from firstbyte.protocol.openai import encode, error_body
from firstbyte.protocol.sse import DONE, SSEDecoder, SSEProtocolError

from .. import aionet
from ..config import LimitsConfig
from ..metrics import Metrics
from ..streams import Stream
from .backend import PEER_PREFIX, Backend
from .context import RequestContext

__all__ = ["DRAIN_CANCEL", "Proxy", "UpstreamHead", "UpstreamReply", "error_event"]

DRAIN_CANCEL = "draining"
"""The message a producer is cancelled with when the drain timed out: the stream then ends
with a ``draining`` error event instead of ``cancelled``."""

_MAX_ERROR_BODY_BYTES = 64 << 10


def error_event(message: str, type: str = "server_error", code: str | None = None) -> bytes:
    """An in-stream error payload (OpenAI's error body)."""
    return encode(error_body(message, type, code=code))


_POOL_SHARDS = 4
"""Upstream connection pools the streams are spread over (see :class:`Proxy`)."""

_DRAIN_AFTER_DONE_S = 1.0
"""How long to read on after ``[DONE]`` for the body's end before dropping the connection."""


@dataclass(frozen=True, slots=True)
class UpstreamHead:
    """How the upstream answered a streamed request: 200, or an error status with its body."""

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


def _has_content(data: bytes) -> bool:
    """Does this chunk carry output (text, a tool call, a refusal)? Cheap pre-check first."""
    if b'"delta"' not in data:
        return False
    try:
        chunk: Any = msgspec.json.decode(data)
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("content") or delta.get("tool_calls") or delta.get("refusal"):
                return True
    except (msgspec.DecodeError, AttributeError, TypeError):
        return False
    return False


class Proxy:
    """Upstream IO for one router: a shared connection pool and the stream producers."""

    def __init__(
        self,
        limits: LimitsConfig,
        metrics: Metrics,
        clock: Callable[[], float] = time.monotonic,
        *,
        ca_file: str | None = None,
    ) -> None:
        self.limits = limits
        # One TLS context for every pool: built once, it also shares TLS session state.
        verify: ssl.SSLContext | bool = (
            ssl.create_default_context(cafile=ca_file) if ca_file is not None else True
        )
        self.metrics = metrics
        self.clock = clock
        total = limits.upstream_max_connections
        shards = max(1, min(_POOL_SHARDS, total))
        # httpcore's pool scans every connection it holds on each request start and end (in
        # Python, with a poll() per idle one), which at 100 streams cost ~9% of the router's
        # CPU; streams spread over a few smaller pools scan a few times less. The shards split
        # ``upstream_max_connections`` exactly, and a stream takes the least loaded one, so
        # the total limit behaves as before (sequential streams all reuse shard 0's
        # connection). Shard 0 is ``client``: the non-streamed requests and the routing
        # stages' probes use it.
        self.stream_clients = [
            self._new_client(limits, total // shards + (1 if i < total % shards else 0), verify)
            for i in range(shards)
        ]
        self.client = self.stream_clients[0]
        self._shard_load = [0] * shards
        # Peer regions' routers: HTTP/2 (negotiated by ALPN with a TLS peer), so one connection
        # per peer carries the status polls that keep it warm and every request forwarded
        # there at once; over HTTP/1.1 a forward during a poll or another forward opened a new
        # TCP+TLS connection across the inter-region RTT (+2 RTT, measured in bench routing).
        # A plain-HTTP peer speaks HTTP/1.1, one stream per connection, so the pool must be as
        # large as the upstreams': with 4 connections the 5th concurrent spill waited in the
        # pool for a whole stream to end (spilled TTFT 300+ ms where the peer answers in 30).
        self.peer_client = self._new_client(
            limits, limits.upstream_max_connections, verify, http2=True
        )
        self.producers: set[asyncio.Task[None]] = set()

    @staticmethod
    def _new_client(
        limits: LimitsConfig,
        max_connections: int,
        verify: ssl.SSLContext | bool,
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

    def client_for(self, backend: Backend) -> httpx.AsyncClient:
        """The pool for one-shot requests to ``backend``: a peer region's or the upstreams'."""
        return self.peer_client if backend.name.startswith(PEER_PREFIX) else self.client

    def _headers(self, ctx: RequestContext, backend: Backend, accept: str) -> dict[str, str]:
        headers = {
            "content-type": "application/json",
            "accept": accept,
            "traceparent": ctx.traceparent.header(),
        }
        if backend.api_key:
            headers["authorization"] = f"Bearer {backend.api_key}"
        # Set by the multi-region stage when the "backend" is a peer region's router.
        headers.update(ctx.extra.get("upstream_headers", {}))
        return headers

    def start_stream(self, ctx: RequestContext, stream: Stream) -> asyncio.Future[UpstreamHead]:
        """Start producing ``stream`` from the upstream; the future resolves with its head."""
        head: asyncio.Future[UpstreamHead] = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(self._produce(ctx, stream, head))
        self.producers.add(task)
        task.add_done_callback(self.producers.discard)
        stream.cancel_producer = task.cancel
        return head

    async def _produce(
        self, ctx: RequestContext, stream: Stream, head: asyncio.Future[UpstreamHead]
    ) -> None:
        backend: Backend = ctx.backend
        backend.in_flight += 1
        backend.requests += 1
        self.metrics.in_flight += 1
        sent_at = time.perf_counter()
        response: httpx.Response | None = None
        # The multi-region stage's per-request hooks (router.multiregion.Observation).
        observer: Any = ctx.extra.get("observer")
        ok = False
        load = self._shard_load
        shard: int | None = None
        if backend.name.startswith(PEER_PREFIX):
            client = self.peer_client  # the one warm HTTP/2 connection to that region
        else:
            shard = load.index(min(load))
            load[shard] += 1
            client = self.stream_clients[shard]
        try:
            appended = [0]
            while True:
                ctx.upstream_sent_at = sent_at
                request = client.build_request(
                    "POST",
                    backend.url + paths.CHAT_COMPLETIONS,
                    content=_stream_body(ctx),
                    headers=self._headers(ctx, backend, "text/event-stream"),
                )
                try:
                    async with asyncio.timeout(None) as watch:
                        timer = _arm_deadline(observer, ctx, watch)
                        try:
                            response = await client.send(request, stream=True)
                            elapsed_ms = (time.perf_counter() - sent_at) * 1000
                            if response.status_code != 200:
                                body = await _read_bounded(response)
                                if not head.done():
                                    head.set_result(
                                        UpstreamHead(response.status_code, body, elapsed_ms)
                                    )
                                backend.failures += 1
                                stream.append(
                                    _as_error_event(response.status_code, body), self.clock()
                                )
                                self.metrics.count("chat", f"upstream_{response.status_code}")
                                return
                            ready = UpstreamHead(200, b"", elapsed_ms)
                            if timer is None and not head.done():
                                head.set_result(ready)
                            # With a first-token deadline the client's response head waits for
                            # the first token, so a switch also changes x-firstbyte-region.
                            ok = await self._pump(
                                ctx,
                                stream,
                                response,
                                sent_at,
                                watch,
                                observer,
                                appended,
                                None if head.done() else (head, ready),
                            )
                            if not head.done():
                                head.set_result(ready)
                        finally:
                            if timer is not None:
                                timer.cancel()
                    break
                except TimeoutError:
                    # No first token by the deadline and the stage found somewhere better:
                    # nothing was sent to the client yet, so switch without a trace.
                    if response is not None:
                        await asyncio.shield(response.aclose())
                        response = None
                    backend.in_flight -= 1
                    backend = observer.switch(ctx)
                    backend.in_flight += 1
                    backend.requests += 1
                    sent_at = time.perf_counter()
        except asyncio.CancelledError as exc:
            drained = exc.args == (DRAIN_CANCEL,)
            stream.append(_DRAINED_EVENT if drained else _CANCELLED_EVENT, self.clock())
            self.metrics.count("chat", "draining" if drained else "cancelled")
            raise
        except (httpx.HTTPError, SSEProtocolError, OSError) as exc:
            backend.failures += 1
            message = f"Upstream failed: {type(exc).__name__}."
            if not head.done():
                head.set_result(UpstreamHead(502, encode(error_body(message, "server_error"))))
            stream.append(error_event(message, code=error_codes.UPSTREAM_ERROR), self.clock())
            self.metrics.count("chat", "upstream_error")
        finally:
            if not head.done():
                head.set_result(UpstreamHead(502, error_event("The upstream request failed.")))
            stream.finish(self.clock())
            backend.in_flight -= 1
            self.metrics.in_flight -= 1
            if observer is not None:
                observer.finished(ctx, ok)
            try:
                if response is not None:
                    # Closing an unfinished response drops the connection: the upstream aborts.
                    await asyncio.shield(response.aclose())
            finally:
                if shard is not None:
                    load[shard] -= 1

    async def _pump(
        self,
        ctx: RequestContext,
        stream: Stream,
        response: httpx.Response,
        sent_at: float,
        watch: asyncio.Timeout,
        observer: Any,
        appended: list[int],
        release: tuple[asyncio.Future[UpstreamHead], UpstreamHead] | None,
    ) -> bool:
        """Copy upstream events into ``stream``; True if it ended with ``[DONE]``.

        ``watch`` (the first-token deadline) is lifted at the first content; ``appended[0]``
        counts the events appended across upstreams. After a switch (``appended[0] > 0``),
        events before the new upstream's first content (its role chunk) are dropped: the
        client already has the first upstream's. ``release`` resolves the response head at
        the first content (when a deadline holds it back until then).
        """
        decoder = SSEDecoder()
        first_content = False
        skip_preamble = appended[0] > 0
        done = False
        try:
            # After [DONE], read on to the end of the body (briefly): closing an unfinished
            # response drops the kept-alive connection, and every stream would pay a new one.
            async with asyncio.timeout(None) as tail:
                async for raw in response.aiter_raw():
                    if done:
                        continue
                    for event in decoder.receive_data(raw):
                        if event.data == DONE:
                            done = True
                            self.metrics.count("chat", "ok")
                            loop_time = asyncio.get_running_loop().time()
                            tail.reschedule(loop_time + _DRAIN_AFTER_DONE_S)
                            break
                        data = event.data.encode()
                        now = time.perf_counter()
                        if not first_content and _has_content(data):
                            first_content = True
                            watch.reschedule(None)  # the first-token deadline no longer applies
                            stream.upstream_ttft_ms = (now - sent_at) * 1000
                            ctx.first_token_at = now
                            self.metrics.ttft.observe(now - ctx.received_at)
                            if observer is not None:
                                observer.first_token(ctx, (now - ctx.received_at) * 1000)
                            if release is not None and not release[0].done():
                                release[0].set_result(release[1])
                        elif observer is not None and first_content:
                            observer.chunk(ctx, now)
                        if skip_preamble and not first_content:
                            continue
                        stream.append(data, self.clock())
                        appended[0] += 1
        except TimeoutError:
            if not done:
                raise
        if done:
            return True
        stream.append(
            error_event(
                "The upstream closed the stream before [DONE].", code=error_codes.UPSTREAM_EOF
            ),
            self.clock(),
        )
        self.metrics.count("chat", "upstream_eof")
        return False

    async def forward(
        self, ctx: RequestContext, method: str, path: str, body: bytes | None = None
    ) -> UpstreamReply:
        """Send one request upstream and return the whole answer (502 if it fails)."""
        backend: Backend = ctx.backend
        backend.in_flight += 1
        self.metrics.in_flight += 1
        sent_at = time.perf_counter()
        observer: Any = ctx.extra.get("observer")
        ok = False
        ctx.upstream_sent_at = sent_at
        try:
            response = await self.client_for(backend).request(
                method,
                backend.url + path,
                content=body,
                headers=self._headers(ctx, backend, "application/json"),
            )
            content_type = response.headers.get("content-type", "application/json")
            ok = response.status_code == 200
            return UpstreamReply(
                response.status_code,
                response.content,
                content_type,
                (time.perf_counter() - sent_at) * 1000,
            )
        except httpx.HTTPError as exc:
            backend.failures += 1
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
        for task in list(self.producers):
            task.cancel()
        await asyncio.gather(*self.producers, return_exceptions=True)
        for client in (*self.stream_clients, self.peer_client):
            await client.aclose()


def _arm_deadline(
    observer: Any, ctx: RequestContext, watch: asyncio.Timeout
) -> asyncio.TimerHandle | None:
    """At the observer's first-token deadline, expire ``watch`` if it claims a switch.

    Asking first (instead of a plain timeout) means a request with nowhere better to go, or
    no spill slot, keeps waiting on its upstream rather than being cut off. The claim holds
    the spill slot, so the deadlines of a burst that fire together cannot all spill.
    """
    deadline_s = getattr(observer, "first_token_deadline_s", None)
    if deadline_s is None:
        return None
    loop = asyncio.get_running_loop()

    def check() -> None:
        if watch.when() is None and observer.claim_switch(ctx):
            watch.reschedule(loop.time())

    return loop.call_later(max(0.0, deadline_s - (time.perf_counter() - ctx.received_at)), check)


def _stream_body(ctx: RequestContext) -> bytes:
    """The body to send upstream: the client's bytes untouched, with ``stream`` forced on
    when the client did not ask for it (``POST /v1/streams``, WebSocket)."""
    if ctx.request is not None and ctx.request.stream:
        return ctx.body
    data = msgspec.json.decode(ctx.body)
    data["stream"] = True
    return encode(data)


async def _read_bounded(response: httpx.Response) -> bytes:
    parts: list[bytes] = []
    size = 0
    async for chunk in response.aiter_raw():
        parts.append(chunk)
        size += len(chunk)
        if size > _MAX_ERROR_BODY_BYTES:
            break
    return b"".join(parts)[:_MAX_ERROR_BODY_BYTES]


_CANCELLED_EVENT = error_event(
    "The upstream request was cancelled.", code=error_codes.CANCELLED
)
_DRAINED_EVENT = error_event(
    "This router shut down before the stream ended (listen.drain_timeout_s); send the request"
    " again to get the rest (another router of the region takes it).",
    code=error_codes.DRAINING,
)


def _as_error_event(status: int, body: bytes) -> bytes:
    """An upstream error reply as an in-stream error event (its body if it is OpenAI's)."""
    try:
        data: Any = msgspec.json.decode(body)
        if isinstance(data, dict) and isinstance(data.get("error"), dict):
            return encode({"error": data["error"]})
    except msgspec.DecodeError:
        pass
    return error_event(f"Upstream answered {status}.", code=f"upstream_{status}")
