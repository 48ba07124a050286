"""The sim's HTTP face: a plain ASGI app over the engine, OpenAI's API and vLLM's metrics.

Routes: ``POST /v1/chat/completions`` (SSE when ``stream`` is true, JSON otherwise),
``GET /v1/models``, ``GET /health`` (and ``/healthz``), ``GET /metrics``. Every error is
OpenAI's body ``{"error": {"message", "type", "param", "code"}}``: 400 for an invalid request
(via :func:`firstbyte.protocol.openai.decode_request`), 404 unknown route, 405 wrong method, 413
body over the limit, 415 non-JSON content type, 503 overloaded or injected.

The streaming hot path writes pre-encoded byte templates (one per request) with the token's
JSON string spliced in, and sends every token that is ready in one ``send`` call.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from firstbyte.protocol import paths
from firstbyte.protocol.openai import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Choice,
    PromptTokensDetails,
    RequestValidationError,
    ResponseMessage,
    Usage,
    decode_request,
    encode,
    error_body,
)
from firstbyte.protocol.sse import DONE, encode_event
from firstbyte.router.sim.driver import EngineDriver
from firstbyte.router.sim.engine import Engine, Overloaded, Sequence
from firstbyte.router.sim.faults import FaultPlan, RequestFaults
from firstbyte.router.sim.models import ServedModels
from firstbyte.router.sim.output import plan_completion
from firstbyte.router.sim.tokens import prompt_tokens

__all__ = ["DEFAULT_MAX_BODY_BYTES", "DropConnection", "SimApp", "SimOptions"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

DEFAULT_MAX_BODY_BYTES = 4 << 20

log = logging.getLogger("firstbyte.router.sim")


class DropConnection(Exception):
    """Raised inside a response to make the ASGI server close the connection abruptly.

    Servers log exceptions escaping the app; :func:`quiet_drop_logs` filters these out.
    """


class _DropFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, DropConnection)


def quiet_drop_logs() -> None:
    """Keep the injected connection drops out of the ASGI servers' error logs."""
    for name in ("uvicorn.error", "hypercorn.error", "granian", "_granian", "asyncio"):
        logging.getLogger(name).addFilter(_DropFilter())


@dataclass(slots=True)
class SimOptions:
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    seed: int = 0
    faults: FaultPlan = field(default_factory=lambda: FaultPlan(()))
    served_model_names: tuple[str, ...] = ()
    """vLLM's ``--served-model-name``; empty: the profile's model alone."""
    max_model_len: int | None = None
    """The context length ``/v1/models`` reports; None: the profile's."""


_JSON_HEADERS = [(b"content-type", b"application/json")]
_SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]
_TEXT_HEADERS = [(b"content-type", b"text/plain; version=0.0.4; charset=utf-8")]
_DONE_EVENT = encode_event(DONE)


