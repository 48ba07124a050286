"""Client-side helpers for the sim's HTTP tests: stream a completion and time it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from firstbyte.protocol.openai import ChatCompletionChunk, decode_chunk
from firstbyte.protocol.sse import DONE, SSEDecoder


@dataclass
class Streamed:
    status: int
    ttft_s: float | None = None
    e2e_s: float | None = None
    text: str = ""
    chunks: list[ChatCompletionChunk] = field(default_factory=list)
    done: bool = False
    body: bytes = b""


MODEL = "sim"
"""The model name the sims of these tests serve (``served_model_names=[MODEL]``) and the
bodies below ask for."""


def chat_body(content: str, *, system: str | None = None, **fields: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": content}]
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    return {"model": MODEL, "messages": messages, "stream": True, **fields}


async def stream_chat(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> Streamed:
    """POST a streaming completion; TTFT = request start to the first content chunk."""
    start = time.perf_counter()
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        result = Streamed(status=response.status_code)
        if response.status_code != 200:
            result.body = await response.aread()
            return result
        decoder = SSEDecoder()
        async for piece in response.aiter_raw():
            for event in decoder.receive_data(piece):
                if event.data == DONE:
                    result.done = True
                    continue
                chunk = decode_chunk(event.data)
                result.chunks.append(chunk)
                content = chunk.choices[0].delta.content if chunk.choices else None
                if content:
                    now = time.perf_counter() - start
                    if result.ttft_s is None:
                        result.ttft_s = now
                    result.e2e_s = now
                    result.text += content
    return result


def metric(text: str, name: str) -> float:
    """The value of the first sample of ``name`` in a Prometheus text exposition."""
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)
