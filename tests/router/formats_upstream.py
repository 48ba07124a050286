"""A test upstream that speaks every format the router serves, as vLLM sends them.

``/v1/chat/completions``, ``/v1/completions``, ``/v1/responses`` (typed events with
``sequence_number`` from 0), ``/v1/messages`` (Anthropic's events, ``ping`` included) and
``/v1/embeddings``, streamed and not. Output is ``max_tokens`` words ``w0 w1 ...``, one
content event per word every ``delay_s``, with ``gap_s`` of silence after ``gap_after``
words (a stalled upstream, for the router's heartbeat). Every body received is kept, with
its path and headers, so a test can check what went upstream; ``cut_after`` ends a stream's
body early.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from tests.router.upstream import serving_upstream

MODEL = "test-model"
CONTENT = b"\0"
"""Marks a content event in the generators below (stripped before sending)."""


def _sse(obj: dict[str, Any], event: str | None = None) -> bytes:
    data = b"data: " + json.dumps(obj).encode() + b"\n\n"
    return (b"event: " + event.encode() + b"\n" + data) if event else data


def _usage(n: int) -> dict[str, int]:
    return {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": 3 + n}


def _chat(words: list[str], request: dict[str, Any]) -> Iterator[bytes]:
    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {
            "id": "chatcmpl-f", "object": "chat.completion.chunk", "created": 0, "model": MODEL,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        }

    yield _sse(chunk({"role": "assistant", "content": ""}))
    for i, word in enumerate(words):
        yield CONTENT + _sse(chunk({"content": word if i == 0 else " " + word}))
    yield _sse(chunk({}, "length"))
    if (request.get("stream_options") or {}).get("include_usage"):
        yield _sse({**chunk({}), "choices": [], "usage": _usage(len(words))})
    yield b"data: [DONE]\n\n"


def _completions(words: list[str], request: dict[str, Any]) -> Iterator[bytes]:
    def chunk(text: str, finish: str | None = None) -> dict[str, Any]:
        return {
            "id": "cmpl-f", "object": "text_completion", "created": 0, "model": MODEL,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
        }

    for i, word in enumerate(words):
        yield CONTENT + _sse(chunk(word if i == 0 else " " + word))
    yield _sse(chunk("", "length"))
    if (request.get("stream_options") or {}).get("include_usage"):
        yield _sse({**chunk(""), "choices": [], "usage": _usage(len(words))})
    yield b"data: [DONE]\n\n"


def _response(text: str, status: str, n: int) -> dict[str, Any]:
    output = [] if status == "in_progress" else [_message_item(text, "completed")]
    usage = None if status == "in_progress" else {
        "input_tokens": 3, "output_tokens": n, "total_tokens": 3 + n,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens_details": {"reasoning_tokens": 0},
    }
    return {
        "id": "resp_f", "object": "response", "created_at": 0, "model": MODEL, "status": status,
        "output": output, "usage": usage, "parallel_tool_calls": True, "tool_choice": "auto",
        "tools": [], "error": None, "incomplete_details": None, "instructions": None,
        "metadata": {}, "temperature": 1.0, "top_p": 1.0,
    }


def _message_item(text: str, status: str) -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": []}] if text else []
    return {
        "id": "msg_f", "type": "message", "status": status, "role": "assistant",
        "content": content,
    }


def _responses(words: list[str], request: dict[str, Any]) -> Iterator[bytes]:
    seq = iter(range(1 << 30))

    def event(kind: str, **fields: Any) -> bytes:
        return _sse({"type": kind, "sequence_number": next(seq), **fields}, kind)

    text = " ".join(words)
    where = {"item_id": "msg_f", "output_index": 0, "content_index": 0}
    yield event("response.created", response=_response("", "in_progress", 0))
    yield event("response.in_progress", response=_response("", "in_progress", 0))
    yield event("response.output_item.added", output_index=0,
                item=_message_item("", "in_progress"))
    yield event("response.content_part.added", **where,
                part={"type": "output_text", "text": "", "annotations": []})
    for i, word in enumerate(words):
        yield CONTENT + event("response.output_text.delta", **where,
                    delta=word if i == 0 else " " + word, logprobs=[])
    yield event("response.output_text.done", **where, text=text, logprobs=[])
    yield event("response.content_part.done", **where,
                part={"type": "output_text", "text": text, "annotations": []})
    yield event("response.output_item.done", output_index=0,
                item=_message_item(text, "completed"))
    yield event("response.completed", response=_response(text, "completed", len(words)))


def _anthropic_message(text: str, n: int, stop: str | None) -> dict[str, Any]:
    return {
        "id": "msg_f", "type": "message", "role": "assistant", "model": MODEL,
        "content": [{"type": "text", "text": text}] if text else [],
        "stop_reason": stop, "stop_sequence": None,
        "usage": {"input_tokens": 3, "output_tokens": n},
    }


def _messages(words: list[str], request: dict[str, Any]) -> Iterator[bytes]:
    def event(kind: str, **fields: Any) -> bytes:
        return _sse({"type": kind, **fields}, kind)

    yield event("message_start", message=_anthropic_message("", 1, None))
    yield event("content_block_start", index=0, content_block={"type": "text", "text": ""})
    yield event("ping")
    for i, word in enumerate(words):
        yield CONTENT + event("content_block_delta", index=0,
                    delta={"type": "text_delta", "text": word if i == 0 else " " + word})
    yield event("content_block_stop", index=0)
    yield event("message_delta", delta={"stop_reason": "max_tokens", "stop_sequence": None},
                usage={"output_tokens": len(words)})
    yield event("message_stop")


def _whole(path: str, words: list[str], request: dict[str, Any]) -> dict[str, Any]:
    text = " ".join(words)
    n = len(words)
    if path == "/v1/completions":
        return {
            "id": "cmpl-f", "object": "text_completion", "created": 0, "model": MODEL,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}],
            "usage": _usage(n),
        }
    if path == "/v1/responses":
        return _response(text, "completed", n)
    if path == "/v1/messages":
        return _anthropic_message(text, n, "max_tokens")
    return {
        "id": "chatcmpl-f", "object": "chat.completion", "created": 0, "model": MODEL,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                     "finish_reason": "length"}],
        "usage": _usage(n),
    }


def _embeddings(request: dict[str, Any]) -> dict[str, Any]:
    inputs = request["input"] if isinstance(request["input"], list) else [request["input"]]
    data = []
    for index, _ in enumerate(inputs):
        vector = [0.25, -0.5, float(index)]
        if request.get("encoding_format") == "base64":
            packed = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
            data.append({"object": "embedding", "index": index, "embedding": packed})
        else:
            data.append({"object": "embedding", "index": index, "embedding": vector})
    return {"object": "list", "data": data, "model": MODEL,
            "usage": {"prompt_tokens": 2, "total_tokens": 2}}


_STREAMS = {
    "/v1/chat/completions": _chat,
    "/v1/completions": _completions,
    "/v1/responses": _responses,
    "/v1/messages": _messages,
}


@dataclass
class FormatsUpstream:
    delay_s: float = 0.0
    """Between content events."""
    gap_after: int | None = None
    gap_s: float = 0.0
    cut_after: int | None = None
    """End the body after this many words, before the stream's own end (a crashed server)."""
    url: str = ""
    received: list[tuple[str, dict[str, str], dict[str, Any]]] = field(default_factory=list)
    """(path, headers, body) of every POST, in order."""
    completed: int = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        path = scope["path"]
        if path == "/v1/models":
            await _reply(send, 200, {"object": "list", "data": [
                {"id": MODEL, "object": "model", "created": 0, "owned_by": "t"}]})
            return
        if path == "/metrics":
            await _reply(send, 200, None, b"vllm:num_requests_running 0\n")
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        request = json.loads(body)
        headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        self.received.append((path, headers, request))
        if path == "/v1/embeddings":
            await _reply(send, 200, _embeddings(request))
            return
        words = [f"w{i}" for i in range(request.get("max_tokens")
                                        or request.get("max_output_tokens") or 8)]
        if path not in _STREAMS:
            await _reply(send, 404, {"error": {"message": "no", "type": "x", "code": None}})
            return
        if not request.get("stream"):
            await _reply(send, 200, _whole(path, words, request))
            return
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        content = 0
        gone = asyncio.Event()

        async def listen() -> None:  # the router closed the connection: stop generating
            while (await receive())["type"] != "http.disconnect":
                pass
            gone.set()

        listener = asyncio.create_task(listen())
        with contextlib.suppress(OSError):
            for event in _STREAMS[path](words, request):
                if gone.is_set():
                    break
                if event[:1] == CONTENT:
                    event = event[1:]
                    content += 1
                    if self.cut_after is not None and content > self.cut_after:
                        break
                    if self.delay_s:
                        await asyncio.sleep(self.delay_s)
                    if self.gap_after is not None and content == self.gap_after + 1:
                        await asyncio.sleep(self.gap_s)
                await send({"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            self.completed += not gone.is_set()
        listener.cancel()


async def _reply(send: Any, status: int, obj: Any, raw: bytes | None = None) -> None:
    body = raw if raw is not None else json.dumps(obj).encode()
    ctype = b"text/plain" if raw is not None else b"application/json"
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", ctype)]})
    await send({"type": "http.response.body", "body": body})


def running_formats_upstream(**options: Any) -> contextlib.AbstractAsyncContextManager[FormatsUpstream]:
    return serving_upstream(FormatsUpstream(**options))
