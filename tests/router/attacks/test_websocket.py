"""WebSocket over TLS: oversized frames from a raw socket (memory measured), idle sockets,
WebSockets in the per-client connection count; on each server (``auto``: uvicorn's protocol
behind hypercorn's TLS)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import struct
import time
from collections.abc import AsyncIterator

import pytest
import websockets
from websockets.asyncio.client import connect

from tests.router.conftest import API_KEY, auth
from tests.router.upstream import Upstream

from .conftest import (
    ON_EACH_PROTOCOL,
    ON_EACH_SERVER,
    STALLED_TOKENS,
    TIMER_SLACK_S,
    RouterProcess,
    RouterStarter,
    canary_running,
    chat_body,
    open_tls,
    open_tls_small_window,
    read_until_closed,
)
from .test_http1 import CLOSED_WITHIN_S

MiB = 1 << 20
CLOSE_1009 = struct.pack("!H", 1009)



async def _upgraded(
    router: RouterProcess, *, small_window: bool = False
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A WebSocket upgraded over TLS (``small_window``: its socket receives into 4 KiB)."""
    if small_window:
        reader, writer = await open_tls_small_window(router, ["http/1.1"])
    else:
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
    # The rest of the answer: the close frame may come in more than one read, or after a write
    # failed (what the router sent before its close is still in the buffer).
    with contextlib.suppress(TimeoutError, ConnectionError, OSError):
        async with asyncio.timeout(5.0):
            while CLOSE_1009 not in answer and (more := await reader.read(1024)):
                answer += more
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
    missing = [(answer[:32], sent) for answer, sent in results if CLOSE_1009 not in answer]
    assert not missing, f"{len(missing)} of 40 without a 1009 close: {missing}"
    before, peak = rss
    print(f"forty 16 MB frames: RSS {before / MiB:.1f} -> peak {peak / MiB:.1f} MiB")
    assert peak - before < 32 * MiB  # 640 MB of frames; 790 MB of RSS before
    router.assert_clean_log()


@ON_EACH_PROTOCOL
async def test_a_client_still_sending_reads_its_1009_then_the_socket_closes(
    start_router_process: RouterStarter,
) -> None:
    """A client that goes on sending a refused frame's payload for 2.5 s (three times the
    quiet interval) and reads only then still finds the 1009 close: the socket closes once
    the client has been quiet, not at a fixed time after the refusal, when the kernel would
    reset it with input unread and the reset would destroy the close frame. Then it closes."""
    async with start_router_process() as router:
        reader, writer = await _upgraded(router)
        writer.write(_frame_header(64 * MiB))
        chunk = b"\0" * (16 << 10)
        loop = asyncio.get_running_loop()
        sending_until = loop.time() + 2.5
        while loop.time() < sending_until:  # ~1.6 MB/s, without reading
            writer.write(chunk)
            await writer.drain()
            await asyncio.sleep(0.01)
        answer = b""
        async with asyncio.timeout(10):
            while CLOSE_1009 not in answer:
                more = await reader.read(1024)
                assert more, f"closed without a 1009 close; read {answer!r}"
                answer += more
        # Quiet now: the router closes the socket (a second later), the client reads its end.
        async with asyncio.timeout(10):
            while await reader.read(1024):
                pass
        writer.close()
    assert "WebSocket message too big" in router.log()
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
        assert 1.5 - TIMER_SLACK_S <= held_s < 20
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


def _text_frame(payload: bytes) -> bytes:
    """A masked, final text frame carrying ``payload`` (under 64 KiB)."""
    mask = os.urandom(4)
    masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
    if len(payload) < 126:
        return bytes([0x81, 0x80 | len(payload)]) + mask + masked
    return bytes([0x81, 0x80 | 126]) + struct.pack("!H", len(payload)) + mask + masked


