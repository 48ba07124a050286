"""End to end: the SDK against the real router in front of the real sim, on loopback with TLS."""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Any

import httpx
import pytest

from firstbyte.client_sdk.client import AsyncClient
from firstbyte.client_sdk.errors import AuthenticationError, ConnectError, RateLimitError, TLSError
from firstbyte.client_sdk.sync import Client
from firstbyte.client_sdk.timings import Timings
from tests.client_sdk.conftest import ROUTER_KEY, Stack, start_stack
from tests.client_sdk.protocol_server import RunningServer

MESSAGES = [{"role": "user", "content": "Tell me about latency."}]
COMBOS = [("sse", "1.1"), ("sse", "2"), ("sse", "3"), ("websocket", "1.1"),
          ("longpoll", "1.1"), ("longpoll", "2"), ("longpoll", "3")]


async def reference_text(stack: Stack, max_tokens: int, seed: int = 11) -> str:
    """What the sim answers to this request, asked directly and without streaming."""
    async with httpx.AsyncClient() as http:
        response = await http.post(f"{stack.sim_url}/v1/chat/completions", json={
            "model": "sim-instant", "messages": MESSAGES, "max_tokens": max_tokens,
            "seed": seed})
    content: str = response.json()["choices"][0]["message"]["content"]
    return content


async def stream_once(client: AsyncClient, max_tokens: int = 24, **kw: Any) -> tuple[str, Timings, list[int]]:
    seqs: list[int] = []
    async with client.stream(model="sim-instant", messages=MESSAGES, max_tokens=max_tokens,
                             seed=11, **kw) as stream:
        parts = []
        async for delta in stream:
            parts.append(delta.text)
            if delta.seq is not None:
                seqs.append(delta.seq)
    assert stream.usage is not None
    # The sim may stop before max_tokens; every token it generated must have arrived once.
    assert stream.usage.completion_tokens == stream.timings.output_chunks
    assert stream.usage.completion_tokens <= max_tokens
    return "".join(parts), stream.timings, seqs


def assert_serial_phases(timings: Timings) -> None:
    """The connection phases end before the request is sent, which precedes the first byte."""
    assert timings.request_sent_ms is not None
    assert timings.first_byte_ms is not None
    setup = timings.connect_ms + (timings.pool_wait_ms or 0.0)
    assert setup <= timings.request_sent_ms + 0.001, timings
    assert timings.request_sent_ms <= timings.first_byte_ms


@pytest.mark.parametrize(("transport", "http"), COMBOS)
async def test_every_transport_streams_the_sims_text(stack: Stack, transport: str, http: str) -> None:
    expected = await reference_text(stack, 24)
    async with AsyncClient(stack.base_url, ROUTER_KEY, transport=transport, http=http,  # type: ignore[arg-type]
                           ca_file=stack.ca_file, idle_timeout_s=10) as client:
        text, timings, seqs = await stream_once(client)
    assert text == expected
    assert seqs == sorted(set(seqs))
    assert timings.transport == transport
    assert timings.http_version == {"1.1": "HTTP/1.1", "2": "HTTP/2", "3": "HTTP/3"}[http]
    assert timings.stream_id is not None
    assert timings.warm is False
    assert timings.output_chunks == 24
    assert len(timings.inter_token_ms) == 23
    assert timings.first_byte_ms is not None
    assert timings.first_token_ms is not None
    assert timings.last_token_ms is not None
    assert timings.first_byte_ms <= timings.first_token_ms <= timings.last_token_ms
    assert_serial_phases(timings)
    if http == "3":
        assert timings.quic_handshake_ms is not None
        assert timings.tcp_connect_ms is None
    else:
        assert timings.tcp_connect_ms is not None
        assert timings.tls_handshake_ms is not None
    if transport == "sse":
        assert "queue" in timings.server_timing
        assert timings.region == "sdk-test"


@pytest.mark.parametrize(("transport", "http"), [("sse", "1.1"), ("sse", "2"), ("sse", "3"),
                                                 ("websocket", "1.1"), ("longpoll", "2")])
