"""HTTP endpoints: each runs the pipeline stages for its request and answers.

The streamed completion path: admit -> the key's limits (:mod:`firstbyte.router.tenancy`)
-> choose backend -> create a stream in the store ->
start the upstream producer -> wait for the upstream's response head -> answer 200 and
follow the stream as SSE. ``Server-Timing`` at header time carries ``queue``, ``route`` and
``upstream-headers`` (upstream request to its response head); ``upstream-ttft`` is not known
yet when a live stream's headers go out, so it appears on non-streamed replies and on
``GET /v1/streams/{id}`` once the first token has been produced.

Every format goes through that one path (:func:`completion`): chat completions, completions,
Responses and Anthropic Messages, each read by its codec
(:data:`firstbyte.protocol.formats.BY_PATH`), which the route chooses; embeddings are
never streamed and take the non-streamed branch of the same path.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING
from urllib.parse import parse_qs

import msgspec

from firstbyte.protocol import error_codes
from firstbyte.protocol.codec import CHAT, Codec
from firstbyte.protocol.content_coding import CONTENT_ENCODING_HEADER, Coding
from firstbyte.protocol.content_coding import QUERY_PARAM as ENCODING_PARAM
from firstbyte.protocol.edge import EdgeStatusReport, PublicEdgeStatus
from firstbyte.protocol.formats import BY_PATH, MESSAGES, STREAMED
from firstbyte.protocol.headers import REGION_HEADER, STREAM_HEADER
from firstbyte.protocol.openai import Model, ModelList, encode
from firstbyte.protocol.poll import StreamStarted
from firstbyte.protocol.timings import decode_report
from firstbyte.protocol.tokens import QUERY_PARAM, TokenRequest

from .asgi import (
    BodyTimeout,
    ClientGone,
    Disconnect,
    Headers,
    Message,
    Receive,
    Scope,
    Send,
    Started,
    body_writer,
    head_body,
    header_dict,
    read_body,
    receive_now,
    send_bytes,
    stream_body,
    unless_gone,
    until_disconnect,
)
from .config import Origin
from .multiregion import DRAINING_RETRY_AFTER_S
from .observability.access import CONTEXT_KEY, reply_usage
from .pipeline.admit import admit_body, adopt_api_key_header, adopt_token, authenticate
from .pipeline.backend import PEER_PREFIX
from .pipeline.content_coding import ADVERTISED, body_coding, inflate_body
from .pipeline.context import (
    CONTINUE,
    Fallback,
    LocalReply,
    Outcome,
    RequestContext,
    Traceparent,
    error_reply,
)
from .pipeline.simple_start import adopt_query_token
from .placement import PLACE_LATER, place_later, release_key_slot
from .readers import (
    HistoryTrimmed,
    ReadableStream,
    parse_after,
    poll,
    sse_events,
    trimmed_reply,
)
from .shared.errors import RETRY_AFTER_S, StateUnavailable, unavailable_reply
from .state import CLIENT_GONE, RouterState
from .tenancy import refusal

if TYPE_CHECKING:
    from .pipeline.proxy import UpstreamHead

__all__ = [
    "FORMAT_ROUTES",
    "chat_completions",
    "completion",
    "edge_status",
    "edge_timings",
    "fallback_reply",
    "healthz",
    "metrics",
    "mint_token",
    "models",
    "new_context",
    "not_found",
    "read_stream",
    "reply",
    "start_detached_stream",
    "upstream_refusal",
    "upstream_retry_after",
]

SSE_HEADERS = (
    ("content-type", "text/event-stream; charset=utf-8"),
    ("cache-control", "no-cache"),
    ("x-accel-buffering", "no"),
)
_SSE_HEADERS_ENCODED = tuple((k.encode("latin-1"), v.encode("latin-1")) for k, v in SSE_HEADERS)
""":data:`SSE_HEADERS` as sent, encoded once (every streamed answer has them)."""


_new_context_object = object.__new__
_init_context = RequestContext.__init__


def new_context(state: RouterState, scope: Scope) -> RequestContext:
    headers = dict(header_dict(scope))  # a copy: admission may add the credential it found
    client = scope.get("client")
    # Made and then initialised, not by calling the class: a class's call passes keywords to
    # a Python __init__ through a dict built for them (type.__call__ has no vectorcall for
    # it on 3.11), some 2.5k instructions a request more than this call of __init__.
    ctx = _new_context_object(RequestContext)
    _init_context(
        ctx,
        method=scope.get("method", "GET"),
        path=scope["path"],
        headers=headers,
        client=tuple(client) if client else None,
        http_version=scope.get("http_version", "1.1"),
        traceparent=Traceparent.continue_from(headers.get("traceparent")),
        region=state.region,
    )
    scope[CONTEXT_KEY] = ctx  # for the access log, written when the request is over
    return ctx


def _common_headers(ctx: RequestContext) -> list[tuple[str, str]]:
    return [
        (REGION_HEADER, ctx.region),
        ("traceparent", ctx.traceparent.header()),
        *ctx.response_headers,  # e.g. x-firstbyte-better-region
    ]


async def reply(send: Send, ctx: RequestContext | None, outcome: LocalReply) -> None:
    headers = [*(_common_headers(ctx) if ctx else []), *outcome.headers]
    await send_bytes(send, outcome.status, outcome.body, headers=headers)


def fallback_reply(outcome: Fallback) -> LocalReply:
    """The ``503`` for a stage that could not serve the request here (SSE's and the
    WebSocket's answer alike)."""
    return error_reply(
        503,
        f"Cannot serve this request here: {outcome.reason}.",
        "server_error",
        code=error_codes.UNAVAILABLE,
        headers=(("retry-after", "1"),),
        outcome="unavailable",
    )


async def _finish(
    state: RouterState, send: Send, ctx: RequestContext, outcome: Outcome, endpoint: str
) -> bool:
    """Answer a stage's non-continue outcome; True if the request is over."""
    if outcome is CONTINUE:
        return False
    local = fallback_reply(outcome) if isinstance(outcome, Fallback) else outcome
    assert isinstance(local, LocalReply)
    state.metrics.count_reply(endpoint, local, ctx.model_label)
    ctx.outcome = local.outcome
    ctx.error_code = local.code or None
    await reply(send, ctx, local)
    return True


async def _admitted(
    state: RouterState,
    scope: Scope,
    receive: Receive,
    send: Send,
    *,
    force_stream: bool,
    invalid: LocalReply | None = None,
    codec: Codec = CHAT,
) -> RequestContext | None:
    """Read the body, admit, apply the key's limits and route; None if a reply was sent.

    ``invalid`` (a bad query parameter found by the caller) is answered once the key is checked
    and the body read, before the body is parsed, the key's limits and routing, so a rejected
    request spends no token and never holds a routing slot. ``codec`` reads the body (the
    endpoint's wire format)."""
    ctx = new_context(state, scope)
    ctx.codec = codec
    endpoint = codec.name
    if codec is MESSAGES:
        adopt_api_key_header(ctx)  # Anthropic's header for the key
    # _query's answer without its call for a request without a query (nearly every one).
    query = _query(scope) if scope.get("query_string") else {}
    # Each outcome is tested for CONTINUE before awaiting _finish: the stages nearly always
    # continue, and an awaited call is a coroutine made, run and closed (five a request).
    # A browser's preflight-free start carries its client token in the URL (none without a
    # query, nearly every request's: no call then).
    outcome = adopt_query_token(ctx, query, state.cors) if query else CONTINUE
    if outcome is not CONTINUE and await _finish(state, send, ctx, outcome, endpoint):
        return None
    # The key is checked on the head, before any body is read: a client without one cannot
    # make the router wait for a body, or read and drain one.
    outcome = authenticate(ctx, state.api_keys, state.tokens)
    if outcome is not CONTINUE and await _finish(state, send, ctx, outcome, endpoint):
        return None
    limit = state.config.limits.max_body_bytes
    # A body come whole with its head, as sent (nearly every request's), is taken without an
    # await: reading it through _read_request_body made four coroutines. Its receive is begun
    # (receive_now) where _read_request_body would read the body at once: no coding, not
    # too big to read.
    # body_coding's and _too_big_to_read's answers for nearly every request without their
    # calls: no coding named (IDENTITY), and a declared length within the limit (within
    # either drain limit, each at least ``limit``) or none.
    headers = ctx.headers
    declared = headers.get("content-length", "")
    first = (
        None if (
            (headers.get(CONTENT_ENCODING_HEADER) is not None or ENCODING_PARAM in query)
            and body_coding(ctx, query) is not Coding.IDENTITY
        ) or (declared.isdigit() and int(declared) > limit and _too_big_to_read(ctx, limit))
        else receive_now(receive)
    )
    if (
        type(first) is dict
        and first["type"] != "http.disconnect"
        and not first.get("more_body", False)
    ):
        ctx.body = first.get("body", b"")[: limit + 1]  # as read_body would have it
    elif not await _read_request_body(state, receive, send, ctx, query, endpoint, first):
        return None
    # Before the body is parsed: with an unknown ``endpoint`` the codec reading it is only a
    # stand-in, and its complaint about the body would hide the real mistake.
    if invalid is not None and await _finish(state, send, ctx, invalid, endpoint):
        return None
    outcome = admit_body(ctx, limit, force_stream=force_stream)
    if outcome is not CONTINUE and await _finish(state, send, ctx, outcome, endpoint):
        return None
    # Placed without an await (and no listener for the client's going made) unless it waits;
    # by the region state's own place_now (placement.place_now's call of it, a call less).
    placed = state.region_state.place_now(state, ctx)
    if placed is PLACE_LATER:
        placed = await place_later(state, ctx, lambda: until_disconnect(receive))
    if placed is CLIENT_GONE:  # it left while waiting for a slot: nobody to answer
        state.metrics.count(endpoint, "client_gone", ctx.model_label)
        ctx.outcome = "client_gone"
        return None
    if placed is not CONTINUE and await _finish(state, send, ctx, placed, endpoint):
        return None
    return ctx


async def _read_request_body(
    state: RouterState, receive: Receive, send: Send, ctx: RequestContext,
    query: dict[str, str], endpoint: str, first: Message | Started | None = None,
) -> bool:
    """Read an inference request's body into ``ctx.body``, inflated if its head names a
    coding (:mod:`.pipeline.content_coding`); False once a reply was sent or the client went
    away. Past ``max_body_bytes`` (read or inflated) the body is cut and admission answers
    413. ``first``: what :func:`_admitted` received (its receive begun), if it asked."""
    coding = body_coding(ctx, query)
    if isinstance(coding, LocalReply):  # refused on the head: nothing read
        await _finish(state, send, ctx, coding, endpoint)
        return False
    limit = state.config.limits.max_body_bytes
    body = await _read_body(state, receive, send, ctx, limit, endpoint, first)
    if body is None:
        return False
    ctx.body = body
    if coding is Coding.IDENTITY:  # as sent: nothing to inflate
        return True
    inflated = inflate_body(ctx, coding, limit)
    return inflated is CONTINUE or not await _finish(state, send, ctx, inflated, endpoint)


def _too_big_to_read(ctx: RequestContext, limit: int) -> bool:
    """Does the request declare a body too big to read (answered 413 without reading)?"""
    declared = ctx.headers.get("content-length", "")
    # HTTP/2 and HTTP/3 end one stream, not the connection: past the limit the answer goes
    # at once and the server resets the stream (NO_ERROR, RFC 9113 section 8.1), so the
    # client stops sending; draining as on HTTP/1.1 made a 63 MiB body take 57 s to its 413.
    drain_limit = limit if ctx.http_version in ("2", "3") else 64 * max(limit, 1 << 20)
    return declared.isdigit() and int(declared) > drain_limit


async def _read_body(
    state: RouterState, receive: Receive, send: Send, ctx: RequestContext, limit: int,
    endpoint: str, first: Message | Started | None = None,
) -> bytes | None:
    """The request body, cut at ``limit + 1`` bytes (the caller answers 413 past ``limit``);
    None once the client went away or a 408 for a stalled body was sent. ``first``: its
    first message, or that receive begun, if the caller has it."""
    if first is None and _too_big_to_read(ctx, limit):
        return b"\0" * (limit + 1)  # too big to read: 413 without reading
    multiplexed = ctx.http_version in ("2", "3")
    timeout_s = state.config.limits.client_body_timeout_s
    try:
        return await read_body(
            receive, limit, timeout_s=timeout_s,
            drain_bytes=limit if multiplexed else 64 << 20, first=first,
        )
    except ClientGone:
        return None
    except BodyTimeout:
        state.metrics.count(endpoint, "body_timeout")
        timeout = error_reply(
            408,
            f"The request body stalled for over {timeout_s:g} s.",
            code=error_codes.REQUEST_TIMEOUT,
            outcome="body_timeout",
        )
        await reply(send, ctx, timeout)
        return None


async def completion(
    state: RouterState, scope: Scope, receive: Receive, send: Send, codec: Codec = CHAT
) -> None:
    """``POST`` a completion in ``codec``'s format: SSE through the store when streamed (the
    upstream's events, with our ``id:`` lines and heartbeats), else its JSON."""
    ctx = await _admitted(state, scope, receive, send, force_stream=False, codec=codec)
    if ctx is None:
        return
    endpoint = codec.name
    if not ctx.stream_requested:
        # Counted against the key's concurrency like a stream (streams count in the store).
        try:
            with state.limiter.holding(ctx.owner):
                forward = asyncio.ensure_future(
                    state.proxy.forward(ctx, "POST", codec.path, ctx.body)
                )
                if not await unless_gone(receive, forward):
                    forward.cancel()  # nobody will read the answer: stop the upstream's work
                    state.metrics.count(endpoint, "client_gone", ctx.model_label)
                    ctx.outcome = "client_gone"
                    return
                answer = forward.result()
        finally:
            release_key_slot(ctx)
        ctx.outcome = "ok" if answer.status == 200 else f"upstream_{answer.status}"
        ctx.usage = reply_usage(answer.body, codec)
        if answer.status == 200 and not str(getattr(ctx.backend, "name", "")).startswith(
            PEER_PREFIX
        ):  # a peer region's router counts what its backends serve
            state.metrics.usage.record(
                ctx.owner, ctx.usage.input_tokens, ctx.usage.output_tokens
            )
        state.metrics.count(endpoint, ctx.outcome, ctx.model_label)
        timing = ctx.server_timing(upstream=answer.elapsed_ms)
        await send_bytes(
            send,
            answer.status,
            answer.body,
            content_type=answer.content_type,
            headers=[
                *_common_headers(ctx),
                ("server-timing", timing),
                *upstream_retry_after(state, answer.status),
            ],
        )
        return
    # place() made room in the store (nothing awaited since): no eviction here. Nor a clock
    # reading: the stream starts when the request was placed (placed_at).
    now = state.clock() if ctx.placed_at is None else ctx.placed_at
    # The region state's new_stream, not through RouterState.new_stream: a call less.
    stream = ctx.stream = state.region_state.new_stream(
        state.store, ctx.owner, now, ctx.release_key_slot, ctx.subject
    )
    stream.format = codec.name  # before its metadata is written (queued, not yet sent)
    # ClientLatency.stream_started's own call (a call a stream less).
    state.client_latency.served.started(ctx.owner, ctx.region or state.region, now)
    # Attached while waiting for the upstream's head, so a slow queue is not "unattended".
    stream.attach(now)
    disconnect = Disconnect(receive, scope)  # one listener for the head's wait and the body
    # Start the upstream for the attached stream, then answer with its head: the SSE body, or
    # the upstream's error. In line, not a coroutine of its own: one made, run and closed a
    # stream less, and one frame less for each of the task's wake-ups to pass through.
    try:
        try:
            # The listener's loop is the running one: no lookup (a getpid() on Python 3.11).
            started = state.proxy.start_stream(ctx, stream, disconnect.listener.get_loop())
            if not await disconnect.unless_gone(started):
                # Gone before the response head, so before learning the stream id: nobody can
                # ever read this stream (an HTTP/2 rapid reset, or a client giving up).
                if stream.cancel_producer is not None:
                    stream.cancel_producer()
                state.metrics.count(endpoint, "client_gone", ctx.model_label)
                return
            head = started.result()
            # None in memory: nothing to wait for. The region state's, not through
            # RouterState.announced: a call less.
            announcing = state.region_state.announced(stream)
            if announcing is not None:  # written by now: it went out while upstream answered
                await announcing
        finally:
            stream.detach(state.clock())
        headers = _common_headers(ctx)  # a new list: added to, not copied
        headers += (
            (STREAM_HEADER, stream.id),
            ("server-timing", ctx.server_timing_upstream_headers(head.elapsed_ms)),
        )
        if head.status != 200:
            headers += upstream_retry_after(state, head.status)
            await send_bytes(send, head.status, head.body, headers=headers)
            return
        await stream_body(
            receive,
            send,
            200,
            headers,
            sse_events(
                stream,
                0,
                heartbeat_s=state.config.limits.heartbeat_interval_s,
                clock=state.clock,
                direct=body_writer(scope),
                tally=state.metrics.sse_events,
            ),
            disconnect=disconnect,
            # Its first event (the role chunk) came with the upstream's head, as a rule: then
            # it goes out with ours.
            first_at_hand=stream.last_seq > 0 and head_body(scope),
            encoded=_SSE_HEADERS_ENCODED,  # before ``headers``, as SSE_HEADERS were
        )
    finally:
        disconnect.stop()


def _completion_in(codec: Codec) -> Callable[[RouterState, Scope, Receive, Send], Awaitable[None]]:
    """``POST`` of a completion in ``codec``'s format: a plain function returning
    :func:`completion`'s coroutine (not awaiting it: no frame more for its wake-ups), where a
    :func:`functools.partial` with the codec as a keyword cost ~1.6k instructions a call
    (Python 3.11 builds its arguments' tuple and dict)."""

    def post(state: RouterState, scope: Scope, receive: Receive, send: Send) -> Awaitable[None]:
        return completion(state, scope, receive, send, codec)

    return post


chat_completions = completion  # CHAT is its default codec: no call between
"""``POST /v1/chat/completions``."""

FORMAT_ROUTES = {
    path: completion if codec is CHAT else _completion_in(codec)
    for path, codec in BY_PATH.items()
}
"""``POST`` of every format (:data:`~firstbyte.protocol.formats.BY_PATH`): chat completions,
completions, Responses, Anthropic Messages, embeddings."""


async def upstream_refusal(
    started: asyncio.Future[UpstreamHead], timeout_s: float
) -> UpstreamHead | None:
    """The upstream's head if it refused the stream (not 200) within ``timeout_s``, else None.

    A long-poll or WebSocket start answers a refusal (the upstream's 429 or 503, a 502 when
    no backend could be reached) with its status, as SSE does, instead of announcing the
    stream and handing over its error as the first event: a client sends a refused request
    to the next region, but takes an error inside a started stream as the stream's end."""
    if not started.done():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(started), timeout_s)
    if not started.done() or started.cancelled():
        return None
    head = started.result()
    return head if head.status != 200 else None


