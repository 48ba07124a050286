"""One access record per request, built in one place when the request is over.

A request is over when its response has been sent and, if it started a stream, when that
stream has finished (``[DONE]`` is in the store: the upstream completed, failed or was
cancelled). So a client that disconnects from an SSE stream, or a long-poll client whose
``POST /v1/streams`` was answered at once, still gets a line with the stream's tokens and
outcome. :class:`RequestLog` builds the :class:`AccessRecord` from the request context and
the stream, writes the line (its :class:`AccessLine`) on the ``firstbyte.access`` logger
(``info``; ``debug`` for the operational paths a load balancer, Prometheus or the peers ask
every second, whose record is not built at all where ``debug`` is off) and hands the record
to the trace exporter when one is configured and takes it (a sampled request); a request no
trace takes gets its line's fields made from the same values, without the record.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol, overload

import msgspec
from msgspec import UNSET, UnsetType

from firstbyte.protocol import paths
from firstbyte.protocol.codec import CHAT, Codec, event_data
from firstbyte.protocol.formats import BY_PATH

from ..asgi import Message, Receive, Scope, Send
from ..chunkpath import ELAPSED_MS
from ..streams import DONE_DATA, Stream
from .logs import key_id, struct_fields, subject_id, write_direct

if TYPE_CHECKING:
    from ..pipeline.context import RequestContext

__all__ = [
    "CONTEXT_KEY",
    "MAX_FIELD_CHARS",
    "AccessLine",
    "AccessRecord",
    "RequestLog",
    "SpanSink",
    "Usage",
    "bounded",
    "hundredths",
    "reply_usage",
    "stream_ending",
    "stream_usage",
]

log = logging.getLogger("firstbyte.access")

CONTEXT_KEY = "firstbyte.context"
"""The ASGI scope key under which the endpoints leave the request's context."""

MAX_FIELD_CHARS = 256
"""The most characters of a client-supplied string (model, path, method, ``Host``) an access
record keeps: a 900 KB model name made a 900 KB access line (and span) per request. A longer
value keeps its first characters and ends with :func:`bounded`'s marker."""

_OPERATIONAL = frozenset({paths.HEALTHZ, paths.METRICS, paths.EDGE_STATUS})
_OPERATIONAL_GETS = _OPERATIONAL | {paths.EDGE_WARM}
"""The paths on which a ``GET`` is operational (:meth:`RequestLog._write`'s test for a ``GET``;
it is the one method they answer)."""
_STARTS_STREAM = frozenset({*BY_PATH, paths.STREAMS})


