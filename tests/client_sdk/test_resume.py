"""Resume and the idle watchdog, end to end through the real router and sim.

A proxy between the SDK and the router cuts the first connection after a fixed number of
bytes (TCP: forwards them, then resets both sides; QUIC: goes silent, as a lost path does).
The SDK must resume from the last event it delivered and hand the application every token
exactly once.
"""

from __future__ import annotations

import time

import pytest

from firstbyte.client_sdk.client import AsyncClient
from firstbyte.client_sdk.errors import StreamStalledError
from tests.client_sdk.conftest import ROUTER_KEY, Stack, start_stack
from tests.client_sdk.cutproxy import TcpCutProxy, UdpCutProxy
from tests.client_sdk.test_client import MESSAGES, reference_text, stream_once

TOKENS = 200
CUT_AFTER = 9000  # bytes: past the TLS handshake, well before the ~40 KB of a 200-token stream


@pytest.mark.parametrize(("transport", "http"), [
    ("sse", "1.1"), ("sse", "2"), ("websocket", "1.1"), ("longpoll", "1.1"), ("longpoll", "2"),
])
async def test_tcp_cut_mid_stream_loses_and_repeats_nothing(
    stack: Stack, transport: str, http: str
) -> None:
    expected = await reference_text(stack, TOKENS)
    async with TcpCutProxy(stack.port, cut_after=CUT_AFTER) as proxy, AsyncClient(
        stack.url_via(proxy.port), ROUTER_KEY, transport=transport,  # type: ignore[arg-type]
        http=http, ca_file=stack.ca_file, idle_timeout_s=10,
    ) as client:
        text, timings, seqs = await stream_once(client, max_tokens=TOKENS)
    assert proxy.cuts_done == 1
    assert proxy.connections >= 2  # the cut connection and the one the resume opened
    assert text == expected
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # every event once, in order
    assert timings.output_chunks > 60  # long enough that the cut fell inside the stream
    if transport != "longpoll":
        # Long-poll retries a failed poll from its cursor without a stream-level resume.
        assert timings.resumes >= 1


async def test_quic_path_going_silent_mid_stream_resumes_on_a_new_connection(stack: Stack) -> None:
    expected = await reference_text(stack, TOKENS)
    async with UdpCutProxy(stack.port, cut_after=CUT_AFTER) as proxy, AsyncClient(
        stack.url_via(proxy.port), ROUTER_KEY, http="3", ca_file=stack.ca_file, idle_timeout_s=1.0,
    ) as client:
        text, timings, seqs = await stream_once(client, max_tokens=TOKENS)
    assert proxy.cuts_done == 1
    assert text == expected
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    assert timings.resumes == 1
    assert timings.http_version == "HTTP/3"


@pytest.mark.parametrize(("transport", "http"), [("sse", "2"), ("websocket", "1.1")])
async def test_watchdog_ignores_heartbeats_and_detects_a_stall(
    tls_files: tuple[str, str, str], transport: str, http: str
) -> None:
    idle = 0.8
    received: list[str] = []

    async def consume(client: AsyncClient) -> None:
        async with client.stream(model="sim-instant", messages=MESSAGES, max_tokens=20) as stream:
            async for delta in stream:
                if delta.text:
                    received.append(delta.text)

    async with start_stack(tls_files, faults=["stall:after=3"], heartbeat_s=0.1) as stack, \
            AsyncClient(stack.base_url, ROUTER_KEY, transport=transport, http=http,  # type: ignore[arg-type]
                        ca_file=stack.ca_file, idle_timeout_s=idle, stall_retries=1) as client:
        started = time.monotonic()
        with pytest.raises(StreamStalledError) as info:
            await consume(client)
        elapsed = time.monotonic() - started
    assert len(received) == 3
    assert info.value.idle_s == idle
    # One stall, one resume on a fresh connection, one more stall: at least two idle periods
    # although heartbeats arrived every 0.1 s.
    assert elapsed >= 2 * idle