def upstream_retry_after(state: RouterState, status: int) -> list[tuple[str, str]]:
    """A 429 or 503 from upstream (a peer region, a backend) goes out with our Retry-After
    (over SSE and long-poll as a header, over WebSocket in the ``error`` message)."""
    if status in (429, 503):
        return [("retry-after", str(state.routing.retry_after_s()))]
    return []


async def start_detached_stream(
    state: RouterState, scope: Scope, receive: Receive, send: Send
) -> None:
    """``POST /v1/streams[?wait=S][&endpoint=NAME]``: start a stream and answer 201.

    Without ``wait`` (or ``wait=0``) the answer is ``{"stream": ID}`` at once. With ``wait > 0``
    it is the stream's first long-poll batch (:func:`firstbyte.router.readers.poll` after 0, the
    stream id included), so a long-poll client's first token costs one round trip, not two.
    ``endpoint`` names the body's format (:data:`~firstbyte.protocol.formats.STREAMED`;
    default ``chat``); another name is ``400 invalid_request``.
    """
    query = _query(scope)
    wait = _wait_param(state, query, default=0.0)
    codec = STREAMED.get(query.get("endpoint", CHAT.name))
    invalid = wait if isinstance(wait, LocalReply) else None
    if codec is None:
        names = ", ".join(STREAMED)
        invalid = error_reply(
            400, f"endpoint must be one of {names}.", param="endpoint",
            code=error_codes.INVALID_REQUEST,
        )
    ctx = await _admitted(
        state,
        scope,
        receive,
        send,
        force_stream=True,
        invalid=invalid,
        codec=codec or CHAT,
    )
    if ctx is None:
        return
    assert isinstance(wait, float)
    now = state.clock() if ctx.placed_at is None else ctx.placed_at  # placed this loop turn
    stream = ctx.stream = state.new_stream(ctx.owner, ctx.release_key_slot, ctx.subject, now)
    stream.format = ctx.codec.name  # a lost producer's end comes in this format
    state.client_latency.stream_started(ctx.owner, ctx.region or state.region, now)
    started = state.proxy.start_stream(ctx, stream)
    announcing = state.announced(stream)
    if announcing is not None:
        await announcing
    if wait == 0:
        headers = [
            *_common_headers(ctx),
            (STREAM_HEADER, stream.id),
            ("server-timing", ctx.server_timing()),
        ]
        await send_bytes(send, 201, encode(StreamStarted(stream.id)), headers=headers)
        return
    began = state.clock()
    refused = await upstream_refusal(started, wait)
    if refused is not None:  # answered as SSE answers it: the client tries the next region
        headers = [
            *_common_headers(ctx),
            (STREAM_HEADER, stream.id),
            ("server-timing", ctx.server_timing(upstream_headers=refused.elapsed_ms)),
            *upstream_retry_after(state, refused.status),
        ]
        await send_bytes(send, refused.status, refused.body, headers=headers)
        return
    wait = max(0.0, wait - (state.clock() - began))
    batch = await poll(stream, 0, wait, clock=state.clock)
    timing = {} if stream.upstream_ttft_ms is None else {"upstream_ttft": stream.upstream_ttft_ms}
    headers = [
        *_common_headers(ctx),
        (STREAM_HEADER, stream.id),
        ("server-timing", ctx.server_timing(**timing)),
        ("cache-control", "no-cache"),
    ]
    await send_bytes(send, 201, msgspec.json.encode(batch), headers=headers)


