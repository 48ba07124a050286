"""The router's HTTP/1.1 upstream pool against raw servers on loopback, and through the router:
chunked bodies, keep-alive reuse, and a kept-alive connection the upstream closed."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httptools
import httpx
import pytest

from firstbyte.router.config import LimitsConfig
from firstbyte.router.metrics import Metrics
from firstbyte.router.pipeline import proxy
from firstbyte.router.pipeline.backend import Backend
from firstbyte.router.pipeline.context import RequestContext
from firstbyte.router.upstream_h1 import (
    H1Connection,
    H1Pool,
    Origin,
    encode_request,
    encode_request_parts,
    fetch,
)

from .conftest import RouterFactory, auth
from .upstream import chunk, read_request, sse

MODELS = json.dumps({"object": "list", "data": [{"id": "test-model", "object": "model"}]}).encode()
SSE_BODY = sse(chunk(content="hi")) + b"data: [DONE]\n\n"
WHOLE_BODY = json.dumps({
    "id": "chatcmpl-1", "object": "chat.completion", "model": "test-model",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"},
                 "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
}).encode()


def chunked_reply(body: bytes) -> bytes:
    return (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
        + f"{len(body):x}\r\n".encode()
        + body
        + b"\r\n0\r\n\r\n"
    )


@asynccontextmanager
async def raw_server(close_after: int | None = None) -> AsyncIterator[tuple[str, list[int]]]:
    """Answer each request with an SSE body; with ``close_after``, a connection that has
    answered that many requests closes on the next one without answering (the keep-alive
    race: the server gave up on the idle connection as the request arrived)."""
    connections: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(len(connections))
        answered = 0
        try:
            while True:
                request = await read_request(reader)
                if not request.startswith(b"POST /v1/chat/completions "):
                    # /metrics, /v1/models (the router's probes): an empty but healthy answer
                    body = MODELS if request.startswith(b"GET /v1/models ") else b""
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(body))
                    writer.write(body)
                    continue
                if close_after is not None and answered >= close_after:
                    writer.transport.abort()
                    return
                if not re.search(rb'"stream":\s*true', request):  # a whole answer
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json; "
                                 b"charset=utf-8\r\ncontent-length: %d\r\n\r\n%s"
                                 % (len(WHOLE_BODY), WHOLE_BODY))
                else:
                    writer.write(chunked_reply(SSE_BODY))
                await writer.drain()
                answered += 1
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", connections
    finally:
        server.close()
        await server.wait_closed()


class Collect:
    def __init__(self) -> None:
        self.status = 0
        self.body = b""
        self.error: Exception | None = None
        self.done = asyncio.get_running_loop().create_future()

    def on_head(self, status: int) -> None:
        self.status = status

    def on_body(self, data: bytes) -> None:
        self.body += data

    def on_read_end(self) -> None:
        pass

    def on_end(self) -> None:
        self.done.set_result(None)

    def on_error(self, exc: Exception) -> None:
        self.error = exc
        self.done.set_result(None)


def pool() -> H1Pool:
    return H1Pool(max_connections=4, keepalive_expiry_s=60, connect_timeout_s=2, read_timeout_s=5)


async def _stream_whole(upstreams: H1Pool, origin: Origin, *, times: int) -> None:
    """Send ``times`` requests one after another, each on a connection from the pool, and
    check each body arrives whole with no error before the connection goes back."""
    for _ in range(times):
        conn = await upstreams.acquire(origin)
        sink = Collect()
        conn.send(encode_request("POST", origin, "/v1/chat/completions", {},
                                 b'{"stream": true}'), sink)
        await asyncio.wait_for(sink.done, 5)
        assert (sink.status, sink.body, sink.error) == (200, SSE_BODY, None)
        upstreams.release(conn)


async def test_chunked_bodies_arrive_whole_and_the_connection_is_reused() -> None:
    async with raw_server() as (url, connections):
        upstreams = pool()
        origin = Origin.parse(url)
        await _stream_whole(upstreams, origin, times=3)
        assert len(connections) == 1
        assert "1 idle" in repr(upstreams)
        await upstreams.aclose()


@asynccontextmanager
async def page_server(body: bytes, *, chunked: bool = False, hang: bool = False
                      ) -> AsyncIterator[tuple[Origin, list[bytes]]]:
    """Answer every GET with ``body`` (in 1 KiB chunks, with ``chunked``), or never (``hang``);
    the requests' heads are listed as they arrive."""
    heads: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                heads.append(await read_request(reader))
                if hang:
                    await reader.read()  # until the client gives up
                    return
                if chunked:
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n"
                                 b"transfer-encoding: chunked\r\n\r\n")
                    for at in range(0, len(body), 1024):
                        part = body[at:at + 1024]
                        writer.write(b"%x\r\n%s\r\n" % (len(part), part))
                    writer.write(b"0\r\n\r\n")
                else:
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n"
                                 b"content-length: %d\r\n\r\n%s" % (len(body), body))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield Origin.parse(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"), heads
    finally:
        server.close()
        await server.wait_closed()


@pytest.mark.parametrize("chunked", [False, True])
async def test_fetch_reads_a_page_whole_and_keeps_the_connection(chunked: bool) -> None:
    page = b"vllm:num_requests_running 3\n" * 1000  # 28 KB
    async with page_server(page, chunked=chunked) as (origin, heads):
        upstreams = pool()
        for _ in range(2):
            got = await fetch(upstreams, origin, "/metrics", max_bytes=64 << 10, timeout_s=5,
                              headers={"accept": "text/plain"})
            assert (got.status, got.content_type, got.body) == (200, "text/plain", page)
        assert len(heads) == 2
        assert all(h.startswith(b"GET /metrics HTTP/1.1\r\n") for h in heads)
        assert b"accept: text/plain" in heads[0]
        assert "0 active, 1 idle" in repr(upstreams)  # both on one kept-alive connection
        await upstreams.aclose()


@pytest.mark.parametrize("chunked", [False, True])
async def test_fetch_stops_reading_a_page_over_its_bound_and_drops_the_connection(
    chunked: bool,
) -> None:
    async with page_server(b"x" * 4_000_000, chunked=chunked) as (origin, _):
        upstreams = pool()
        got = await fetch(upstreams, origin, "/metrics", max_bytes=10_000, timeout_s=5)
        assert (got.status, got.body) == (200, None)
        # Far more than one read brings: the rest unread, the connection is not reused.
        assert "0 active, 0 idle" in repr(upstreams)
        await upstreams.aclose()


async def test_fetch_times_out_as_a_whole_and_drops_the_connection() -> None:
    async with page_server(b"", hang=True) as (origin, heads):
        upstreams = pool()  # its read timeout is 5 s: the fetch's own bound comes first
        with pytest.raises(httpx.ReadTimeout, match=r"no whole answer within 0\.3 s"):
            await fetch(upstreams, origin, "/metrics", max_bytes=1000, timeout_s=0.3)
        assert len(heads) == 1
        assert "0 active, 0 idle" in repr(upstreams)
        await upstreams.aclose()


async def test_fetch_from_a_closed_port_is_a_connect_error() -> None:
    import socket

    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))  # bound, not listening: refused
        origin = Origin.parse(f"http://127.0.0.1:{closed.getsockname()[1]}")
        with pytest.raises(httpx.ConnectError):
            await fetch(pool(), origin, "/metrics", max_bytes=1000, timeout_s=5)


