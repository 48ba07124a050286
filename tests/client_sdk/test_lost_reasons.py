"""A stream the router ends as trimmed or lost: the SDK's error carries the router's reason.

The router knows why (a key over its share of the store, Redis's per-stream bound, Redis full,
a producer's lease evicted or its process stopped) and says so in the error event; the SDK
used to put a fixed reason of its own in front, which contradicted the router's for every
cause but one. A scripted HTTP/1.1 server on loopback plays the router's side of one stream.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from firstbyte.client_sdk.client import AsyncClient
from firstbyte.client_sdk.errors import StreamHistoryTrimmedError, StreamLostError
from firstbyte.protocol import error_codes
from firstbyte.protocol.headers import STREAM_HEADER
from firstbyte.protocol.openai import encode, error_body
from firstbyte.protocol.sse import encode_event
from tests.client_sdk.test_client import MESSAGES

CAP = (
    "Events 3 to 40 of this stream were dropped: the region's shared state (Redis) keeps about"
    " the last 16 events of a stream (state.max_events_per_stream). Read on from after=40, or"
    " send the request again."
)
EVICTED = (
    "The lease of the process producing this stream is gone from Redis, which evicts keys"
    " (maxmemory-policy allkeys-lru): the process may still be running."
)


def _chunk(content: str | None, role: str | None = None) -> bytes:
    delta = {"content": content} | ({"role": role} if role else {})
    return encode({"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m",
                   "choices": [{"index": 0, "delta": delta, "finish_reason": None}]})


@pytest.fixture
async def ends_with() -> AsyncIterator[tuple[dict[str, bytes], str]]:
    """A server answering every chat completion with a role chunk, one token and then
    ``error["event"]`` (an error event as the router writes it); its base URL."""
    error: dict[str, bytes] = {}

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.lower().split(b"\r\n")
                      if line.startswith(b"content-length:"))
        await reader.readexactly(length)
        body = (
            encode_event(_chunk("", role="assistant"), id=1)
            + encode_event(_chunk("Hello"), id=2)
            + error["event"]
        )
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            + STREAM_HEADER.encode() + b": s-1\r\n"
            + b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body) + body
        )
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield error, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1"
    finally:
        server.close()
        await server.wait_closed()


async def _read(url: str) -> tuple[str, BaseException]:
    text = ""
    async with AsyncClient(url, "k", transport="sse", http="1.1", max_resumes=0) as client:
        try:
            async with client.stream(model="m", messages=MESSAGES, max_tokens=5) as stream:
                async for delta in stream:
                    text += delta.text
        except (StreamHistoryTrimmedError, StreamLostError) as exc:
            return text, exc
    raise AssertionError("the stream ended without its error")


async def test_a_trim_says_the_routers_reason_not_the_keys_share(
    ends_with: tuple[dict[str, bytes], str],
) -> None:
    error, url = ends_with
    body = error_body(CAP, param="after", code=error_codes.STREAM_HISTORY_TRIMMED)
    # Without an id, as the router writes it (readers.trimmed_event): not one of the
    # stream's events, though SSE gives it the last id seen (2), a replay's.
    error["event"] = encode_event(encode(body))
    text, exc = await _read(url)
    assert isinstance(exc, StreamHistoryTrimmedError)
    assert (text, exc.delivered_text, exc.last_seq) == ("Hello", "Hello", 2)
    assert CAP in str(exc)
    assert "key's share" not in str(exc)  # not the SDK's guess: the router said why


async def test_a_lost_stream_says_the_routers_reason(
    ends_with: tuple[dict[str, bytes], str],
) -> None:
    error, url = ends_with
    body = error_body(EVICTED, "server_error", code=error_codes.STREAM_LOST)
    error["event"] = encode_event(encode(body), id=3)  # one of the stream's events
    text, exc = await _read(url)
    assert isinstance(exc, StreamLostError)
    assert (text, exc.delivered_text, exc.last_seq) == ("Hello", "Hello", 3)
    assert EVICTED in str(exc)
    assert "process stopped" not in str(exc)
