"""The SDK's typed calls (completions, Responses, Messages, embeddings) end to end: the real
router over TLS in front of the real sim speaking each format as vLLM, on loopback.

Each format is streamed over every transport and HTTP version; a TCP cut in the middle of
a stream resumes with no event lost or repeated; a region that cannot take the request
passes it to the next; timings are filled as for chat.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from firstbyte.client_sdk.client import AsyncClient, EventStream
from firstbyte.client_sdk.errors import (
    BadRequestError,
    NotFoundError,
    RateLimitError,
    StreamBrokenError,
)
from firstbyte.client_sdk.sync import Client
from firstbyte.protocol.events import CompletionChunk, MessageEvent, ResponseEvent
from tests.client_sdk.conftest import Stack
from tests.client_sdk.cutproxy import TcpCutProxy, UdpCutProxy
from tests.client_sdk.formats_stack import (
    MODEL,
    ROUTER_KEY,
    body_for,
    reference,
    start_formats_stack,
)

COMBOS = [("sse", "1.1"), ("sse", "2"), ("sse", "3"), ("websocket", "1.1"),
          ("longpoll", "1.1"), ("longpoll", "2"), ("longpoll", "3")]
FORMATS = ["completions", "responses", "messages"]
WORDS = 24


@pytest.fixture
async def formats(tls_files: tuple[str, str, str]) -> AsyncIterator[Stack]:
    async with start_formats_stack(tls_files) as running:
        yield running


def open_stream(client: AsyncClient, fmt: str, words: int, **kw: Any) -> EventStream[Any]:
    """The typed call of ``fmt`` for ``words`` tokens (the fields of :func:`body_for`)."""
    fields = {**body_for(fmt, words), **kw}
    if fmt == "completions":
        return client.completions.stream(**fields)
    if fmt == "responses":
        return client.responses.stream(**fields)
    return client.messages.stream(**fields)


async def read(stream: EventStream[Any]) -> list[Any]:
    """Every event the stream passed, in order."""
    async with stream:
        return [event async for event in stream]


def check_events(fmt: str, stream: EventStream[Any], events: list[Any], expected: str) -> None:
    """The events are the format's own, each once and in order, and add up to ``expected``;
    every output token the sim reported was timed once."""
    assert stream.text == expected
    assert stream.last_event is events[-1]
    assert stream.usage is not None
    assert stream.usage.input_tokens is not None
    assert stream.usage.output_tokens == stream.timings.output_chunks
    if fmt == "completions":
        assert all(isinstance(e, CompletionChunk) for e in events)
        assert "".join(e.text for e in events) == expected
        assert events[-1].usage is not None  # include_usage was asked for
    elif fmt == "responses":
        assert all(isinstance(e, ResponseEvent) for e in events)
        assert events[0].type == "response.created"
        # ``incomplete`` when it stopped at max_output_tokens, as OpenAI's
        assert events[-1].type in ("response.completed", "response.incomplete")
        numbers = [e.sequence_number for e in events]
        assert numbers == list(range(len(events)))  # the upstream's own numbering, whole
        assert events[-1].response.output_text == expected
    else:
        assert all(isinstance(e, MessageEvent) for e in events)
        assert events[0].type == "message_start"
        assert events[-1].type == "message_stop"
        assert "ping" in [e.type for e in events]
        deltas = [e for e in events if e.type == "content_block_delta"]
        assert len(deltas) == stream.timings.output_chunks


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(("transport", "http"), COMBOS)
async def test_every_format_streams_over_every_transport(
    formats: Stack, fmt: str, transport: str, http: str
) -> None:
    stack = formats
    expected = await reference(stack, fmt, WORDS)
    async with AsyncClient(stack.base_url, ROUTER_KEY, transport=transport,  # type: ignore[arg-type]
                           http=http, ca_file=stack.ca_file, idle_timeout_s=10) as client:
        stream = open_stream(client, fmt, WORDS)
        events = await read(stream)
    check_events(fmt, stream, events, expected)
    timings = stream.timings
    assert timings.output_chunks > WORDS // 2  # the sim may stop early, not that early
    assert timings.transport == transport
    assert timings.http_version == {"1.1": "HTTP/1.1", "2": "HTTP/2", "3": "HTTP/3"}[http]
    assert timings.stream_id is not None
    assert timings.stream_id == stream.stream_id
    assert len(timings.inter_token_ms) == timings.output_chunks - 1
    assert timings.first_byte_ms is not None
    assert timings.first_token_ms is not None
    assert timings.last_token_ms is not None
    assert timings.first_byte_ms <= timings.first_token_ms <= timings.last_token_ms
    if transport == "sse":
        assert timings.region == "sdk-formats"


TOKENS = 200
CUT_AFTER = 9000  # bytes: past the TLS handshake, well inside a 200-token stream


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(("transport", "http"), [
    ("sse", "1.1"), ("sse", "2"), ("websocket", "1.1"), ("longpoll", "2"),
])
async def test_a_cut_mid_stream_resumes_with_nothing_lost_or_repeated(
    tls_files: tuple[str, str, str], fmt: str, transport: str, http: str
) -> None:
    async with start_formats_stack(tls_files) as stack:
        expected = await reference(stack, fmt, TOKENS)
        async with TcpCutProxy(stack.port, cut_after=CUT_AFTER) as proxy, AsyncClient(
            stack.url_via(proxy.port), ROUTER_KEY, transport=transport,  # type: ignore[arg-type]
            http=http, ca_file=stack.ca_file, idle_timeout_s=10,
        ) as client:
            stream = open_stream(client, fmt, TOKENS)
            events = await read(stream)
    assert proxy.cuts_done == 1
    assert proxy.connections >= 2  # the cut connection and the one the resume opened
    check_events(fmt, stream, events, expected)
    assert stream.timings.output_chunks > 60  # long enough that the cut fell inside it
    # Long-poll's resume is its next poll from the cursor: counted as the others' are.
    assert stream.timings.resumes >= 1


async def test_a_long_poll_cut_past_max_resumes_gives_up(tls_files: tuple[str, str, str]) -> None:
    """``max_resumes`` bounds long-poll's retried polls too (it was a fixed 5)."""
    async with start_formats_stack(tls_files) as stack, \
            TcpCutProxy(stack.port, cut_after=CUT_AFTER) as proxy, AsyncClient(
                stack.url_via(proxy.port), ROUTER_KEY, transport="longpoll", http="2",
                ca_file=stack.ca_file, idle_timeout_s=10, max_resumes=0) as client:
        stream = open_stream(client, "chat", TOKENS)
        with pytest.raises(StreamBrokenError, match="gave up after 0 retries"):
            await read(stream)
    assert proxy.cuts_done == 1