async def test_a_header_with_a_line_break_is_refused() -> None:
    with pytest.raises(httpx.LocalProtocolError):
        encode_request("POST", Origin.parse("http://x"), "/", {"a": "b\r\nevil: 1"}, b"")


@pytest.mark.parametrize("url", ["http://127.0.0.1:8000", "https://h/base/", "http://[::1]:81"])
@pytest.mark.parametrize("auth_key", [None, "sk-k"])
def test_request_parts_cut_encode_requests_bytes(url: str, auth_key: str | None) -> None:
    origin = Origin.parse(url)
    headers = {"content-type": "application/json", "accept": "text/event-stream",
               "traceparent": "x"}
    if auth_key:
        headers["authorization"] = f"Bearer {auth_key}"
    parts = encode_request_parts("POST", origin, "/v1/chat/completions", headers, "traceparent")
    assert parts is not None
    head, tail = parts
    for value in ("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", ""):
        for body in (b"", b"{}", b"x" * 5000):
            want = encode_request(
                "POST", origin, "/v1/chat/completions", {**headers, "traceparent": value}, body
            )
            assert head + value.encode() + tail + b"%d\r\n\r\n" % len(body) + body == want


def test_request_parts_refuse_a_line_break_and_pass_on_a_nul() -> None:
    origin = Origin.parse("http://x")
    with pytest.raises(httpx.LocalProtocolError):
        encode_request_parts("POST", origin, "/", {"a": "b\nevil: 1", "t": "x"}, "t")
    assert encode_request_parts("POST", origin, "/", {"a": "\0", "t": "x"}, "t") is None