async def test_prewarmed_request_skips_the_handshake_the_cold_first_byte_waits_for(
    stack: Stack, transport: str, http: str
) -> None:
    """A cold request's first byte comes after its handshake; a prewarmed one has none to wait for.

    On loopback the handshake costs a few milliseconds, the same as the scheduling noise of a
    loaded CI machine, so comparing the two first-byte times would be a coin toss there. The
    physical bound holds on any machine: every cold first byte is at least its own serial
    connection phases later than the request start, and the warm requests have no such phase.
    How much sooner that makes the first byte over real distances is measured by the transport
    benchmarks, not here."""
    for _ in range(3):
        async with AsyncClient(stack.base_url, ROUTER_KEY, transport=transport, http=http,  # type: ignore[arg-type]
                               ca_file=stack.ca_file) as client:
            _, t_cold, _ = await stream_once(client, max_tokens=4)
        assert not t_cold.warm
        assert t_cold.dns_ms is not None
        assert t_cold.first_byte_ms is not None
        handshake = sum(ms for ms in (t_cold.dns_ms, t_cold.tcp_connect_ms, t_cold.tls_handshake_ms,
                                      t_cold.quic_handshake_ms) if ms is not None)
        assert (t_cold.tls_handshake_ms or t_cold.quic_handshake_ms or 0.0) > 0.0, t_cold
        assert t_cold.first_byte_ms >= handshake, t_cold
    async with AsyncClient(stack.base_url, ROUTER_KEY, transport=transport, http=http,  # type: ignore[arg-type]
                           ca_file=stack.ca_file) as client:
        await client.prewarm()
        for _ in range(3):
            _, t_warm, _ = await stream_once(client, max_tokens=4)
            assert t_warm.warm
            assert (t_warm.dns_ms, t_warm.tcp_connect_ms, t_warm.tls_handshake_ms,
                    t_warm.quic_handshake_ms) == (None, None, None, None)
            assert t_warm.first_byte_ms is not None


@pytest.mark.parametrize(("transport", "http"), [("sse", "2"), ("sse", "3"), ("websocket", "1.1"),
                                                 ("longpoll", "1.1")])
async def test_wrong_api_key_is_an_authentication_error(stack: Stack, transport: str, http: str) -> None:
    async with AsyncClient(stack.base_url, "sk-wrong-key-000", transport=transport, http=http,  # type: ignore[arg-type]
                           ca_file=stack.ca_file) as client:
        with pytest.raises(AuthenticationError) as info:
            await stream_once(client)
    assert info.value.status in (401, None)


@pytest.mark.parametrize("http", ["2", "3"])
async def test_untrusted_certificate_is_a_tls_error(stack: Stack, http: str) -> None:
    async with AsyncClient(stack.base_url, ROUTER_KEY, http=http,  # type: ignore[arg-type]
                           connect_timeout_s=5) as client:
        with pytest.raises(TLSError):
            await stream_once(client)


async def test_unreachable_server_is_a_connect_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: connection refused
        async with AsyncClient(f"https://localhost:{port}/v1", ROUTER_KEY) as client:
            with pytest.raises(ConnectError, match="cannot connect"):
                await stream_once(client)


async def test_saturation_is_a_rate_limit_error_with_retry_after(server: RunningServer,
                                                                  ca_file: str) -> None:
    async with AsyncClient(server.base_url, "test-key", ca_file=ca_file, retries=0) as client:
        with pytest.raises(RateLimitError) as info:
            async with client.stream(model="busy", messages=MESSAGES):
                pass
    assert info.value.retry_after == 2.0
    assert info.value.status == 429


async def test_render_callback_sets_render_time(stack: Stack) -> None:
    seen: list[str] = []
    async with AsyncClient(stack.base_url, ROUTER_KEY, ca_file=stack.ca_file) as client:
        _, timings, _ = await stream_once(client, on_first_token=lambda d: seen.append(d.text))
    assert len(seen) == 1
    assert timings.render_ms is not None
    assert timings.first_token_ms is not None
    assert timings.render_ms >= timings.first_token_ms


def test_sync_client_streams_on_its_own_loop(server: RunningServer, ca_file: str) -> None:
    from tests.client_sdk.protocol_server import expected_text

    with Client(server.base_url, "test-key", ca_file=ca_file, http="2") as client:
        client.prewarm()
        with client.stream(model="m", messages=MESSAGES, max_tokens=9) as stream:
            text = "".join(delta.text for delta in stream)
        assert text == expected_text(9)
        assert stream.usage is not None
        assert stream.timings.warm
        assert stream.timings.http_version == "HTTP/2"


async def test_abandoning_a_stream_half_way_frees_the_connection(stack: Stack) -> None:
    async with AsyncClient(stack.base_url, ROUTER_KEY, ca_file=stack.ca_file, http="1.1") as client:
        await client.prewarm()
        async with client.stream(model="sim-instant", messages=MESSAGES, max_tokens=50) as stream:
            async for _ in stream:
                break
        _, timings, _ = await stream_once(client, max_tokens=3)
    assert timings.output_chunks == 3


async def test_h3_reconnect_resumes_the_tls_session_and_sends_0rtt(stack: Stack) -> None:
    async with AsyncClient(stack.base_url, ROUTER_KEY, http="3", ca_file=stack.ca_file) as client:
        _, first, _ = await stream_once(client, max_tokens=3)
        assert f"localhost:{stack.port}" in client.pool.tickets  # type: ignore[operator]
        await client.pool.session(client.origin, "3").reset()  # connection gone, ticket kept
        _, again, _ = await stream_once(client, max_tokens=3)
    assert not first.zero_rtt
    assert first.quic_handshake_ms is not None
    assert again.quic_handshake_ms is not None  # a new connection...
    assert again.zero_rtt  # ...whose request went out as early data, accepted by the router
    assert_serial_phases(first)
    assert_serial_phases(again)  # the handshake's end overlaps the request: not counted
    assert again.output_chunks == 3


