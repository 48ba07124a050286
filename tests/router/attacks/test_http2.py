"""HTTP/2 over TLS with the h2 library as a client that misbehaves on purpose."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import h2.config
import h2.connection
import h2.errors
import h2.events
import pytest

from tests.router.conftest import API_KEY
from tests.router.upstream import Upstream

from .conftest import RouterProcess, RouterStarter, canary_running, chat_body, open_tls

CHAT = "/v1/chat/completions"


class H2Client:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.conn = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=True, header_encoding="utf-8")
        )
        self.conn.initiate_connection()
        self.closed = False

    @classmethod
    async def open(cls, router: RouterProcess) -> H2Client:
        reader, writer = await open_tls(router, alpn=["h2"])
        client = cls(reader, writer)
        await client.flush()
        return client

    async def flush(self) -> None:
        data = self.conn.data_to_send()
        if data:
            self.writer.write(data)
            await self.writer.drain()

    async def events(self, timeout_s: float) -> list[Any]:
        """What the server sent within ``timeout_s`` (empty if nothing); ``closed`` once
        the server has closed the connection."""
        try:
            data = await asyncio.wait_for(self.reader.read(1 << 16), timeout_s)
        except TimeoutError:
            return []
        except ConnectionError:
            data = b""
        if not data:
            self.closed = True
            return []
        events = self.conn.receive_data(data)
        with contextlib.suppress(ConnectionError):
            await self.flush()
        return events

    def headers(self, path: str, method: str = "POST") -> list[tuple[str, str]]:
        return [
            (":method", method),
            (":path", path),
            (":scheme", "https"),
            (":authority", "127.0.0.1"),
            ("authorization", f"Bearer {API_KEY}"),
            ("content-type", "application/json"),
        ]

    async def response(self, stream_id: int, timeout_s: float = 30) -> tuple[int, bytes]:
        status, body = 0, b""
        async with asyncio.timeout(timeout_s):
            while not self.closed:
                for event in await self.events(1):
                    if getattr(event, "stream_id", None) != stream_id:
                        continue
                    if isinstance(event, h2.events.ResponseReceived):
                        status = int(dict(event.headers)[":status"])
                    elif isinstance(event, h2.events.DataReceived):
                        body += event.data
                        self.conn.acknowledge_received_data(
                            event.flow_controlled_length, stream_id
                        )
                    elif isinstance(event, (h2.events.StreamEnded, h2.events.StreamReset)):
                        return status, body
        return status, body

    async def post(self, path: str, body_bytes: int) -> tuple[int, bytes]:
        """POST ``body_bytes`` of body, respecting flow control, stopping once answered."""
        stream_id = self.conn.get_next_available_stream_id()
        self.conn.send_headers(stream_id, self.headers(path))
        sent, status, answer = 0, 0, b""
        chunk = b"x" * (1 << 14)
        while sent < body_bytes and not status and not self.closed:
            window = min(self.conn.local_flow_control_window(stream_id), len(chunk))
            if window <= 0:
                await self.flush()
                for event in await self.events(5):
                    if isinstance(event, h2.events.ResponseReceived):
                        status = int(dict(event.headers)[":status"])
                    elif isinstance(event, h2.events.DataReceived):
                        answer += event.data
                continue
            self.conn.send_data(stream_id, chunk[: min(window, body_bytes - sent)])
            sent += window
            if sent % (1 << 20) < window:
                await self.flush()
        if not status:
            if sent >= body_bytes:
                self.conn.end_stream(stream_id)
            await self.flush()
            status, rest = await self.response(stream_id)
            answer += rest
        return status, answer

    async def get(self, path: str) -> int:
        stream_id = self.conn.get_next_available_stream_id()
        self.conn.send_headers(stream_id, self.headers(path, "GET"), end_stream=True)
        await self.flush()
        status, _ = await self.response(stream_id)
        return status


async def test_rapid_reset_gets_goaway_and_upstream_work_is_bounded(
    start_router_process: RouterStarter, upstream: Upstream
) -> None:
    """HEADERS + DATA + RST_STREAM, 5000 times: GOAWAY ENHANCE_YOUR_CALM, a bounded number
    of upstream requests (1,114 reached it before), and none of them left running."""
    threshold = 100
    async with start_router_process(limits={"h2_max_early_resets": threshold}) as router:
        async with canary_running(router):
            client = await H2Client.open(router)
            body = json.dumps(chat_body(200)).encode()
            goaway: h2.events.ConnectionTerminated | None = None
            attempts = 0
            for attempts in range(1, 5001):
                # An attacker is bound by the connection window too. On a slow machine the
                # client can get 64 KiB ahead of the router: wait for its WINDOW_UPDATE
                # rather than break flow control (a router that never returns the window
                # fails here, by the deadline).
                async with asyncio.timeout(30):
                    while (
                        client.conn.outbound_flow_control_window < len(body)
                        and goaway is None
                        and not client.closed
                    ):
                        await client.flush()
                        for event in await client.events(0.5):
                            if isinstance(event, h2.events.ConnectionTerminated):
                                goaway = event
                if goaway is not None or client.closed:
                    break
                stream_id = client.conn.get_next_available_stream_id()
                client.conn.send_headers(stream_id, client.headers(CHAT))
                client.conn.send_data(stream_id, body, end_stream=True)
                client.conn.reset_stream(stream_id, h2.errors.ErrorCodes.CANCEL)
                if attempts % 20 == 0:
                    try:
                        await client.flush()
                    except (ConnectionError, RuntimeError):
                        break
                    for event in await client.events(0.001):
                        if isinstance(event, h2.events.ConnectionTerminated):
                            goaway = event
                    if goaway is not None or client.closed:
                        break
            while goaway is None and not client.closed:
                for event in await client.events(5):
                    if isinstance(event, h2.events.ConnectionTerminated):
                        goaway = event
            client.writer.close()
        # Streams whose upstream answered before the reset was seen, and the canary's last
        # one (stopped just now), end once their resume grace (1 s here) passes with no
        # reader.
        for _ in range(200):
            if upstream.running == 0:
                break
            await asyncio.sleep(0.05)
        started = len(upstream.chat_requests)
        print(f"rapid reset: {attempts} streams sent, {started} reached the upstream")
        assert goaway is not None
        assert goaway.error_code == h2.errors.ErrorCodes.ENHANCE_YOUR_CALM
        assert started <= 2 * threshold + 20  # the canary's own requests included
        assert upstream.running == 0
    assert "HTTP/2 rapid reset" in router.log()
    router.assert_clean_log()


async def test_an_oversized_http2_body_is_413_without_a_traceback(
    start_router_process: RouterStarter,
) -> None:
    """A body over 64 MiB gets 413 (it used to drop the connection with a ``KeyError``)."""
    async with start_router_process() as router, canary_running(router):
        client = await H2Client.open(router)
        answered, answer = await client.post(CHAT, 70 << 20)
        assert answered == 413, answer
        assert not client.closed
    router.assert_clean_log()


@pytest.mark.parametrize(
    ("path", "body_bytes", "status"),
    [
        pytest.param(CHAT, 70 << 20, 413, id="body-over-64MiB-413"),
        pytest.param("/no/such/path", 1 << 20, 404, id="unknown-path-404"),
    ],
)
async def test_answer_before_the_body_keeps_the_connection(
    start_router_process: RouterStarter, path: str, body_bytes: int, status: int
) -> None:
    """The router answers before the client has sent its whole body: the answer arrives,
    the rest of the body is refused with RST_STREAM NO_ERROR (not a ``KeyError`` that
    dropped the connection, nor a 28-line traceback), and the connection serves on."""
    async with start_router_process() as router, canary_running(router):
        client = await H2Client.open(router)
        answered, answer = await client.post(path, body_bytes)
        assert answered == status, answer
        assert await client.get("/healthz") == 200
    router.assert_clean_log()


async def test_a_stream_past_the_limit_is_refused_alone_not_the_connection(
    start_router_process: RouterStarter,
) -> None:
    """150 requests sent at once on one connection, before the server's SETTINGS could be
    seen (the initial limit is unlimited): those past hypercorn's 100 concurrent streams get
    RST_STREAM REFUSED_STREAM, the others are answered, and the connection serves on. h2
    made it a connection error: GOAWAY PROTOCOL_ERROR, and all 150 were lost."""
    from h2.frame_buffer import FrameBuffer
    from hpack import Encoder
    from hyperframe.frame import HeadersFrame, SettingsFrame

    async with start_router_process() as router:
        reader, writer = await open_tls(router, alpn=["h2"])
        encoder = Encoder()
        head = [(":method", "GET"), (":path", "/healthz"), (":scheme", "https"),
                (":authority", "127.0.0.1")]
        out = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + SettingsFrame(0).serialize()
        for i in range(150):
            frame = HeadersFrame(1 + 2 * i)
            frame.data = encoder.encode(head)
            frame.flags.add("END_HEADERS")
            frame.flags.add("END_STREAM")
            out += frame.serialize()
        writer.write(out)
        frames = FrameBuffer(server=False)
        frames.max_frame_size = 1 << 24
        ended: set[int] = set()
        refused: set[int] = set()
        goaway = []
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(20):
                while len(ended) + len(refused) < 150 and not goaway:
                    data = await reader.read(1 << 20)
                    if not data:
                        break
                    frames.add_data(data)
                    for frame in frames:
                        kind = type(frame).__name__
                        if kind == "RstStreamFrame":
                            assert frame.error_code == h2.errors.ErrorCodes.REFUSED_STREAM
                            refused.add(frame.stream_id)
                        elif kind == "GoAwayFrame":
                            goaway.append(frame.error_code)
                        elif "END_STREAM" in frame.flags:
                            ended.add(frame.stream_id)
        assert goaway == []
        assert refused  # past the limit: refused, each alone
        assert len(ended) + len(refused) == 150
        assert len(ended) >= 100
        writer.close()
    router.assert_clean_log()
