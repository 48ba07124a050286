"""HTTP/1.0 clients (router.hosting.http10): an answer of unknown length reaches a 1.0 client
as its bytes, delimited by the connection's close (HTTP/1.0 has no chunked coding, RFC 9112
section 6.1), on every server the config offers; an answer with a length keeps it. Checked
with real curl speaking HTTP/1.0, reading the raw bytes (``--raw``: curl would otherwise
undo a chunked coding even for 1.0); the router's own SSE to a 1.0 client:
tests/router/test_transports.py::test_curl_http10_reads_the_events_unchunked."""

from __future__ import annotations

import asyncio
import subprocess
from typing import Any

import pytest

from firstbyte.router import hosting
from firstbyte.router.hosting import ServerOptions

CHUNKS = [b"data: a\n\n", b"", b"x" * 70_000, b"data: [DONE]\n\n"]


async def _app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            await send({"type": message["type"] + ".complete"})
            if message["type"] == "lifespan.shutdown":
                return
    await receive()
    headers = [(b"content-type", b"text/event-stream")]
    if scope["path"] == "/sized":
        body = b"".join(CHUNKS)
        headers.append((b"content-length", str(len(body)).encode()))
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body[:10], "more_body": True})
        await send({"type": "http.response.body", "body": body[10:], "more_body": False})
        return
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    for chunk in CHUNKS:
        await send({"type": "http.response.body", "body": chunk, "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


async def curl_http10(url: str, *args: str) -> tuple[dict[str, str], bytes]:
    """POST to ``url`` with curl speaking HTTP/1.0: the answer's headers (lower-cased names;
    a name seen twice fails) and its raw body, as they came on the connection."""
    process = await asyncio.create_subprocess_exec(
        "/usr/bin/curl", "-sS", "-N", "--raw", "--http1.0", "-i", "--max-time", "20",
        *args, url,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 30)
    # curl ends (0) only once the server closed: a close-delimited body ends there.
    assert process.returncode == 0, err
    head, _, body = out.partition(b"\r\n\r\n")
    status, *lines = head.decode("latin-1").split("\r\n")
    assert status.startswith("HTTP/1.1 200"), status
    headers: dict[str, str] = {}
    for line in lines:
        name, _, value = line.partition(":")
        assert name.lower() not in headers, line
        headers[name.lower()] = value.strip()
    return headers, body


@pytest.mark.parametrize("server", ["auto", "uvicorn", "hypercorn"])
async def test_a_stream_reaches_an_http10_client_as_its_bytes_until_the_close(
    server: str,
) -> None:
    listeners = hosting.bind("127.0.0.1", 0)
    async with hosting.running(_app, listeners, ServerOptions(server=server)):
        url = f"http://127.0.0.1:{listeners.port}"
        headers, body = await curl_http10(url + "/stream", "--data", "{}")
        assert body == b"".join(CHUNKS)  # no chunk-size line, no last chunk
        assert "transfer-encoding" not in headers
        assert "content-length" not in headers
        assert headers["connection"].lower() == "close"

        headers, body = await curl_http10(url + "/sized", "--data", "{}")
        assert body == b"".join(CHUNKS)
        assert headers["content-length"] == str(len(body))
        assert "transfer-encoding" not in headers
