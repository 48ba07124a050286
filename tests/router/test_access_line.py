"""The access line's exact bytes, in both formats, for the requests a router sees: a streamed
completion with everything known, a refusal, a read of a stream, a stream evicted before its
end, a request no pipeline ran for; and the record the trace exporter gets. The line is an
interface (operators parse it): these pin its keys, their order and their values, so a change
made for speed is seen to give the same line."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import struct
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgspec
import pytest

from firstbyte.protocol.openai import ChatCompletionRequest, Message
from firstbyte.router.geo import GeoPoint, Location
from firstbyte.router.observability import logs
from firstbyte.router.observability.access import (
    CONTEXT_KEY,
    AccessRecord,
    RequestLog,
    Usage,
    hundredths,
)
from firstbyte.router.observability.logs import LogFormat
from firstbyte.router.observability.usage import TokenUsage
from firstbyte.router.pipeline.backend import Backend
from firstbyte.router.pipeline.context import RequestContext, Traceparent
from firstbyte.router.streams import Stream, StreamEvent
from tests.router.test_logs import configured

NOW = 1_700_000_000.25
"""``time.time()`` as each line is written."""


@dataclass
class _Observation:
    spill: bool
    reason: str


class _Spans:
    def __init__(self) -> None:
        self.records: list[AccessRecord] = []

    def export(self, record: AccessRecord) -> None:
        self.records.append(record)

    async def aclose(self) -> None:
        pass


def _clock(*values: float) -> Any:
    readings: Iterator[float] = iter(values)
    return lambda: next(readings)


def _chunk(content: str) -> bytes:
    return (
        b'{"id":"c1","object":"chat.completion.chunk","model":"served-m","choices":[{"index":0,'
        b'"delta":{"content":"' + content.encode() + b'"}}]}'
    )


def _stream(*payloads: bytes, done: bool = True, usage: TokenUsage | None = None) -> Stream:
    events = [StreamEvent(seq, data) for seq, data in enumerate(payloads, 1)]
    if done:
        events.append(StreamEvent(len(events) + 1, b"[DONE]"))
    return Stream(
        "strm-1", b"owner", 1.0, events=events, finished_at=2.0 if done else None, usage=usage
    )


def _request(model: str = "m", max_tokens: int | None = 64) -> ChatCompletionRequest:
    return ChatCompletionRequest(model, [Message("user", "hi")], stream=True, max_tokens=max_tokens)


def _streamed() -> RequestContext:
    """A streamed chat completion with everything an access line can say."""
    ctx = RequestContext(
        "POST",
        "/v1/chat/completions",
        {"host": "router.example", "authorization": "Bearer k"},
        http_version="1.1",
        received_at=10.0,
    )
    ctx.api_key = "sk-test-key"
    ctx.subject = "user-7"
    ctx.request = _request()
    ctx.stream_requested = True
    ctx.traceparent = Traceparent(
        "4bf92f3577b34da6a3ce929d0e0e4736", "a1b2c3d4e5f60718", "01", "00f067aa0ba902b7"
    )
    ctx.backend = Backend("gpu-a", "http://10.0.0.5:8000/v1")
    ctx.region = "eu-2"
    ctx.admitted_at, ctx.routed_at = 10.001, 10.002
    ctx.upstream_sent_at, ctx.first_token_at = 10.003, 10.0523
    ctx.location = Location(GeoPoint(48.1, 11.6), "Munich", "DE")
    ctx.observer = _Observation(True, "first_token_deadline")  # type: ignore[assignment]
    ctx.upstream_error = "ReadTimeout: timed out"
    ctx.outcome = "ok"
    ctx.model_label = "m"
    ctx.stream = _stream(_chunk(""), _chunk("a"), _chunk("b"), usage=TokenUsage(11, 2))
    return ctx


def _refused() -> RequestContext:
    """A refusal before routing, of a model name past the bound."""
    ctx = RequestContext("POST", "/v1/chat/completions", {}, received_at=20.0)
    ctx.traceparent = Traceparent("0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331", "00")
    ctx.request = _request("x" * 300, None)
    ctx.outcome = "rejected"
    ctx.error_code = "key_rate_limited"
    ctx.usage = Usage(outcome="")
    return ctx


def _read() -> RequestContext:
    """A read of another request's stream (it is not this request's: no tokens)."""
    ctx = RequestContext("GET", "/v1/streams/strm-1", {}, http_version="2", received_at=30.0)
    ctx.traceparent = Traceparent("0af7651916cd43dd8448eb211c80319c", "c7ad6b7169203331")
    ctx.stream = _stream(_chunk("a"))
    ctx.region = "eu-1"
    return ctx


def _evicted() -> RequestContext:
    """A long-poll stream evicted before its end, its tokens counted from its events."""
    ctx = RequestContext("POST", "/v1/streams", {}, received_at=40.0)
    ctx.traceparent = Traceparent("0af7651916cd43dd8448eb211c80319c", "d7ad6b7169203331")
    ctx.request = _request()
    ctx.backend = Backend("gpu-b", "http://10.0.0.6:8000")
    ctx.first_token_at = 40.25
    stream = _stream(
        _chunk(""),
        _chunk("a"),
        _chunk("b"),
        b'{"error":{"message":"x","code":"upstream_eof"}}',
        done=False,
    )
    stream.evicted = True
    ctx.stream = stream
    return ctx


async def _serve(
    request_log: RequestLog,
    path: str,
    ctx: RequestContext | None,
    status: int,
    *,
    complete: bool = True,
    method: str | None = None,
) -> None:
    scope: dict[str, Any] = {
        "type": "http",
        "method": method or (ctx.method if ctx else "GET"),
        "path": path,
        "http_version": ctx.http_version if ctx else "1.1",
    }
    sent: list[dict[str, Any]] = []

    async def send(message: Any) -> None:
        sent.append(message)

    async def receive() -> Any:
        return {"type": "http.disconnect"}

    async def handler(scope: Any, receive: Any, send: Any) -> None:
        if ctx is not None:
            scope[CONTEXT_KEY] = ctx
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": b"x", "more_body": not complete})

    await request_log.serve(scope, receive, send, handler)
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]


JSON_LINES = [
    '{"time":"2023-11-14T22:13:20.250Z","level":"info","logger":"firstbyte.access","msg":"POST /v1/chat/completions 200","request_id":"a1b2c3d4e5f60718","trace_id":"4bf92f3577b34da6a3ce929d0e0e4736","key_id":"b92d22615001","usage_key":"team-a","region":"eu-2","entry_region":"eu-1","backend":"gpu-a","transport":"sse","http_version":"1.1","method":"POST","path":"/v1/chat/completions","endpoint":"chat","status":200,"ttft_ms":52.3,"duration_ms":1250.5,"input_tokens":11,"output_tokens":2,"outcome":"ok","model":"m","stream":"strm-1","client_city":"Munich","client_country":"DE","subject_id":"4ff4c7354d44","spill":true,"route_reason":"first_token_deadline","upstream_error":"ReadTimeout: timed out"}\n',
    '{"time":"2023-11-14T22:13:20.250Z","level":"info","logger":"firstbyte.access","msg":"POST /v1/chat/completions 429","request_id":"b7ad6b7169203331","trace_id":"0af7651916cd43dd8448eb211c80319c","key_id":null,"usage_key":"team-a","region":"eu-1","entry_region":"eu-1","backend":null,"transport":"json","http_version":"1.1","method":"POST","path":"/v1/chat/completions","endpoint":"chat","status":429,"ttft_ms":null,"duration_ms":0.75,"input_tokens":null,"output_tokens":null,"outcome":"rejected","model":"'
    + "x" * 256
    + '...[+44]","stream":null,"client_city":null,"client_country":null,"error_code":"key_rate_limited"}\n',
    '{"time":"2023-11-14T22:13:20.250Z","level":"info","logger":"firstbyte.access","msg":"GET /v1/streams/{id} 200","request_id":"c7ad6b7169203331","trace_id":"0af7651916cd43dd8448eb211c80319c","key_id":null,"usage_key":null,"region":"eu-1","entry_region":"eu-1","backend":null,"transport":"sse","http_version":"2","method":"GET","path":"/v1/streams/{id}","endpoint":null,"status":200,"ttft_ms":null,"duration_ms":3000.0,"input_tokens":null,"output_tokens":null,"outcome":"ok","model":null,"stream":"strm-1","client_city":null,"client_country":null}\n',
    '{"time":"2023-11-14T22:13:20.250Z","level":"info","logger":"firstbyte.access","msg":"POST /v1/streams 200","request_id":"d7ad6b7169203331","trace_id":"0af7651916cd43dd8448eb211c80319c","key_id":null,"usage_key":"team-a","region":"eu-1","entry_region":"eu-1","backend":"gpu-b","transport":"longpoll","http_version":"1.1","method":"POST","path":"/v1/streams","endpoint":"chat","status":200,"ttft_ms":250.0,"duration_ms":500.0,"input_tokens":null,"output_tokens":2,"outcome":"evicted","model":"m","stream":"strm-1","client_city":null,"client_country":null,"client_gone":true}\n',
    '{"time":"2023-11-14T22:13:20.250Z","level":"info","logger":"firstbyte.access","msg":"GET /nowhere 404","request_id":"","trace_id":"","key_id":null,"usage_key":null,"region":"eu-1","entry_region":"eu-1","backend":null,"transport":"http","http_version":"1.1","method":"GET","path":"/nowhere","endpoint":null,"status":404,"ttft_ms":null,"duration_ms":2.0,"input_tokens":null,"output_tokens":null,"outcome":"error","model":null,"stream":null,"client_city":null,"client_country":null}\n',
]

TEXT_LINES = [
    "2023-11-14T22:13:20.250Z INFO firstbyte.access: POST /v1/chat/completions 200 request_id=a1b2c3d4e5f60718 trace_id=4bf92f3577b34da6a3ce929d0e0e4736 key_id=b92d22615001 usage_key=team-a region=eu-2 entry_region=eu-1 backend=gpu-a transport=sse http_version=1.1 method=POST path=/v1/chat/completions endpoint=chat status=200 ttft_ms=52.3 duration_ms=1250.5 input_tokens=11 output_tokens=2 outcome=ok model=m stream=strm-1 client_city=Munich client_country=DE subject_id=4ff4c7354d44 spill=True route_reason=first_token_deadline upstream_error=ReadTimeout: timed out\n",
    "2023-11-14T22:13:20.250Z INFO firstbyte.access: POST /v1/chat/completions 429 request_id=b7ad6b7169203331 trace_id=0af7651916cd43dd8448eb211c80319c usage_key=team-a region=eu-1 entry_region=eu-1 transport=json http_version=1.1 method=POST path=/v1/chat/completions endpoint=chat status=429 duration_ms=0.75 outcome=rejected model="
    + "x" * 256
    + "...[+44] error_code=key_rate_limited\n",
    "2023-11-14T22:13:20.250Z INFO firstbyte.access: GET /v1/streams/{id} 200 request_id=c7ad6b7169203331 trace_id=0af7651916cd43dd8448eb211c80319c region=eu-1 entry_region=eu-1 transport=sse http_version=2 method=GET path=/v1/streams/{id} status=200 duration_ms=3000.0 outcome=ok stream=strm-1\n",
    "2023-11-14T22:13:20.250Z INFO firstbyte.access: POST /v1/streams 200 request_id=d7ad6b7169203331 trace_id=0af7651916cd43dd8448eb211c80319c usage_key=team-a region=eu-1 entry_region=eu-1 backend=gpu-b transport=longpoll http_version=1.1 method=POST path=/v1/streams endpoint=chat status=200 ttft_ms=250.0 duration_ms=500.0 output_tokens=2 outcome=evicted model=m stream=strm-1 client_gone=True\n",
    "2023-11-14T22:13:20.250Z INFO firstbyte.access: GET /nowhere 404 request_id= trace_id= region=eu-1 entry_region=eu-1 transport=http http_version=1.1 method=GET path=/nowhere status=404 duration_ms=2.0 outcome=error\n",
]


async def _lines(
    fmt: LogFormat, monkeypatch: pytest.MonkeyPatch, *, traced: bool = True
) -> tuple[str, list[Any]]:
    spans = _Spans()
    # Each request's two readings: when it arrived, when it was over.
    clock = _clock(
        10.5, 11.2505, 20.1, 20.00075, 31.0, 33.0, 40.1, 40.5, 50.0, 50.002, 60.0, 60.001
    )
    request_log = RequestLog(
        "eu-1", spans if traced else None, clock, usage_key=lambda owner: "team-a"
    )
    with configured(fmt) as (out, _), monkeypatch.context() as patch:
        patch.setattr(time, "time", lambda: NOW)
        await _serve(request_log, "/v1/chat/completions", _streamed(), 200)
        await _serve(request_log, "/v1/chat/completions", _refused(), 429)
        await _serve(request_log, "/v1/streams/strm-1", _read(), 200)
        await _serve(request_log, "/v1/streams", _evicted(), 200, complete=False)
        await _serve(request_log, "/nowhere", None, 404)
        await _serve(request_log, "/healthz", None, 200)  # debug: no line at info
        return out.getvalue(), spans.records


@pytest.mark.parametrize("traced", [True, False])
@pytest.mark.parametrize("fmt", ["json", "text"])
async def test_access_lines_are_these_bytes(
    fmt: LogFormat, traced: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same lines whether a trace exporter takes the records or not (without one, a
    line's fields are made without a record: RequestLog._make)."""
    written, _ = await _lines(fmt, monkeypatch, traced=traced)
    assert written.splitlines(keepends=True) == (JSON_LINES if fmt == "json" else TEXT_LINES)