async def _lookup(
    state: RouterState, ctx: RequestContext, stream_id: str
) -> ReadableStream | LocalReply:
    outcome = authenticate(ctx, state.api_keys, state.tokens)
    if isinstance(outcome, LocalReply):
        return outcome
    try:
        stream = await state.find_stream(stream_id, ctx.owner, ctx.reader_subject)
    except StateUnavailable as exc:
        return unavailable_reply(exc)
    if stream is None:
        return error_reply(
            404,
            "No such stream.",
            code=error_codes.STREAM_NOT_FOUND,
            param="stream",
            outcome="not_found",
        )
    return stream


def _query(scope: Scope) -> dict[str, str]:
    raw = scope.get("query_string", b"")
    if not raw:
        return {}  # most requests: nothing to parse
    parsed = parse_qs(raw.decode("latin-1"), keep_blank_values=True)
    return {k: v[-1] for k, v in parsed.items()}


def _wait_param(state: RouterState, query: dict[str, str], *, default: float) -> float | LocalReply:
    """The long-poll ``wait`` (seconds, 0..``max_poll_wait_s``), or the 400 to answer."""
    max_wait = state.config.streams.max_poll_wait_s
    raw = query.get("wait")
    try:
        wait_s = default if raw is None else float(raw)
        if not 0 <= wait_s <= max_wait:  # also rejects nan
            raise ValueError
    except ValueError:
        return error_reply(
            400,
            f"wait must be a number of seconds from 0 to {max_wait:g}.",
            param="wait",
            code=error_codes.INVALID_WAIT,
        )
    return wait_s


