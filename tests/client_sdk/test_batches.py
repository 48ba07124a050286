"""Events arrive in batches (one per network read) and leave the client one at a time.

A raw HTTP/1.1 server on loopback writes each answer in one ``send``, so the client reads it as
one batch; the batch holds a sequence gap in its middle. The client must deliver the events
before the gap, drop the rest of that batch, resume after the last event it delivered and take
the replay without repeating anything. The read-ahead queue counts events, not batches.
"""

from __future__ import annotations

import asyncio
import contextlib

import msgspec
import pytest

from firstbyte.client_sdk.client import AsyncClient, _ReadAhead
from firstbyte.client_sdk.transports.base import Event, Opened

WORDS = [f" w{i}" for i in range(1, 13)]
STREAM_ID = "s" * 32


def chunk(text: str) -> bytes:
    return msgspec.json.encode({"id": "c", "created": 0, "model": "m", "choices": [
        {"index": 0, "delta": {"content": text}, "finish_reason": None}]})


def sse(seqs: list[int]) -> bytes:
    """Events ``seqs`` (1-based; word n is event n, then [DONE] as event len(WORDS) + 1)."""
    out = b""
    for seq in seqs:
        data = chunk(WORDS[seq - 1]) if seq <= len(WORDS) else b"[DONE]"
        out += b"id: %d\ndata: %s\n\n" % (seq, data)
    return out


class GapServer:
    """``POST``: events 1-4, then 6-8 (5 is missing), one write, then the connection closes.
    ``GET /v1/streams/{id}`` with ``Last-Event-ID: N``: every event after N, then [DONE]."""

    def __init__(self) -> None:
        self.resumed_after: list[int] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode().split("\r\n")
            headers = dict(line.lower().split(": ", 1) for line in lines[1:] if ": " in line)
            await reader.readexactly(int(headers.get("content-length", "0")))
            if lines[0].startswith("POST"):
                body = sse([1, 2, 3, 4, 6, 7, 8])
            else:
                after = int(headers["last-event-id"])
                self.resumed_after.append(after)
                body = sse(list(range(after + 1, len(WORDS) + 2)))
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                         b"x-firstbyte-stream: " + STREAM_ID.encode() + b"\r\n"
                         b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body) + body)
            await writer.drain()
        writer.close()


async def test_a_gap_inside_a_batch_resumes_after_the_last_event_delivered() -> None:
    server = GapServer()
    listener = await asyncio.start_server(server.handle, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    async with listener, AsyncClient(
        f"http://127.0.0.1:{port}/v1", "key", http="1.1", resume_backoff_s=0.0,
    ) as client, client.stream(model="m", messages=[]) as stream:
        deltas = [delta async for delta in stream]
    assert server.resumed_after == [4]
    assert [d.seq for d in deltas] == list(range(1, len(WORDS) + 1))
    assert stream.text == "".join(WORDS)
    timings = stream.timings
    assert timings.resumes == 1
    assert timings.output_chunks == len(WORDS)
    assert len(timings.inter_token_ms) == len(WORDS) - 1


async def test_read_ahead_counts_a_batch_as_its_events() -> None:
    queue = _ReadAhead(4)
    queue.put_nowait(Opened("s"))
    batch = [Event(seq, b"x") for seq in range(1, 6)]
    queue.put_nowait(batch)  # room for one more item: a whole batch goes in
    assert queue.qsize() == 6
    assert queue.full()
    with pytest.raises(asyncio.QueueFull):
        queue.put_nowait(Event(6, b"x"))
    assert isinstance(queue.get_nowait(), Opened)
    assert queue.get_nowait() is batch
    assert queue.qsize() == 0
    assert queue.empty()