@pytest.mark.parametrize("fmt", ["responses", "messages"])
async def test_a_quic_path_going_silent_resumes_on_a_new_connection(
    tls_files: tuple[str, str, str], fmt: str
) -> None:
    async with start_formats_stack(tls_files) as stack:
        expected = await reference(stack, fmt, TOKENS)
        # 2 s of silence is a dead path: the resumed stream's new QUIC connection must bring
        # its next event within that, which took over 1 s under CI's load on a slow machine.
        async with UdpCutProxy(stack.port, cut_after=CUT_AFTER) as proxy, AsyncClient(
            stack.url_via(proxy.port), ROUTER_KEY, http="3", ca_file=stack.ca_file,
            idle_timeout_s=2.0,
        ) as client:
            stream = open_stream(client, fmt, TOKENS)
            events = await read(stream)
    assert proxy.cuts_done == 1
    check_events(fmt, stream, events, expected)
    assert stream.timings.resumes == 1
    assert stream.timings.http_version == "HTTP/3"


@pytest.mark.parametrize("fmt", FORMATS)
async def test_an_unreachable_region_fails_over_to_the_next(formats: Stack, fmt: str) -> None:
    stack = formats
    expected = await reference(stack, fmt, 5)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        down = f"https://localhost:{s.getsockname()[1]}/v1"
        async with AsyncClient([down, stack.base_url], ROUTER_KEY,
                               ca_file=stack.ca_file) as client:
            stream = open_stream(client, fmt, 5)
            events = await read(stream)
    check_events(fmt, stream, events, expected)
    assert stream.timings.region == "sdk-formats"


@contextlib.asynccontextmanager
async def saturated_region(
    retry_after: int = 2, *, status: int = 429, code: str = "region_saturated"
) -> AsyncIterator[tuple[str, list[bytes]]]:
    """A plain-HTTP/1.1 server answering every request ``status`` (429, or 503 for a region
    whose routers say ``code``) with Retry-After (a region that cannot take it); yields its
    base URL and the request lines it got."""
    lines: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            head = await reader.readuntil(b"\r\n\r\n")
            lines.append(head.split(b"\r\n", 1)[0])
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":", 1)[1])
            await reader.readexactly(length)
            body = (b'{"error": {"message": "refused", "type": "rate_limit",'
                    b' "param": null, "code": "' + code.encode() + b'"}}')
            writer.write(b"HTTP/1.1 %d Refused\r\ncontent-type: application/json\r\n"
                         b"retry-after: %d\r\ncontent-length: %d\r\n\r\n"
                         % (status, retry_after, len(body)) + body)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1", lines
    finally:
        server.close()


