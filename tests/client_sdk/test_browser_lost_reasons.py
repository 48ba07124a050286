"""The browser client reads an error the router adds to an SSE stream without an id of its own.

The router writes ``stream_history_trimmed`` to a reader overtaken by a trim as an event with
no ``id:`` line: it is not one of the stream's events. SSE gives such an event the last id
seen (the spec's last-event-ID buffer), so a client that takes every id as a sequence number
dropped it as a replay, took the body's end for a cut and resumed into the same answer. Both
the fetch-based SSE transport and EventSource now pass it on as the APIError it is.

A scripted router on loopback (CORS for the page's origin) plays one stream.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from firstbyte.benchmarks.browser import stream_script
from firstbyte.protocol import error_codes
from firstbyte.protocol.openai import encode, error_body
from firstbyte.protocol.sse import encode_event
from tests.benchmarks.test_report_browser import chromium  # noqa: F401 (the fixture)
from tests.client_sdk.browser_stack import browser_on, world
from tests.client_sdk.test_client import MESSAGES
from tests.client_sdk.test_lost_reasons import CAP, _chunk

pytestmark = [pytest.mark.usefixtures("chromium"), pytest.mark.slow]

BODY = (
    encode_event(_chunk("", role="assistant"), id=1)
    + encode_event(_chunk("Hello"), id=2)
    + encode_event(encode(error_body(CAP, param="after",
                                     code=error_codes.STREAM_HISTORY_TRIMMED)))
)


class ScriptedRouter:
    """Answers a page's preflights, a stream's start and its SSE body (:data:`BODY`), with
    the CORS headers of the page's origin; notes each request."""

    def __init__(self, page_origin: str) -> None:
        self.origin = page_origin.encode()
        self.requests: list[str] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
                method, target = head.split(" ", 2)[:2]
                fields = dict(line.lower().split(": ", 1) for line in head.split("\r\n")[1:]
                              if ": " in line)
                await reader.readexactly(int(fields.get("content-length", "0")))
                path = target.split("?")[0]
                self.requests.append(f"{method} {path}")
                cors = b"access-control-allow-origin: " + self.origin + b"\r\n"
                if method == "OPTIONS":
                    asked = fields.get("access-control-request-headers", "").encode()
                    status, ctype, body = b"204 No Content", b"", b""
                    cors += (b"access-control-allow-methods: GET, POST\r\n"
                             b"access-control-allow-headers: " + asked + b"\r\n")
                elif path.endswith("/streams"):  # EventSource's start: the stream's id
                    status, ctype, body = b"201 Created", b"application/json", b'{"stream":"s-1"}'
                else:
                    status, ctype, body = b"200 OK", b"text/event-stream", BODY
                cors += b"access-control-expose-headers: x-firstbyte-stream\r\n"
                writer.write(b"HTTP/1.1 " + status + b"\r\n" + cors
                             + (b"content-type: " + ctype + b"\r\n" if ctype else b"")
                             + b"x-firstbyte-stream: s-1\r\ncontent-length: %d\r\n\r\n"
                             % len(body) + body)
                await writer.drain()
        writer.close()


@contextlib.asynccontextmanager
async def scripted_router(page_origin: str) -> AsyncIterator[tuple[ScriptedRouter, str]]:
    scripted = ScriptedRouter(page_origin)
    server = await asyncio.start_server(scripted.handle, "127.0.0.1", 0)
    async with server:
        yield scripted, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1"


@pytest.mark.parametrize("transport", ["sse-fetch", "eventsource"])
async def test_an_idless_trim_error_ends_the_stream_with_its_reason(transport: str) -> None:
    request = {"model": "m", "messages": MESSAGES, "max_tokens": 5}
    # The modules from the router, the stream from the scripted one.
    async with (world() as w, scripted_router(w.page_origin) as (scripted, url),
                browser_on(w) as page):
        got = await page.evaluate(
            stream_script(url, "t", transport, request, options={"maxResumes": 0}))
    assert (got.get("error"), got.get("code")) == ("APIError", "stream_history_trimmed"), got
    assert got["message"] == CAP
    # One stream, never resumed: the error was read, not taken for a cut.
    assert [r for r in scripted.requests if not r.startswith("OPTIONS")] == [
        "POST /v1/chat/completions" if transport == "sse-fetch" else "POST /v1/streams",
        *(["GET /v1/streams/s-1"] if transport == "eventsource" else []),
    ], scripted.requests
    assert got["timings"]["resumes"] == 0