async def test_the_trace_exporter_gets_these_records(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sampled requests a pipeline ran for, not the operational ones: every field of each."""
    _, records = await _lines("json", monkeypatch)
    assert [
        msgspec.structs.asdict(record) | {"usage": msgspec.structs.asdict(record.usage)}
        for record in records
    ] == EXPORTED


EXPORTED: list[dict[str, Any]] = [
    {
        "request_id": "a1b2c3d4e5f60718",
        "trace_id": "4bf92f3577b34da6a3ce929d0e0e4736",
        "caller_span_id": "00f067aa0ba902b7",
        "sampled": True,
        "key_id": "b92d22615001",
        "usage_key": "team-a",
        "subject_id": "4ff4c7354d44",
        "region": "eu-2",
        "entry_region": "eu-1",
        "spill": True,
        "route_reason": "first_token_deadline",
        "client_city": "Munich",
        "client_country": "DE",
        "backend": "gpu-a",
        "backend_url": "http://10.0.0.5:8000/v1",
        "transport": "sse",
        "http_version": "1.1",
        "method": "POST",
        "path": "/v1/chat/completions",
        "status": 200,
        "outcome": "ok",
        "stream": "strm-1",
        "model": "m",
        "max_tokens": 64,
        "usage": {
            "input_tokens": 11,
            "output_tokens": 2,
            "response_model": "served-m",
            "outcome": "ok",
        },
        "client_gone": False,
        "server_address": "router.example",
        "started_at": 10.0,
        "admitted_at": 10.001,
        "routed_at": 10.002,
        "upstream_sent_at": 10.003,
        "first_token_at": 10.0523,
        "ended_at": 11.2505,
        "endpoint": "chat",
        "upstream_error": "ReadTimeout: timed out",
        "error_code": None,
    },
    {
        "request_id": "c7ad6b7169203331",
        "trace_id": "0af7651916cd43dd8448eb211c80319c",
        "caller_span_id": None,
        "sampled": True,
        "key_id": None,
        "usage_key": None,
        "subject_id": None,
        "region": "eu-1",
        "entry_region": "eu-1",
        "spill": False,
        "route_reason": "",
        "client_city": None,
        "client_country": None,
        "backend": None,
        "backend_url": None,
        "transport": "sse",
        "http_version": "2",
        "method": "GET",
        "path": "/v1/streams/{id}",
        "status": 200,
        "outcome": "ok",
        "stream": "strm-1",
        "model": None,
        "max_tokens": None,
        "usage": {
            "input_tokens": None,
            "output_tokens": None,
            "response_model": None,
            "outcome": "",
        },
        "client_gone": False,
        "server_address": None,
        "started_at": 30.0,
        "admitted_at": None,
        "routed_at": None,
        "upstream_sent_at": None,
        "first_token_at": None,
        "ended_at": 33.0,
        "endpoint": None,
        "upstream_error": None,
        "error_code": None,
    },
    {
        "request_id": "d7ad6b7169203331",
        "trace_id": "0af7651916cd43dd8448eb211c80319c",
        "caller_span_id": None,
        "sampled": True,
        "key_id": None,
        "usage_key": "team-a",
        "subject_id": None,
        "region": "eu-1",
        "entry_region": "eu-1",
        "spill": False,
        "route_reason": "",
        "client_city": None,
        "client_country": None,
        "backend": "gpu-b",
        "backend_url": "http://10.0.0.6:8000",
        "transport": "longpoll",
        "http_version": "1.1",
        "method": "POST",
        "path": "/v1/streams",
        "status": 200,
        "outcome": "evicted",
        "stream": "strm-1",
        "model": "m",
        "max_tokens": 64,
        "usage": {
            "input_tokens": None,
            "output_tokens": 2,
            "response_model": "served-m",
            "outcome": "evicted",
        },
        "client_gone": True,
        "server_address": None,
        "started_at": 40.0,
        "admitted_at": None,
        "routed_at": None,
        "upstream_sent_at": None,
        "first_token_at": 40.25,
        "ended_at": 40.5,
        "endpoint": "chat",
        "upstream_error": None,
        "error_code": None,
    },
]


def test_the_record_has_the_fields_record_passes_by_position() -> None:
    """RequestLog.record passes the record's values by position: a field moved or added
    must move its value there too."""
    assert AccessRecord.__struct_fields__ == (
        "request_id", "trace_id", "caller_span_id", "sampled", "key_id", "usage_key",
        "subject_id", "region", "entry_region", "spill", "route_reason", "client_city",
        "client_country", "backend", "backend_url", "transport", "http_version", "method",
        "path", "status", "outcome", "stream", "model", "max_tokens", "usage", "client_gone",
        "server_address", "started_at", "admitted_at", "routed_at", "upstream_sent_at",
        "first_token_at", "ended_at", "endpoint", "upstream_error", "error_code",
    )  # fmt: skip


class _CountingHashlib:
    """``hashlib`` as :mod:`.logs` sees it, counting the SHA-256 digests it is asked for."""

    def __init__(self) -> None:
        self.hashed: list[bytes] = []

    def sha256(self, data: bytes) -> Any:
        self.hashed.append(data)
        return hashlib.sha256(data)


def _keyed(api_key: str, subject: str) -> RequestContext:
    """A refused keyed request naming a subject (no stream: its line is written at once)."""
    ctx = RequestContext("POST", "/v1/chat/completions", {}, received_at=70.0)
    ctx.traceparent = Traceparent("0af7651916cd43dd8448eb211c80319c", "e7ad6b7169203331")
    ctx.api_key = api_key
    ctx.subject = subject
    ctx.request = _request()
    ctx.outcome = "rejected"
    ctx.usage = Usage(outcome="")
    return ctx


async def test_a_key_and_a_subject_are_digested_once_for_all_their_lines(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One application sends thousands of streams under one key: its key's and its
    subjects' digests are each worked out once, and every line carries the bytes the digest
    gives (a domain-separated SHA-256's first 12 hex digits, as the first line above has for
    ``sk-test-key`` and ``user-7``)."""
    # Names no other test used: the digests this process may have kept are not theirs.
    api_key, subject, other = (f"sk-{uuid.uuid4()}", f"u-{uuid.uuid4()}", f"u-{uuid.uuid4()}")
    counting = _CountingHashlib()
    request_log = RequestLog("eu-1")
    with configured("json") as (out, _), monkeypatch.context() as patch:
        patch.setattr(logs, "hashlib", counting)
        for name in (subject, subject, other, subject):
            await _serve(request_log, "/v1/chat/completions", _keyed(api_key, name), 429)
    lines = [json.loads(line) for line in out.getvalue().splitlines()]

    def digest(domain: bytes, value: str) -> str:
        return hashlib.sha256(domain + b"\0" + value.encode()).hexdigest()[:12]

    assert [(line["key_id"], line["subject_id"]) for line in lines] == [
        (digest(b"firstbyte-key-id", api_key), digest(b"firstbyte-subject-id", name))
        for name in (subject, subject, other, subject)
    ]
    assert counting.hashed == [
        b"firstbyte-key-id\0" + api_key.encode(),
        b"firstbyte-subject-id\0" + subject.encode(),
        b"firstbyte-subject-id\0" + other.encode(),
    ]


_OPERATIONAL = [
    ("GET", "/healthz", False),  # (method, path, whether its endpoint makes a context)
    ("GET", "/metrics", True),
    ("GET", "/v1/edge/status", True),
    ("GET", "/v1/edge/warm", False),
]
_OTHERS = [("POST", "/v1/edge/warm", True), ("GET", "/nowhere", False)]

HEALTHZ_DEBUG_LINE = '{"time":"2023-11-14T22:13:20.250Z","level":"debug","logger":"firstbyte.access","msg":"GET /healthz 200","request_id":"","trace_id":"","key_id":null,"usage_key":null,"region":"eu-1","entry_region":"eu-1","backend":null,"transport":"http","http_version":"1.1","method":"GET","path":"/healthz","endpoint":null,"status":200,"ttft_ms":null,"duration_ms":0.0,"input_tokens":null,"output_tokens":null,"outcome":"ok","model":null,"stream":null,"client_city":null,"client_country":null}'


@pytest.mark.parametrize("level", ["info", "debug"])
async def test_an_operational_request_s_record_is_built_only_to_be_written(
    level: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A load balancer asks /healthz every second: at ``info`` the operational requests'
    records (their lines are ``debug``, never traced) are not built at all, the others' are;
    at ``debug`` every record is built and the operational ones are written, at ``debug``."""
    built: list[str] = []
    make = RequestLog._make  # the record, or the line's fields alone

    def counted(self: RequestLog, exchange: Any, *args: Any) -> Any:
        built.append(f"{exchange.method} {exchange.path}")
        return make(self, exchange, *args)

    monkeypatch.setattr(RequestLog, "_make", counted)
    spans = _Spans()
    request_log = RequestLog("eu-1", spans, clock=lambda: 5.0)
    with configured("json", level) as (out, _), monkeypatch.context() as patch:
        patch.setattr(time, "time", lambda: NOW)
        for method, path, context in [*_OPERATIONAL, *_OTHERS]:
            ctx = RequestContext(method, path, {}, received_at=5.0) if context else None
            await _serve(request_log, path, ctx, 200, method=method)
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    written = [(line["level"], line["msg"]) for line in lines]
    others = [f"{method} {path}" for method, path, _ in _OTHERS]
    if level == "info":
        assert built == others
        assert written == [("info", f"{name} 200") for name in others]
    else:
        assert built == [f"{method} {path}" for method, path, _ in [*_OPERATIONAL, *_OTHERS]]
        assert written == [
            *(("debug", f"{method} {path} 200") for method, path, _ in _OPERATIONAL),
            *(("info", f"{name} 200") for name in others),
        ]
        assert out.getvalue().splitlines()[0] == HEALTHZ_DEBUG_LINE
    # Traced at either level: the request a pipeline ran for, not an operational one.
    assert [(r.method, r.path) for r in spans.records] == [("POST", "/v1/edge/warm")]


def _hundredths_cases() -> Iterator[float]:
    """Durations in ms as a line sees them, and the values where a shortcut would go wrong:
    near halves of a hundredth, both sides of each, tiny, huge, zero, negative, not finite."""
    import random

    rng = random.Random(26)
    for _ in range(200_000):
        yield rng.uniform(0, 10) ** rng.uniform(0, 7)
        yield (rng.uniform(0, 1e6) - rng.uniform(0, 1e6)) / 7
    for whole in range(0, 100_000, 7):
        tie = (whole + 0.5) / 100
        yield tie
        yield math.nextafter(tie, 0)
        yield math.nextafter(tie, math.inf)
        for step in (1e-13, 1e-9, 1e-7, 1e-6, 9.99e-7, 1.0001e-6):
            yield tie - step
            yield tie + step
        yield whole / 100
        yield math.nextafter(whole / 100, 0)
        yield math.nextafter(whole / 100, math.inf)
    for scale in range(-330, 309):
        yield 10.0 ** scale
        yield 1.2345 * 10.0 ** scale
        yield math.nextafter(1e9 * 10.0 ** (scale % 5), math.inf)
    yield from (0.0, -0.0, -0.004, -0.005, 0.004, 0.005, 0.015, 1e9, 1e9 + 0.005,
                5e-324, math.inf, -math.inf, 1e308)


def test_hundredths_is_round_to_two_places_bit_for_bit() -> None:
    """The line's ``ttft_ms`` and ``duration_ms`` are ``round(ms, 2)``: the shortcut gives
    the same float (sign of zero included), or the same error."""
    for value in _hundredths_cases():
        expected = round(value, 2)
        got = hundredths(value)
        assert struct.pack("<d", got) == struct.pack("<d", expected), value
    for bad in (math.nan,):
        assert math.isnan(hundredths(bad))


def test_the_compiled_elapsed_ms_is_the_python_s_bit_for_bit() -> None:
    """A line's ``elapsed_ms(end, start) or hundredths((end - start) * 1000)`` is
    ``hundredths((end - start) * 1000)`` (``round(..., 2)`` for floats: above): the compiled
    shortcut gives its float, or None (or 0.0) for the Python to answer, for times as
    perf_counter gives them, the rounding's hard cases, and values of other types (which it
    never takes). The compiled function itself (a missing build fails here)."""
    import random

    from firstbyte.router._chunkpath import (  # type: ignore[import-not-found]
        elapsed_ms as ELAPSED_MS,
    )

    def check(end: Any, start: Any) -> None:
        expected = hundredths((end - start) * 1000)
        got = ELAPSED_MS(end, start)
        if got is None or got == 0.0:
            if type(end) is float and type(start) is float and not math.isnan(expected):
                scaled = (end - start) * 1000 * 100
                # None or 0.0 only where hundredths' shortcut does not answer, or answers 0.0.
                assert got == 0.0 or not 0.0 < scaled < 1e11 or (
                    0.4999 <= scaled % 1.0 <= 0.5001), (end, start)
            got = hundredths((end - start) * 1000)
        if isinstance(expected, float) and math.isnan(expected):
            assert math.isnan(got)
        else:
            assert type(got) is type(expected), (end, start)
            assert struct.pack("<d", got) == struct.pack("<d", expected), (end, start)

    rng = random.Random(55)
    for _ in range(100_000):
        start = rng.uniform(0, 1e7)
        check(start + rng.uniform(0, 10) ** rng.uniform(-3, 3), start)
    for value in _hundredths_cases():
        check(value / 1000, 0.0)
        check(value, value / 2)

    class Float(float):
        pass

    for end, start in ((2, 1), (2.5, 1), (2, 1.5), (True, 0.0), (Float(2.5), 1.0),
                       (2.5, Float(1.0)), (math.nan, 0.0), (math.inf, 0.0), (0.0, math.inf),
                       (-1.0, 0.0), (1e300, -1e300)):
        check(end, start)
    assert ELAPSED_MS(None, 1.0) is None
    assert ELAPSED_MS("2.5", 1.0) is None
    assert ELAPSED_MS(2.5, 1.0, 0.0) is None
    assert ELAPSED_MS(2.5, 1.0) == 1500.0


def test_the_compiled_hundredths_text_is_format_2f() -> None:
    """A Server-Timing duration's ``hundredths_text(ms) or format(ms, ".2f")`` is
    ``format(ms, ".2f")``: the compiled text is the same string where it answers (None, for
    format to answer, only where :func:`hundredths`' shortcut does not), for durations as
    a request has them, the rounding's hard cases, and values of other types. The compiled
    function itself (a missing build fails here)."""
    import random

    from firstbyte.router._chunkpath import (  # type: ignore[import-not-found]
        hundredths_text as HUNDREDTHS_TEXT,
    )

    def check(value: Any) -> None:
        expected = format(value, ".2f")
        got = HUNDREDTHS_TEXT(value)
        if got is None:
            if type(value) is float and not math.isnan(value):
                scaled = value * 100
                assert not 0.0 < scaled < 1e11 or 0.4999 <= scaled % 1.0 <= 0.5001, value
            return
        assert type(got) is str
        assert got == expected, value

    rng = random.Random(55)
    for _ in range(100_000):
        check(rng.uniform(0, 10) ** rng.uniform(-3, 3))
        check(rng.uniform(0, 1e9))
    for value in _hundredths_cases():
        check(value)

    class Float(float):
        pass

    for value in (2, True, Float(2.5), 1e9 - 0.001, 999999999.994, 1e9, -0.001):
        check(value)
    assert HUNDREDTHS_TEXT(Float(2.5)) is None
    assert HUNDREDTHS_TEXT(2) is None
    assert HUNDREDTHS_TEXT(0.07) == "0.07"
    assert HUNDREDTHS_TEXT(1234.5) == "1234.50"


@pytest.mark.parametrize("change", ["level", "disabled", "disable"])
async def test_logging_turned_off_mid_request_writes_no_line(
    change: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whether a line is written is asked again when the request is over: logging made quiet
    while the request ran (the access logger's level raised, the logger disabled, or
    ``logging.disable``) writes none, though it was on when the request came in (the
    answer then was known from the logger's cache)."""
    from firstbyte.router.observability import access

    request_log = RequestLog("eu-1", clock=lambda: 5.0)
    with configured("json") as (out, _), monkeypatch.context() as patch:
        patch.setattr(time, "time", lambda: NOW)
        ctx = RequestContext("GET", "/v1/models", {}, received_at=5.0)
        await _serve(request_log, "/v1/models", ctx, 200)  # the cache warm: on
        assert len(out.getvalue().splitlines()) == 1
        level = access.log.level

        def quieted(self: RequestLog, *args: Any) -> Any:
            raise AssertionError("no line: nothing to make")

        def turn_off() -> None:
            if change == "level":
                access.log.setLevel(logging.WARNING)
            elif change == "disabled":
                patch.setattr(access.log, "disabled", True)
            else:
                logging.disable(logging.INFO)

        served = RequestLog.serve

        async def serve_then_turn_off(self: RequestLog, scope: Any, receive: Any, send: Any,
                                      handler: Any) -> None:
            async def handler_then_off(scope: Any, receive: Any, send: Any) -> None:
                await handler(scope, receive, send)
                turn_off()

            await served(self, scope, receive, send, handler_then_off)

        patch.setattr(RequestLog, "serve", serve_then_turn_off)
        patch.setattr(RequestLog, "_make", quieted)
        try:
            await _serve(request_log, "/v1/models", ctx, 200)
        finally:
            logging.disable(logging.NOTSET)
            access.log.setLevel(level)
        assert len(out.getvalue().splitlines()) == 1


@pytest.mark.parametrize("last", [
    _chunk("b"),
    b'{"error":{"message":"x","code":"upstream_eof"}}',
    b'{"error":{"message":"x"}}',
    b'{"error":"not an object"}',
    b'{"error":',
    b' {"error":{"code":"not at the start"}}',
])
@pytest.mark.parametrize("done", [True, False])
def test_a_line_alone_has_the_record_s_outcome(last: bytes, done: bool) -> None:
    """A chat stream with the relay's usage: the line made without a record (no trace) has
    the outcome the record has (the last event's error code, ``error``, or ``ok``), though
    the line reads the last event alone."""
    from firstbyte.router.observability.access import _Exchange

    ctx = _streamed()
    ctx.stream = _stream(_chunk(""), _chunk("a"), last, done=done, usage=TokenUsage(11, 2))
    request_log = RequestLog("eu-1")
    exchange = _Exchange("POST", "/v1/chat/completions", "1.1", 10.0, 200, True)
    record = request_log.record(exchange, ctx, False, 11.0, ctx.stream)
    line = request_log._make(exchange, ctx, False, 11.0, ctx.stream, False, True)
    assert line == record.line_fields()
    assert record.usage.outcome == (
        "upstream_eof" if b"upstream_eof" in last
        else "error" if last.startswith(b'{"error"') else "ok")
