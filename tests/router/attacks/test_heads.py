"""Request heads over their bounds, before any key is checked, on every protocol and server:
414 or 431 with an error body, the connection (HTTP/1.1) or the stream (HTTP/2, HTTP/3)
ended, nothing buffered past the bound; and HTTP/2 bodies over the limit answered 413 as the
limit is crossed."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import h2.errors
import h2.events
import h2.settings
import pytest

from tests.router.conftest import API_KEY
from tests.router.h3client import h3_request

from .conftest import (
    ON_EACH_SERVER,
    RouterProcess,
    RouterStarter,
    canary_running,
    chat_body,
    open_tls,
    read_until_closed,
)
from .test_http2 import H2Client

CHAT = "/v1/chat/completions"


def _fields(count: int, size: int = 10) -> str:
    """``count`` header lines of ``size`` bytes each (``x-N: vvv``)."""
    return "".join(
        f"x-{i:04}: {'v' * (size - 8)}\r\n" for i in range(count)
    )


def _error_code(answer: bytes) -> str:
    body = answer.split(b"\r\n\r\n", 1)[1]
    code: str = json.loads(body)["error"]["code"]
    return code


HEADS = [
    pytest.param(
        f"GET /{'a' * 9000} HTTP/1.1\r\nhost: x\r\n\r\n", 414, "request_line_too_long",
        id="request-line-9KB",
    ),
    pytest.param(
        f"GET /{'a' * 100_000}", 414, "request_line_too_long", id="request-line-unended",
    ),
    pytest.param(
        f"GET /v1/models HTTP/1.1\r\nhost: x\r\nx-big: {'v' * 9000}\r\n\r\n", 431,
        "header_too_large", id="header-line-9KB",
    ),
    pytest.param(
        f"GET /v1/models HTTP/1.1\r\nhost: x\r\n{_fields(101)}\r\n", 431, "too_many_headers",
        id="101-headers",
    ),
    pytest.param(
        f"GET /v1/models HTTP/1.1\r\nhost: x\r\n{_fields(5, 7000)}\r\n", 431,
        "headers_too_large", id="35KB-of-headers",
    ),
]


@ON_EACH_SERVER
@pytest.mark.parametrize(("head", "status", "code"), HEADS)
async def test_http1_head_over_a_bound_is_refused_and_closed(
    start_router_process: RouterStarter, head: str, status: int, code: str
) -> None:
    """Each bound (the defaults: 8 KiB request line, 8 KiB header line, 32 KiB of headers,
    100 headers) answered as nginx answers it, without a key, and the connection closed."""
    async with start_router_process() as router:
        reader, writer = await open_tls(router)
        writer.write(head.encode())
        answer = await read_until_closed(reader, 10)
        writer.close()
    assert answer.startswith(b"HTTP/1.1 %d " % status), answer[:200]
    assert b"\r\nconnection: close\r\n" in answer.lower()
    assert _error_code(answer) == code
    assert f"request head refused: {status}" in router.log()
    router.assert_clean_log()


@ON_EACH_SERVER
async def test_http1_head_within_the_bounds_is_served(start_router_process: RouterStarter) -> None:
    """Right at the bounds (an 8 KiB request line, 100 headers, an 8 KiB header) a request
    is served: the answer is the app's (401: no key), not a refusal."""
    target = "/v1/models?" + "q" * (8192 - len("GET /v1/models? HTTP/1.1"))
    big = "x-big: " + "v" * (8192 - len("x-big: "))
    head = f"GET {target} HTTP/1.1\r\nhost: x\r\n{big}\r\n{_fields(98)}\r\n"
    async with start_router_process() as router:
        reader, writer = await open_tls(router)
        writer.write(head.encode())
        await writer.drain()
        answer = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        writer.close()
    assert answer.startswith(b"HTTP/1.1 401 "), answer[:200]


