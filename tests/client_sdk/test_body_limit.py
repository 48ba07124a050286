"""A response body read whole (long-poll batch, error, status) is bounded: a server that keeps
sending gets a clear error, not the client's memory."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator

import pytest

from firstbyte.client_sdk.errors import StreamBrokenError
from firstbyte.client_sdk.resolver import Origin, Resolver
from firstbyte.client_sdk.transports.base import TransportCut
from firstbyte.client_sdk.transports.http import HttpxSession

CHUNK = 64 << 10
SENT_AT_MOST = 64  # chunks: 4 MiB, far past the limit the test sets


@pytest.fixture
async def endless() -> AsyncIterator[str]:
    """The URL of an HTTP/1.1 server whose body goes on (bounded) in 64 KiB chunks."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        try:
            for _ in range(SENT_AT_MOST):
                writer.write(b"%x\r\n" % CHUNK + b"x" * CHUNK + b"\r\n")
                await writer.drain()
            writer.write(b"0\r\n\r\n")
            await writer.drain()
        except OSError:
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.close()
        await server.wait_closed()


async def test_read_stops_at_the_limit(endless: str) -> None:
    session = HttpxSession(Origin.parse(endless), "1.1", ssl.create_default_context(), Resolver())
    try:
        async with session.request("GET", "/", headers={}, body=None, recorder=None) as response:
            with pytest.raises(StreamBrokenError, match="larger than") as raised:
                await response.read(limit=4 * CHUNK)
        # Not a cut: the client does not resume into the same oversized answer.
        assert not isinstance(raised.value, TransportCut)
        async with session.request("GET", "/", headers={}, body=None, recorder=None) as response:
            assert len(await response.read(limit=SENT_AT_MOST * CHUNK)) == SENT_AT_MOST * CHUNK
    finally:
        await session.aclose()