async def test_a_streams_request_is_encode_requests_of_its_headers() -> None:
    """The stream's request bytes (made once but for the traceparent and body) are those
    :func:`encode_request` makes of the proxy's headers: with and without a key, with a
    peer's extra headers, and again from the made bytes."""
    upstream = proxy.Proxy(LimitsConfig(), Metrics(), max_connections=4)
    try:
        for key in (None, "sk-up", "bad\nkey"):
            backend = Backend("b", "http://127.0.0.1:9/base", api_key=key)
            origin = upstream.origin(backend)
            for extra in ({}, {}, {"x-firstbyte-peer": "1"}, {"accept": "*/*"}):
                ctx = RequestContext("POST", "/v1/chat/completions", {})
                ctx.upstream_headers = dict(extra)
                body = b'{"model":"m","stream":true}'
                try:
                    want = encode_request(
                        "POST", origin, ctx.codec.path,
                        upstream._headers(ctx, backend, "text/event-stream"), body,
                    )
                except httpx.LocalProtocolError:
                    with pytest.raises(httpx.LocalProtocolError):
                        upstream._stream_request(ctx, backend, origin, body)
                    continue
                assert upstream._stream_request(ctx, backend, origin, body) == want
    finally:
        await upstream.aclose()


async def test_router_sends_again_when_the_kept_alive_connection_was_closed(
    start_router: RouterFactory,
) -> None:
    async with (
        raw_server(close_after=1) as (url, connections),
        start_router([url], tls=False) as router,
        httpx.AsyncClient(timeout=10) as client,
    ):
        for _ in range(3):
            response = await client.post(
                router.base_url + "/v1/chat/completions",
                headers=auth(),
                json={
                    "model": "test-model",
                    "stream": True,
                    "messages": [{"role": "user", "content": "x"}],
                },
            )
            assert response.status_code == 200
            assert '"hi"' in response.text
            assert "error" not in response.text
            assert response.text.endswith("data: [DONE]\n\n")
    # each request after the first found its kept-alive connection closed and took a new one
    assert len(connections) >= 3


