"""HTTP/2 over TLS with the h2 library as a client that misbehaves on purpose."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
import pytest

from tests.router.conftest import API_KEY
from tests.router.upstream import Upstream

from .conftest import (
    ON_EACH_PROTOCOL,
    STALLED_TOKENS,
    TIMER_SLACK_S,
    RouterProcess,
    RouterStarter,
    canary_running,
    chat_body,
    open_tls,
    open_tls_small_window,
    sse_text,
    words,
)

CHAT = "/v1/chat/completions"
CLOSED_WITHIN_S = 20.0
"""How long an attack waits for the router to close its connection: ample on a loaded
machine, and below the keep-alive timeout its router is given (``test_without_patches``
waits less, where the close never comes)."""
KEEP_ALIVE_S = 30.0


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


@pytest.mark.parametrize("diluted", [False, True], ids=["resets", "resets-between-warm-gets"])
async def test_rapid_reset_gets_goaway_and_upstream_work_is_bounded(
    start_router_process: RouterStarter, upstream: Upstream, diluted: bool
) -> None:
    """HEADERS + DATA + RST_STREAM, 5000 times: GOAWAY ENHANCE_YOUR_CALM, a bounded number
    of upstream requests (1,114 reached it before), and none of them left running. Diluted:
    a cheap ``GET /v1/edge/warm`` between the resets, answered; that kept the resets under
    half of all streams, the former rule, and 139 of 3,000 reached the upstream."""
    threshold = 100
    limits = {"h2_max_early_resets": threshold, "h2_early_resets_per_s": 1.0}
    async with start_router_process(limits=limits) as router:
        async with canary_running(router):
            client = await H2Client.open(router)
            body = json.dumps(chat_body(200)).encode()
            goaway: h2.events.ConnectionTerminated | None = None
            attempts = 0
            for attempts in range(1, 5001):
                # An attacker is bound by the connection window too. On a slow machine the
                # client can get 64 KiB ahead of the router: wait for its WINDOW_UPDATE
                # rather than break flow control (a router that never returns the window
                # fails here, by the deadline); and for the answers of its GETs, within the
                # router's 100 concurrent streams.
                async with asyncio.timeout(30):
                    while (
                        (
                            client.conn.outbound_flow_control_window < len(body)
                            or client.conn.open_outbound_streams > 50
                        )
                        and goaway is None
                        and not client.closed
                    ):
                        await client.flush()
                        for event in await client.events(0.5):
                            if isinstance(event, h2.events.ConnectionTerminated):
                                goaway = event
                if goaway is not None or client.closed:
                    break
                if diluted:
                    client.conn.send_headers(
                        client.conn.get_next_available_stream_id(),
                        client.headers("/v1/edge/warm", "GET"),
                        end_stream=True,
                    )
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
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(10):
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


async def test_a_client_cancelling_every_stream_it_has_keeps_its_connection(
    start_router_process: RouterStarter, upstream: Upstream
) -> None:
    """The default reset budget lets a client (a page closing, an SDK giving up) cancel all
    100 streams it may have open, mid-answer, twice in a row: no GOAWAY, the connection
    serves on."""
    async with start_router_process() as router:
        client = await H2Client.open(router)
        assert await client.get("/healthz") == 200  # the router's SETTINGS are in
        body = json.dumps(chat_body(2000)).encode()
        for _ in range(2):
            streams = []
            for _ in range(100):
                stream_id = client.conn.get_next_available_stream_id()
                client.conn.send_headers(stream_id, client.headers(CHAT))
                client.conn.send_data(stream_id, body, end_stream=True)
                streams.append(stream_id)
            await client.flush()
            answering: set[int] = set()
            async with asyncio.timeout(30):
                while len(answering) < len(streams):
                    for event in await client.events(1):
                        assert not isinstance(event, h2.events.ConnectionTerminated)
                        if isinstance(event, h2.events.ResponseReceived):
                            answering.add(event.stream_id)
                        elif isinstance(event, h2.events.DataReceived):
                            client.conn.acknowledge_received_data(
                                event.flow_controlled_length, event.stream_id
                            )
            for stream_id in streams:
                client.conn.reset_stream(stream_id, h2.errors.ErrorCodes.CANCEL)
            await client.flush()
        assert await client.get("/healthz") == 200
        assert not client.closed
        client.writer.close()
    assert "HTTP/2 rapid reset" not in router.log()
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


class RawH2:
    """An HTTP/2 connection written frame by frame (hyperframe, hpack), so a client can stop
    mid-frame or mid-header-block; :meth:`until_closed` reads what the server sends."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        from hpack import Encoder

        self.reader = reader
        self.writer = writer
        self.encoder = Encoder()
        self.goaway: list[int] = []
        self.goaway_last_stream: list[int] = []
        self.ended: list[int] = []

    @classmethod
    async def open(cls, router: RouterProcess) -> RawH2:
        from hyperframe.frame import SettingsFrame

        raw = cls(*await open_tls(router, alpn=["h2"]))
        await raw.send(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + SettingsFrame(0).serialize())
        return raw

    async def send(self, data: bytes) -> None:
        with contextlib.suppress(ConnectionError, RuntimeError):  # the router closed first
            self.writer.write(data)
            await self.writer.drain()

    def headers(self, stream_id: int, head: list[tuple[str, str]], *flags: str) -> bytes:
        from hyperframe.frame import HeadersFrame

        frame = HeadersFrame(stream_id)
        frame.data = self.encoder.encode(head)
        for flag in flags:
            frame.flags.add(flag)
        return bytes(frame.serialize())

    async def until_closed(self) -> float:
        """Read until the server closes; when it did (``time.monotonic()``). GOAWAY error
        codes are kept in :attr:`goaway`, their last stream ids in :attr:`goaway_last_stream`,
        the streams the server ended (END_STREAM) in :attr:`ended`."""
        from h2.frame_buffer import FrameBuffer
        from hyperframe.frame import GoAwayFrame

        frames = FrameBuffer(server=False)
        frames.max_frame_size = 1 << 24
        while True:
            try:
                data = await self.reader.read(1 << 16)
            except (ConnectionError, OSError):
                data = b""
            if not data:
                return time.monotonic()
            frames.add_data(data)
            for frame in frames:
                if isinstance(frame, GoAwayFrame):
                    self.goaway.append(frame.error_code)
                    self.goaway_last_stream.append(frame.last_stream_id)
                elif "END_STREAM" in frame.flags:
                    self.ended.append(frame.stream_id)


