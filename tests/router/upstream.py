"""A tiny OpenAI-compatible upstream for the router's tests (until/besides the sim).

Deterministic output ``"w0 w1 w2 ..."`` (``max_tokens`` words), one chunk per word every
``delay_s``; counts running streams and how many were cut off by the router
(``vllm:num_requests_running`` on ``/metrics``, like vLLM).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import uvicorn

_U = TypeVar("_U")

MODELS = (
    "test-model", "m", "x", "sim", "sim-model", "sim-instant", "sim-llama-7b", "chat-model",
    "served-m", "gpt-4o-mini",
)
"""The model names the router's tests send to this upstream."""


@dataclass
class Upstream:
    delay_s: float = 0.0
    burst: int = 1
    """Chunks sent back to back (one ``send`` each, no wait between) after each delay."""
    fail_status: int | None = None
    running: int = 0
    started: int = 0
    cancelled: int = 0
    completed: int = 0
    last_headers: dict[str, str] = field(default_factory=dict)
    client_ports: set[int] = field(default_factory=set)
    """The client port of every chat request: one per TCP connection the router used."""
    url: str = ""
    chat_requests: list[str] = field(default_factory=list)
    """The first user message of every chat request received, in order."""
    chat_headers: list[dict[str, str]] = field(default_factory=list)
    """The headers of every chat request received, in order (``last_headers`` is any path's)."""
    hold: asyncio.Event | None = None
    """When set to an event: chat requests wait for it before answering."""
    pause: asyncio.Event | None = None
    """When set to an event: streamed chat requests wait for it after their first word (a
    stream surely in flight meanwhile)."""
    models: tuple[str, ...] | None = MODELS
    """What its ``/v1/models`` lists, so the router routes these names to it (it answers any);
    None: ``/v1/models`` answers 404 (a server without it)."""

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                else:
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        path = scope["path"]
        if scope.get("client") and path == "/v1/chat/completions":
            self.client_ports.add(scope["client"][1])
        self.last_headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        if path == "/v1/models" and self.models is None:
            await _json(send, 404, {"detail": "Not Found"})
            return
        if path == "/v1/models":
            await _json(
                send,
                200,
                {
                    "object": "list",
                    "data": [
                        {"id": m, "object": "model", "created": 0, "owned_by": "t"}
                        for m in self.models or ()
                    ],
                },
            )
            return
        if path == "/metrics":
            text = f"vllm:num_requests_running {self.running}\n"
            await _send(send, 200, text.encode(), "text/plain")
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if self.fail_status is not None:
            await _json(
                send,
                self.fail_status,
                {
                    "error": {
                        "message": "busy",
                        "type": "server_error",
                        "param": None,
                        "code": "busy",
                    }
                },
            )
            return
        request = json.loads(body)
        users = [m.get("content") for m in request.get("messages", []) if m.get("role") == "user"]
        self.chat_requests.append(str(users[0]) if users else "")
        self.chat_headers.append({k.decode(): v.decode() for k, v in scope["headers"]})
        if self.hold is not None:
            await self.hold.wait()
        n = request.get("max_tokens") or 8
        words = [f"w{i}" for i in range(n)]
        if not request.get("stream"):
            await _json(send, 200, completion(" ".join(words)))
            return
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        self.running += 1
        self.started += 1
        disconnected = asyncio.Event()

        async def listen() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            disconnected.set()

        listener = asyncio.create_task(listen())
        try:
            await send(
                {"type": "http.response.body", "body": sse(chunk(role=True)), "more_body": True}
            )
            for i, word in enumerate(words):
                if i == 1 and self.pause is not None:
                    await self.pause.wait()
                if self.delay_s and i % self.burst == 0:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(disconnected.wait(), self.delay_s)
                if disconnected.is_set():
                    self.cancelled += 1
                    return
                text = word if i == 0 else " " + word
                await send(
                    {
                        "type": "http.response.body",
                        "body": sse(chunk(content=text)),
                        "more_body": True,
                    }
                )
            await send(
                {
                    "type": "http.response.body",
                    "body": sse(chunk(finish=True)) + b"data: [DONE]\n\n",
                    "more_body": False,
                }
            )
            self.completed += 1
        except OSError:
            self.cancelled += 1
        finally:
            self.running -= 1
            listener.cancel()


def chunk(
    *, role: bool = False, content: str | None = None, finish: bool = False
) -> dict[str, Any]:
    delta: dict[str, Any] = {}
    if role:
        delta = {"role": "assistant", "content": ""}
    if content is not None:
        delta["content"] = content
    return {
        "id": "chatcmpl-test",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "test-model",
        "choices": [{"index": 0, "delta": delta, "finish_reason": "stop" if finish else None}],
    }


def completion(text: str) -> dict[str, Any]:
    return {
        "id": "chatcmpl-test",
        "object": "chat.completion",
        "created": 0,
        "model": "test-model",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
        ],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


async def _send(send: Any, status: int, body: bytes, ctype: str) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", ctype.encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def _json(send: Any, status: int, obj: Any) -> None:
    await _send(send, status, json.dumps(obj).encode(), "application/json")


@contextlib.asynccontextmanager
async def serving_on_loopback(app: Any) -> AsyncIterator[str]:
    """``app`` served by plain uvicorn in this event loop on a free loopback port (not the
    router's hosting: a test upstream stands apart from what it tests); yields its base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(app, lifespan="on", log_level="warning", loop="none", http="httptools")
    )
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task
        sock.close()


@contextlib.asynccontextmanager
async def serving_upstream(upstream: _U) -> AsyncIterator[_U]:
    """A test upstream (an ASGI app with a ``url``) served on loopback, its ``url`` set."""
    async with serving_on_loopback(upstream) as url:
        upstream.url = url
        yield upstream


def running_upstream(**options: Any) -> contextlib.AbstractAsyncContextManager[Upstream]:
    return serving_upstream(Upstream(**options))


async def read_request(reader: asyncio.StreamReader) -> bytes:
    """One raw HTTP/1.1 request, head and ``content-length`` body (for raw upstreams that
    script their bytes)."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        (
            int(line.split(b":", 1)[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        ),
        0,
    )
    return head + await reader.readexactly(length)
