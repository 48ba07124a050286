"""A server that accepts TCP connections and never answers (a stopped or wedged router: the
kernel completes the connect, nothing does the TLS handshake).

A stream cancelled while its handshake waits closes its socket at once (httpcore closes it
only when the handshake raises an ``Exception``, not when it is cancelled); a handshake that
times out is a ``ConnectError`` saying so, not a ``TLSError`` about a certificate; and with
several regions, such a region is failed over after the idle timeout, as an unreachable one.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator

import anyio
import httpcore
import pytest

from firstbyte.client_sdk.client import AsyncClient
from firstbyte.client_sdk.errors import ConnectError, StreamStalledError, TLSError
from firstbyte.client_sdk.transports.http import _ClosingStream
from tests.client_sdk.conftest import ROUTER_KEY, Stack
from tests.client_sdk.cutproxy import UdpCutProxy

MESSAGES = [{"role": "user", "content": "Hi"}]


class SilentServer:
    """Accepts connections and reads them, never writes; ``closed`` is set for each
    connection whose client closed it (EOF or reset)."""

    def __init__(self) -> None:
        self.accepted = asyncio.Event()
        self.closed = asyncio.Event()
        self.port = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted.set()
        try:
            while await reader.read(65536):
                pass
        except OSError:
            pass
        self.closed.set()
        writer.close()


@pytest.fixture
async def silent() -> AsyncIterator[SilentServer]:
    server = SilentServer()
    listening = await asyncio.start_server(server.handle, "127.0.0.1", 0)
    server.port = listening.sockets[0].getsockname()[1]
    async with listening:
        yield server
        listening.close()


@pytest.mark.parametrize(("transport", "http"), [("sse", "1.1"), ("sse", "2"),
                                                  ("longpoll", "2")])
async def test_a_stream_cancelled_during_the_tls_handshake_closes_its_socket(
    silent: SilentServer, ca_file: str, transport: str, http: str,
) -> None:
    async with AsyncClient(f"https://localhost:{silent.port}/v1", "key", ca_file=ca_file,
                           transport=transport, http=http) as client:  # type: ignore[arg-type]

        async def read() -> None:
            async with client.stream(model="m", messages=MESSAGES) as stream:
                async for _ in stream:
                    pass

        task = asyncio.create_task(read())
        await asyncio.wait_for(silent.accepted.wait(), 5)
        await asyncio.sleep(0.1)  # the ClientHello is out; the handshake waits for an answer
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # Closed by the cancel, not left to the garbage collector ("unclosed transport").
        await asyncio.wait_for(silent.closed.wait(), 2)


@pytest.mark.parametrize("http", ["1.1", "2"])
async def test_a_tls_handshake_that_gets_no_answer_is_a_connect_error_saying_so(
    silent: SilentServer, ca_file: str, http: str,
) -> None:
    async with AsyncClient(f"https://localhost:{silent.port}/v1", "key", ca_file=ca_file,
                           http=http, connect_timeout_s=0.5) as client:  # type: ignore[arg-type]
        with pytest.raises(ConnectError) as raised:
            async with client.stream(model="m", messages=MESSAGES):
                pass
    assert not isinstance(raised.value, TLSError)  # nothing is wrong with the certificate
    assert str(raised.value) == (
        f"cannot connect to localhost:{silent.port}: TLS handshake timed out after 0.5 s")


@pytest.mark.parametrize(("transport", "http"), [("sse", "1.1"), ("sse", "2"), ("sse", "3"),
                                                  ("websocket", "1.1"), ("longpoll", "2")])
async def test_a_region_that_never_answers_is_failed_over_within_the_idle_timeout(
    silent: SilentServer, stack: Stack, transport: str, http: str,
) -> None:
    # The silent region accepts the connection (TCP; over HTTP/3 its UDP port swallows the
    # datagrams) and never answers: after idle_timeout_s the next region takes the request,
    # long before connect_timeout_s. Sent again to the same region it stalled again, then
    # raised StreamStalledError without ever trying the region that answers.
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", silent.port))
    try:
        regions = {"wedged": f"https://localhost:{silent.port}/v1", "live": stack.base_url}
        async with AsyncClient(regions, ROUTER_KEY, ca_file=stack.ca_file,
                               transport=transport,  # type: ignore[arg-type]
                               http=http,  # type: ignore[arg-type]
                               idle_timeout_s=1.0, connect_timeout_s=30.0,
                               reprobe_interval_s=None) as client:
            started = time.monotonic()
            async with client.stream(model="sim-instant", messages=MESSAGES,
                                     max_tokens=8) as stream:
                text = "".join([delta.text async for delta in stream])
            elapsed_s = time.monotonic() - started
            assert text
            assert stream.timings.region == "sdk-test"
            assert 1.0 <= elapsed_s < 10.0  # one idle timeout, then the live region
            # The wedged region is set aside: the next request goes straight to the live one.
            async with client.stream(model="sim-instant", messages=MESSAGES,
                                     max_tokens=8) as stream:
                assert "".join([delta.text async for delta in stream])
            assert stream.timings.first_token_ms is not None
            assert stream.timings.first_token_ms < 1000.0
    finally:
        udp.close()


class FreezingProxy:
    """A TCP relay to ``target_port`` that, once ``frozen``, forwards nothing more either way
    and keeps its connections open: a warm connection whose router went silent."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.frozen = False
        self.port = 0
        self._writers: list[asyncio.StreamWriter] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        self._writers += [writer, up_writer]

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError):
                while data := await src.read(65536):
                    if not self.frozen:
                        dst.write(data)
                        await dst.drain()

        await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer))

    def close(self) -> None:
        for writer in self._writers:
            writer.transport.abort()


