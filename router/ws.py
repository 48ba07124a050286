"""WebSocket ``/v1/ws``: start streams and resume them over one socket (docs/protocol.md).

The messages are :mod:`firstbyte.protocol.ws`'s tagged unions; a malformed message gets an
``error`` message and the socket closes with 1007, an unknown or foreign stream with 1008.
Each stream on the socket is followed by its own task; sends are serialised by a lock so
messages never interleave.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import msgspec

from firstbyte.protocol import error_codes, paths
from firstbyte.protocol.codec import event_data
from firstbyte.protocol.formats import STREAMED
from firstbyte.protocol.headers import BETTER_REGION_HEADER, BETTER_REGION_URL_HEADER, REGION_HEADER
from firstbyte.protocol.openai import ErrorBody, encode, error_body
from firstbyte.protocol.ws import (
    CLOSE_INVALID_PAYLOAD,
    CLOSE_POLICY,
    SUBPROTOCOL,
    TOKEN_SUBPROTOCOL_PREFIX,
    Done,
    Error,
    Event,
    Request,
    Resume,
    ServerMessage,
    Start,
    decode_client_message,
)
from firstbyte.protocol.ws import encode as encode_message

from .asgi import Message, Receive, Scope, Send
from .endpoints import fallback_reply, new_context, upstream_refusal, upstream_retry_after
from .multiregion import draining_reply
from .pipeline.admit import admit_chat, adopt_token, authenticate
from .pipeline.context import CONTINUE, Fallback, LocalReply, RequestContext
from .pipeline.relay import upstream_error_object
from .placement import place
from .readers import TRIMMED_STATUS, HistoryTrimmed, ReadableStream, follow, trimmed_body
from .shared.errors import StateUnavailable, unavailable_reply
from .state import RouterState

__all__ = ["refuse_upgrade", "websocket_session"]

log = logging.getLogger("firstbyte.router")

CLOSE_GOING_AWAY = 1001
"""Close code for a socket closed for being idle (RFC 6455 section 7.4.1)."""

CLOSE_SERVICE_RESTART = 1012
"""Close code of an upgrade refused while draining where the server cannot answer it with
HTTP (IANA's "Service Restart": the server is going away, connect again). Not 1013 "Try
Again Later", which the router gives an upgrade shed for memory: a client reading the code
tells the process stopping from the one overloaded. It is also what uvicorn closes the
sockets still open with when the drain ends."""

MAX_STREAMS_PER_SOCKET = 64
"""Streams followed at once on one socket; one more is refused (error, close 1008), so a
client cannot make the router hold a task per message it sends."""


class _Close(Exception):
    def __init__(self, code: int, reason: str) -> None:
        self.code = code
        self.reason = reason


def _error(
    stream: str | None, body: ErrorBody | bytes, status: int,
    headers: tuple[tuple[str, str], ...] | list[tuple[str, str]] = (),
) -> Error:
    """The ``error`` message for an answer that is ``status`` with ``body`` and ``headers``
    over HTTP."""
    raw = body if isinstance(body, bytes) else encode(body)
    # The message carries the inner error object, as in ``{"error": {...}}`` bodies.
    inner = msgspec.json.decode(raw).get("error", {})
    return Error(stream, msgspec.Raw(encode(inner)), status, _retry_after(headers))


def _reply(stream: str | None, reply: LocalReply) -> Error:
    """The ``error`` message for a refusal that HTTP answers with ``reply``."""
    return _error(stream, reply.body, reply.status, reply.headers)


def _retry_after(headers: tuple[tuple[str, str], ...] | list[tuple[str, str]]) -> int | None:
    """The ``Retry-After`` seconds among an HTTP answer's headers: read from the header the
    code that refuses sets, so SSE and the socket give one figure, computed once."""
    for name, value in headers:
        if name == "retry-after":
            return int(value)  # the router's are whole seconds (never an HTTP-date)
    return None


def _upstream_error(state: RouterState, status: int, body: bytes) -> Error:
    """The ``error`` message for a stream the upstream refused with ``status`` and ``body``
    (OpenAI's or Anthropic's error body, whose ``error`` object it carries; another body, a
    proxy's HTML page, is named by its status), with the ``Retry-After`` SSE adds to it."""
    headers = upstream_retry_after(state, status)
    error = upstream_error_object(body)
    if error is not None:
        return Error(None, msgspec.Raw(encode(error)), status, _retry_after(headers))
    fallback = error_body(f"Upstream answered {status}.", code=f"upstream_{status}")
    return _error(None, fallback, status, headers)


def _trimmed(stream_id: str, trimmed: HistoryTrimmed) -> Error:
    return _error(stream_id, trimmed_body(trimmed), TRIMMED_STATUS)


class _Session:
    def __init__(self, state: RouterState, ctx: RequestContext, send: Send) -> None:
        self.state = state
        self.ctx = ctx
        self._send = send
        self._lock = asyncio.Lock()
        self.followers: set[asyncio.Task[None]] = set()
        self.last_active = state.clock()
        """When the client last sent a message or the last followed stream ended."""

    async def send(self, message: ServerMessage) -> None:
        async with self._lock:
            await self._send({"type": "websocket.send", "text": encode_message(message).decode()})

    async def handle(self, text: str | bytes) -> None:
        try:
            message = decode_client_message(text)
        except msgspec.DecodeError as exc:
            reason = f"malformed message: {exc}"[:120]
            await self.send(
                _error(None, error_body(reason, code=error_codes.INVALID_MESSAGE), 400)
            )
            raise _Close(CLOSE_INVALID_PAYLOAD, reason) from None
        if len(self.followers) >= MAX_STREAMS_PER_SOCKET:
            reason = f"more than {MAX_STREAMS_PER_SOCKET} streams at once on one socket"
            await self.send(
                _error(None, error_body(reason, code=error_codes.TOO_MANY_STREAMS), 429)
            )
            raise _Close(CLOSE_POLICY, reason)
        if isinstance(message, Request):
            await self._request(message)
        else:
            await self._resume(message)

    async def _request(self, message: Request) -> None:
        ctx = new_context(
            self.state,
            {
                "path": paths.WEBSOCKET,
                "method": "POST",
                "headers": [],
                "http_version": self.ctx.http_version,
            },
        )
        ctx.headers = self.ctx.headers
        # The socket's peer: X-Forwarded-For is believed only from a trusted proxy, so without
        # it a WebSocket request had no client location (and never a better-region hint).
        ctx.client = self.ctx.client
        ctx.traceparent = self.ctx.traceparent
        ctx.body = bytes(message.body)
        ctx.codec = STREAMED[message.endpoint]
        limits = self.state.config.limits
        outcome = admit_chat(ctx, self.state.api_keys, limits.max_body_bytes, force_stream=True,
                             tokens=self.state.tokens)
        if isinstance(outcome, LocalReply):
            self.state.metrics.count("ws", outcome.outcome)
            await self.send(_reply(None, outcome))
            if outcome.status == 401:  # a token revoked (or expired) since the socket opened
                raise _Close(CLOSE_POLICY, "unauthorized")
            raise _Close(CLOSE_INVALID_PAYLOAD, "invalid request body")
        outcome = await place(self.state, ctx)
        if isinstance(outcome, LocalReply):
            self.state.metrics.count_reply("ws", outcome, ctx.model_label)
            await self.send(_reply(None, outcome))
            return
        if outcome is not CONTINUE:
            # SSE's 503 for it, Retry-After included.
            unavailable = fallback_reply(
                outcome if isinstance(outcome, Fallback) else Fallback("unavailable")
            )
            self.state.metrics.count("ws", "unavailable", ctx.model_label)
            await self.send(_reply(None, unavailable))
            return
        # Placed this loop turn: the stream starts then (placed_at), no clock read again.
        now = self.state.clock() if ctx.placed_at is None else ctx.placed_at
        stream = ctx.stream = self.state.new_stream(
            ctx.owner, ctx.release_key_slot, ctx.subject, now
        )
        stream.format = ctx.codec.name  # a lost producer's end comes in this format
        self.state.client_latency.stream_started(
            ctx.owner, ctx.region or self.state.region, now
        )
        started = self.state.proxy.start_stream(ctx, stream)
        announcing = self.state.announced(stream)
        if announcing is not None:
            await announcing
        self.state.requests.stream_started(ctx)
        # The upstream's head before ``start``: a refusal goes out as the error with its status
        # (what SSE answers), which sends the request to the next region, not as the first
        # event of a started stream. The head ends the producer's wait at the latest (its
        # connect and read timeouts); the bound is for a producer cancelled before it ran.
        limits = self.state.config.limits
        refused = await upstream_refusal(
            started, limits.upstream_connect_timeout_s + limits.upstream_read_timeout_s
        )
        if refused is not None:
            await self.send(_upstream_error(self.state, refused.status, refused.body))
            return
        # The routing stage put the hint (if any) in the headers SSE would send.
        hint = dict(ctx.response_headers)
        await self.send(Start(stream.id, ctx.region, hint.get(BETTER_REGION_HEADER),
                              hint.get(BETTER_REGION_URL_HEADER)))
        self._follow(stream, 0)

    async def _resume(self, message: Resume) -> None:
        # The socket's credential is checked again: a token revoked by a reload since the
        # socket opened reads nothing more (as a new request on the socket would be refused).
        outcome = authenticate(self.ctx, self.state.api_keys, self.state.tokens)
        if isinstance(outcome, LocalReply):
            self.state.metrics.count("ws", outcome.outcome)
            await self.send(_reply(message.stream, outcome))
            raise _Close(CLOSE_POLICY, "unauthorized")
        try:
            stream = await self.state.find_stream(
                message.stream, self.ctx.owner, self.ctx.reader_subject
            )
        except StateUnavailable as exc:  # the socket stays: the client may resume again
            refused = unavailable_reply(exc)
            self.state.metrics.count_reply("ws", refused)
            await self.send(_reply(message.stream, refused))
            return
        if stream is None:
            await self.send(
                _error(
                    message.stream,
                    error_body(
                        "No such stream.", code=error_codes.STREAM_NOT_FOUND, param="stream"
                    ),
                    404,
                )
            )
            raise _Close(CLOSE_POLICY, "unknown stream")
        if message.after < stream.trimmed:
            # The stream exists but not from there: its error, and the socket stays open.
            await self.send(_trimmed(stream.id, HistoryTrimmed(message.after, stream.trimmed)))
            return
        await self.send(Start(stream.id))
        self._follow(stream, message.after)

    def _follow(self, stream: ReadableStream, after: int) -> None:
        task = asyncio.create_task(self._pump(stream, after))
        self.followers.add(task)
        task.add_done_callback(self._followed)

    def _followed(self, task: asyncio.Task[None]) -> None:
        self.followers.discard(task)
        self.last_active = self.state.clock()
        if task.cancelled():
            return
        # Retrieved here, or asyncio logs "Task exception was never retrieved" with a
        # traceback when the task is collected: a follower whose send found the client gone
        # (uvicorn's ClientDisconnected, an OSError) is no news; anything else is a bug.
        exc = task.exception()
        if exc is not None and not isinstance(exc, OSError):
            log.error("following a stream on a WebSocket failed", exc_info=exc)

    async def _pump(self, stream: ReadableStream, after: int) -> None:
        self.state.metrics.count("ws", "stream")
        batches = follow(
            stream,
            after,
            idle_s=self.state.config.limits.heartbeat_interval_s,
            clock=self.state.clock,
        )
        try:
            async for batch in batches:
                for event in batch:
                    if event.is_done:
                        await self.send(Done(stream.id, event.seq))
                        return
                    data = event_data(event.data)  # a named event's JSON names it (type)
                    await self.send(Event(stream.id, event.seq, msgspec.Raw(data)))
        except HistoryTrimmed as trimmed:  # this reader fell behind a trim of the stream
            await self.send(_trimmed(stream.id, trimmed))
        finally:
            await batches.aclose()

    async def aclose(self) -> None:
        for task in list(self.followers):
            task.cancel()
        await asyncio.gather(*self.followers, return_exceptions=True)


async def refuse_upgrade(
    scope: Scope, send: Send, refusal: LocalReply, close_code: int = CLOSE_POLICY,
    reason: str = "unauthorized", *, draining: bool,
) -> None:
    """Refuse the upgrade with ``refusal``, the HTTP answer (status, body, headers such as
    ``Retry-After``) a POST gets, if the server can; else close with ``close_code``. While
    ``draining``, an HTTP/1.x answer says ``Connection: close``, as every other does."""
    if "websocket.http.response" in scope.get("extensions", {}):
        headers = [(b"content-type", b"application/json")]
        headers += [(k.encode("latin-1"), v.encode("latin-1")) for k, v in refusal.headers]
        if draining and scope.get("http_version") in ("1.1", "1.0"):
            # RouterApp.__call__ adds it to HTTP answers (the client's next request then
            # goes on a new connection, to a process not draining); a refused upgrade is an
            # HTTP answer too. uvicorn's WebSocket protocol sent it anyway, hypercorn's not.
            # Over HTTP/2 (RFC 8441) the header is forbidden: GOAWAY does it.
            headers.append((b"connection", b"close"))
        await send(
            {
                "type": "websocket.http.response.start",
                "status": refusal.status,
                "headers": headers,
            }
        )
        await send({"type": "websocket.http.response.body", "body": refusal.body})
    else:
        await send({"type": "websocket.close", "code": close_code, "reason": reason})


async def _next_message(session: _Session, receive: Receive, idle_s: float) -> Message | None:
    """The client's next message; None once the socket has been idle for ``idle_s``: no
    message from the client and no stream followed for it."""
    clock = session.state.clock
    while True:
        try:
            async with asyncio.timeout(idle_s):
                message: Message = await receive()
        except TimeoutError:
            if session.followers:
                continue  # streams are flowing to the client: not idle
            quiet_s = clock() - session.last_active
            if quiet_s >= idle_s:
                return None
            continue
        session.last_active = clock()
        return message


async def websocket_session(state: RouterState, scope: Scope, receive: Receive, send: Send) -> None:
    """Serve one WebSocket connection until either side closes it."""
    message = await receive()
    if message["type"] != "websocket.connect":
        return
    ctx = new_context(state, scope)
    offered: list[str] = list(scope.get("subprotocols") or ())
    for protocol in offered:
        if protocol.startswith(TOKEN_SUBPROTOCOL_PREFIX):
            # A browser's WebSocket cannot send Authorization: its token rides as a
            # subprotocol (out of the URL, so out of access logs), never selected.
            adopt_token(ctx, protocol[len(TOKEN_SUBPROTOCOL_PREFIX) :])
    outcome = authenticate(ctx, state.api_keys, state.tokens)
    if isinstance(outcome, LocalReply):
        state.metrics.count("ws", outcome.outcome)
        await refuse_upgrade(scope, send, outcome, draining=state.draining)
        return
    if state.draining:
        # The HTTP request's refusal, Retry-After included, so the client opens its socket on
        # a sibling process or region: a 101 here would keep it on this process, which would
        # refuse (or forward) each request sent on it until the drain closed it.
        refusal = draining_reply()
        state.metrics.count_reply("ws", refusal)
        await refuse_upgrade(scope, send, refusal, CLOSE_SERVICE_RESTART, "draining",
                             draining=True)
        return
    accept: dict[str, object] = {
        "type": "websocket.accept",
        "headers": [(REGION_HEADER.encode(), state.region.encode())],
    }
    if SUBPROTOCOL in offered:
        accept["subprotocol"] = SUBPROTOCOL
    await send(accept)
    session = _Session(state, ctx, send)
    idle_s = state.config.limits.websocket_idle_timeout_s
    try:
        while True:
            incoming = await _next_message(session, receive, idle_s)
            if incoming is None:
                await session.aclose()
                await send({"type": "websocket.close", "code": CLOSE_GOING_AWAY, "reason": "idle"})
                return
            if incoming["type"] == "websocket.disconnect":
                return
            if incoming["type"] != "websocket.receive":
                continue
            text = incoming.get("text")
            data = text if text is not None else incoming.get("bytes") or b""
            await session.handle(data)
    except _Close as close:
        await session.aclose()
        with contextlib.suppress(Exception):
            await send({"type": "websocket.close", "code": close.code, "reason": close.reason})
    finally:
        await session.aclose()
