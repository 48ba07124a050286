"""Drain and reload, tried on real ``firstbyte router`` processes (the attack tests' harness:
``start_router_process``, the tests' own upstream, TLS from trustme, a raw h2 client)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import h2.events

from tests.router.attacks.conftest import (  # noqa: F401 (fixtures)
    RouterProcess,
    router_server,
    start_router_process,
    upstream,
    without_patches,
    write_config,
)
from tests.router.attacks.test_http2 import H2Client

__all__ = ["H2Session", "H2Stream", "RouterProcess", "content_of", "write_config"]


@dataclass
class H2Stream:
    """One request's answer on an :class:`H2Session`."""

    stream_id: int
    status: int = 0
    body: bytes = b""
    ended: bool = False


@dataclass
class H2Session:
    """Requests on one raw HTTP/2 connection, read together; the server's GOAWAY if any."""

    client: H2Client
    streams: dict[int, H2Stream] = field(default_factory=dict)
    goaway: h2.events.ConnectionTerminated | None = None

    @classmethod
    async def open(cls, router: RouterProcess) -> H2Session:
        return cls(await H2Client.open(router))

    async def request(self, body: dict[str, Any], key: str) -> H2Stream:
        """Send a chat completion request with ``key``."""
        conn = self.client.conn
        stream_id = conn.get_next_available_stream_id()
        headers = [(n, f"Bearer {key}" if n == "authorization" else v)
                   for n, v in self.client.headers("/v1/chat/completions")]
        conn.send_headers(stream_id, headers)
        conn.send_data(stream_id, json.dumps(body).encode(), end_stream=True)
        await self.client.flush()
        stream = self.streams[stream_id] = H2Stream(stream_id)
        return stream

    async def read(self, done: Callable[[], bool], timeout_s: float = 30) -> None:
        """Read the connection until ``done()`` (or it closes)."""
        conn = self.client.conn
        async with asyncio.timeout(timeout_s):
            while not done() and not self.client.closed:
                for event in await self.client.events(0.5):
                    stream = self.streams.get(getattr(event, "stream_id", None) or 0)
                    if isinstance(event, h2.events.ConnectionTerminated):
                        self.goaway = event
                    elif stream is None:
                        continue
                    elif isinstance(event, h2.events.ResponseReceived):
                        stream.status = int(dict(event.headers)[":status"])
                    elif isinstance(event, h2.events.DataReceived):
                        conn.acknowledge_received_data(
                            event.flow_controlled_length, event.stream_id
                        )
                        stream.body += event.data
                    elif isinstance(event, (h2.events.StreamEnded, h2.events.StreamReset)):
                        stream.ended = True
                await self.client.flush()


def content_of(sse_body: bytes) -> tuple[str, list[dict[str, Any]], bool]:
    """(the text, the error objects, whether ``[DONE]`` came) of an SSE body."""
    text, errors, done = "", [], False
    for line in sse_body.decode().splitlines():
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            done = True
            continue
        obj = json.loads(data)
        if "error" in obj:
            errors.append(obj["error"])
        for choice in obj.get("choices", []):
            text += (choice.get("delta") or {}).get("content") or ""
    return text, errors, done