def _request(path: str, method: str = "GET") -> list[tuple[str, str]]:
    return [(":method", method), (":path", path), (":scheme", "https"),
            (":authority", "127.0.0.1"), ("authorization", f"Bearer {API_KEY}")]


async def _drip(raw: RawH2, first: bytes, pieces: list[bytes], closed: asyncio.Task[float]) -> None:
    """Send ``first``, then one of ``pieces`` every 0.25 s, until the server closes."""
    await raw.send(first)
    for piece in pieces:
        await asyncio.wait([closed], timeout=0.25)
        if closed.done():
            return
        await raw.send(piece)


Drip = tuple[bytes, list[bytes]]
"""What a client sends at once, then the pieces it sends one at a time."""


def unfinished_block(raw: RawH2, stream_id: int) -> Drip:
    """HEADERS without END_HEADERS, then CONTINUATION frames of one byte each, never the
    last (h2 holds up to 64 frames of a block)."""
    from hyperframe.frame import ContinuationFrame, HeadersFrame

    block = raw.headers(stream_id, [*_request("/v1/models"), ("x-pad", "p" * 200)])[9:]
    opening = HeadersFrame(stream_id)
    opening.data = block[:1]
    pieces = []
    for i in range(1, 60):
        piece = ContinuationFrame(stream_id)
        piece.data = block[i : i + 1]
        pieces.append(bytes(piece.serialize()))
    return bytes(opening.serialize()), pieces


def headers_frame_by_bytes(raw: RawH2, stream_id: int) -> Drip:
    """One whole HEADERS frame, its bytes sent one at a time after its frame header."""
    frame = raw.headers(
        stream_id, [*_request("/v1/models"), ("x-pad", "p" * 200)], "END_HEADERS", "END_STREAM"
    )
    return frame[:10], [frame[i : i + 1] for i in range(10, len(frame))]


async def _open_a_long_stream(raw: RawH2) -> int:
    """A streamed completion that runs longer than the attack (its upstream stalls once the
    client's window is full): the connection is not idle, so its keep-alive timer is off."""
    from hyperframe.frame import DataFrame

    body = DataFrame(1)
    body.data = json.dumps(chat_body(5000)).encode()
    body.flags.add("END_STREAM")
    head = raw.headers(
        1, [*_request(CHAT, "POST"), ("content-type", "application/json")], "END_HEADERS"
    )
    await raw.send(head + bytes(body.serialize()))
    return 3


