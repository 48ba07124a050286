"""WebSocket over TLS: oversized frames from a raw socket (memory measured), idle sockets,
WebSockets in the per-client connection count; on each server (``auto``: uvicorn's protocol
behind hypercorn's TLS)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import struct
import time
from collections.abc import AsyncIterator

import pytest
import websockets
from websockets.asyncio.client import connect

from tests.router.conftest import API_KEY, auth

from .conftest import (
    ON_EACH_PROTOCOL,
    ON_EACH_SERVER,
    RouterProcess,
    RouterStarter,
    canary_running,
    open_tls,
)

MiB = 1 << 20
CLOSE_1009 = struct.pack("!H", 1009)



async def _upgraded(router: RouterProcess) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await open_tls(router)
    key = base64.b64encode(os.urandom(16)).decode()
    writer.write(
        (
            "GET /v1/ws HTTP/1.1\r\nhost: x\r\nupgrade: websocket\r\nconnection: Upgrade\r\n"
            f"sec-websocket-key: {key}\r\nsec-websocket-version: 13\r\n"
            f"authorization: Bearer {API_KEY}\r\n\r\n"
        ).encode()
    )
    head = await reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 101"), head
    return reader, writer


def _frame_header(length: int) -> bytes:
    """A masked, final, binary frame announcing ``length`` payload bytes."""
    return bytes([0x82, 0x80 | 127]) + struct.pack("!Q", length) + os.urandom(4)


async def _send_frame(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, length: int
) -> tuple[bytes, int]:
    """Send a frame header for ``length`` bytes, then payload until the router answers;
    returns (what it answered, payload bytes sent)."""
    writer.write(_frame_header(length))
    chunk = b"\0" * (64 << 10)
    sent = 0
    answer = b""
    while sent < length:
        with contextlib.suppress(TimeoutError):
            answer += await asyncio.wait_for(reader.read(1024), 0.001)
        if answer:
            break
        try:
            writer.write(chunk)
            await writer.drain()
        except (ConnectionError, RuntimeError):
            break
        sent += len(chunk)
    return answer, sent


@contextlib.asynccontextmanager
async def _peak_rss(router: RouterProcess) -> AsyncIterator[list[int]]:
    """Samples the router's RSS every 20 ms; the list holds [before, peak]."""
    samples = [router.rss_bytes(), router.rss_bytes()]
    stop = asyncio.Event()

    async def sample() -> None:
        while not stop.is_set():
            samples[1] = max(samples[1], router.rss_bytes())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.02)

    task = asyncio.create_task(sample())
    try:
        yield samples
    finally:
        stop.set()
        await task


@ON_EACH_PROTOCOL
async def test_oversized_frame_closed_at_its_header(start_router_process: RouterStarter) -> None:
    """One frame announcing 128 MB: 1009 after the first bytes of payload, and the router's
    memory does not follow (it took 320 MB before)."""
    async with start_router_process() as router, canary_running(router):
        reader, writer = await _upgraded(router)
        async with _peak_rss(router) as rss:
            answer, sent = await _send_frame(reader, writer, 128 * MiB)
        writer.close()
    assert CLOSE_1009 in answer, answer
    assert sent < 16 * MiB
    before, peak = rss
    print(f"one 128 MB frame: RSS {before / MiB:.1f} -> peak {peak / MiB:.1f} MiB, {sent} B sent")
    assert peak - before < 16 * MiB
    assert "WebSocket message too big" in router.log()
    router.assert_clean_log()


@ON_EACH_PROTOCOL
async def test_forty_16mb_frames_do_not_take_memory(start_router_process: RouterStarter) -> None:
    async with start_router_process() as router, canary_running(router):
        sockets = [await _upgraded(router) for _ in range(40)]
        async with _peak_rss(router) as rss:
            results = await asyncio.gather(*(_send_frame(r, w, 16 * MiB) for r, w in sockets))
        for _, writer in sockets:
            writer.close()
    assert all(CLOSE_1009 in answer for answer, _ in results)
    before, peak = rss
    print(f"forty 16 MB frames: RSS {before / MiB:.1f} -> peak {peak / MiB:.1f} MiB")
    assert peak - before < 32 * MiB  # 640 MB of frames; 790 MB of RSS before
    router.assert_clean_log()


async def test_idle_websocket_is_closed(start_router_process: RouterStarter) -> None:
    async with start_router_process(limits={"websocket_idle_timeout_s": 1.5}) as router:
        async with canary_running(router):
            url = f"wss://127.0.0.1:{router.port}/v1/ws"
            async with connect(url, ssl=router.client_tls(), additional_headers=auth()) as ws:
                started = time.monotonic()
                with pytest.raises(websockets.ConnectionClosed) as closed:
                    await asyncio.wait_for(ws.recv(), 20)
                held_s = time.monotonic() - started
        assert closed.value.rcvd is not None
        assert closed.value.rcvd.code == 1001
        assert 1.5 - 0.05 <= held_s < 20  # the loop's timer may fire a few ms early
    router.assert_clean_log()


@ON_EACH_SERVER
async def test_websockets_count_for_their_client_until_they_close(
    start_router_process: RouterStarter,
) -> None:
    """With a hard cap of 3: three open WebSockets leave no room for a fourth connection
    (503); once they close, the client connects again, however many WebSockets came and went
    (a server that forgot an upgraded connection's count would refuse it for good)."""
    async with start_router_process(limits={"hard_max_connections_per_client": 3}) as router:
        held = [await _upgraded(router) for _ in range(3)]
        reader, writer = await open_tls(router)
        writer.write(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
        refused = await asyncio.wait_for(reader.read(4096), 15)
        writer.close()
        assert refused.startswith(b"HTTP/1.1 503"), refused
        for _, w in held:
            w.close()
        await asyncio.sleep(0.5)
        for _ in range(6):
            reader, writer = await _upgraded(router)
            writer.close()
            await asyncio.sleep(0.2)  # the server sees the close before the next connects
        url = f"wss://127.0.0.1:{router.port}/v1/ws"
        async with connect(url, ssl=router.client_tls(), additional_headers=auth()):
            pass
    router.assert_clean_log()
