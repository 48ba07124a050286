"""HTTP/3 response bytes nobody reads are bounded: past the limit the stream is cut (and
reset), so a server cannot fill the client's memory through aioquic's eager flow control."""

from __future__ import annotations

import asyncio
import json

import pytest

from firstbyte.client_sdk.resolver import Origin, Resolver
from firstbyte.client_sdk.tickets import MemoryTicketStore
from firstbyte.client_sdk.transports import h3
from firstbyte.client_sdk.transports.base import TransportCut
from tests.client_sdk.conftest import ROUTER_KEY, Stack
from tests.client_sdk.test_client import MESSAGES

LIMIT = 4096


async def request_stream(session: h3.H3Session, *, read_after_s: float) -> bytes:
    body = json.dumps({"model": "sim-instant", "messages": MESSAGES, "max_tokens": 256,
                       "seed": 11, "stream": True}).encode()
    headers = {"authorization": f"Bearer {ROUTER_KEY}", "content-type": "application/json"}
    async with session.request("POST", "/v1/chat/completions", headers=headers, body=body,
                               recorder=None) as response:
        assert response.status == 200
        await asyncio.sleep(read_after_s)  # the whole answer arrives meanwhile ("instant")
        return await response.read()


async def test_unread_http3_data_is_bounded(stack: Stack, monkeypatch: pytest.MonkeyPatch) -> None:
    session = h3.H3Session(Origin.parse(stack.base_url), Resolver(), MemoryTicketStore(),
                           ca_file=stack.ca_file)
    try:
        whole = await request_stream(session, read_after_s=0)
        assert len(whole) > 2 * LIMIT
        assert whole.endswith(b"data: [DONE]\n\n")
        monkeypatch.setattr(h3, "MAX_UNREAD_BYTES", LIMIT)
        with pytest.raises(TransportCut, match="unread"):
            await request_stream(session, read_after_s=1.0)
        # Read as it comes (a datagram at a time), the same answer passes the same bound.
        again = await request_stream(session, read_after_s=0)
        assert again.endswith(b"data: [DONE]\n\n")
        assert len(again) == len(whole)
    finally:
        await session.aclose()