@pytest.mark.parametrize("fmt", FORMATS)
async def test_a_429_region_passes_the_request_to_the_next(formats: Stack, fmt: str) -> None:
    stack = formats
    expected = await reference(stack, fmt, 4)
    async with saturated_region() as (busy, lines), AsyncClient(
        [busy, stack.base_url], ROUTER_KEY, http="1.1", ca_file=stack.ca_file
    ) as client:
        stream = open_stream(client, fmt, 4)
        events = await read(stream)
        # Its Retry-After sets the region aside: the next call goes straight to the router.
        again = await client.responses.create(**body_for("responses", 2))
    check_events(fmt, stream, events, expected)
    assert stream.timings.region == "sdk-formats"
    assert lines == [f"POST /v1/{fmt} HTTP/1.1".encode()]
    assert again.output_text == await reference(stack, "responses", 2)


@pytest.mark.parametrize("retries", [0, 1])
async def test_create_sends_a_refused_request_again_after_retry_after(retries: int) -> None:
    async with saturated_region(retry_after=1) as (busy, lines), AsyncClient(
        busy, ROUTER_KEY, http="1.1", retries=retries, retry_budget_s=5
    ) as client:
        started = time.monotonic()
        with pytest.raises(RateLimitError) as refused:
            await client.messages.create(**body_for("messages", 2))
        elapsed = time.monotonic() - started
    assert refused.value.code == "region_saturated"
    assert lines == [b"POST /v1/messages HTTP/1.1"] * (1 + retries)
    if retries:
        assert elapsed >= 1.0  # not sooner than the server's Retry-After


async def test_create_answers_each_format_typed(formats: Stack) -> None:
    stack = formats
    async with AsyncClient(stack.base_url, ROUTER_KEY, ca_file=stack.ca_file) as client:
        completion = await client.completions.create(**body_for("completions", 3))
        response = await client.responses.create(**body_for("responses", 4))
        message = await client.messages.create(**body_for("messages", 5))
        vectors = await client.embeddings.create(model=MODEL, input=["a", "b"])
        with pytest.raises(BadRequestError) as refused:
            await client.messages.create(**{**body_for("messages", 5), "max_tokens": 0})
        with pytest.raises(NotFoundError):  # the sim serves MODEL only (vLLM's 404)
            await client.responses.create(**{**body_for("responses", 2), "model": "other"})
    assert completion.text == await reference(stack, "completions", 3)
    assert completion.usage is not None
    assert completion.usage.usage().output_tokens == 3
    assert response.status in ("completed", "incomplete")
    assert response.output_text == await reference(stack, "responses", 4)
    assert response.usage is not None
    assert response.usage.usage().output_tokens == 4
    assert message.text == await reference(stack, "messages", 5)
    assert message.stop_reason == "max_tokens"
    assert [v.index for v in vectors.data] == [0, 1]
    assert isinstance(vectors.data[0].embedding, list)
    assert vectors.data[0].embedding
    assert refused.value.param == "max_tokens"


async def test_first_token_callback_sets_render_time(formats: Stack) -> None:
    stack = formats
    firsts: list[ResponseEvent] = []
    async with AsyncClient(stack.base_url, ROUTER_KEY, ca_file=stack.ca_file) as client:
        stream = open_stream(client, "responses", 3, on_first_token=firsts.append)
        await read(stream)
    assert [e.type for e in firsts] == ["response.output_text.delta"]
    assert firsts[0].delta
    assert stream.text.startswith(firsts[0].delta)
    timings = stream.timings
    assert timings.render_ms is not None
    assert timings.first_token_ms is not None
    assert timings.render_ms >= timings.first_token_ms


def test_sync_client_streams_and_creates(tls_files: tuple[str, str, str]) -> None:
    async def serve(ready: asyncio.Future[tuple[Stack, str, str]], stop: asyncio.Event) -> None:
        async with start_formats_stack(tls_files) as stack:
            ready.set_result((stack, await reference(stack, "messages", 4),
                              await reference(stack, "messages", 2)))
            await stop.wait()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[tuple[Stack, str, str]] = loop.create_future()
        stop = asyncio.Event()
        server = asyncio.create_task(serve(ready, stop))
        stack, four, two = await ready
        try:
            await asyncio.to_thread(run_sync, stack, four, two)
        finally:
            stop.set()
            await server

    def run_sync(stack: Stack, four: str, two: str) -> None:
        with Client(stack.base_url, ROUTER_KEY, ca_file=stack.ca_file) as client:
            with client.messages.stream(**body_for("messages", 4)) as stream:
                kinds = [event.type for event in stream]
            message = client.messages.create(**body_for("messages", 2))
        assert kinds[0] == "message_start"
        assert kinds[-1] == "message_stop"
        assert stream.text == four
        assert stream.usage is not None
        assert stream.usage.output_tokens == stream.timings.output_chunks
        assert message.text == two

    asyncio.run(main())
