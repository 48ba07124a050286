"""Keep-warm: prewarmed connections outlive the server's idle timeouts because the pool
exercises them; without keep-warm the same idle period makes the next request cold.

The router times an idle connection two ways: HTTP/1.1 and HTTP/2 by ``keep_alive_timeout_s``,
QUIC by ``client_header_timeout_s`` without a request (a PING does not count), so both are
short here."""

from __future__ import annotations

import asyncio

import pytest

from firstbyte.client_sdk.client import AsyncClient
from tests.client_sdk.conftest import ROUTER_KEY, start_stack
from tests.client_sdk.protocol_server import RunningServer
from tests.client_sdk.test_client import stream_once

SERVER_IDLE_S = 1.0


@pytest.mark.parametrize(("transport", "http"), [("sse", "1.1"), ("sse", "2"), ("sse", "3"),
                                                 ("websocket", "1.1")])
async def test_keep_warm_outlives_the_server_idle_timeout(
    tls_files: tuple[str, str, str], transport: str, http: str
) -> None:
    async with start_stack(tls_files, keep_alive_timeout_s=SERVER_IDLE_S,
                           header_timeout_s=SERVER_IDLE_S) as stack, \
            AsyncClient(stack.base_url, ROUTER_KEY, transport=transport, http=http,  # type: ignore[arg-type]
                        ca_file=stack.ca_file, keepalive_interval_s=0.3) as client:
        await client.prewarm()
        await asyncio.sleep(2.5 * SERVER_IDLE_S)
        _, timings, _ = await stream_once(client, max_tokens=3)
    assert timings.warm, timings


@pytest.mark.parametrize("http", ["1.1", "2", "3"])
async def test_without_keep_warm_the_server_closes_the_idle_connection(
    tls_files: tuple[str, str, str], http: str
) -> None:
    async with start_stack(tls_files, keep_alive_timeout_s=SERVER_IDLE_S,
                           header_timeout_s=SERVER_IDLE_S) as stack, \
            AsyncClient(stack.base_url, ROUTER_KEY, http=http,  # type: ignore[arg-type]
                        ca_file=stack.ca_file, keepalive_interval_s=60) as client:
        await client.prewarm()
        await asyncio.sleep(2.5 * SERVER_IDLE_S)
        _, timings, _ = await stream_once(client, max_tokens=3)
    assert not timings.warm
    # A new handshake (QUIC's may be a 0-RTT resumption, still a new connection).
    handshake = timings.quic_handshake_ms if http == "3" else timings.tls_handshake_ms
    assert handshake is not None, timings


async def test_http2_opens_another_connection_past_a_connections_streams(
    server: RunningServer, ca_file: str
) -> None:
    # hypercorn (the router's server) allows 100 streams a connection. httpcore kept every
    # request on its first HTTP/2 connection, those past 100 waiting for a stream to end:
    # 2,000 streams through one client ran 100 at a time (TTFT seconds, the router's 56 ms).
    streams = 150
    started = 0
    all_started = asyncio.Event()

    async def one(client: AsyncClient) -> None:
        nonlocal started
        async with client.stream(model="stall-1", messages=[{"role": "user", "content": "hi"}],
                                 max_tokens=4) as stream:
            async for delta in stream:
                if delta.text:
                    started += 1
                    if started == streams:
                        all_started.set()
                    await asyncio.sleep(3600)  # hold the stream open

    async with AsyncClient(server.base_url, "test-key", transport="sse", http="2",
                           ca_file=ca_file) as client:
        tasks = [asyncio.create_task(one(client)) for _ in range(streams)]
        try:
            await asyncio.wait_for(all_started.wait(), 10)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        session = client.pool.session(client.origin, "2")
    assert started == streams
    assert len(session._clients) == 2  # type: ignore[attr-defined]
