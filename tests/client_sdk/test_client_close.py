"""Closing the client while streams are read (an application shutting down, a request
handler's client leaving its ``async with``).

The streams end at once with a ``StreamBrokenError`` saying the client was closed (before,
SSE and WebSocket streams went on reading on connections the close had let go and were left
open, "unclosed transport"; long-poll ones raised httpx's own ``RuntimeError``), and the
closed client opens no connection again.
"""

from __future__ import annotations

import asyncio
import gc
import warnings
from collections.abc import AsyncIterator

import pytest

from firstbyte.client_sdk.client import AsyncClient
from firstbyte.client_sdk.errors import FirstbyteError, StreamBrokenError
from firstbyte.router.sim.profiles import get_profile
from tests.client_sdk.conftest import ROUTER_KEY, Stack, start_stack

MESSAGES = [{"role": "user", "content": "Tell me about latency."}]
PROFILE = "h100-7b"  # ~10 ms a token: a stream of 400 tokens is still being read at the close


@pytest.fixture
async def slow_stack(tls_files: tuple[str, str, str]) -> AsyncIterator[Stack]:
    async with start_stack(tls_files, profile=PROFILE) as running:
        yield running


@pytest.mark.parametrize(("transport", "http"), [("sse", "1.1"), ("sse", "2"), ("sse", "3"),
                                                  ("websocket", "1.1"), ("longpoll", "2")])
async def test_closing_the_client_ends_its_open_streams_with_a_clear_error(
    slow_stack: Stack, transport: str, http: str,
) -> None:
    model = get_profile(PROFILE).model
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        client = AsyncClient(slow_stack.base_url, ROUTER_KEY, ca_file=slow_stack.ca_file,
                             transport=transport, http=http)  # type: ignore[arg-type]
        delivered: list[str] = []
        reading = asyncio.Event()

        async def read() -> None:
            async with client.stream(model=model, messages=MESSAGES,
                                     max_tokens=400) as stream:
                async for delta in stream:
                    delivered.append(delta.text)
                    if len(delivered) == 3:
                        reading.set()

        reader = asyncio.create_task(read())
        await asyncio.wait_for(reading.wait(), 10)
        await client.aclose()
        with pytest.raises(StreamBrokenError, match="the client was closed while stream"):
            await asyncio.wait_for(reader, 2)
        with pytest.raises(FirstbyteError, match="the client is closed"):
            async with client.stream(model=model, messages=MESSAGES, max_tokens=4):
                pass
        gc.collect()
    assert [w for w in caught if issubclass(w.category, ResourceWarning)] == []


async def test_a_client_closed_with_http2_streams_in_flight_leaves_none_on_the_router(
    slow_stack: Stack,
) -> None:
    """The router ends every request of an HTTP/2 connection its client closed mid-stream.
    Before, the second stream's close on the dead connection deadlocked hypercorn's writer
    (the reset of an unfinished stream flushed to it while the writer held its lock): every
    other request stayed "being answered", blocked in its send, and a drain never ended."""
    model = get_profile(PROFILE).model
    client = AsyncClient(slow_stack.base_url, ROUTER_KEY, ca_file=slow_stack.ca_file,
                         transport="sse", http="2")
    reading: set[int] = set()
    all_reading = asyncio.Event()

    async def read(i: int) -> None:
        async with client.stream(model=model, messages=MESSAGES, max_tokens=400) as stream:
            async for _ in stream:
                reading.add(i)
                if len(reading) == 20:
                    all_reading.set()

    readers = [asyncio.create_task(read(i)) for i in range(20)]
    await asyncio.wait_for(all_reading.wait(), 20)
    app = slow_stack.app
    assert app is not None
    assert app.requests_in_flight >= 20
    await client.aclose()
    await asyncio.gather(*readers, return_exceptions=True)
    for _ in range(100):  # 5 s: the router notices the connection's end at once
        if app.requests_in_flight == 0:
            break
        await asyncio.sleep(0.05)
    assert app.requests_in_flight == 0
