"""``router.aionet``: httpx over the asyncio backend, against real servers on loopback.

Plain and TLS keep-alive, a body split in many pieces, larger than the read buffer bound,
read timeout, a server that closes mid-body or while idle in the pool, connect errors.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import pytest
import trustme

from firstbyte.router import aionet

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@contextlib.asynccontextmanager
async def serving(handler: Handler, tls: ssl.SSLContext | None = None) -> AsyncIterator[int]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0, ssl=tls)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(server.wait_closed(), 2)


async def read_head(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    if length:
        await reader.readexactly(length)
    return head


def chunked(*pieces: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


HEAD = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-type: text/plain\r\n\r\n"


def client(**options: object) -> httpx.AsyncClient:
    c = httpx.AsyncClient(trust_env=False, **options)  # type: ignore[arg-type]
    assert aionet.install(c)
    return c


async def test_keepalive_streamed_body_in_pieces() -> None:
    connections = 0
    pieces = [b"data: %d\n\n" % i for i in range(50)]

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while True:
                await read_head(reader)
                writer.write(HEAD)
                for piece in pieces:
                    writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                    await writer.drain()
                    await asyncio.sleep(0)
                writer.write(b"0\r\n\r\n")
                await writer.drain()
        writer.close()

    async with serving(handler) as port, client(timeout=5) as c:
        for _ in range(3):
            received = b""
            async with c.stream("POST", f"http://127.0.0.1:{port}/", content=b"{}") as r:
                async for raw in r.aiter_raw():
                    received += raw
            assert received == b"".join(pieces)
    assert connections == 1  # kept alive and reused


async def test_body_larger_than_the_read_buffer_bound() -> None:
    big = bytes(range(256)) * (3 * aionet.HIGH_WATER_BYTES // 256)

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_head(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(big) + big)
        await writer.drain()
        writer.close()

    parts = []
    async with (
        serving(handler) as port,
        client(timeout=5) as c,
        c.stream("GET", f"http://127.0.0.1:{port}/") as r,
    ):
        async for raw in r.aiter_raw():
            parts.append(raw)
            await asyncio.sleep(0.001)  # a slow reader: the transport must pause, not grow
    assert b"".join(parts) == big


async def test_tls_upstream() -> None:
    ca = trustme.CA()
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server_ctx)
    client_ctx = ssl.create_default_context()
    ca.configure_trust(client_ctx)

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError, ssl.SSLError):
            while True:
                await read_head(reader)
                writer.write(HEAD + chunked(b"hello ", b"tls"))
                await writer.drain()

    async with serving(handler, server_ctx) as port, client(verify=client_ctx, timeout=5) as c:
        for _ in range(2):
            r = await c.get(f"https://127.0.0.1:{port}/")
            assert r.text == "hello tls"
    # and an untrusted certificate is a connect error, as with httpx's own backend
    async with serving(handler, server_ctx) as port, client(timeout=5) as c:
        with pytest.raises(httpx.ConnectError):
            await c.get(f"https://127.0.0.1:{port}/")


async def test_read_timeout_and_server_closing_mid_body() -> None:
    async def stalls(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_head(reader)
        writer.write(HEAD + b"5\r\nhello\r\n")
        await writer.drain()
        await asyncio.sleep(5)
        writer.close()

    async def cuts(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_head(reader)
        writer.write(HEAD + b"5\r\nhello\r\n")
        await writer.drain()
        writer.close()

    async with serving(stalls) as port, client(timeout=httpx.Timeout(5, read=0.2)) as c:
        with pytest.raises(httpx.ReadTimeout):
            await drain(c, f"http://127.0.0.1:{port}/")
    async with serving(cuts) as port, client(timeout=5) as c:
        with pytest.raises(httpx.RemoteProtocolError):
            await drain(c, f"http://127.0.0.1:{port}/")


async def drain(c: httpx.AsyncClient, url: str) -> None:
    async with c.stream("GET", url) as r:
        async for _ in r.aiter_raw():
            pass


async def test_pooled_connection_closed_by_the_server_is_not_reused() -> None:
    connections = 0

    async def once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        await read_head(reader)
        writer.write(HEAD + chunked(b"ok"))
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.close()  # keep-alive announced, then closed while idle

    async with serving(once) as port, client(timeout=5) as c:
        assert (await c.get(f"http://127.0.0.1:{port}/")).text == "ok"
        await asyncio.sleep(0.2)
        assert (await c.get(f"http://127.0.0.1:{port}/")).text == "ok"
    assert connections == 2


async def test_connect_refused_is_a_connect_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: refused
        async with client(timeout=2) as c:
            with pytest.raises(httpx.ConnectError):
                await c.get(f"http://127.0.0.1:{port}/")