class SimApp:
    """ASGI application for one simulated vLLM replica."""

    def __init__(self, engine: Engine, options: SimOptions | None = None) -> None:
        self.engine = engine
        self.options = options or SimOptions()
        self.driver = EngineDriver(engine)
        profile = engine.profile
        self.models = ServedModels(
            self.options.served_model_names or (profile.model,),
            root=profile.model,
            max_model_len=self.options.max_model_len or profile.max_model_len,
        )
        self._models_body = self.models.list_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "lifespan":
            await self._lifespan(receive, send)
            return
        if kind != "http":
            return
        path: str = scope["path"]
        method: str = scope["method"]
        if path == paths.CHAT_COMPLETIONS:
            if method != "POST":
                await _error(send, 405, f"Method {method} not allowed on {path}.")
                return
            await self._chat(scope, receive, send)
        elif path in ("/health", paths.HEALTHZ, paths.MODELS, paths.METRICS):
            if method not in ("GET", "HEAD"):
                await _error(send, 405, f"Method {method} not allowed on {path}.")
            elif path == paths.MODELS:
                await _respond(send, 200, self._models_body)
            elif path == paths.METRICS:
                body = self.engine.render_metrics().encode()
                await _respond(send, 200, body, _TEXT_HEADERS)
            else:
                await _respond(send, 200, b"", [])
        else:
            await _error(send, 404, f"Route {method} {path} not found.", "not_found_error")

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self.driver.start()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.driver.stop()
                await send({"type": "lifespan.shutdown.complete"})
                return

    # -- chat completions --------------------------------------------------------------------

    async def _chat(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = dict(scope["headers"])
        ctype = headers.get(b"content-type", b"application/json").split(b";")[0].strip().lower()
        if ctype != b"application/json":
            await _error(
                send,
                415,
                f"Unsupported content type {ctype.decode(errors='replace')!r}: "
                "send the request as application/json.",
                code="unsupported_media_type",
            )
            return
        body = await _read_body(receive, headers, self.options.max_body_bytes)
        if body is None:
            limit = self.options.max_body_bytes
            await _error(
                send, 413, f"Request body larger than {limit} bytes.", code="request_too_large"
            )
            return
        try:
            request = decode_request(body)
        except RequestValidationError as exc:
            await _respond(send, 400, encode(exc.body()))
            return
        if not self.models.serves(request.model):
            await _respond(send, 404, self.models.not_found_body(request.model))
            return
        request.model = self.models.name  # vLLM answers with its first served name
        faults = self.options.faults.next_request()
        if faults.error503:
            await _overloaded(send, "Injected fault: the server is temporarily unavailable.")
            return
        if faults.delay_s > 0:
            await asyncio.sleep(faults.delay_s)
        completion = plan_completion(request, self.options.seed)
        tokens = prompt_tokens(request.messages)
        try:
            seq = self.driver.submit(tokens, len(completion.words), completion.finish_reason)
        except Overloaded:
            await _overloaded(send, "The server is overloaded, please try again later.")
            return
        disconnected = asyncio.get_running_loop().create_future()
        listener = asyncio.ensure_future(self._listen(receive, seq, disconnected))
        try:
            if request.stream:
                await self._stream(send, request, completion.token_text, seq, faults, disconnected)
            else:
                await self._complete(send, request, completion.words, seq, faults, disconnected)
        finally:
            listener.cancel()
            self.driver.cancel(seq)

    async def _listen(self, receive: Receive, seq: Sequence, done: asyncio.Future[None]) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                if not done.done():
                    done.set_result(None)
                self.driver.cancel(seq)
                return

    async def _stream(
        self,
        send: Send,
        request: ChatCompletionRequest,
        token_text: Callable[[int], str],
        seq: Sequence,
        faults: RequestFaults,
        disconnected: asyncio.Future[None],
    ) -> None:
        chunk_id = "chatcmpl-" + secrets.token_hex(12)
        created = int(time.time())
        head = (
            b'data: {"id":"' + chunk_id.encode() + b'","object":"chat.completion.chunk",'
            b'"created":'
            + str(created).encode()
            + b',"model":'
            + encode(request.model)
            + b',"system_fingerprint":null,"choices":[{"index":0,"delta":'
        )
        usage_null = b',"usage":null' if request.wants_usage_chunk else b""
        tail = b'},"logprobs":null,"finish_reason":null}]' + usage_null + b"}\n\n"
        content_head = head + b'{"content":'
        await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
        limit = seq.max_output
        stop_at = limit
        pause_at: int | None = None  # a stall with an end: send on after it
        if faults.stall_after is not None and faults.stall_s is not None:
            pause_at = faults.stall_after
        elif faults.stall_after is not None:
            stop_at = min(stop_at, faults.stall_after)
        if faults.drop_after is not None:
            stop_at = min(stop_at, faults.drop_after)
        sent = 0
        wait = self.driver.wait
        while sent < stop_at:
            if pause_at is not None and sent >= pause_at:
                pause_at = None
                await asyncio.wait({disconnected}, timeout=faults.stall_s)
                if disconnected.done():
                    return
            if seq.generated <= sent:
                await wait(seq, sent)
                if disconnected.done() or seq.generated <= sent:
                    return
            upto = min(seq.generated, stop_at if pause_at is None else min(stop_at, pause_at))
            parts = []
            if sent == 0:
                parts.append(head + b'{"role":"assistant","content":""' + tail)
            for i in range(sent, upto):
                parts.append(content_head + encode(token_text(i)) + tail)
            sent = upto
            await send({"type": "http.response.body", "body": b"".join(parts), "more_body": True})
        if sent < limit:
            if faults.drop_after is not None and sent == faults.drop_after:
                raise DropConnection(f"injected fault: drop after {sent} tokens")
            await disconnected  # stall: keep the connection open until the client leaves
            return
        reason = seq.finish_reason.encode()
        final = [
            head + b'{},"logprobs":null,"finish_reason":"' + reason + b'"}]' + usage_null + b"}\n\n"
        ]
        if request.wants_usage_chunk:
            usage_chunk = ChatCompletionChunk(
                id=chunk_id, created=created, model=request.model, choices=[], usage=_usage(seq)
            )
            final.append(encode_event(encode(usage_chunk)))
        final.append(_DONE_EVENT)
        await send({"type": "http.response.body", "body": b"".join(final), "more_body": False})

    async def _complete(
        self,
        send: Send,
        request: ChatCompletionRequest,
        words: tuple[str, ...],
        seq: Sequence,
        faults: RequestFaults,
        disconnected: asyncio.Future[None],
    ) -> None:
        stall_for_good = faults.stall_after if faults.stall_s is None else None
        fault_at = min(
            (n for n in (stall_for_good, faults.drop_after) if n is not None),
            default=None,
        )
        if faults.stall_s is not None and faults.stall_after is not None:
            await asyncio.wait({disconnected}, timeout=faults.stall_s)  # the answer comes late
        target = seq.max_output if fault_at is None else min(fault_at, seq.max_output)
        while seq.generated < target:
            await self.driver.wait(seq, seq.generated)
            if disconnected.done():
                return
        if fault_at is not None and fault_at < seq.max_output:
            if faults.drop_after == fault_at:
                # Promise a body, send half of it, and close: an abrupt end mid-response.
                body = encode(self._completion(request, words, seq))
                headers = [*_JSON_HEADERS, (b"content-length", str(len(body)).encode())]
                await send({"type": "http.response.start", "status": 200, "headers": headers})
                half = {"type": "http.response.body", "body": body[: len(body) // 2]}
                await send({**half, "more_body": True})
                raise DropConnection(f"injected fault: drop after {fault_at} tokens")
            await disconnected
            return
        await _respond(send, 200, encode(self._completion(request, words, seq)))

    @staticmethod
    def _completion(
        request: ChatCompletionRequest, words: tuple[str, ...], seq: Sequence
    ) -> ChatCompletion:
        text = " ".join(words[: seq.generated])
        return ChatCompletion(
            id="chatcmpl-" + secrets.token_hex(12),
            created=int(time.time()),
            model=request.model,
            choices=[
                Choice(
                    index=0,
                    message=ResponseMessage(content=text),
                    finish_reason=seq.finish_reason,
                )
            ],
            usage=_usage(seq),
        )


def _usage(seq: Sequence) -> Usage:
    return Usage(
        prompt_tokens=seq.prompt_len,
        completion_tokens=seq.generated,
        total_tokens=seq.prompt_len + seq.generated,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=seq.cached_tokens),
    )


async def _read_body(receive: Receive, headers: dict[bytes, bytes], limit: int) -> bytes | None:
    """The request body, or None when it is (or announces itself) larger than ``limit``."""
    declared = headers.get(b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        return None
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return b""
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _respond(
    send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    all_headers = list(_JSON_HEADERS if headers is None else headers)
    all_headers.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": all_headers})
    await send({"type": "http.response.body", "body": body})


async def _error(
    send: Send,
    status: int,
    message: str,
    type_: str = "invalid_request_error",
    code: str | None = None,
) -> None:
    await _respond(send, status, encode(error_body(message, type_, code=code)))


async def _overloaded(send: Send, message: str) -> None:
    body = encode(error_body(message, "server_error", code="service_unavailable"))
    headers = [*_JSON_HEADERS, (b"retry-after", b"1")]
    await _respond(send, 503, body, headers)