@pytest.mark.parametrize("transport", ["sse", "websocket", "longpoll"])
async def test_tool_call_deltas_stream_through(server: RunningServer, ca_file: str,
                                               transport: str) -> None:
    from tests.client_sdk.protocol_server import TOOL_ARGUMENTS

    async with AsyncClient(server.base_url, "test-key", transport=transport,  # type: ignore[arg-type]
                           ca_file=ca_file) as client, \
            client.stream(model="tools", messages=MESSAGES, tools=[{
                "type": "function", "function": {"name": "get_weather"}}]) as stream:
        deltas = [delta async for delta in stream]
    calls = [call for delta in deltas for call in delta.tool_calls]
    assert calls[0].id == "call_1"
    assert calls[0].function is not None
    assert calls[0].function.name == "get_weather"
    arguments = "".join(c.function.arguments or "" for c in calls if c.function is not None)
    assert arguments == "".join(TOOL_ARGUMENTS)
    assert deltas[-1].finish_reason == "tool_calls"
    assert stream.timings.output_chunks == 1 + len(TOOL_ARGUMENTS)
    assert stream.text == ""


async def test_failover_to_the_next_region_when_the_first_is_unreachable(stack: Stack) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        down = f"https://localhost:{s.getsockname()[1]}/v1"
        async with AsyncClient([down, stack.base_url], ROUTER_KEY, ca_file=stack.ca_file) as client:
            text, timings, _ = await stream_once(client, max_tokens=5)
    assert text == await reference_text(stack, 5)
    assert timings.region == "sdk-test"


async def test_an_app_streams_more_than_sixteen_at_once_over_http11(
    tls_files: tuple[str, str, str],
) -> None:
    # A stream over HTTP/1.1 holds its connection to the end: with the pool's old cap of 16
    # connections, the 17th stream waited for one of the first 16 to end.
    async with start_stack(tls_files, profile="h100-7b") as slow, AsyncClient(
        slow.base_url, ROUTER_KEY, http="1.1", ca_file=slow.ca_file
    ) as client:
        first: list[float] = []
        ended: list[float] = []

        async def one(i: int) -> None:
            async with client.stream(model="sim-llama-7b", messages=MESSAGES, max_tokens=40,
                                     seed=i) as stream:
                async for _ in stream:
                    if len(first) < 24 and stream.timings.output_chunks == 1:
                        first.append(time.monotonic())
                ended.append(time.monotonic())

        await asyncio.gather(*(one(i) for i in range(24)))
    assert len(first) == len(ended) == 24
    assert max(first) < min(ended)  # all 24 were streaming at once


@pytest.mark.parametrize(("transport", "http"), COMBOS)
async def test_a_region_whose_upstream_refuses_fails_over_on_every_transport(
    stack: Stack, tls_files: tuple[str, str, str], transport: str, http: str
) -> None:
    # The first region's backend answers every request 503. Over SSE the router answers
    # 503 too; over WebSocket and long-poll it announced the stream and sent the refusal as
    # its first event, which the SDK took for the stream's end: an APIError, no failover.
    async with (
        start_stack(tls_files, faults=["error503:rate=1"]) as refusing,
        AsyncClient([refusing.base_url, stack.base_url], ROUTER_KEY,
                    transport=transport, http=http,  # type: ignore[arg-type]
                    ca_file=stack.ca_file, idle_timeout_s=10) as client,
    ):
        text, timings, _ = await stream_once(client, max_tokens=5)
    # Served whole: only the second region can have served it (the first refuses all).
    assert text == await reference_text(stack, 5)
    assert timings.stream_id is not None


async def test_failover_on_429_and_a_started_stream_stays_on_its_region(
    stack: Stack, tls_files: tuple[str, str, str]
) -> None:
    from tests.client_sdk.protocol_server import running_protocol_server

    _, cert_file, key_file = tls_files
    with running_protocol_server(cert_file, key_file, api_key=None) as saturated:
        async with AsyncClient([saturated.base_url, stack.base_url], ROUTER_KEY,
                               ca_file=stack.ca_file) as client:
            async with client.stream(model="busy", messages=MESSAGES, max_tokens=4) as stream:
                chunks = [delta.text async for delta in stream]
            # The 429's Retry-After (2 s) sets the region aside: the next request skips it.
            _, again, _ = await stream_once(client, max_tokens=3)
    assert stream.timings.region == "sdk-test"  # the router served, after the 429
    assert stream.timings.output_chunks == len([c for c in chunks if c])
    assert again.region == "sdk-test"
    assert again.warm  # straight onto the open connection to the second region
    assert [method for method, _ in saturated.app.requests] == ["POST"]