@ON_EACH_SERVER
@pytest.mark.parametrize(
    ("second", "status"),
    [
        pytest.param(f"GET /v1/models HTTP/1.1\r\nhost: x\r\n{_fields(101)}\r\n", 431,
                     id="101-headers-whole"),
        pytest.param(f"GET /v1/models HTTP/1.1\r\nhost: x\r\nx-big: {'v' * 9000}\r\n\r\n",
                     431, id="header-line-9KB"),
        pytest.param("\r\n" * 3 + f"GET /v1/models HTTP/1.1\r\nhost: x\r\n{_fields(101)}\r\n",
                     431, id="101-headers-after-blank-lines"),
    ],
)
async def test_a_head_after_a_served_request_is_bounded_as_the_first(
    start_router_process: RouterStarter, second: str, status: int
) -> None:
    """The next head on a kept-alive connection, sent once the first request's answer is
    in (so it starts a read of its own), meets the same bounds as a connection's first."""
    async with start_router_process() as router:
        reader, writer = await open_tls(router)
        writer.write(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
        first = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        length = next(int(line.split(b":", 1)[1]) for line in first.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        await asyncio.wait_for(reader.readexactly(length), 10)
        writer.write(second.encode())
        answer = await read_until_closed(reader, 10)
        writer.close()
    assert first.startswith(b"HTTP/1.1 200 "), first
    assert answer.startswith(b"HTTP/1.1 %d " % status), answer[:200]
    assert f"request head refused: {status}" in router.log()
    router.assert_clean_log()


@ON_EACH_SERVER
async def test_a_pipelined_head_split_across_reads_is_bounded_not_misread(
    start_router_process: RouterStarter,
) -> None:
    """A second request whose head began in the read that carried the first: its end and
    its 20 KiB body (one line) in a later read are not taken for an over-long request line
    (the scanner did not see where the head began), and a never-ending header line in the
    same place is still cut (431) long before its end."""
    first = "GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n"
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "w" * 20_000}]})
    async with start_router_process() as router:
        reader, writer = await open_tls(router)
        writer.write(
            (first + f"POST {CHAT} HTTP/1.1\r\nhost: x\r\ncontent-length: {len(body)}\r\n")
            .encode()
        )
        healthz = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        await asyncio.sleep(0.2)
        writer.write(b"\r\n" + body.encode())
        second = b""
        with contextlib.suppress(TimeoutError):  # uvicorn keeps the connection after a 401
            async with asyncio.timeout(10):
                while b" 401 " not in second and b" 414 " not in second:
                    chunk = await reader.read(65536)
                    if not chunk:
                        break
                    second += chunk
        writer.close()

        reader, writer = await open_tls(router)
        writer.write((first + "GET /v1/models HTTP/1.1\r\nhost: x\r\nx-big: ").encode())
        await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        with contextlib.suppress(TimeoutError):  # the rest of healthz's answer
            await asyncio.wait_for(reader.read(65536), 0.5)
        answer = asyncio.ensure_future(reader.read(65536))  # the refusal's first bytes
        sent = 0
        while sent < 16 << 20 and not answer.done():
            writer.write(b"v" * 65536)
            sent += 65536
            try:
                await asyncio.wait_for(writer.drain(), 5)
            except (ConnectionError, TimeoutError):
                break
        cut = await asyncio.wait_for(answer, 10) + await read_until_closed(reader, 10)
        writer.close()
    assert healthz.startswith(b"HTTP/1.1 200 "), healthz
    assert b"HTTP/1.1 401 " in second, second[:400]  # no key: not a 414
    assert b"HTTP/1.1 431 " in cut, cut[:400]
    router.assert_clean_log()


@ON_EACH_SERVER
async def test_a_pipelined_huge_head_does_not_cut_into_the_answer_before_it(
    start_router_process: RouterStarter,
) -> None:
    """A stream in flight, and behind it on the same connection a head that never ends: the
    stream's answer arrives whole, and only after it a 431 (or the close), never inside."""
    body = json.dumps(chat_body(50)).encode()
    first = (
        f"POST {CHAT} HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {API_KEY}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
    ).encode() + body
    async with start_router_process() as router:
        reader, writer = await open_tls(router)
        writer.write(first + f"POST {CHAT} HTTP/1.1\r\nhost: x\r\nx-big: ".encode())
        await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)  # the stream has begun
        for _ in range(16):  # 1 MiB of header line while the stream goes on
            writer.write(b"v" * 65536)
            with contextlib.suppress(ConnectionError, TimeoutError):
                await asyncio.wait_for(writer.drain(), 5)
        rest = await read_until_closed(reader, 20)
        writer.close()
    end = rest.index(b"data: [DONE]")
    last_chunk = rest.index(b"\r\n0\r\n\r\n", end) + len(b"\r\n0\r\n\r\n")
    assert b"HTTP/1.1" not in rest[:last_chunk], rest[:last_chunk][-400:]
    after = rest[last_chunk:]
    assert after == b"" or after.startswith(b"HTTP/1.1 431 "), after[:200]
    router.assert_clean_log()


