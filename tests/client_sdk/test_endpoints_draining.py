"""A router that drains before a Responses or Messages stream ends: its ``draining`` error
event comes in the format's own shape, and the SDK acts on it as for chat: before any
content it sends the request again (the next region takes it), after content it raises
:class:`StreamLostError` with what was delivered."""

from __future__ import annotations

import asyncio

import pytest

from firstbyte.client_sdk.errors import StreamLostError
from firstbyte.router.drain import drain
from tests.client_sdk.test_draining import _client, _region, _url
from tests.client_sdk.test_endpoints import open_stream

TRANSPORTS = [("sse", "2"), ("websocket", "1.1"), ("longpoll", "1.1")]
MODEL = "sim-instant"  # what test_draining's sims serve


@pytest.mark.parametrize("fmt", ["responses", "messages"])
@pytest.mark.parametrize(("transport", "http"), TRANSPORTS)
async def test_draining_before_content_sends_the_request_again(
    tls_files: tuple[str, str, str], fmt: str, transport: str, http: str
) -> None:
    async with (
        _region(tls_files, "first", ["stall:after=0"]) as first,  # never a token
        _region(tls_files, "second", []) as second,
        _client({"first": _url(first), "second": _url(second)}, tls_files, transport, http)
        as client,
    ):
        stream = open_stream(client, fmt, 12, model=MODEL)
        async with stream:
            first_id = stream.stream_id
            draining = asyncio.ensure_future(drain(first.app, None))
            events = [event async for event in stream]
        await draining
    assert events[-1].type in ("response.completed", "response.incomplete", "message_stop")
    assert stream.text
    assert stream.timings.output_chunks == len(stream.text.split())
    assert stream.stream_id != first_id  # a new stream, on the second region's router
    assert stream.timings.region == "second"
    assert stream.timings.first_token_ms is not None
    assert stream.timings.first_token_ms >= 300  # the wasted attempt is in the timings


@pytest.mark.parametrize("fmt", ["responses", "messages"])
async def test_draining_after_content_raises_stream_lost_with_the_text(
    tls_files: tuple[str, str, str], fmt: str
) -> None:
    async with (
        _region(tls_files, "only", ["stall:after=3"]) as only,
        _client(_url(only), tls_files, "sse", "2") as client,
    ):
        drained: list[asyncio.Future[None]] = []
        stream = open_stream(client, fmt, 12, model=MODEL)

        async def read() -> None:
            async with stream:
                async for _ in stream:
                    if stream.timings.output_chunks == 3 and not drained:
                        drained.append(asyncio.ensure_future(drain(only.app, None)))

        with pytest.raises(StreamLostError) as lost:
            await read()
        await drained[0]
    assert lost.value.delivered_text == stream.text
    assert stream.timings.output_chunks == 3
    assert "its router shut down before the end" in str(lost.value)
