"""Drain and reload, tried on real ``firstbyte router`` processes (the attack tests' harness:
``start_router_process``, the tests' own upstream, TLS from trustme, a raw h2 client)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

import h2.events

from tests.router.attacks.conftest import (  # noqa: F401 (fixtures)
    RouterProcess,
    start_router_process,
    upstream,
)
from tests.router.attacks.test_http2 import H2Client

__all__ = [
    "H2Stream",
    "RouterProcess",
    "content_of",
    "open_h2_stream",
    "read_h2_stream",
    "send_h2_request",
    "wait_for_goaway",
]


@dataclass
class H2Stream:
    """One streamed completion on a raw HTTP/2 connection, and what the connection saw."""

    client: H2Client
    stream_id: int
    status: int = 0
    body: bytes = b""
    ended: bool = False
    goaway: h2.events.ConnectionTerminated | None = None
    other: dict[int, bytes] = field(default_factory=dict)


async def open_h2_stream(router: RouterProcess, body: dict[str, Any], key: str) -> H2Stream:
    client = await H2Client.open(router)
    return await send_h2_request(client, body, key)


async def send_h2_request(client: H2Client, body: dict[str, Any], key: str) -> H2Stream:
    stream_id = client.conn.get_next_available_stream_id()
    headers = [(n, f"Bearer {key}" if n == "authorization" else v)
               for n, v in client.headers("/v1/chat/completions")]
    client.conn.send_headers(stream_id, headers)
    client.conn.send_data(stream_id, json.dumps(body).encode(), end_stream=True)
    await client.flush()
    return H2Stream(client, stream_id)


async def read_h2_stream(stream: H2Stream, until: bytes | None = None,
                         timeout_s: float = 30) -> H2Stream:
    """Read ``stream`` until it ends (or its body contains ``until``)."""
    conn = stream.client.conn
    async with asyncio.timeout(timeout_s):
        while not stream.ended and not stream.client.closed:
            if until is not None and until in stream.body:
                return stream
            for event in await stream.client.events(0.5):
                if isinstance(event, h2.events.ConnectionTerminated):
                    stream.goaway = event
                sid = getattr(event, "stream_id", None)
                if isinstance(event, h2.events.ResponseReceived) and sid == stream.stream_id:
                    stream.status = int(dict(event.headers)[":status"])
                elif isinstance(event, h2.events.DataReceived):
                    conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                    if sid == stream.stream_id:
                        stream.body += event.data
                elif (
                    isinstance(event, (h2.events.StreamEnded, h2.events.StreamReset))
                    and sid == stream.stream_id
                ):
                    stream.ended = True
            await stream.client.flush()
    return stream


async def wait_for_goaway(stream: H2Stream, timeout_s: float = 10) -> None:
    """Read the connection until the server's GOAWAY (kept in ``stream.goaway``)."""
    async with asyncio.timeout(timeout_s):
        while stream.goaway is None and not stream.client.closed:
            for event in await stream.client.events(0.5):
                if isinstance(event, h2.events.ConnectionTerminated):
                    stream.goaway = event


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
