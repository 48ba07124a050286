"""The keep-alive timer of the default server's HTTP/1.1 protocol (``uvicorn_limits``): one
timer a connection, not one a request, which still closes an idle connection at the
keep-alive timeout after its last response, and never a connection whose request is on. A
real router on loopback (``auto`` and ``uvicorn``), a raw socket, the router's own protocol
object."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.router.conftest import RouterFactory
from tests.router.hosting.test_head_timer import HEAD, _answer, _protocol_of
from tests.router.upstream import Upstream

SLACK_S = 0.05
"""The loop's timers may fire this early (they count in milliseconds)."""

SERVERS = pytest.mark.parametrize("server", ["auto", "uvicorn"])


async def _connect(router: object) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = router.base_url.removeprefix("http://").rsplit(":", 1)  # type: ignore[attr-defined]
    return await asyncio.open_connection(host, int(port))


@SERVERS
async def test_one_keep_alive_timer_serves_every_request_of_a_connection(
    start_router: RouterFactory, upstream: Upstream, server: str
) -> None:
    async with start_router(
        [upstream.url], tls=False, listen={"server": server, "keep_alive_timeout_s": 30.0}
    ) as router:
        reader, writer = await _connect(router)
        try:
            timers = []
            for _ in range(3):
                writer.write(HEAD)
                assert (await _answer(reader)).startswith(b"HTTP/1.1 200")
                protocol = _protocol_of(writer.get_extra_info("sockname"))
                timers.append(protocol.timeout_keep_alive_task)
            assert timers[0] is not None
            assert timers[1] is timers[0]
            assert timers[2] is timers[0]
        finally:
            writer.close()


@SERVERS
async def test_an_idle_connection_closes_at_the_timeout_after_its_last_response(
    start_router: RouterFactory, upstream: Upstream, server: str
) -> None:
    timeout_s = 1.0
    async with start_router(
        [upstream.url], tls=False, listen={"server": server, "keep_alive_timeout_s": timeout_s}
    ) as router:
        reader, writer = await _connect(router)
        try:
            # Requests 0.6 s apart: the timer armed with the connection (or its first answer)
            # fires while the connection is busy or not idle for long enough, and moves on.
            for _ in range(3):
                writer.write(HEAD)
                assert (await _answer(reader)).startswith(b"HTTP/1.1 200")
                await asyncio.sleep(0.6 * timeout_s)
            writer.write(HEAD)
            assert (await _answer(reader)).startswith(b"HTTP/1.1 200")
            answered = time.monotonic()
            assert await asyncio.wait_for(reader.read(), 10) == b""  # closed by the router
            idle_s = time.monotonic() - answered
            assert timeout_s - SLACK_S <= idle_s < timeout_s + 0.5
        finally:
            writer.close()


@SERVERS
async def test_a_request_on_when_the_timer_fires_keeps_its_connection(
    start_router: RouterFactory, upstream: Upstream, server: str
) -> None:
    timeout_s = 0.5
    async with start_router(
        [upstream.url], tls=False, listen={"server": server, "keep_alive_timeout_s": timeout_s}
    ) as router:
        reader, writer = await _connect(router)
        try:
            writer.write(HEAD)
            assert (await _answer(reader)).startswith(b"HTTP/1.1 200")
            # A head in two parts, the second after the timeout: the connection is busy from
            # its first byte, as with uvicorn's own timer (cancelled by that byte).
            writer.write(HEAD[:20])
            await asyncio.sleep(timeout_s + 0.3)
            writer.write(HEAD[20:])
            assert (await _answer(reader)).startswith(b"HTTP/1.1 200")
            answered = time.monotonic()
            assert await asyncio.wait_for(reader.read(), 10) == b""
            assert time.monotonic() - answered >= timeout_s - SLACK_S
        finally:
            writer.close()