@pytest.mark.parametrize(
    ("drip", "beside_a_stream"),
    [
        pytest.param(unfinished_block, False, id="continuation-bytes"),
        pytest.param(headers_frame_by_bytes, False, id="headers-frame-bytes"),
        pytest.param(unfinished_block, True, id="continuation-bytes-beside-a-stream"),
    ],
)
async def test_an_unfinished_header_block_is_cut_at_the_header_timeout(
    start_router_process: RouterStarter,
    drip: Callable[[RawH2, int], Drip],
    beside_a_stream: bool,
) -> None:
    """A header block that never ends (a CONTINUATION byte every 0.25 s), or a HEADERS frame
    sent a byte at a time, gets GOAWAY PROTOCOL_ERROR at ``client_header_timeout_s`` from its
    first HEADERS bytes; it held the connection until the keep-alive timeout (75 s by
    default), and for good beside an open stream."""
    async with start_router_process(
        limits={"client_header_timeout_s": 2.0}, listen={"keep_alive_timeout_s": KEEP_ALIVE_S}
    ) as router:
        async with canary_running(router):
            raw = await RawH2.open(router)
            closed = asyncio.create_task(raw.until_closed())
            stream_id = await _open_a_long_stream(raw) if beside_a_stream else 1
            first, pieces = drip(raw, stream_id)
            started = time.monotonic()
            try:
                async with asyncio.timeout(CLOSED_WITHIN_S):
                    await _drip(raw, first, pieces, closed)
                    held_s = await closed - started
            finally:
                closed.cancel()
                raw.writer.close()
        assert 2.0 - TIMER_SLACK_S <= held_s < CLOSED_WITHIN_S
        assert raw.goaway == [h2.errors.ErrorCodes.PROTOCOL_ERROR]
    assert "HTTP/2 request head timed out" in router.log()
    router.assert_clean_log()


async def test_a_connection_that_only_pings_closes_at_the_keep_alive_timeout(
    start_router_process: RouterStarter,
) -> None:
    """PINGs do not hold an HTTP/2 connection: with no stream, it closes at
    ``keep_alive_timeout_s`` (nginx's idle timer ignores PINGs too)."""
    from hyperframe.frame import PingFrame

    async with start_router_process(
        limits={"client_header_timeout_s": KEEP_ALIVE_S}, listen={"keep_alive_timeout_s": 2.0}
    ) as router:
        raw = await RawH2.open(router)
        closed = asyncio.create_task(raw.until_closed())
        started = time.monotonic()
        ping = bytes(PingFrame(0, opaque_data=b"12345678").serialize())
        try:
            async with asyncio.timeout(CLOSED_WITHIN_S):
                await _drip(raw, ping, [ping] * 200, closed)
                held_s = await closed - started
        finally:
            closed.cancel()
            raw.writer.close()
        assert 2.0 - TIMER_SLACK_S <= held_s < CLOSED_WITHIN_S
    router.assert_clean_log()


@ON_EACH_PROTOCOL
@pytest.mark.parametrize("requests", [1, 0], ids=["after-a-request", "without-a-request"])
async def test_an_idle_connection_gets_goaway_with_its_last_stream_before_the_close(
    start_router_process: RouterStarter, requests: int
) -> None:
    """An HTTP/2 connection idle for ``keep_alive_timeout_s`` gets GOAWAY NO_ERROR naming
    the last stream it took (1 after one request, 0 without any) before the server closes
    it (RFC 9113 section 6.8): a request that crosses the close is then known not to have
    been processed. hypercorn closed it with no GOAWAY; ``auto`` serves HTTP/2 the same."""
    async with start_router_process(
        limits={"client_header_timeout_s": KEEP_ALIVE_S}, listen={"keep_alive_timeout_s": 2.0}
    ) as router:
        raw = await RawH2.open(router)
        closed = asyncio.create_task(raw.until_closed())
        try:
            if requests:
                await raw.send(raw.headers(1, _request("/v1/models"), "END_HEADERS", "END_STREAM"))
            started = time.monotonic()
            async with asyncio.timeout(CLOSED_WITHIN_S):
                held_s = await closed - started
        finally:
            closed.cancel()
            raw.writer.close()
        assert raw.ended == [1] * requests  # answered, before the idle close
        assert raw.goaway == [h2.errors.ErrorCodes.NO_ERROR]
        assert raw.goaway_last_stream == [requests]  # stream 1, or none (0)
        assert 2.0 - TIMER_SLACK_S <= held_s < CLOSED_WITHIN_S
    router.assert_clean_log()


