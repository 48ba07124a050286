"""HTTP/3 to a server that went away without closing its connections (a router killed or
restarted): the next request on the warm connection learns it in a fraction of a second from
the ICMP port unreachable its datagrams draw, checked by a PING, instead of waiting out the
watchdog or the keep-warm's failure (25 s with the defaults)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from firstbyte.client_sdk.client import AsyncClient
from firstbyte.client_sdk.errors import ConnectError
from tests.client_sdk.conftest import ROUTER_KEY, start_stack
from tests.client_sdk.test_client import stream_once


class _UdpRelay(asyncio.DatagramProtocol):
    """One client's datagrams to the router's UDP port and back. Closing it is the server
    vanishing at once: its port then draws ICMP port unreachable, nothing says goodbye."""

    def __init__(self, server_port: int) -> None:
        self.server_port = server_port
        self.transport: asyncio.DatagramTransport | None = None
        self.upstream: asyncio.DatagramTransport | None = None
        self.client_addr: Any = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: Any) -> None:
        self.client_addr = addr
        if self.upstream is not None:
            self.upstream.sendto(data)

    async def start(self) -> int:
        loop = asyncio.get_running_loop()
        relay = self

        class Back(asyncio.DatagramProtocol):
            def datagram_received(self, data: bytes, addr: Any) -> None:
                if relay.transport is not None and relay.client_addr is not None:
                    relay.transport.sendto(data, relay.client_addr)

        self.upstream, _ = await loop.create_datagram_endpoint(
            Back, remote_addr=("127.0.0.1", self.server_port))
        await loop.create_datagram_endpoint(lambda: self, local_addr=("127.0.0.1", 0))
        assert self.transport is not None
        return int(self.transport.get_extra_info("sockname")[1])

    def close(self) -> None:
        for transport in (self.transport, self.upstream):
            if transport is not None:
                transport.close()


async def test_a_request_on_a_warm_quic_connection_to_a_vanished_server_fails_fast(
    tls_files: tuple[str, str, str],
) -> None:
    async with start_stack(tls_files) as stack:
        relay = _UdpRelay(stack.port)
        port = await relay.start()
        try:
            async with AsyncClient(f"https://localhost:{port}/v1", ROUTER_KEY, http="3",
                                   ca_file=stack.ca_file) as client:
                await client.prewarm()
                await stream_once(client, max_tokens=3)  # served through the relay
                relay.close()
                start = time.perf_counter()
                try:
                    await stream_once(client, max_tokens=3)
                except ConnectError as exc:
                    error: ConnectError | None = exc
                else:
                    error = None
                elapsed = time.perf_counter() - start
        finally:
            relay.close()
    assert error is not None
    assert f"nothing listens on UDP port {port}" in str(error), error
    # Defaults: idle_timeout_s 30, keep-warm every 15 s with a 10 s connect timeout. The PING
    # waits at most 2 s (0.2 s on loopback), then the reconnect is refused at once.
    assert elapsed < 5, elapsed