@pytest.mark.parametrize("http", ["1.1", "2", "3"])
async def test_a_region_gone_silent_on_a_warm_connection_holds_no_probe_or_keep_warm(
    stack: Stack, http: str,
) -> None:
    # TCP through a relay that freezes; QUIC through one that black-holes its flow.
    proxy = FreezingProxy(stack.port)
    listening = await asyncio.start_server(proxy.handle, "127.0.0.1", 0)
    proxy.port = listening.sockets[0].getsockname()[1]
    async with listening, UdpCutProxy(stack.port, cut_after=1 << 40) as udp, AsyncClient(
        {"silent": f"https://localhost:{udp.port if http == '3' else proxy.port}/v1",
         "live": stack.base_url},
        ROUTER_KEY, ca_file=stack.ca_file, http=http,  # type: ignore[arg-type]
        connect_timeout_s=1.0, keepalive_interval_s=0.2, reprobe_interval_s=None,
    ) as client:
        try:
            await client.prewarm()  # probes both, keeps both warm: keep-warm runs
            assert client.regions.rtt_ms("silent") is not None  # warm through the relay
            proxy.frozen = True
            udp.cut_after = 0  # the next datagram from the router black-holes the flow
            live = client.pool.session(client._origin_by_name["live"], http)
            pings = 0
            keepalive = live.keepalive

            async def counted() -> None:
                nonlocal pings
                pings += 1
                await keepalive()

            live.keepalive = counted  # type: ignore[method-assign]
            started = time.monotonic()
            rtts = await asyncio.wait_for(client.probe_regions(), 5)
            assert time.monotonic() - started < 3.0  # within connect_timeout_s, not for ever
            assert rtts["silent"] is None
            assert rtts["live"] is not None
            client.pool.touch()
            # Keep-warm of the live region goes on, at least once per connect_timeout_s.
            await asyncio.sleep(2.5)
            assert pings >= 2
        finally:
            proxy.close()


@pytest.mark.parametrize("http", ["1.1", "2"])
async def test_the_only_region_gone_silent_gets_the_request_again(stack: Stack, http: str) -> None:
    # No answer to the request, and none to the probe that follows (over HTTP/2 on the same
    # connection, over HTTP/1.1 on another through the same frozen relay): the router is
    # wedged or the path dead, so the request is sent again on fresh connections (which
    # stall too here), unlike a router that answers the probe (test_slow_head.py).
    proxy = FreezingProxy(stack.port)
    listening = await asyncio.start_server(proxy.handle, "127.0.0.1", 0)
    proxy.port = listening.sockets[0].getsockname()[1]
    async with listening, AsyncClient(
        f"https://localhost:{proxy.port}/v1", ROUTER_KEY, ca_file=stack.ca_file,
        http=http,  # type: ignore[arg-type]
        idle_timeout_s=0.5, connect_timeout_s=5.0, reprobe_interval_s=None,
    ) as client:
        try:
            await client.prewarm()
            proxy.frozen = True
            with pytest.raises(StreamStalledError) as raised:
                async with client.stream(model="sim-instant", messages=MESSAGES,
                                         max_tokens=8):
                    pass
        finally:
            proxy.close()
    assert str(raised.value).endswith("after event 0; resumed 1 times")


async def test_warm_websockets_to_a_router_gone_silent_are_closed_in_a_second(
    stack: Stack,
) -> None:
    # Closing waits for the router's close frame, which a silent router never sends: for
    # websockets' default 10 s a socket, one after another (the pool's reset after a stall,
    # keep-warm after a missed pong).
    proxy = FreezingProxy(stack.port)
    listening = await asyncio.start_server(proxy.handle, "127.0.0.1", 0)
    proxy.port = listening.sockets[0].getsockname()[1]
    async with listening, AsyncClient(
        f"https://localhost:{proxy.port}/v1", ROUTER_KEY, ca_file=stack.ca_file,
        transport="websocket", http="1.1", reprobe_interval_s=None,
    ) as client:
        try:
            origin = client.origins[0]
            sockets = client.pool.websockets(origin, client.headers)
            await sockets.prewarm(3)
            proxy.frozen = True
            started = time.monotonic()
            await asyncio.wait_for(sockets.reset(), 20)
            assert time.monotonic() - started < 3.0  # 1 s together, not 10 s each
        finally:
            proxy.close()


class _CutOnWrite(httpcore.AsyncNetworkStream):
    """A TLS stream whose peer is gone: anyio's TLS write raises ``EndOfStream`` (what it
    raises for an unexpected EOF when not ``standard_compatible``, as httpcore opens it)."""

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:  # noqa: ASYNC109
        return b""

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:  # noqa: ASYNC109
        raise anyio.EndOfStream

    async def aclose(self) -> None:
        pass


async def test_a_write_on_a_cut_tls_connection_is_a_cut_not_anyios_end_of_stream() -> None:
    # Seen as `EndOfStream` raised by a long-poll over HTTP/2 whose connection was cut while
    # a poll was being written; httpx maps httpcore's WriteError to a TransportError, which
    # the SDK resumes from.
    with pytest.raises(httpcore.WriteError):
        await _ClosingStream(_CutOnWrite()).write(b"GET /healthz")
