"""A loopback server that answers one streamed chat completion with given bytes, for the load
generators' tests: what they count and time from the chunks a router or the sim sends."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

ROLE = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
"""The role chunk a stream opens with (its content empty)."""
TOKEN = b'data: {"choices":[{"index":0,"delta":{"content":"%s"}}]}\n\n'
"""A content chunk (``TOKEN % text``)."""


@contextlib.asynccontextmanager
async def answering(first: bytes, then: bytes | None = None,
                    held_s: float = 0.0) -> AsyncIterator[int]:
    """A server's port: it answers a request's head with a 200 SSE head and ``first`` in one
    write, then ``then`` and ``[DONE]`` ``held_s`` later, or (``then`` None) closes without
    ``[DONE]``, as a dropped stream."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n"
            + first
        )
        await writer.drain()
        if then is not None:
            await asyncio.sleep(held_s)
            writer.write(then + b"data: [DONE]\n\n")
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        await server.wait_closed()