async def test_an_http2_client_that_stops_reading_is_reset_at_the_send_timeout(
    start_router_process: RouterStarter, upstream: Upstream
) -> None:
    """An HTTP/2 client that opens every flow-control window wide (so nothing but TCP holds
    the router's writes back), asks for a long stream and then reads nothing is reset once
    the writes have stayed paused for ``client_send_timeout_s``: one log line, no traceback,
    and the stream never reaches its end."""
    upstream.burst = 2000  # the stream at ~200,000 chunks a second, not the fixture's 100
    async with start_router_process(limits={"client_send_timeout_s": 1.0}) as router:
        async with canary_running(router):
            reader, writer = await open_tls_small_window(router, ["h2"])
            client = H2Client(reader, writer)
            wide = 2**31 - 1
            client.conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: wide})
            client.conn.increment_flow_control_window(wide - 65535)
            stream_id = client.conn.get_next_available_stream_id()
            client.conn.send_headers(stream_id, client.headers(CHAT))
            client.conn.send_data(
                stream_id, json.dumps(chat_body(STALLED_TOKENS)).encode(), end_stream=True
            )
            await client.flush()
            writer.transport.pause_reading()
            await router.logged("client stopped reading", CLOSED_WITHIN_S)
            writer.transport.resume_reading()
            ended = False
            async with asyncio.timeout(CLOSED_WITHIN_S):
                while not client.closed:
                    events = await client.events(1)
                    ended = ended or any(isinstance(e, h2.events.StreamEnded) for e in events)
        assert not ended
    router.assert_clean_log()


SEND_TIMEOUT_S = 1.0
"""``limits.client_send_timeout_s`` of the tests of a stream's flow-control window."""


@dataclass
class Answer:
    """What one stream of an :class:`H2Client` got, and when (``time.monotonic()``)."""

    status: int = 0
    body: bytearray = field(default_factory=bytearray)
    head_at: float = 0.0
    last_data_at: float = 0.0
    ended_at: float | None = None
    reset: int | None = None
    """The error code of the server's RST_STREAM."""
    reset_at: float | None = None

    @property
    def over(self) -> bool:
        return self.ended_at is not None or self.reset is not None


class Streams:
    """Streamed completions on one :class:`H2Client`, read together. The connection's window
    is given back as its data comes; a stream's only for the streams in :attr:`reading`, or
    when the test says so (:meth:`open`), so a test can leave one stream's window shut."""

    def __init__(self, client: H2Client) -> None:
        self.client = client
        self.answers: dict[int, Answer] = {}
        self.reading: set[int] = set()
        self.unopened: dict[int, int] = {}
        """Per stream, the bytes received whose window was not given back yet."""

    def request(self, body: dict[str, Any], *, reading: bool = True) -> int:
        """Send a completion request (flushed by the next :meth:`read`); its stream id."""
        conn = self.client.conn
        stream_id = conn.get_next_available_stream_id()
        conn.send_headers(stream_id, self.client.headers(CHAT))
        conn.send_data(stream_id, json.dumps(body).encode(), end_stream=True)
        self.answers[stream_id] = Answer()
        self.unopened[stream_id] = 0
        if reading:
            self.reading.add(stream_id)
        return stream_id

    def open(self, stream_id: int, extra: int = 0) -> None:
        """Give ``stream_id`` back the window its data took, and ``extra`` bytes more."""
        grant = self.unopened[stream_id] + extra
        self.unopened[stream_id] = 0
        if grant and not self.answers[stream_id].over:
            with contextlib.suppress(h2.exceptions.StreamClosedError):
                self.client.conn.increment_flow_control_window(grant, stream_id)

    async def read(self, wait_s: float = 0.1) -> None:
        """Take what the server sent within ``wait_s``."""
        for event in await self.client.events(wait_s):
            now = time.monotonic()
            answer = self.answers.get(getattr(event, "stream_id", None) or 0)
            if answer is None:
                continue
            stream_id = event.stream_id
            if isinstance(event, h2.events.ResponseReceived):
                answer.status = int(dict(event.headers)[":status"])
                answer.head_at = now
            elif isinstance(event, h2.events.DataReceived):
                answer.body += event.data
                answer.last_data_at = now
                if event.flow_controlled_length:
                    self.client.conn.increment_flow_control_window(event.flow_controlled_length)
                    self.unopened[stream_id] += event.flow_controlled_length
                    if stream_id in self.reading:
                        self.open(stream_id)
            elif isinstance(event, h2.events.StreamEnded):
                answer.ended_at = now
            elif isinstance(event, h2.events.StreamReset):
                answer.reset = event.error_code
                answer.reset_at = now
        with contextlib.suppress(ConnectionError):
            await self.client.flush()

    async def until_over(self, *stream_ids: int) -> None:
        """Read until each of ``stream_ids`` ended or was reset (``TimeoutError`` after
        ``CLOSED_WITHIN_S`` if not)."""
        async with asyncio.timeout(CLOSED_WITHIN_S):
            while not all(self.answers[s].over for s in stream_ids) and not self.client.closed:
                await self.read()