class _Usage(msgspec.Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


class _Chunk(msgspec.Struct):
    model: str | None = None
    usage: _Usage | None = None


class _Error(msgspec.Struct):
    code: str | None = None


class _ErrorEvent(msgspec.Struct):
    error: _Error | None = None


_chunk = msgspec.json.Decoder(_Chunk)
_error = msgspec.json.Decoder(_ErrorEvent)


class Usage(msgspec.Struct, gc=False):
    """What a completion cost and who produced it, as far as the upstream said.

    A msgspec struct, built once a request: its ``__init__`` is C (as :class:`AccessRecord`)."""

    input_tokens: int | None = None
    output_tokens: int | None = None
    response_model: str | None = None
    outcome: str = "ok"
    """``ok``, or the code of the stream's error event (``upstream_error``, ``cancelled``...)."""


@overload
def bounded(value: str, limit: int = MAX_FIELD_CHARS) -> str: ...
@overload
def bounded(value: None, limit: int = MAX_FIELD_CHARS) -> None: ...
@overload
def bounded(value: str | None, limit: int = MAX_FIELD_CHARS) -> str | None: ...
def bounded(value: str | None, limit: int = MAX_FIELD_CHARS) -> str | None:
    """``value``, or its first ``limit`` characters and ``...[+N]`` saying how many more
    there were (so a truncated field is never mistaken for the client's own value)."""
    if value is None or len(value) <= limit:
        return value
    return f"{value[:limit]}...[+{len(value) - limit}]"


def hundredths(value: float) -> float:
    """``round(value, 2)``, the same float, without its decimal conversions where the answer
    is plain (~1.8k instructions a call: a dtoa, a snprintf and a strtod; twice a line).

    ``value * 100`` is within a 2**-17 of the exact value times 100 below 1e11, so where its
    fraction is clear of a half by 1e-4 the integer it rounds to is the one ``round`` rounds
    the exact value to, and that integer divided by 100 (both exact, the division correctly
    rounded) is the float nearest that decimal: ``round``'s answer. Near a half, zero or
    below, past 1e11 or not finite: ``round`` itself."""
    scaled = value * 100
    if 0.0 < scaled < 1e11:
        # The integer as a float (exact below 2**53, as its sum with 1), not an int: int()
        # parses its arguments, and a float's true division is an int's, correctly rounded.
        fraction = scaled % 1.0  # exact (fmod)
        if fraction < 0.4999:
            return (scaled - fraction) / 100
        if fraction > 0.5001:
            return (scaled - fraction + 1) / 100
    return round(value, 2)


def _no_shortcut(end: float, start: float) -> float | None:
    """None: where the compiled module is not there, :func:`hundredths` answers alone."""
    return None


_elapsed_ms: Callable[[float, float], float | None] = ELAPSED_MS or _no_shortcut
"""``round((end - start) * 1000, 2)`` where :func:`hundredths` would take its shortcut, in
one C call without a Python frame (twice a line), else None (or 0.0, which :func:`hundredths`
answers the same): a line's ``elapsed_ms(end, start) or hundredths((end - start) * 1000)``."""


def _decode_chunk(data: bytes) -> _Chunk | None:
    try:
        return _chunk.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def _model_and_error(first: bytes, last: bytes) -> tuple[str | None, str]:
    """A stream's model (from its first event, at its top or in its ``response`` or
    ``message``) and outcome (``ok``, or the code of its last event's error, in OpenAI's,
    Responses' or Anthropic's shape)."""
    model = None
    try:
        data: Any = msgspec.json.decode(event_data(first))
        inner = data.get("response") or data.get("message") or data
        model = inner.get("model") if isinstance(inner, dict) else None
    except (msgspec.DecodeError, AttributeError):
        pass
    outcome = "ok"
    if b'"error"' in last or b"response.failed" in last:
        try:
            data = msgspec.json.decode(event_data(last))
            error = data.get("error")
            if data.get("type") == "response.failed":
                error = (data.get("response") or {}).get("error") or {}
                outcome = str(error.get("code") or "upstream_error")
            elif isinstance(error, dict):
                outcome = str(error.get("code") or error.get("type") or "error")
            elif data.get("type") == "error":
                outcome = str(data.get("code") or "error")
        except (msgspec.DecodeError, AttributeError):
            outcome = "error"
    return (model if isinstance(model, str) else None), outcome


def stream_ending(
    first: bytes | None, last: bytes | None, codec: Codec = CHAT
) -> tuple[str | None, str]:
    """A stream's model (bounded) and outcome, from its first and last event payloads other
    than ``[DONE]`` (None: the stream has none): two events decoded at most, whatever the
    stream's length. Chat's: its first chunk's model, and ``ok`` or the code of a last
    ``{"error": ...}`` event."""
    model: str | None = None
    outcome = "ok"
    if codec is CHAT:  # in line, not in helpers: once a request, a call costs more than it
        if first is not None:
            try:
                model = _chunk.decode(first).model
            except (msgspec.DecodeError, msgspec.ValidationError):
                model = None
        if last is not None and last.startswith(b'{"error"'):
            try:
                error = _error.decode(last).error
            except (msgspec.DecodeError, msgspec.ValidationError):
                error = None
            outcome = (error.code if error is not None else None) or "error"
    elif first is not None and last is not None:
        model, outcome = _model_and_error(first, last)
    if model is not None and len(model) > MAX_FIELD_CHARS:
        model = bounded(model)
    return model, outcome


def stream_usage(events: Iterable[bytes], codec: Codec = CHAT) -> Usage:
    """The usage of a stream from its event payloads (``[DONE]`` included or not), in
    ``codec``'s format.

    Tokens come from the upstream's usage chunk when it sent one (``stream_options``
    ``include_usage``); otherwise the output is counted as content chunks, which is one
    token per chunk for vLLM-like servers (fewer chunks than tokens with speculative
    decoding). Cost: a byte search per event, a JSON decode of two. Where the tokens are
    known already (the relay read the usage chunk), :func:`stream_ending` alone says the rest.
    """
    payloads = [data for data in events if data != b"[DONE]"]
    first, last = (payloads[0], payloads[-1]) if payloads else (None, None)
    model, outcome = stream_ending(first, last, codec)
    if codec is not CHAT:
        tokens = codec.stream_usage(payloads)
        output = tokens.output_tokens if tokens is not None else None
        if output is None:
            output = sum(1 for data in payloads if codec.is_content(data))
        return Usage(
            input_tokens=tokens.input_tokens if tokens is not None else None,
            output_tokens=output,
            response_model=model,
            outcome=outcome,
        )
    usage: _Usage | None = None
    for data in reversed(payloads[-3:]):  # the usage chunk is last (or just before an error)
        if data.find(b'"usage":{') >= 0:
            decoded = _decode_chunk(data)
            usage = decoded.usage if decoded is not None else None
            break
    if usage is not None and usage.completion_tokens is not None:
        output = usage.completion_tokens
    else:
        # ``find``, not ``in``: ``bytes in bytes`` first tries its operand as an int and
        # makes (and drops) a TypeError, several times the cost of the search, per event.
        output = sum(
            1
            for data in payloads
            if data.find(b'"content":"') >= 0 and data.find(b'"content":""') < 0
        )
    return Usage(
        input_tokens=usage.prompt_tokens if usage is not None else None,
        output_tokens=output,
        response_model=model,
        outcome=outcome,
    )


def _stored_ends(stream: Stream) -> tuple[bytes | None, bytes | None]:
    """The first and last payloads other than ``[DONE]`` (only ever last) of the events
    ``stream`` holds; None for both if it holds no other."""
    events = stream.events
    end = len(events)
    if end and events[-1].data == b"[DONE]":
        end -= 1
    if end == 0:
        return None, None
    return events[0].data, events[end - 1].data


def reply_usage(body: bytes, codec: Codec = CHAT) -> Usage:
    """The usage of a non-streamed completion from its JSON body (empty if there is none)."""
    if codec is not CHAT:
        tokens = codec.usage(body) if body.startswith(b"{") else None
        model, _ = _model_and_error(body, b"")
        if tokens is None:
            return Usage(response_model=bounded(model))
        return Usage(tokens.input_tokens, tokens.output_tokens, bounded(model))
    decoded = _decode_chunk(body) if body.startswith(b"{") else None
    if decoded is None:
        return Usage()
    usage = decoded.usage or _Usage()
    return Usage(usage.prompt_tokens, usage.completion_tokens, bounded(decoded.model))


class AccessRecord(msgspec.Struct, gc=False):
    """Everything logged (and traced) about one request. Times are ``perf_counter`` seconds.

    A msgspec struct: built once a request from 36 values, which a dataclass's ``__init__``
    matches one by one in Python (~47k instructions for the record; a frozen one also sets
    each field through ``object.__setattr__``), msgspec's in C. :meth:`RequestLog.record`
    passes them by position, in this order (keywords cost msgspec ~0.4k instructions each)."""

    request_id: str
    """The router's span id for the request (the one in the ``traceparent`` it sent on)."""
    trace_id: str
    caller_span_id: str | None
    sampled: bool
    key_id: str | None
    usage_key: str | None
    """The key's label on the usage metrics (``[[auth.keys]] usage_label``, or ``other``)."""
    subject_id: str | None
    """A digest of the request's subject (its end user), when it named one."""
    region: str
    """The region that served (a peer's, when forwarded or spilled)."""
    entry_region: str
    """This router's region."""
    spill: bool
    route_reason: str
    """Why the request left its first choice (``first_token_deadline``...), or empty."""
    client_city: str | None
    client_country: str | None
    backend: str | None
    backend_url: str | None
    transport: str
    http_version: str
    method: str
    path: str
    status: int | None
    outcome: str
    stream: str | None
    model: str | None
    max_tokens: int | None
    usage: Usage
    client_gone: bool
    server_address: str | None
    started_at: float
    admitted_at: float | None
    routed_at: float | None
    upstream_sent_at: float | None
    first_token_at: float | None
    ended_at: float
    endpoint: str | None = None
    """The API the request called, as its codec names it (``chat``, ``completions``,
    ``responses``, ``messages``, ``embeddings``); None for the others (reads, status)."""
    upstream_error: str | None = None
    """The last failure of its upstream requests (:attr:`RequestContext.upstream_error`),
    even one it failed over from; None when there was none."""
    error_code: str | None = None
    """The code of the router's own refusal (``key_rate_limited``, ...); None otherwise."""

    @property
    def ttft_ms(self) -> float | None:
        """Request received to first content chunk from upstream."""
        if self.first_token_at is None:
            return None
        return (self.first_token_at - self.started_at) * 1000

    @property
    def duration_ms(self) -> float:
        return (self.ended_at - self.started_at) * 1000

    def fields(self) -> dict[str, Any]:
        """The access line's fields (no key, no prompt; ``key_id`` is a digest)."""
        return struct_fields(self.line_fields())

    def line_fields(self) -> AccessLine:
        """:meth:`fields` as a struct (the members a line leaves out are ``UNSET``): the JSON
        line encodes it without a dict, its names encoded once (:func:`.logs.write_direct`)."""
        first_token_at = self.first_token_at  # ttft_ms and duration_ms, without their calls
        started_at = self.started_at
        spill = self.spill
        route_reason = self.route_reason
        shows_route = spill or route_reason
        usage = self.usage
        subject_id, upstream_error, error_code = (
            self.subject_id, self.upstream_error, self.error_code)
        # Positional, in AccessLine's order: a keyword costs msgspec a match each.
        return AccessLine(
            self.request_id,
            self.trace_id,
            self.key_id,
            self.usage_key,
            self.region,
            self.entry_region,
            self.backend,
            self.transport,
            self.http_version,
            self.method,
            self.path,
            self.endpoint,
            self.status,
            None if first_token_at is None else (
                _elapsed_ms(first_token_at, started_at)
                or hundredths((first_token_at - started_at) * 1000)),
            (_elapsed_ms(self.ended_at, started_at)
             or hundredths((self.ended_at - started_at) * 1000)),
            usage.input_tokens,
            usage.output_tokens,
            self.outcome,
            self.model,
            self.stream,
            self.client_city,
            self.client_country,
            UNSET if subject_id is None else subject_id,
            spill if shows_route else UNSET,
            route_reason if shows_route else UNSET,
            True if self.client_gone else UNSET,
            UNSET if upstream_error is None else upstream_error,
            UNSET if error_code is None else error_code,
        )


class AccessLine(msgspec.Struct, gc=False):
    """The access line's fields in their order (:meth:`AccessRecord.fields`); a member the
    line leaves out is ``UNSET`` (msgspec omits it)."""

    request_id: str
    trace_id: str
    key_id: str | None
    usage_key: str | None
    region: str
    entry_region: str
    backend: str | None
    transport: str
    http_version: str
    method: str
    path: str
    endpoint: str | None
    status: int | None
    ttft_ms: float | None
    duration_ms: float
    input_tokens: int | None
    output_tokens: int | None
    outcome: str
    model: str | None
    stream: str | None
    client_city: str | None
    client_country: str | None
    subject_id: str | UnsetType = UNSET
    """Only when the request named a subject."""
    spill: bool | UnsetType = UNSET
    """``spill`` and ``route_reason`` only when it spilled or has a reason."""
    route_reason: str | UnsetType = UNSET
    client_gone: bool | UnsetType = UNSET
    """Only when true."""
    upstream_error: str | UnsetType = UNSET
    error_code: str | UnsetType = UNSET


class SpanSink(Protocol):
    """Where finished requests go as traces (:class:`.traces.OtlpTraces`)."""

    def export(self, record: AccessRecord) -> None: ...

    async def aclose(self) -> None: ...


class _Exchange(msgspec.Struct, gc=False):
    """What the ASGI layer saw of one HTTP request (a Struct: its ``__init__`` is C)."""

    method: str
    path: str
    http_version: str
    started_at: float
    status: int | None = None
    complete: bool = False


def _transport(path: str, ctx: RequestContext | None, websocket: bool) -> str:
    if websocket:
        return "websocket"
    if path in BY_PATH:
        return "sse" if ctx is not None and ctx.stream_requested else "json"
    if path == paths.STREAMS or path.endswith("/poll"):
        return "longpoll"
    if path.startswith(paths.STREAMS + "/"):
        return "sse"
    return "http"


_STREAM_PATH = paths.STREAMS + "/"


def _path_template(path: str) -> str:
    """The path with a stream id replaced by ``{id}``, found or not: a found stream's id is
    logged as ``stream``; an id no stream of the key has (a mistake, a guess, another key's)
    is the client's text, not kept."""
    if path.startswith(_STREAM_PATH):
        _, slash, rest = path[len(_STREAM_PATH):].partition("/")
        return f"{_STREAM_PATH}{{id}}{slash}{rest}"
    return path


def _host(url: str | None) -> str | None:
    if not url:
        return None
    rest = url.split("://", 1)[-1]
    return rest.split("/", 1)[0] or None


class RequestLog:
    """Writes each request's access line (and trace) once the request is over."""

    def __init__(
        self,
        region: str,
        spans: SpanSink | None = None,
        clock: Callable[[], float] = time.perf_counter,
        usage_key: Callable[[bytes], str] | None = None,
    ) -> None:
        self.region = region
        self.spans = spans
        self.clock = clock
        self.usage_key = usage_key
        """Owner digest -> usage label (:meth:`.usage.UsageMeter.label`)."""
        self._waiting: set[asyncio.Task[None]] = set()

    @property
    def enabled(self) -> bool:
        """Is anything listening (the access logger at ``debug``/``info``, or traces)?"""
        return self.spans is not None or log.isEnabledFor(logging.INFO)

    async def serve(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        handler: Callable[[Scope, Receive, Send], Awaitable[None]],
    ) -> None:
        """Run ``handler`` for one HTTP request and record it when it is over: :meth:`watch`,
        the handler, then :meth:`finish` (which the app calls itself, in its own coroutine)."""
        watching = self.watch(scope, send)
        if watching is None:
            await handler(scope, receive, send)
            return
        exchange, watched = watching
        try:
            await handler(scope, receive, watched)
        finally:
            self.finish(exchange, scope.get(CONTEXT_KEY))

    def watch(self, scope: Scope, send: Send) -> tuple[_Exchange, Send] | None:
        """The start of :meth:`serve` for an HTTP request: the exchange that will be recorded
        and the ``send`` to hand the handler in place of ``send`` (it notes the status and
        the body's end), or None if nothing will be recorded (run the handler with ``send``).
        A plain call, not a coroutine around the handler: the app awaits the handler in its
        own, one coroutine frame less on each of the request's resumptions. The caller
        calls :meth:`finish` with the exchange and the scope's context when the handler is
        over, however it ends."""
        if self.spans is None and not log.isEnabledFor(logging.INFO):  # not self.enabled
            return None
        method, path = scope.get("method", "GET"), scope.get("path", "")
        # An operational request (a balancer's probe, a scrape, every second) is written at
        # debug and never traced (_write): below debug nothing would come of its record, so
        # none is built (40-60k instructions each). _write's test for a GET, on the same
        # values; the method first, a string compare, so that a POST (every completion) pays
        # no set lookup. Another method's 405 on those paths is rare: built, and not written.
        if (method == "GET" and path in _OPERATIONAL_GETS
                and not log.isEnabledFor(logging.DEBUG)):
            return None
        exchange = _Exchange(method, path, scope.get("http_version", "1.1"), self.clock())

        # send's own awaitable, returned, not awaited in a coroutine of this one's: two
        # coroutines (a head, a body's end) a request less. The caller awaits it at once.
        def watched(message: Message) -> Awaitable[None]:
            kind = message["type"]
            if kind == "http.response.start":
                exchange.status = message["status"]
            elif kind == "http.response.body" and not message.get("more_body", False):
                exchange.complete = True
            return send(message)

        return exchange, watched

    def stream_started(self, ctx: RequestContext) -> None:
        """A WebSocket ``request`` message started ``ctx.stream``: record it when it ends."""
        if not self.enabled:
            return
        exchange = _Exchange("WS", paths.WEBSOCKET, ctx.http_version, ctx.received_at, None, True)
        self.finish(exchange, ctx, True)

    def finish(
        self, exchange: _Exchange, ctx: RequestContext | None, websocket: bool = False
    ) -> None:
        """The end of :meth:`serve` (and of a WebSocket's stream): ``exchange``, whose
        context is ``ctx`` (the scope's :data:`CONTEXT_KEY`; None: no pipeline ran), is over;
        its line is written now, or when the stream it started ends."""
        # The stream this request started in this process (its tokens are this request's),
        # or None: a request that read a stream, or started none.
        stream = ctx.stream if ctx is not None else None
        if not isinstance(stream, Stream) or not (
                websocket or exchange.path in _STARTS_STREAM):
            stream = None
        # finished_at, not the done property: one call less a request.
        if stream is None or stream.finished_at is not None or stream.evicted:
            self._write(exchange, ctx, websocket, self.clock(), stream)
            return
        task = asyncio.ensure_future(self._after(stream, exchange, ctx, websocket))
        self._waiting.add(task)
        task.add_done_callback(self._waiting.discard)

    async def _after(
        self, stream: Stream, exchange: _Exchange, ctx: RequestContext | None, websocket: bool
    ) -> None:
        try:
            while not stream.done and not stream.evicted:
                await stream.wait(stream.last_seq, None)
        finally:  # at shutdown: the line as it stands
            self._write(exchange, ctx, websocket, self.clock(), stream)

    def _write(
        self, exchange: _Exchange, ctx: RequestContext | None, websocket: bool, ended_at: float,
        stream: Stream | None,
    ) -> None:
        # A page keeping its connection warm asks GET /v1/edge/warm every 20 s: debug too (a
        # prompt warm-up, its POST, spends tokens and is logged as any request). watch()
        # makes the same test to build no record where this would write none.
        operational = exchange.path in _OPERATIONAL or (
            exchange.path == paths.EDGE_WARM and exchange.method == "GET")
        # Not the operational requests either: a scrape and each peer's poll every second
        # would be a trace a second each, as they would be a line (debug only, below).
        spans = self.spans
        traced = spans is not None and ctx is not None and not operational and (
            ctx.traceparent.sampled)
        level = logging.DEBUG if operational else logging.INFO
        record: AccessRecord | None = None
        if traced:
            record = self.record(exchange, ctx, websocket, ended_at, stream)
        if log.isEnabledFor(level):
            # Without a trace, the line's fields alone: no record made to be read once.
            line = (record.line_fields() if record is not None
                    else self._make(exchange, ctx, websocket, ended_at, stream, False, True))
            assert isinstance(line, AccessLine)
            if not write_direct(log, level, f"{line.method} {line.path} {line.status}", line):
                # Logger.log without its findCaller (a walk up the stack, once a request): the
                # record says where it comes from by its logger's name, not a line.
                log.handle(log.makeRecord(
                    log.name, level, __file__, 0, "%s %s %s",
                    (line.method, line.path, line.status), None,
                    extra={"fields": struct_fields(line)},
                ))
        if record is not None and spans is not None:
            spans.export(record)

    def record(
        self, exchange: _Exchange, ctx: RequestContext | None, websocket: bool, ended_at: float,
        stream: Stream | None,
    ) -> AccessRecord:
        """The access record of a finished request (``ctx`` None: no pipeline ran) that
        produced ``stream`` (started in this process: its tokens are this request's)."""
        record = self._make(exchange, ctx, websocket, ended_at, stream, True, False)
        assert isinstance(record, AccessRecord)
        return record

    def _make(
        self, exchange: _Exchange, ctx: RequestContext | None, websocket: bool, ended_at: float,
        stream: Stream | None, traced: bool, line: bool,
    ) -> AccessRecord | AccessLine:
        """:meth:`record`, or with ``line`` its :meth:`~AccessRecord.line_fields` made
        without it. Unless ``traced`` (the record goes to the trace exporter), a chat
        stream's ``usage.response_model``, which only a trace says, is not read (None)."""
        status = exchange.status
        path = exchange.path
        if ctx is None:
            bare = self._bare_record(exchange, websocket, ended_at)
            return bare.line_fields() if line else bare
        # From here on ctx is there: one test of it, not one a field.
        if stream is not None:
            codec = ctx.codec
            if stream.usage is not None:  # the relay's (its usage chunk may be dropped)
                # Tokens known: no pass over the events, a JSON decode of two at most.
                # _stored_ends in line (once a request, the call costs more than its work).
                events = stream.events
                end = len(events)
                if end and events[-1].data == DONE_DATA:
                    end -= 1
                if end and not traced and codec is CHAT:
                    # A chat stream's first event is decoded for its model only, which only
                    # a trace says: not for a line alone (a JSON decode a request). Then
                    # stream_ending's answer is (None, "ok") unless its last event is an
                    # error: its call (a frame and a tuple) only for that one.
                    last = events[end - 1].data
                    if last.startswith(b'{"error"'):
                        model, ended = stream_ending(None, last, codec)
                    else:
                        model, ended = None, "ok"
                elif end:
                    model, ended = stream_ending(
                        events[0].data if traced or codec is not CHAT else None,
                        events[end - 1].data, codec)
                else:
                    model, ended = stream_ending(None, None, codec)
                usage = Usage(stream.usage.input_tokens, stream.usage.output_tokens,
                              model, ended)
            else:
                usage = stream_usage((event.data for event in stream.events), codec)
            if stream.evicted and not stream.done:
                usage = Usage(usage.input_tokens, usage.output_tokens, usage.response_model,
                              "evicted")
        elif ctx.usage is not None:
            usage = ctx.usage
        else:
            usage = Usage(outcome="")
        outcome = ctx.outcome or usage.outcome
        if not outcome:
            outcome = "ok" if status is not None and status < 400 else "error"
        backend = ctx.backend
        request = ctx.request
        trace = ctx.traceparent
        touched = ctx.stream  # started or read
        # The multi-region stage's records (router.multiregion.Observation, geo.Location).
        observer = ctx.observer
        if observer is not None:
            spill = bool(getattr(observer, "spill", False))
            reason = getattr(observer, "reason", "")
        else:
            spill, reason = False, ""
        location = ctx.location
        if location is not None:
            city, country = getattr(location, "city", None), getattr(location, "country", None)
        else:
            city = country = None
        # Client-supplied strings are bounded; each is tested here and bounded() called only
        # for one past the bound (six calls a request otherwise, nearly always of nothing).
        if path.startswith(_STREAM_PATH):
            path = _path_template(path)
        method, http_version = exchange.method, exchange.http_version
        model = request.model if request is not None else None
        # server_address is the record's only (bounded alone: bounded() bounds each value by
        # itself), not a line's: not read for a line.
        host = None if line else ctx.headers.get("host")
        if (len(path) > MAX_FIELD_CHARS or len(method) > MAX_FIELD_CHARS
                or len(http_version) > MAX_FIELD_CHARS
                or (model is not None and len(model) > MAX_FIELD_CHARS)
                or (host is not None and len(host) > MAX_FIELD_CHARS)):
            path, method, http_version = bounded(path), bounded(method), bounded(http_version)
            model, host = bounded(model), bounded(host)
        # _transport in line, with ctx known to be there.
        if websocket:
            transport = "websocket"
        elif exchange.path in BY_PATH:
            transport = "sse" if ctx.stream_requested else "json"
        else:
            transport = _transport(exchange.path, ctx, websocket)
        started_at, received_at = exchange.started_at, ctx.received_at
        if received_at < started_at:  # min(), without its call
            started_at = received_at
        upstream_error = ctx.upstream_error
        api_key = ctx._api_key
        # The digests only of what is there (an anonymous request has no key), each worked
        # out once per key and subject (key_id's and subject_id's caches). The key is read
        # from its field, not through the api_key descriptor: a call less. A client token's
        # request has no key: its key's id came with the token's check.
        the_key_id = (key_id(api_key) if api_key
                      else ctx.token_key_id if ctx._token_owner is not None else None)
        usage_key = (self.usage_key(ctx.owner)
                     if self.usage_key is not None and request is not None else None)
        the_subject_id = subject_id(ctx.subject) if ctx.subject else None
        route_reason = str(reason or ctx.route_reason)
        endpoint = ctx.codec.name if request is not None else None
        stream_id = touched.id if touched is not None else None
        first_token_at = ctx.first_token_at
        error_code = ctx.error_code
        if line:
            # AccessRecord.line_fields of the record these values make, without the record
            # (no trace takes it): the same values, the same members left out.
            shows_route = spill or route_reason
            return AccessLine(
                trace.parent_id,  # request_id
                trace.trace_id,  # trace_id
                the_key_id,  # key_id
                usage_key,  # usage_key
                ctx.region or self.region,  # region
                self.region,  # entry_region
                getattr(backend, "name", None),  # backend
                transport,  # transport
                http_version,  # http_version
                method,  # method
                path,  # path
                endpoint,  # endpoint
                status,  # status
                (None if first_token_at is None  # ttft_ms
                 else _elapsed_ms(first_token_at, started_at)
                 or hundredths((first_token_at - started_at) * 1000)),
                (_elapsed_ms(ended_at, started_at)  # duration_ms
                 or hundredths((ended_at - started_at) * 1000)),
                usage.input_tokens,  # input_tokens
                usage.output_tokens,  # output_tokens
                outcome,  # outcome
                model,  # model
                stream_id,  # stream
                city,  # client_city
                country,  # client_country
                UNSET if the_subject_id is None else the_subject_id,  # subject_id
                spill if shows_route else UNSET,  # spill
                route_reason if shows_route else UNSET,  # route_reason
                UNSET if exchange.complete else True,  # client_gone
                bounded(upstream_error) if upstream_error else UNSET,  # upstream_error
                UNSET if error_code is None else error_code,  # error_code
            )
        # Positional, in the fields' order (the comments name them): msgspec matched these
        # 36 keywords to fields at ~16k instructions a record, the positions cost ~6k.
        return AccessRecord(
            trace.parent_id,  # request_id
            trace.trace_id,  # trace_id
            trace.caller_id,  # caller_span_id
            trace.sampled,  # sampled
            the_key_id,  # key_id
            usage_key,  # usage_key
            the_subject_id,  # subject_id
            ctx.region or self.region,  # region
            self.region,  # entry_region
            spill,  # spill
            route_reason,  # route_reason
            city,  # client_city
            country,  # client_country
            getattr(backend, "name", None),  # backend
            getattr(backend, "url", None),  # backend_url
            transport,  # transport
            http_version,  # http_version
            method,  # method
            path,  # path
            status,  # status
            outcome,  # outcome
            stream_id,  # stream
            model,  # model
            request.output_limit if request is not None else None,  # max_tokens
            usage,  # usage
            not exchange.complete,  # client_gone
            host,  # server_address
            started_at,  # started_at
            ctx.admitted_at,  # admitted_at
            ctx.routed_at,  # routed_at
            ctx.upstream_sent_at,  # upstream_sent_at
            first_token_at,  # first_token_at
            ended_at,  # ended_at
            endpoint,  # endpoint
            bounded(upstream_error) if upstream_error else None,  # upstream_error
            error_code,  # error_code
        )

    def _bare_record(self, exchange: _Exchange, websocket: bool, ended_at: float) -> AccessRecord:
        """:meth:`record` of a request no pipeline ran for (no context, so no stream)."""
        status = exchange.status
        path = exchange.path
        if path.startswith(_STREAM_PATH):
            path = _path_template(path)
        return AccessRecord(
            request_id="",
            trace_id="",
            caller_span_id=None,
            sampled=False,
            key_id=None,
            usage_key=None,
            subject_id=None,
            region=self.region,
            entry_region=self.region,
            spill=False,
            route_reason="",
            client_city=None,
            client_country=None,
            backend=None,
            backend_url=None,
            transport=_transport(exchange.path, None, websocket),
            # Each bounded alone: the same as bounding all when one is past the bound.
            http_version=bounded(exchange.http_version),
            method=bounded(exchange.method),
            path=bounded(path),
            status=status,
            outcome="ok" if status is not None and status < 400 else "error",
            stream=None,
            model=None,
            max_tokens=None,
            usage=Usage(outcome=""),
            client_gone=not exchange.complete,
            server_address=None,
            started_at=exchange.started_at,
            admitted_at=None,
            routed_at=None,
            upstream_sent_at=None,
            first_token_at=None,
            ended_at=ended_at,
        )

    async def aclose(self) -> None:
        """Write what is still waiting for its stream (as it stands), then close the traces."""
        for task in list(self._waiting):
            task.cancel()
        await asyncio.gather(*self._waiting, return_exceptions=True)
        if self.spans is not None:
            await self.spans.aclose()
