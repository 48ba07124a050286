from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from typing import Any

import httpx
import msgspec
import uvicorn

from firstbyte.protocol.edge import EdgeStatus, prefix_hash
from firstbyte.protocol.headers import PEER_KEY_HEADER
from firstbyte.router.peers import PeerPoller, PeerTable

STATUS = EdgeStatus(region="tokyo", healthy=True, saturated=False, in_flight=3, capacity=8,
                    queue_wait_ms=0.0, latitude=35.68, longitude=139.69,
                    warm_prefixes=[prefix_hash("sys")])


def test_table_staleness_and_failures() -> None:
    table = PeerTable([("tokyo", "http://x"), ("virginia", "http://y")], ttl_s=5.0)
    assert table.fresh(0.0) == {}
    table.observe("tokyo", STATUS, now=10.0, rtt_ms=4.0)
    assert list(table.fresh(14.0)) == ["tokyo"]
    assert table.fresh(15.5) == {}  # older than the TTL: unknown
    table.observe("tokyo", STATUS, now=20.0, rtt_ms=8.0)
    rtt = table.peers["tokyo"].rtt_ms
    assert rtt is not None
    assert rtt.value is not None
    assert 4.0 < rtt.value < 8.0  # EWMA
    table.failed("tokyo", 21.0)
    assert list(table.fresh(21.0)) == ["tokyo"]  # one failure: keep the state until the TTL
    table.failed("tokyo", 22.0)
    assert table.fresh(22.0) == {}


def test_prefix_hash_is_stable_and_hides_text() -> None:
    assert prefix_hash("sys") == prefix_hash("sys")
    assert "sys" not in prefix_hash("sys")
    assert len(prefix_hash("x")) == 16


Scope = MutableMapping[str, Any]


def status_app(seen_keys: list[str | None], fail: list[bool]) -> Callable[..., Awaitable[None]]:
    async def app(scope: Scope, receive: Callable[[], Awaitable[Any]],
                  send: Callable[[Any], Awaitable[None]]) -> None:
        if scope["type"] != "http":
            return
        headers = dict(scope["headers"])
        key = headers.get(PEER_KEY_HEADER.encode())
        seen_keys.append(key.decode() if key else None)
        code, body = (500, b"{}") if fail[0] else (200, msgspec.json.encode(STATUS))
        await send({"type": "http.response.start", "status": code,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})

    return app


@contextlib.asynccontextmanager
async def serve(app: Callable[..., Awaitable[None]]) -> AsyncIterator[str]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:  # noqa: ASYNC110 - uvicorn exposes only a flag
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        await task
        sock.close()


async def test_poller_over_one_kept_warm_connection() -> None:
    seen: list[str | None] = []
    fail = [False]
    async with serve(status_app(seen, fail)) as url:
        table = PeerTable([("tokyo", url)], ttl_s=5.0)
        client = httpx.AsyncClient(base_url=url)
        poller = PeerPoller(table, client, peer_key="k" * 16, interval_s=0.02)
        try:
            for _ in range(3):
                await poller.poll_once("tokyo")
            assert "tokyo" in table.fresh(asyncio.get_running_loop().time())
            assert seen == ["k" * 16] * 3
            pool = client._transport._pool  # type: ignore[attr-defined]
            assert len(pool.connections) == 1  # all polls reused one connection
            fail[0] = True
            await poller.poll_once("tokyo")
            await poller.poll_once("tokyo")
            assert table.fresh(asyncio.get_running_loop().time()) == {}
            fail[0] = False
            poller.start()
            await asyncio.sleep(0.2)
            await poller.stop()
            assert "tokyo" in table.fresh(asyncio.get_running_loop().time())
        finally:
            await client.aclose()
