"""The tenancy benchmark's load generator tells a stream that failed before its first token
from one that failed after: the role chunk is not a token."""

from __future__ import annotations

import asyncio

from firstbyte.benchmarks.scenarios._tenancy_load import Tally, stream_once

ROLE = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
TOKEN = b'data: {"choices":[{"index":0,"delta":{"content":"Hello"}}]}\n\n'


async def _tokens_before_a_drop(sent: bytes) -> int:
    """Content chunks counted from a stream that sends ``sent`` and closes without [DONE]."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\n" + sent)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        outcome = await stream_once(
            server.sockets[0].getsockname()[1], "good", {}, {}, Tally())
    finally:
        server.close()
        await server.wait_closed()
    assert outcome.error is not None  # closed before [DONE]
    return outcome.tokens


async def test_a_drop_after_the_role_chunk_alone_is_before_any_token() -> None:
    assert await _tokens_before_a_drop(ROLE) == 0


async def test_content_chunks_are_counted_without_the_role_chunk() -> None:
    assert await _tokens_before_a_drop(ROLE + TOKEN + TOKEN) == 2
