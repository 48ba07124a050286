"""hypercorn's HTTP/1.1 streamed body chunks framed directly (router.hosting.h1_body): the
bytes on the wire are h11's, h11 no longer sees the chunks, and what the patch does not cover
(a response with Content-Length) still goes through h11."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import h11
import pytest

from firstbyte.router import hosting
from firstbyte.router.hosting import ServerOptions

CHUNKS = [b"data: a\n\n", b"", b"x" * 70_000, b"data: [DONE]\n\n"]


async def _app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            done = message["type"].replace("startup", "startup.complete").replace(
                "shutdown", "shutdown.complete"
            )
            await send({"type": done})
            if message["type"] == "lifespan.shutdown":
                return
    await receive()
    if scope["path"] == "/sized":
        body = b"".join(CHUNKS)
        headers = [(b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body[:10], "more_body": True})
        await send({"type": "http.response.body", "body": body[10:], "more_body": False})
        return
    await send({"type": "http.response.start", "status": 200, "headers": []})
    for chunk in CHUNKS:
        await send({"type": "http.response.body", "body": chunk, "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _get(port: int, path: str) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nhost: t\r\nconnection: close\r\n\r\n".encode())
    raw = await asyncio.wait_for(reader.read(-1), 10)
    writer.close()
    return raw


@pytest.fixture
def h11_events(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """The events the server's h11 connections were asked to send, by type."""
    seen: Counter[str] = Counter()
    send = h11.Connection.send

    def counting(self: h11.Connection, event: Any) -> Any:
        seen[type(event).__name__] += 1
        return send(self, event)

    monkeypatch.setattr(h11.Connection, "send", counting)
    return seen


async def test_streamed_chunks_are_h11_bytes_without_h11(h11_events: Counter[str]) -> None:
    listeners = hosting.bind("127.0.0.1", 0)
    async with hosting.running(_app, listeners, ServerOptions(server="hypercorn")):
        raw = await _get(listeners.port, "/stream")
        head, _, body = raw.partition(b"\r\n\r\n")
        assert b"transfer-encoding: chunked" in head.lower()
        expected = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in CHUNKS if c) + b"0\r\n\r\n"
        assert body == expected
        # Only the head and the end went through h11; no chunk did.
        assert h11_events["Data"] == 0
        assert (h11_events["Response"], h11_events["EndOfMessage"]) == (1, 1)

        h11_events.clear()
        sized = await _get(listeners.port, "/sized")
        head, _, body = sized.partition(b"\r\n\r\n")
        assert body == b"".join(CHUNKS)
        assert h11_events["Data"] == 2  # Content-Length framing stays h11's


async def test_a_client_that_does_not_read_holds_the_app_back() -> None:
    """The direct path keeps hypercorn's flow control: while the client reads nothing, the
    app's sends wait once the socket and the transport are full, instead of the transport
    buffering the whole body; every byte still arrives, in order."""
    chunk, count = b"y" * 65_536, 1_000  # 64 MiB: far more than loopback's socket buffers
    sent = 0

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        nonlocal sent
        if scope["type"] == "lifespan":
            await _app(scope, receive, send)
            return
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for _ in range(count):
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            sent += 1
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    listeners = hosting.bind("127.0.0.1", 0)
    async with hosting.running(app, listeners, ServerOptions(server="hypercorn")):
        reader, writer = await asyncio.open_connection("127.0.0.1", listeners.port, limit=1 << 20)
        writer.write(b"GET / HTTP/1.1\r\nhost: t\r\nconnection: close\r\n\r\n")
        await asyncio.sleep(1.0)  # the client reads nothing for a second
        held_at = sent
        raw = await asyncio.wait_for(reader.read(-1), 60)
        writer.close()
    assert held_at < count // 3, f"{held_at} of {count} chunks sent to a client reading nothing"
    body = raw.partition(b"\r\n\r\n")[2]
    frame = b"%x\r\n%s\r\n" % (len(chunk), chunk)
    assert body == frame * count + b"0\r\n\r\n"
