"""The SDK's typed calls (completions, Responses, Messages, embeddings) end to end: the real
router over TLS in front of an upstream speaking each format, on loopback.

Each format is streamed over every transport and HTTP version; a TCP cut in the middle of
a stream resumes with no event lost or repeated; a region that cannot take the request
passes it to the next; timings are filled as for chat.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest

from firstbyte.client_sdk.client import AsyncClient, EventStream
from firstbyte.client_sdk.errors import BadRequestError
from firstbyte.client_sdk.sync import Client
from firstbyte.protocol.events import CompletionChunk, MessageEvent, ResponseEvent
from tests.client_sdk.conftest import Stack
from tests.client_sdk.cutproxy import TcpCutProxy
from tests.client_sdk.formats_stack import MODEL, ROUTER_KEY, expected_text, start_formats_stack
from tests.router.formats_upstream import FormatsUpstream

COMBOS = [("sse", "1.1"), ("sse", "2"), ("sse", "3"), ("websocket", "1.1"),
          ("longpoll", "1.1"), ("longpoll", "2"), ("longpoll", "3")]
FORMATS = ["completions", "responses", "messages"]
WORDS = 24


@pytest.fixture
async def formats(tls_files: tuple[str, str, str]) -> AsyncIterator[tuple[Stack, FormatsUpstream]]:
    async with start_formats_stack(tls_files) as running:
        yield running


def open_stream(client: AsyncClient, fmt: str, words: int, **kw: Any) -> EventStream[Any]:
    """The typed call of ``fmt`` for ``words`` tokens."""
    if fmt == "completions":
        return client.completions.stream(model=MODEL, prompt="Say words.", max_tokens=words,
                                         **kw)
    if fmt == "responses":
        return client.responses.stream(model=MODEL, input="Say words.",
                                       instructions="Be brief.", max_output_tokens=words, **kw)
    return client.messages.stream(model=MODEL, max_tokens=words, system="Be brief.",
                                  messages=[{"role": "user", "content": "Say words."}], **kw)


async def read(stream: EventStream[Any]) -> list[Any]:
    """Every event the stream passed, in order."""
    async with stream:
        return [event async for event in stream]


def check_events(fmt: str, events: list[Any], words: int) -> None:
    """The events are the format's own, complete and in order."""
    if fmt == "completions":
        assert all(isinstance(e, CompletionChunk) for e in events)
        assert "".join(e.text for e in events) == expected_text(words)
        assert events[-1].usage is not None  # include_usage was asked for
    elif fmt == "responses":
        assert all(isinstance(e, ResponseEvent) for e in events)
        assert events[0].type == "response.created"
        assert events[-1].type == "response.completed"
        numbers = [e.sequence_number for e in events]
        assert numbers == list(range(len(events)))  # the upstream's own numbering, whole
        assert events[-1].response.output_text == expected_text(words)
    else:
        assert all(isinstance(e, MessageEvent) for e in events)
        assert events[0].type == "message_start"
        assert events[-1].type == "message_stop"
        assert "ping" in [e.type for e in events]
        deltas = [e for e in events if e.type == "content_block_delta"]
        assert len(deltas) == words


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(("transport", "http"), COMBOS)
async def test_every_format_streams_over_every_transport(
    formats: tuple[Stack, FormatsUpstream], fmt: str, transport: str, http: str
) -> None:
    stack, upstream = formats
    async with AsyncClient(stack.base_url, ROUTER_KEY, transport=transport,  # type: ignore[arg-type]
                           http=http, ca_file=stack.ca_file, idle_timeout_s=10) as client:
        stream = open_stream(client, fmt, WORDS)
        events = await read(stream)
    check_events(fmt, events, WORDS)
    assert stream.text == expected_text(WORDS)
    assert stream.last_event is events[-1]
    assert stream.usage is not None
    assert stream.usage.output_tokens == WORDS
    assert stream.usage.input_tokens == 3
    path, _, body = upstream.received[-1]
    assert path == f"/v1/{fmt}"
    assert body["stream"] is True
    timings = stream.timings
    assert timings.transport == transport
    assert timings.http_version == {"1.1": "HTTP/1.1", "2": "HTTP/2", "3": "HTTP/3"}[http]
    assert timings.stream_id is not None
    assert timings.stream_id == stream.stream_id
    assert timings.output_chunks == WORDS
    assert len(timings.inter_token_ms) == WORDS - 1
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
    # Paced, so the router is still producing when the cut comes (a resume, not a replay).
    async with start_formats_stack(tls_files, delay_s=0.002) as (stack, _), TcpCutProxy(
        stack.port, cut_after=CUT_AFTER
    ) as proxy, AsyncClient(
        stack.url_via(proxy.port), ROUTER_KEY, transport=transport,  # type: ignore[arg-type]
        http=http, ca_file=stack.ca_file, idle_timeout_s=10,
    ) as client:
        stream = open_stream(client, fmt, TOKENS)
        events = await read(stream)
    assert proxy.cuts_done == 1
    assert proxy.connections >= 2  # the cut connection and the one the resume opened
    check_events(fmt, events, TOKENS)
    assert stream.text == expected_text(TOKENS)
    assert stream.timings.output_chunks == TOKENS
    if transport != "longpoll":
        # Long-poll retries a failed poll from its cursor without a stream-level resume.
        assert stream.timings.resumes >= 1