async def _open_stream(
    state: RouterState,
    scope: Scope,
    send: Send,
    stream_id: str,
    endpoint: str,
    *,
    last_event_id: bool,
) -> tuple[RequestContext, ReadableStream, int, dict[str, str]] | None:
    """Authenticate, find the caller's stream and parse the ``after`` cursor (the
    ``Last-Event-ID`` header first when ``last_event_id``); returns (context, stream, after,
    query), or None once a 401/403/404/400 reply is sent."""
    ctx = new_context(state, scope)
    query = _query(scope)
    if last_event_id:
        adopt_token(ctx, query.get(QUERY_PARAM))  # EventSource cannot send Authorization
    # A browser's poll is a simple request as its start is: the client token in the URL, on
    # the start's terms (never an API key; a listed origin), then every check of any poll.
    elif await _finish(state, send, ctx, adopt_query_token(ctx, query, state.cors), endpoint):
        return None
    found = await _lookup(state, ctx, stream_id)
    if isinstance(found, LocalReply):
        await _finish(state, send, ctx, found, endpoint)
        return None
    ctx.stream = found
    raw_after = query.get("after")
    name = "after"
    if last_event_id:
        raw_after = ctx.headers.get("last-event-id", raw_after)
        name = "Last-Event-ID / after"
    after = parse_after(raw_after)
    if after is None:
        invalid = error_reply(
            400,
            f"{name} must be a non-negative integer.",
            param="after",
            code=error_codes.INVALID_AFTER,
        )
        await _finish(state, send, ctx, invalid, endpoint)
        return None
    if after < found.trimmed:
        await _finish(state, send, ctx, trimmed_reply(HistoryTrimmed(after, found.trimmed)),
                      endpoint)
        return None
    return ctx, found, after, query