async def _send_huge_head(router: RouterProcess, line_bytes: int) -> tuple[bytes, int]:
    """Send a head with one header line of ``line_bytes`` (never ended) in 64 KiB writes
    while reading: the answer, and how many bytes were written before it came."""
    reader, writer = await open_tls(router)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-big: ")
    sent = 0
    chunk = b"v" * 65536
    first = asyncio.ensure_future(reader.read(65536))  # the answer's first bytes
    try:
        while sent < line_bytes and not first.done():
            writer.write(chunk)
            sent += len(chunk)
            try:
                await asyncio.wait_for(writer.drain(), 5)
            except (ConnectionError, TimeoutError):
                break
        answer = await asyncio.wait_for(first, 30)
        return answer + await read_until_closed(reader, 30), sent
    finally:
        first.cancel()
        writer.close()


@ON_EACH_SERVER
async def test_huge_heads_are_cut_at_the_bound_without_memory(
    start_router_process: RouterStarter,
) -> None:
    """Twenty connections each sending a header line of up to 16 MiB: each is answered 431
    near the bound, long before its end, and the router's memory barely moves (20 heads of
    16 MiB took it from 62 to 790 MB). The canary's streams go on whole."""
    async with start_router_process() as router:
        before = router.rss_bytes()
        async with canary_running(router):
            started = time.monotonic()
            results = await asyncio.gather(
                *(_send_huge_head(router, 8 << 20) for _ in range(20))
            )
            elapsed = time.monotonic() - started
        grown = router.rss_bytes() - before
    print(f"huge heads: {elapsed:.1f} s, RSS +{grown >> 20} MiB,"
          f" sent {[sent >> 10 for _, sent in results]} KiB")
    for answer, _ in results:
        assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
        assert _error_code(answer) == "header_too_large"  # not h11's own bare 431
    assert grown < 60 << 20
    router.assert_clean_log()


async def _h2_request(
    client: H2Client, path: str, extra: list[tuple[str, str]]
) -> tuple[int, bytes]:
    stream_id = client.conn.get_next_available_stream_id()
    headers = [*client.headers(path, "GET"), *extra]
    client.conn.send_headers(stream_id, headers, end_stream=True)
    await client.flush()
    return await client.response(stream_id, 10)


@pytest.mark.parametrize(
    ("path", "extra", "status", "code"),
    [
        pytest.param("/v1/models?" + "a" * 9000, [], 414, "request_line_too_long", id="path-9KB"),
        pytest.param(
            "/v1/models", [(f"x-{i}", "v") for i in range(101)], 431, "too_many_headers",
            id="101-headers",
        ),
        pytest.param(
            "/v1/models", [("x-big", "v" * 9000)], 431, "header_too_large", id="header-9KB"
        ),
        pytest.param(
            "/v1/models", [(f"x-{i}", "v" * 7000) for i in range(5)], 431,
            "headers_too_large", id="35KB-of-headers",
        ),
    ],
)
async def test_http2_head_over_a_bound_is_refused_on_its_stream(
    start_router_process: RouterStarter, path: str, extra: list[tuple[str, str]], status: int,
    code: str,
) -> None:
    """The refusal ends the stream, not the connection: the next request on it is served.
    The server advertises the header list it will decode (``SETTINGS_MAX_HEADER_LIST_SIZE``:
    the bounds plus HPACK's 32 bytes a field, below hypercorn's 64 KiB)."""
    async with start_router_process() as router:
        client = await H2Client.open(router)
        answered, body = await _h2_request(client, path, extra)
        assert answered == status, body[:200]
        assert json.loads(body)["error"]["code"] == code
        assert await client.get("/healthz") == 200, router.log()
        advertised = client.conn.remote_settings.max_header_list_size
        client.writer.close()
    assert advertised is not None
    assert advertised < 64 << 10
    assert f"request head refused: {status}" in router.log()
    router.assert_clean_log()


async def test_http2_refused_head_with_a_body_coming_is_reset_after_its_431(
    start_router_process: RouterStarter,
) -> None:
    """A POST with 101 headers whose body is still coming: 431, then RST_STREAM NO_ERROR so
    the client stops sending; the DATA already on its way is dropped without an error, and
    the connection serves on."""
    async with start_router_process() as router:
        client = await H2Client.open(router)
        stream_id = client.conn.get_next_available_stream_id()
        headers = [*client.headers(CHAT), *((f"x-{i}", "v") for i in range(101))]
        client.conn.send_headers(stream_id, headers)
        client.conn.send_data(stream_id, b"x" * 16384)
        await client.flush()
        status, reset = 0, None
        async with asyncio.timeout(10):
            while reset is None and not client.closed:
                for event in await client.events(1):
                    if getattr(event, "stream_id", None) != stream_id:
                        continue
                    if isinstance(event, h2.events.ResponseReceived):
                        status = int(dict(event.headers)[":status"])
                    elif isinstance(event, h2.events.StreamReset):
                        reset = h2.errors.ErrorCodes(event.error_code)
        assert await client.get("/healthz") == 200
        client.writer.close()
    assert (status, reset) == (431, h2.errors.ErrorCodes.NO_ERROR)
    router.assert_clean_log()