@pytest.mark.parametrize("size", [300, 200 << 10])
async def test_a_refused_streams_body_reaches_the_client_up_to_its_bound(
    start_router: RouterFactory, size: int
) -> None:
    """An upstream's 4xx to a stream: its status and body go to the client, the body cut
    at 64 KiB (a larger one is not read further), whatever reads it came in."""
    message = json.dumps({"error": {"message": "m" * size, "type": "invalid_request_error"}})
    body = message.encode()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                request = await read_request(reader)
                if not request.startswith(b"POST /v1/chat/completions "):
                    reply = MODELS if request.startswith(b"GET /v1/models ") else b""
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(reply))
                    writer.write(reply)
                    continue
                writer.write(b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n"
                             b"transfer-encoding: chunked\r\n\r\n")
                for at in range(0, len(body), 7000):
                    part = body[at:at + 7000]
                    writer.write(b"%x\r\n%s\r\n" % (len(part), part))
                    await writer.drain()
                    await asyncio.sleep(0.002)  # reads of their own, some of them
                writer.write(b"0\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        async with start_router([url], tls=False) as router, httpx.AsyncClient(timeout=10) as c:
            for _ in range(2):
                response = await c.post(
                    router.base_url + "/v1/chat/completions", headers=auth(),
                    json={"model": "test-model", "stream": True,
                          "messages": [{"role": "user", "content": "x"}]},
                )
                assert response.status_code == 400
                assert response.content == body[: 64 << 10]
    finally:
        server.close()


async def test_fetch_sends_again_when_the_kept_alive_connection_was_closed() -> None:
    """A POST whose kept-alive connection the upstream closed as it arrived (no byte of an
    answer) goes again on a new connection: the answer, its type and body, come whole."""
    async with raw_server(close_after=1) as (url, connections):
        upstreams = pool()
        for _ in range(3):
            got = await fetch(upstreams, Origin.parse(url), "/v1/chat/completions",
                              method="POST", body=b'{"model": "test-model"}',
                              headers={"content-type": "application/json"},
                              max_bytes=1 << 20, timeout_s=5)
            assert (got.status, got.content_type, got.body) == (
                200, "application/json; charset=utf-8", WHOLE_BODY)
        assert len(connections) == 3  # the 2nd and 3rd each found theirs closed
        await upstreams.aclose()


async def test_router_answers_whole_requests_over_its_own_pool(
    start_router: RouterFactory, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A non-streamed request to a local upstream goes over the streams' pool (not httpx),
    is sent again when its kept-alive connection was closed, and an answer past
    ``MAX_ANSWER_BYTES`` is a 502 ``upstream_error``, not read whole."""
    body = {"model": "test-model", "messages": [{"role": "user", "content": "x"}]}
    async with (
        raw_server(close_after=1) as (url, connections),
        start_router([url], tls=False) as router,
        httpx.AsyncClient(timeout=10) as client,
    ):
        for _ in range(3):
            response = await client.post(router.base_url + "/v1/chat/completions",
                                         headers=auth(), json=body)
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["message"]["content"] == "hi"
            assert response.headers["content-type"].startswith("application/json")
        assert len(connections) >= 3
        assert "1 idle" in repr(router.app.state.proxy.streams_pool)
        monkeypatch.setattr(proxy, "MAX_ANSWER_BYTES", 100)
        response = await client.post(router.base_url + "/v1/chat/completions",
                                     headers=auth(), json=body)
        assert response.status_code == 502, response.text
        assert response.json()["error"]["code"] == "upstream_error"


class Calls(Collect):
    """:class:`Collect`, listing the sink's calls in order."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def on_head(self, status: int) -> None:
        self.calls.append("head")

    def on_body(self, data: bytes) -> None:
        self.calls.append("body")

    def on_read_end(self) -> None:
        self.calls.append("read_end")

    def on_end(self) -> None:
        self.calls.append("end")
        super().on_end()

    def on_error(self, exc: Exception) -> None:
        self.calls.append("error")
        super().on_error(exc)


@pytest.mark.parametrize("broken", [False, True])
async def test_a_sink_hears_each_reads_end_but_the_one_its_response_ended_in(
    broken: bool,
) -> None:
    """A read that ends the response (cleanly, or with a parse error) passes on what it
    brought through ``on_end`` or ``on_error`` (:class:`~firstbyte.router.upstream_h1.
    ResponseSink`), with no ``on_read_end`` after it; every other read ends with one."""
    head = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n"
    end = b"3\r\nabc\r\nzz\r\n" if broken else b"3\r\nabc\r\n0\r\n\r\n"

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(head)
        await writer.drain()
        await asyncio.sleep(0.2)  # a read of its own each
        writer.write(end)
        await reader.read()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    upstreams = pool()
    try:
        origin = Origin.parse(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
        conn = await upstreams.acquire(origin)
        sink = Calls()
        conn.send(encode_request("POST", origin, "/", {}, b""), sink, chunks=True)
        await asyncio.wait_for(sink.done, 5)
        last = "error" if broken else "end"
        assert sink.calls == ["head", "body", "read_end", "body", last]
        assert conn.complete
        upstreams.release(conn)
        assert "1 idle" not in repr(upstreams) if broken else "1 idle" in repr(upstreams)
    finally:
        await upstreams.aclose()
        server.close()


async def test_a_kept_alive_connection_keeps_one_read_timer_and_still_times_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Responses one after another on a connection take over its read timer (it stops when
    # it finds none under way) instead of making one each; a reused connection whose upstream
    # goes silent still fails at the read timeout, counted from its last byte.
    armed: list[float] = []
    arm = H1Connection._arm_timer

    def counting(self: H1Connection, delay_s: float) -> None:
        armed.append(delay_s)
        arm(self, delay_s)

    monkeypatch.setattr(H1Connection, "_arm_timer", counting)
    silent = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                await read_request(reader)
                if silent.is_set():  # the head, then nothing
                    writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
                    await reader.read()
                    return
                writer.write(chunked_reply(SSE_BODY))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    upstreams = H1Pool(
        max_connections=1, keepalive_expiry_s=60, connect_timeout_s=2, read_timeout_s=2.0
    )
    try:
        origin = Origin.parse(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
        await _stream_whole(upstreams, origin, times=5)
        assert armed == [2.0]
        silent.set()
        await asyncio.sleep(2.1)  # the timer runs out with no response under way: it stops
        conn = await upstreams.acquire(origin)
        assert conn.reused
        sink = Collect()
        started = asyncio.get_running_loop().time()
        conn.send(encode_request("POST", origin, "/v1/chat/completions", {},
                                 b'{"stream": true}'), sink)
        await asyncio.wait_for(sink.done, 5)
        assert isinstance(sink.error, httpx.ReadTimeout)
        assert sink.status == 200
        assert asyncio.get_running_loop().time() - started >= 2.0 - 0.05
        # One timer made at the send; the timeout counts from the last byte, so a head that
        # arrived a turn after the send re-arms it once for the rest of the window (a loaded
        # machine read [2.0, 2.0, 0.0013]).
        assert armed[:2] == [2.0, 2.0]
        assert len(armed) <= 3, armed
        assert all(0 < rest < 2.0 for rest in armed[2:]), armed
        upstreams.release(conn)
    finally:
        await upstreams.aclose()
        server.close()
        await server.wait_closed()


@pytest.mark.parametrize(
    "head",
    [
        b"HTTP/1.1 200 OK\ntransfer-encoding: chunked\n\n",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\n\r\n",
        b"HTTP/1.1 200 OK\r\nx: a\r\n b\r\ntransfer-encoding: chunked\r\n\r\n",
    ],
)
def test_the_parser_takes_a_head_of_crlf_lines_only(head: bytes) -> None:
    # H1Connection.data_received cuts a response's first read at its first blank line
    # (CRLF CRLF) and counts on the parser having read the head and nothing more there.
    parser = httptools.HttpResponseParser(object())
    with pytest.raises(httptools.HttpParserError):
        parser.feed_data(head + b"3\r\nabc\r\n")