async def read_stream(
    state: RouterState, scope: Scope, receive: Receive, send: Send, stream_id: str
) -> None:
    """``GET /v1/streams/{id}``: replay after ``Last-Event-ID`` (or ``?after``), then follow."""
    opened = await _open_stream(state, scope, send, stream_id, "stream", last_event_id=True)
    if opened is None:
        return
    ctx, found, after, _ = opened
    state.metrics.count("stream", "ok")
    headers = [*_common_headers(ctx), (STREAM_HEADER, found.id)]
    if found.upstream_ttft_ms is not None:  # else nothing to time: no empty header
        headers.append(("server-timing", ctx.server_timing(upstream_ttft=found.upstream_ttft_ms)))
    await stream_body(
        receive,
        send,
        200,
        headers,
        sse_events(
            found,
            after,
            heartbeat_s=state.config.limits.heartbeat_interval_s,
            clock=state.clock,
            direct=body_writer(scope),
            tally=state.metrics.sse_events,
        ),
        encoded=_SSE_HEADERS_ENCODED,
    )


async def poll_stream(
    state: RouterState, scope: Scope, receive: Receive, send: Send, stream_id: str
) -> None:
    """``GET /v1/streams/{id}/poll?after=N&wait=S``: a JSON batch (long-poll)."""
    opened = await _open_stream(state, scope, send, stream_id, "poll", last_event_id=False)
    if opened is None:
        return
    ctx, found, after, query = opened
    wait_s = _wait_param(state, query, default=10.0)
    if isinstance(wait_s, LocalReply):
        await _finish(state, send, ctx, wait_s, "poll")
        return
    try:
        batch = await poll(found, after, wait_s, clock=state.clock)
    except HistoryTrimmed as trimmed:  # trimmed while the poll waited
        await _finish(state, send, ctx, trimmed_reply(trimmed), "poll")
        return
    state.metrics.count("poll", "ok")
    await send_bytes(
        send,
        200,
        msgspec.json.encode(batch),
        headers=[
            *_common_headers(ctx),
            (STREAM_HEADER, found.id),
            ("cache-control", "no-cache"),
        ],
    )