async def test_http3_head_over_a_bound_is_refused(
    start_router_process: RouterStarter,
) -> None:
    """HTTP/3: the decoded head is checked before the app runs (its size before decoding is
    bounded only by QUIC's flow control: see ``docs/limits.md``)."""
    async with start_router_process(listen={"http3": True}) as router:
        headers = {f"x-{i}": "v" for i in range(101)}
        response = await h3_request(
            router.port, "GET", "/v1/models", cafile=router.cafile, headers=headers
        )
        fine = await h3_request(router.port, "GET", "/healthz", cafile=router.cafile)
    assert response.status == 431, response
    assert json.loads(response.body)["error"]["code"] == "too_many_headers"
    assert fine.status == 200
    router.assert_clean_log()


async def _post_until_answered(
    client: H2Client, body_bytes: int, content_length: int | None = None
) -> tuple[int, int, h2.errors.ErrorCodes | None]:
    """POST up to ``body_bytes`` of body on one stream, respecting flow control, until the
    server answers and resets the stream: the status, the bytes sent by then and the reset's
    error code (None if the stream was not reset)."""
    stream_id = client.conn.get_next_available_stream_id()
    headers = client.headers(CHAT)
    if content_length is not None:
        headers.append(("content-length", str(content_length)))
    client.conn.send_headers(stream_id, headers)
    await client.flush()
    sent, status = 0, 0
    reset: h2.errors.ErrorCodes | None = None
    chunk = b"x" * (1 << 14)
    deadline = time.monotonic() + 10  # never reset by then: the caller's assertions say so
    while reset is None and not client.closed and time.monotonic() < deadline:
        window = 0
        if sent < body_bytes:
            window = min(client.conn.local_flow_control_window(stream_id), len(chunk))
        if window > 0:
            client.conn.send_data(stream_id, chunk[:window])
            sent += window
            if sent % (1 << 18) >= window:
                continue
            await client.flush()
            events = await client.events(0.001)  # what the server sent so far
        else:
            await client.flush()
            events = await client.events(1)
        for event in events:
            if getattr(event, "stream_id", None) != stream_id:
                continue
            if isinstance(event, h2.events.ResponseReceived):
                status = int(dict(event.headers)[":status"])
            elif isinstance(event, h2.events.StreamReset):
                reset = h2.errors.ErrorCodes(event.error_code)
    return status, sent, reset


async def test_http2_body_over_the_limit_is_413_and_reset_as_it_crosses(
    start_router_process: RouterStarter,
) -> None:
    """A 16 MiB body against the 1 MiB limit: 413 and RST_STREAM NO_ERROR once the limit is
    crossed, not after the router read and dropped it all (63 MiB took 57 s to its 413),
    and the connection serves on."""
    async with start_router_process() as router, canary_running(router):
        client = await H2Client.open(router)
        started = time.monotonic()
        status, sent, reset = await _post_until_answered(client, 16 << 20)
        elapsed = time.monotonic() - started
        assert await client.get("/healthz") == 200
        client.writer.close()
    print(f"HTTP/2 413: {sent >> 10} KiB sent, {elapsed:.2f} s")
    assert status == 413
    assert reset == h2.errors.ErrorCodes.NO_ERROR
    assert sent < 4 << 20  # the limit and what flow control let through meanwhile
    router.assert_clean_log()


async def test_http2_content_length_over_the_limit_is_413_at_the_head(
    start_router_process: RouterStarter,
) -> None:
    """``content-length`` over the limit: 413 and the reset before a byte of body is sent."""
    async with start_router_process() as router:
        client = await H2Client.open(router)
        status, sent, reset = await _post_until_answered(client, 0, content_length=2 << 20)
        assert await client.get("/healthz") == 200
        client.writer.close()
    assert (status, sent, reset) == (413, 0, h2.errors.ErrorCodes.NO_ERROR)
    router.assert_clean_log()