@ON_EACH_PROTOCOL
async def test_invalid_utf8_is_one_line_not_a_traceback_per_socket(
    start_router_process: RouterStarter, router_server: str
) -> None:
    """Twenty sockets each send a text frame that is not UTF-8: each is closed, and the log
    holds no traceback and at most a line per 10 s for them, where uvicorn's protocol logged
    an ERROR with a traceback per socket. uvicorn's protocol closes with 1007 (RFC 6455
    section 8.1); hypercorn's wsproto closes the connection without a close frame."""
    sockets = 20

    async def one(router: RouterProcess) -> bytes:
        reader, writer = await _upgraded(router)
        try:
            writer.write(_text_frame(b'{"type":"\xff\xfe"}'))
            await writer.drain()
            return await read_until_closed(reader, 10)  # closed, not held
        finally:
            writer.close()

    async with start_router_process() as router, canary_running(router):
        started = time.monotonic()
        # At once: each waits out the server's close handshake (~1 s, the client never sends
        # its close frame), which one after another took 20 s of the suite.
        answers = await asyncio.gather(*(one(router) for _ in range(sockets)))
        took_s = time.monotonic() - started
    if router_server == "auto":
        assert all(struct.pack("!H", 1007) in answer for answer in answers), answers[:2]
    router.assert_clean_log()
    lines = [line for line in router.log().splitlines() if "UTF-8" in line]
    assert len(lines) <= 1 + int(took_s // 10), lines


async def _until_two_connect(router: RouterProcess, timeout_s: float) -> float:
    """Seconds until two WebSockets at once are let in (with a cap of two per address)."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        held = []
        try:
            for _ in range(2):
                held.append(await _upgraded(router))
            return time.monotonic() - started
        except (AssertionError, ConnectionError, asyncio.IncompleteReadError):
            await asyncio.sleep(0.25)
        finally:
            for _, writer in held:
                writer.close()
    return timeout_s


@ON_EACH_PROTOCOL
async def test_client_leaving_with_65_streams_is_let_go(
    start_router_process: RouterStarter,
) -> None:
    """A client sends 65 stream requests on one WebSocket (one over the 64 a socket may
    follow) and resets the connection: its connection is let go (with a cap of 2 per
    address, two more connect), and the log holds no traceback and no "Task exception was
    never retrieved". Under hypercorn the socket's disconnect waited behind the full app
    queue while the app waited on it: the connection was held until shutdown, then logged
    a traceback."""
    async with (
        start_router_process(limits={"max_connections_per_client": 2}) as router,
        canary_running(router),
    ):
        request = json.dumps({"type": "request", "body": chat_body(200)}).encode()
        _, writer = await _upgraded(router)
        writer.write(b"".join(_text_frame(request) for _ in range(65)))
        await writer.drain()
        writer.transport.abort()  # leave without a close frame, reading nothing
        took_s = await _until_two_connect(router, 10)
        print(f"the reset connection let go after {took_s:.2f} s")
        assert took_s < 10  # before: held until shutdown
        await asyncio.sleep(0.5)
    text = router.log()
    assert "never retrieved" not in text, text[-3000:]
    router.assert_clean_log()


@ON_EACH_PROTOCOL
async def test_a_backed_up_websocket_that_leaves_logs_no_task_exception(
    start_router_process: RouterStarter,
) -> None:
    """64 streams on one WebSocket to a client that reads nothing (a 4 KiB receive buffer)
    until the router's writes back up, then resets: the stream followers that fail on the
    gone socket are not logged as "Task exception was never retrieved" with a traceback (one
    per run before, under uvicorn's protocol)."""
    async with start_router_process() as router, canary_running(router):
        _, writer = await _upgraded(router, small_window=True)
        request = json.dumps({"type": "request", "body": chat_body(5000)}).encode()
        writer.write(b"".join(_text_frame(request) for _ in range(64)))
        await writer.drain()
        writer.transport.pause_reading()
        await asyncio.sleep(4)  # the router's writes back up
        writer.transport.abort()
        await asyncio.sleep(2)
    text = router.log()
    assert "never retrieved" not in text, text[-3000:]
    router.assert_clean_log()


@ON_EACH_PROTOCOL
async def test_a_websocket_that_stops_reading_is_reset_at_the_send_timeout(
    start_router_process: RouterStarter, upstream: Upstream,
) -> None:
    """A WebSocket client that asks for a long stream and then reads nothing is reset once
    the router's writes have stayed paused for ``client_send_timeout_s`` (one log line), not
    held for as long as it stays."""
    upstream.burst = 2000  # the stream at ~200,000 chunks a second, not the fixture's 100
    async with start_router_process(limits={"client_send_timeout_s": 1.0}) as router:
        async with canary_running(router):
            reader, writer = await _upgraded(router, small_window=True)
            request = {"type": "request", "body": chat_body(STALLED_TOKENS)}
            writer.write(_text_frame(json.dumps(request).encode()))
            await writer.drain()
            writer.transport.pause_reading()
            await router.logged("client stopped reading", CLOSED_WITHIN_S)
            writer.transport.resume_reading()
            rest = b""
            with contextlib.suppress(TimeoutError):
                rest = await read_until_closed(reader, 10)
            writer.close()
        assert b"[DONE]" not in rest
        assert b'"done"' not in rest
    router.assert_clean_log()