async def models(state: RouterState, scope: Scope, receive: Receive, send: Send) -> None:
    """``GET /v1/models``: the models this region's backends serve (configured, or listed by
    them); with ``?peers=true`` also those of its peers with fresh status. No upstream is
    asked: the list is what routing goes by."""
    ctx = new_context(state, scope)
    if await _finish(state, send, ctx, authenticate(ctx, state.api_keys, state.tokens), "models"):
        return
    peers = _query(scope).get("peers", "").lower() in ("1", "true", "yes")
    names = state.routing.model_names(peers=peers)
    listing = ModelList(data=[Model(id=name, owned_by=state.config.region) for name in names])
    state.metrics.count("models", "ok")
    await send_bytes(send, 200, encode(listing), headers=_common_headers(ctx))


async def model(
    state: RouterState, scope: Scope, receive: Receive, send: Send, name: str
) -> None:
    """``GET /v1/models/{model}`` (the SDKs' ``models.retrieve``): the model object when this
    region or a peer with fresh status serves ``name``, else 404 ``model_not_found``."""
    ctx = new_context(state, scope)
    if await _finish(state, send, ctx, authenticate(ctx, state.api_keys, state.tokens), "models"):
        return
    if name not in state.routing.model_names(peers=True):
        state.metrics.count("models", "not_found")
        await reply(send, ctx, error_reply(
            404, f"The model {name[:200]!r} is not served in region {state.config.region} or"
                 " its peers; GET /v1/models lists the models served.",
            param="model", code=error_codes.MODEL_NOT_FOUND))
        return
    state.metrics.count("models", "ok")
    await send_bytes(send, 200, encode(Model(id=name, owned_by=state.config.region)),
                     headers=_common_headers(ctx))