@pytest.mark.parametrize("fmt", FORMATS)
async def test_an_unreachable_region_fails_over_to_the_next(
    formats: tuple[Stack, FormatsUpstream], fmt: str
) -> None:
    stack, _ = formats
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        down = f"https://localhost:{s.getsockname()[1]}/v1"
        async with AsyncClient([down, stack.base_url], ROUTER_KEY,
                               ca_file=stack.ca_file) as client:
            stream = open_stream(client, fmt, 5)
            events = await read(stream)
    check_events(fmt, events, 5)
    assert stream.timings.region == "sdk-formats"


@contextlib.asynccontextmanager
async def saturated_region() -> AsyncIterator[tuple[str, list[bytes]]]:
    """A plain-HTTP/1.1 server answering every request 429 with Retry-After (a region that
    cannot take it); yields its base URL and the request lines it got."""
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
            body = (b'{"error": {"message": "saturated", "type": "rate_limit",'
                    b' "param": null, "code": "region_saturated"}}')
            writer.write(b"HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\n"
                         b"retry-after: 2\r\ncontent-length: " + str(len(body)).encode()
                         + b"\r\n\r\n" + body)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1", lines
    finally:
        server.close()


@pytest.mark.parametrize("fmt", FORMATS)
async def test_a_429_region_passes_the_request_to_the_next(
    formats: tuple[Stack, FormatsUpstream], fmt: str
) -> None:
    stack, _ = formats
    async with saturated_region() as (busy, lines), AsyncClient(
        [busy, stack.base_url], ROUTER_KEY, http="1.1", ca_file=stack.ca_file
    ) as client:
        stream = open_stream(client, fmt, 4)
        events = await read(stream)
        # Its Retry-After sets the region aside: the next call goes straight to the router.
        again = await client.responses.create(model=MODEL, input="x", max_output_tokens=2)
    check_events(fmt, events, 4)
    assert stream.timings.region == "sdk-formats"
    assert lines == [f"POST /v1/{fmt} HTTP/1.1".encode()]
    assert again.output_text == expected_text(2)


async def test_create_answers_each_format_typed(formats: tuple[Stack, FormatsUpstream]) -> None:
    stack, upstream = formats
    async with AsyncClient(stack.base_url, ROUTER_KEY, ca_file=stack.ca_file) as client:
        completion = await client.completions.create(model=MODEL, prompt="x", max_tokens=3)
        response = await client.responses.create(model=MODEL, input="x", max_output_tokens=4)
        message = await client.messages.create(
            model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "x"}])
        vectors = await client.embeddings.create(model=MODEL, input=["a", "b"])
        with pytest.raises(BadRequestError) as refused:
            await client.messages.create(model=MODEL, max_tokens=0,
                                         messages=[{"role": "user", "content": "x"}])
    assert completion.text == expected_text(3)
    assert completion.usage is not None
    assert completion.usage.usage().output_tokens == 3
    assert response.status == "completed"
    assert response.output_text == expected_text(4)
    assert response.usage is not None
    assert response.usage.usage().output_tokens == 4
    assert message.text == expected_text(5)
    assert message.stop_reason == "max_tokens"
    assert [v.index for v in vectors.data] == [0, 1]
    assert vectors.data[0].embedding == [0.25, -0.5, 0.0]
    assert refused.value.param == "max_tokens"
    assert [(path, "stream" in body) for path, _, body in upstream.received] == [
        ("/v1/completions", False), ("/v1/responses", False), ("/v1/messages", False),
        ("/v1/embeddings", False)]


async def test_first_token_callback_sets_render_time(
    formats: tuple[Stack, FormatsUpstream]
) -> None:
    stack, _ = formats
    firsts: list[ResponseEvent] = []
    async with AsyncClient(stack.base_url, ROUTER_KEY, ca_file=stack.ca_file) as client:
        stream = open_stream(client, "responses", 3, on_first_token=firsts.append)
        await read(stream)
    assert [e.type for e in firsts] == ["response.output_text.delta"]
    assert firsts[0].delta == "w0"
    timings = stream.timings
    assert timings.render_ms is not None
    assert timings.first_token_ms is not None
    assert timings.render_ms >= timings.first_token_ms


def test_sync_client_streams_and_creates(tls_files: tuple[str, str, str]) -> None:
    async def serve(ready: asyncio.Future[Stack], stop: asyncio.Event) -> None:
        async with start_formats_stack(tls_files) as (stack, _):
            ready.set_result(stack)
            await stop.wait()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[Stack] = loop.create_future()
        stop = asyncio.Event()
        server = asyncio.create_task(serve(ready, stop))
        stack = await ready
        try:
            await asyncio.to_thread(run_sync, stack)
        finally:
            stop.set()
            await server

    def run_sync(stack: Stack) -> None:
        with Client(stack.base_url, ROUTER_KEY, ca_file=stack.ca_file) as client:
            with client.messages.stream(model=MODEL, max_tokens=4,
                                        messages=[{"role": "user", "content": "x"}]) as stream:
                kinds = [event.type for event in stream]
            message = client.messages.create(model=MODEL, max_tokens=2,
                                             messages=[{"role": "user", "content": "x"}])
        assert kinds[0] == "message_start"
        assert kinds[-1] == "message_stop"
        assert stream.text == expected_text(4)
        assert stream.usage is not None
        assert stream.usage.output_tokens == 4
        assert stream.timings.output_chunks == 4
        assert message.text == expected_text(2)

    asyncio.run(main())