@ON_EACH_PROTOCOL
@pytest.mark.parametrize("zero_window", [False, True], ids=["window-spent", "zero-initial-window"])
async def test_a_stream_whose_window_stays_shut_is_reset_and_its_slot_freed(
    start_router_process: RouterStarter, upstream: Upstream, zero_window: bool
) -> None:
    """An HTTP/2 client that reads its connection (its window given back, PINGs answered)
    but never opens one stream's window, once spent or from the start
    (``SETTINGS_INITIAL_WINDOW_SIZE`` 0): that stream is reset with CANCEL once its send has
    taken nothing for ``client_send_timeout_s``, its upstream request is cancelled once its
    resume grace (1 s here) passes and its key's slot is free again, while the stream beside
    it on the same connection streams on to its last token. Before, the stream waited for
    ever, its upstream request ran on and its slot stayed taken: the TCP send timeout never
    fires while the connection is read."""
    upstream.burst = 20  # 2,000 tokens a second: the window and hypercorn's buffer fill at once
    beside_tokens = 6000  # three seconds of it: on through the reset
    limits = {"client_send_timeout_s": SEND_TIMEOUT_S, "max_streams_per_key": 2}
    async with start_router_process(limits=limits) as router:
        client = await H2Client.open(router)
        if zero_window:
            client.conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 0})
        streams = Streams(client)
        shut = streams.request(chat_body(100_000), reading=False)
        beside = streams.request(chat_body(beside_tokens))
        if zero_window:
            streams.open(beside, extra=1 << 20)
        await streams.until_over(shut, beside)
        shut_answer, beside_answer = streams.answers[shut], streams.answers[beside]
        assert shut_answer.status == 200
        assert shut_answer.reset == h2.errors.ErrorCodes.CANCEL, shut_answer
        assert shut_answer.reset_at is not None
        # Shut from its head on (zero window), or from its window's last byte.
        shut_from = shut_answer.head_at if zero_window else shut_answer.last_data_at
        assert shut_answer.reset_at - shut_from >= SEND_TIMEOUT_S - 0.2
        assert beside_answer.status == 200
        assert beside_answer.ended_at is not None
        assert beside_answer.reset is None
        assert beside_answer.ended_at > shut_answer.reset_at  # still streaming at the reset
        assert sse_text(bytes(beside_answer.body)) == words(beside_tokens)
        async with asyncio.timeout(CLOSED_WITHIN_S):
            while upstream.running:  # noqa: ASYNC110 (a counter to poll)
                await asyncio.sleep(0.05)
        assert upstream.cancelled == 1
        # The key's two slots are free: two more streams at once, on the same connection.
        again = [streams.request(chat_body(20)) for _ in range(2)]
        if zero_window:
            for stream_id in again:
                streams.open(stream_id, extra=1 << 20)
        await streams.until_over(*again)
        for stream_id in again:
            answer = streams.answers[stream_id]
            assert answer.status == 200, bytes(answer.body)
            assert sse_text(bytes(answer.body)) == words(20)
        assert not client.closed
        client.writer.close()
    assert "client stopped reading an HTTP/2 stream: RST_STREAM CANCEL" in router.log()
    router.assert_clean_log()


async def test_a_stream_whose_window_opens_late_but_in_time_is_not_reset(
    start_router_process: RouterStarter, upstream: Upstream
) -> None:
    """A slow reader is not a stopped one: a client that gives its stream's window back only
    every half send timeout (the stream shut far longer than the timeout in all, never that
    long in a row) gets the whole stream."""
    upstream.burst = 20
    tokens = 3000
    late_s = SEND_TIMEOUT_S / 2
    async with start_router_process(limits={"client_send_timeout_s": SEND_TIMEOUT_S}) as router:
        client = await H2Client.open(router)
        streams = Streams(client)
        slow = streams.request(chat_body(tokens), reading=False)
        answer = streams.answers[slow]
        opened_at, openings = time.monotonic(), 0
        async with asyncio.timeout(60):
            while not answer.over and not client.closed:
                await streams.read(0.05)
                if streams.unopened[slow] and time.monotonic() - opened_at >= late_s:
                    streams.open(slow)
                    opened_at, openings = time.monotonic(), openings + 1
        assert answer.reset is None
        assert answer.ended_at is not None
        assert sse_text(bytes(answer.body)) == words(tokens)
        assert openings * late_s > 2 * SEND_TIMEOUT_S
        client.writer.close()
    assert "client stopped reading" not in router.log()
    router.assert_clean_log()