_token_request = msgspec.json.Decoder(TokenRequest)
_origin = msgspec.json.Decoder(Origin)


def _parse_token_request(body: bytes) -> TokenRequest | LocalReply:
    try:
        request = _token_request.decode(body) if body.strip() else TokenRequest()
        if request.origin is not None:
            _origin.decode(msgspec.json.encode(request.origin))
    except msgspec.DecodeError as exc:
        return error_reply(400, f"Invalid token request: {exc}", code=error_codes.INVALID_REQUEST)
    return request


async def mint_token(state: RouterState, scope: Scope, receive: Receive, send: Send) -> None:
    """``POST /v1/edge/tokens``: a client token for the calling API key (never for a token)."""
    ctx = new_context(state, scope)
    try:
        body = await read_body(receive, 4096)
    except ClientGone:
        return
    outcome = authenticate(ctx, state.api_keys, state.tokens)
    if outcome is CONTINUE and ctx.by_client_token:
        outcome = error_reply(
            403,
            "A client token cannot mint tokens; the application's backend mints them with"
            " its API key.",
            "permission_error",
            code=error_codes.API_KEY_REQUIRED,
            outcome="forbidden",
        )
    if await _finish(state, send, ctx, outcome, "tokens"):
        return
    request = _parse_token_request(body)
    if isinstance(request, LocalReply):
        await _finish(state, send, ctx, request, "tokens")
        return
    grant = state.tokens.mint(
        ctx.owner, time.time(), request.ttl_s, request.origin,
        subject=request.subject, max_streams=request.max_streams,
    )
    state.metrics.count("tokens", "ok")
    await send_bytes(send, 200, encode(grant),
                     headers=[*_common_headers(ctx), ("cache-control", "no-store")])


async def healthz(state: RouterState, scope: Scope, receive: Receive, send: Send) -> None:
    """``GET /healthz``: 200 ``ok``; 503 ``draining`` (with ``Retry-After``) from SIGTERM on,
    ``state_unavailable`` (with ``Retry-After``) while the region's shared state does not
    answer (new requests get that 503), ``warming`` during the start-up warmup (requests are
    held meanwhile) or ``unhealthy`` when no backend is healthy; 200 ``ok; HTTP/3 down``
    while the HTTP/3 server is being restarted. No key: load balancers ask."""
    headers: Headers = ADVERTISED
    if state.draining:
        # The request refusal's Retry-After: a client (the SDKs' keep-warm) asking here is
        # told when to ask again as it would be on a request.
        status, text = 503, error_codes.DRAINING.encode() + b"\n"
        headers = (*ADVERTISED, ("retry-after", str(DRAINING_RETRY_AFTER_S)))
    elif state.region_state.unreachable:
        # As the requests' own 503: a balancer or the SDK sends users to a router or region
        # that can serve them, and asks again shortly.
        status, text = 503, error_codes.STATE_UNAVAILABLE.encode() + b"\n"
        headers = (*ADVERTISED, ("retry-after", str(RETRY_AFTER_S)))
    elif state.warming:
        status, text = 503, b"warming\n"
    elif state.healthy:
        # TCP serves: a load balancer keeps the process. A QUIC server being restarted is
        # said, not hidden (Alt-Svc is withheld meanwhile).
        down = state.http3 is not None and not state.http3.up
        status, text = 200, b"ok; HTTP/3 down\n" if down else b"ok\n"
    else:
        status, text = 503, b"unhealthy\n"
    # The SDKs' prewarm and keep-warm ask here: the answer says what request bodies go.
    await send_bytes(send, status, text, content_type="text/plain", headers=headers)


def _observer(state: RouterState, ctx: RequestContext) -> Outcome:
    """May this request see the region's load? The peer key, an API key or a metrics key
    (anyone when the router is anonymous: no API keys and no metrics keys)."""
    if state.routing.peer_authenticated(ctx):
        return CONTINUE
    return authenticate(ctx, state.observer_keys)


async def metrics(state: RouterState, scope: Scope, receive: Receive, send: Send) -> None:
    """``GET /metrics`` (Prometheus text), for a peer key, an API key or a metrics key."""
    outcome = _observer(state, new_context(state, scope))
    if isinstance(outcome, LocalReply):
        await reply(send, None, outcome)
        return
    text = state.metrics.render() + state.routing.render_metrics()
    await send_bytes(send, 200, text.encode(), content_type="text/plain; version=0.0.4")


