"""A minimal aioquic HTTP/3 client for the router's tests: one request, whole response,
optional session ticket for resumption and 0-RTT."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aioquic.asyncio.client import connect
from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.buffer import Buffer
from aioquic.h3.connection import H3_ALPN, FrameType, H3Connection
from aioquic.h3.events import DataReceived, H3Event, HeadersReceived
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.events import QuicEvent, StreamDataReceived
from aioquic.tls import SessionTicket

_SERVER_CONTROL_STREAM = 3
"""The server's first unidirectional stream: its control stream (RFC 9114 section 6.2.1)."""


@dataclass
class H3Response:
    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    chunks: list[bytes] = field(default_factory=list)
    session_resumed: bool = False
    early_data_accepted: bool = False
    server_control: bytes = b""
    """What the server sent on its control stream (stream type, SETTINGS, maybe GOAWAY)."""

    def goaway_id(self) -> int | None:
        """The stream id of the server's last GOAWAY frame, or None if it sent none."""
        buf = Buffer(data=self.server_control)
        buf.pull_uint_var()  # the stream type (control)
        found = None
        while not buf.eof():
            frame_type, length = buf.pull_uint_var(), buf.pull_uint_var()
            payload = buf.pull_bytes(length)
            if frame_type == FrameType.GOAWAY:
                found = Buffer(data=payload).pull_uint_var()
        return found


class _Client(QuicConnectionProtocol):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.h3 = H3Connection(self._quic)
        self.response = H3Response()
        self.done = asyncio.Event()
        self.on_data: Callable[[H3Response], None] | None = None

    def quic_event_received(self, event: QuicEvent) -> None:
        if isinstance(event, StreamDataReceived) and event.stream_id == _SERVER_CONTROL_STREAM:
            self.response.server_control += event.data
        for h3_event in self.h3.handle_event(event):
            self._h3_event(h3_event)

    def _h3_event(self, event: H3Event) -> None:
        if isinstance(event, HeadersReceived):
            for name, value in event.headers:
                if name == b":status":
                    self.response.status = int(value)
                else:
                    self.response.headers[name.decode()] = value.decode()
        elif isinstance(event, DataReceived) and event.data:
            self.response.chunks.append(event.data)
            self.response.body += event.data
            if self.on_data is not None:
                self.on_data(self.response)
        if getattr(event, "stream_ended", False):
            self.done.set()


async def h3_request(
    port: int,
    method: str,
    path: str,
    *,
    cafile: str,
    headers: dict[str, str] | None = None,
    body: bytes = b"",
    ticket: SessionTicket | None = None,
    tickets: list[SessionTicket] | None = None,
    timeout_s: float = 15.0,
    on_data: Callable[[H3Response], None] | None = None,
) -> H3Response:
    """Send one request over a new QUIC connection to 127.0.0.1:``port``.

    With ``ticket`` the connection resumes that session and sends the request as 0-RTT
    early data; new tickets from the server are appended to ``tickets``. ``on_data`` is
    called with the response so far whenever a piece of its body arrives.
    """
    configuration = QuicConfiguration(
        alpn_protocols=H3_ALPN, is_client=True, server_name="localhost"
    )
    configuration.load_verify_locations(cafile)
    configuration.verify_mode = ssl.CERT_REQUIRED
    if ticket is not None:
        configuration.session_ticket = ticket
    async with connect(
        "127.0.0.1",
        port,
        configuration=configuration,
        create_protocol=_Client,
        session_ticket_handler=(tickets.append if tickets is not None else None),
        wait_connected=ticket is None,
    ) as protocol:
        client: _Client = protocol  # type: ignore[assignment]
        client.on_data = on_data
        stream_id = client._quic.get_next_available_stream_id()
        request_headers = [
            (b":method", method.encode()),
            (b":scheme", b"https"),
            (b":authority", f"localhost:{port}".encode()),
            (b":path", path.encode()),
            *((k.encode(), v.encode()) for k, v in (headers or {}).items()),
        ]
        client.h3.send_headers(stream_id, request_headers, end_stream=not body)
        if body:
            client.h3.send_data(stream_id, body, end_stream=True)
        client.transmit()
        await asyncio.wait_for(client.done.wait(), timeout_s)
        tls = client._quic.tls
        client.response.session_resumed = bool(tls.session_resumed)
        client.response.early_data_accepted = bool(tls.early_data_accepted)
        if tickets is not None and not tickets:
            await asyncio.sleep(0.05)  # the ticket may come just after the response
        return client.response
