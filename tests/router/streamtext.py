"""The text a streamed chat completion carries, for comparing what the router delivered with
what the sim produces on its own."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import httpx

from firstbyte.protocol.sse import SSEDecoder
from firstbyte.router.sim.server import SimServer

__all__ = ["chunk_text", "sim_text", "sse_text"]


def chunk_text(chunk: Mapping[str, Any]) -> str:
    """The delta content of one parsed ``chat.completion.chunk``, over all its choices."""
    return "".join(c["delta"].get("content") or "" for c in chunk.get("choices", []))


def sse_text(sse: bytes) -> tuple[str, list[str | None]]:
    """The concatenated content of an SSE body, and the event ids (``[DONE]``'s included)."""
    events = SSEDecoder().receive_data(sse)
    text = "".join(chunk_text(json.loads(e.data)) for e in events if e.data != "[DONE]")
    return text, [e.id for e in events]


async def sim_text(sim: SimServer, body: Mapping[str, Any]) -> str:
    """The text the sim streams for ``body`` when asked directly (no router)."""
    async with httpx.AsyncClient() as client:
        response = await client.post(sim.url + "/v1/chat/completions", json=body)
    return sse_text(response.content)[0]