async def edge_status(state: RouterState, scope: Scope, receive: Receive, send: Send) -> None:
    """``GET /v1/edge/status``: this region's load and warm prefixes, for peers and dashboards
    (:class:`~firstbyte.protocol.edge.EdgeStatusReport`).

    Without a key that may see it (:func:`_observer`) only what a client needs to find its
    regions (:class:`~firstbyte.protocol.edge.PublicEdgeStatus`).
    """
    # Unhealthy whenever /healthz is not ok for requests (503 draining, state_unavailable,
    # warming), in both documents: peers and the SDKs send requests elsewhere meanwhile.
    status = state.routing.status(
        unavailable=state.region_state.unreachable or state.warming
    )
    document: PublicEdgeStatus | EdgeStatusReport
    if isinstance(_observer(state, new_context(state, scope)), LocalReply):
        document = PublicEdgeStatus(
            region=status.region,
            healthy=status.healthy,
            public_url=status.public_url,
            latitude=status.latitude,
            longitude=status.longitude,
            peers=status.peers,
        )
    else:
        document = EdgeStatusReport(
            **msgspec.structs.asdict(status),
            streams=len(state.store),
            warm=state.routing.scheduler.registry(),
            time=time.time(),
        )
    await send_bytes(send, 200, encode(document), headers=[("cache-control", "no-cache")])


async def edge_timings(state: RouterState, scope: Scope, receive: Receive, send: Send) -> None:
    """``POST /v1/edge/timings``: an opted-in client's report of what its finished streams
    cost it (:mod:`firstbyte.protocol.timings`), added to the client histograms
    (:mod:`firstbyte.router.client_timings`); 202 ``{"accepted": N}``, or an error naming
    the reason."""
    ctx = new_context(state, scope)
    latency = state.client_latency
    settings = state.config.client_timings
    if not settings.enabled:
        latency.reject("disabled")
        await not_found(scope, send)
        return
    # An API key or a client token (a browser's): a record joins the streams of its key.
    authenticated = authenticate(ctx, state.api_keys, state.tokens)
    if await _finish(state, send, ctx, authenticated, "timings"):
        return
    owner = ctx.owner
    limited = state.report_limiter.take(owner, state.clock())
    if limited is not None:
        latency.reject("rate_limited")
        await _finish(state, send, ctx, refusal(limited), "timings")
        return
    limit = settings.max_report_bytes
    body = await _read_body(state, receive, send, ctx, limit, "timings")
    if body is None:
        return
    if len(body) > limit:
        latency.reject("too_large")
        too_large = error_reply(
            413, f"A timings report may hold {limit} bytes.", code=error_codes.REQUEST_TOO_LARGE
        )
        await _finish(state, send, ctx, too_large, "timings")
        return
    try:
        report = decode_report(body)
    except msgspec.DecodeError as exc:  # ValidationError included
        latency.reject("malformed")
        await _invalid_timings(state, send, ctx, f"Not a timings report: {exc}")
        return
    if latency.too_many(report):
        latency.reject("too_many_records")
        await _invalid_timings(
            state, send, ctx, f"A report may hold {latency.max_records} records."
        )
        return
    server_ttft: list[float | None] = []
    for record in report.records:
        found = None
        if record.stream_id is not None:
            with contextlib.suppress(StateUnavailable):  # judged without the server's TTFT
                found = await state.find_stream(record.stream_id, owner, ctx.reader_subject)
        server_ttft.append(None if found is None else found.upstream_ttft_ms)
    now = state.clock()
    refused = latency.refusal(report, server_ttft, owner, now)
    if refused is not None:
        reason, index = refused
        latency.reject(reason)
        await _invalid_timings(state, send, ctx, f"records[{index}]: {reason}.")
        return
    location = state.routing.locate(ctx, from_peer=False)
    latency.observe(report, location.country if location else None, server_ttft, owner, now)
    state.metrics.count("timings", "ok")
    ctx.outcome = "ok"
    accepted = msgspec.json.encode({"accepted": len(report.records)})
    await send_bytes(send, 202, accepted, headers=_common_headers(ctx))


async def _invalid_timings(
    state: RouterState, send: Send, ctx: RequestContext, message: str
) -> None:
    invalid = error_reply(400, message, param="records", code=error_codes.INVALID_TIMINGS)
    await _finish(state, send, ctx, invalid, "timings")


async def not_found(scope: Scope, send: Send, allowed: str | None = None) -> None:
    if allowed is not None:
        outcome = error_reply(
            405, f"Method not allowed; use {allowed}.", headers=(("allow", allowed),)
        )
    else:
        outcome = error_reply(
            404, f"No route for {scope.get('path', '')}.", code=error_codes.NOT_FOUND
        )
    await reply(send, None, outcome)
