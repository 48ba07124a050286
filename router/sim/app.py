"""The sim's HTTP face: a plain ASGI app over the engine, vLLM's APIs and vLLM's metrics.

Routes, as vLLM serves them: ``POST /v1/chat/completions``, ``/v1/completions``,
``/v1/responses`` and ``/v1/messages`` (SSE when ``stream`` is true, JSON otherwise; each in
its wire format, :mod:`firstbyte.router.sim.wire`), ``POST /v1/embeddings``, ``GET
/v1/models``, ``GET /health`` (and ``/healthz``), ``GET /metrics``. Every request goes through
the same engine (prefill and decode cost, prefix cache) and the same faults. Errors are
OpenAI's body ``{"error": {"message", "type", "param", "code"}}`` (Anthropic's
``{"type": "error", "error": {"type", "message"}}`` on ``/v1/messages``): 400 for an invalid
request, 404 for a model not served (vLLM's body) or an unknown route, 405 wrong method, 413
body over the limit, 415 non-JSON content type, 503 overloaded or injected.

Streaming sends every token that is ready in one ``send`` call; chat's encoder splices each
token's JSON string into a pre-encoded byte template.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from firstbyte.protocol import paths
from firstbyte.protocol.openai import RequestValidationError, decode_request, encode, error_body
from firstbyte.router.sim.apis import Api, Job, decode_job, stop_strings
from firstbyte.router.sim.driver import EngineDriver
from firstbyte.router.sim.engine import Engine, Overloaded, SeqState, Sequence
from firstbyte.router.sim.faults import FaultPlan, RequestFaults
from firstbyte.router.sim.models import ServedModels
from firstbyte.router.sim.output import Completion, plan_output
from firstbyte.router.sim.prefix_cache import block_hashes
from firstbyte.router.sim.tokens import prompt_tokens
from firstbyte.router.sim.wire import (
    ChatFormat,
    CompletionsFormat,
    MessagesFormat,
    ResponsesFormat,
    StreamFormat,
    anthropic_error,
    embeddings_body,
)

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
_ROUTES = {
    paths.CHAT_COMPLETIONS: Api.CHAT,
    "/v1/completions": Api.COMPLETIONS,
    "/v1/responses": Api.RESPONSES,
    "/v1/embeddings": Api.EMBEDDINGS,
    "/v1/messages": Api.MESSAGES,
}


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
        if kind == "websocket":
            # vLLM serves no WebSocket: refused (403), as a server without the route answers
            # (returning without a word made hypercorn answer a bare 500).
            await send({"type": "websocket.close", "code": 1008})
            return
        if kind != "http":
            return
        path: str = scope["path"]
        method: str = scope["method"]
        api = _ROUTES.get(path)
        if api is not None:
            if method != "POST":
                await _error(send, 405, f"Method {method} not allowed on {path}.")
                return
            await self._infer(api, scope, receive, send)
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

    # -- the inference endpoints -----------------------------------------------------------

    async def _infer(self, api: Api, scope: Scope, receive: Receive, send: Send) -> None:
        errors = _ANTHROPIC_ERRORS if api is Api.MESSAGES else _OPENAI_ERRORS
        headers = dict(scope["headers"])
        ctype = headers.get(b"content-type", b"application/json").split(b";")[0].strip().lower()
        if ctype != b"application/json":
            message = (
                f"Unsupported content type {ctype.decode(errors='replace')!r}: "
                "send the request as application/json."
            )
            await errors.send(send, 415, message, code="unsupported_media_type")
            return
        body = await _read_body(receive, headers, self.options.max_body_bytes)
        if body is None:
            limit = self.options.max_body_bytes
            message = f"Request body larger than {limit} bytes."
            await errors.send(send, 413, message, code="request_too_large")
            return
        received = self.driver.now()
        try:
            job = _chat_job(body) if api is Api.CHAT else decode_job(api, body)
        except RequestValidationError as exc:
            await errors.send(send, 400, exc.message, param=exc.param)
            return
        if not self.models.serves(job.model):
            if api is Api.MESSAGES:
                message = f"The model `{job.model}` does not exist."
                await _respond(send, 404, anthropic_error(message, "NotFoundError"))
            else:
                await _respond(send, 404, self.models.not_found_body(job.model))
            return
        block_keys = block_hashes(job.prompt, self.engine.block_size)
        late_s = await self._tokenizing(received, len(job.prompt))
        faults = self.options.faults.next_request()
        if faults.error503:
            await errors.overloaded(send, "Injected fault: the server is temporarily unavailable.")
            return
        if faults.delay_s > 0:
            await asyncio.sleep(faults.delay_s)
        model = self.models.name  # vLLM answers with its first served name
        if api is Api.EMBEDDINGS:
            completion = Completion(words=(), finish_reason="stop")
        else:
            completion = plan_output(
                job.text_key, job.seed, model, job.output_limit, self.options.seed,
                ignore_eos=job.ignore_eos, stop=job.stop,
            )
        try:
            seq = self.driver.submit(
                job.prompt, len(completion.words), completion.finish_reason, block_keys, late_s
            )
        except Overloaded:
            await errors.overloaded(send, "The server is overloaded, please try again later.")
            return
        disconnected = asyncio.get_running_loop().create_future()
        listener = asyncio.ensure_future(self._listen(receive, seq, disconnected))
        try:
            if api is Api.EMBEDDINGS:
                await self._embed(send, job, model, seq, faults, disconnected)
                return
            fmt = _format(api, model, completion, seq, job)
            if job.stream:
                await self._stream(send, fmt, seq, faults, disconnected)
            else:
                await self._complete(send, fmt, seq, faults, disconnected)
        finally:
            listener.cancel()
            self.driver.cancel(seq)

    async def _tokenizing(self, received: float, prompt_tokens: int) -> float:
        """Return when the profile's frontend would have tokenized the prompt, ``received``
        being when its body was read, and how late that is (seconds). What this process
        spent decoding, tokenizing and hashing it since counts toward that time, and the
        engine is handed the request as of the modelled moment (late by this process's CPU
        past the profile's figure, or a timer's overshoot): the sim's latency is the
        profile's, not its own Python's."""
        ready = received + self.engine.profile.tokenize_s(prompt_tokens)
        left = ready - self.driver.now()
        if left > 0:
            await asyncio.sleep(left)
        return max(0.0, self.driver.now() - ready)

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
        fmt: StreamFormat,
        seq: Sequence,
        faults: RequestFaults,
        disconnected: asyncio.Future[None],
    ) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
        preamble = fmt.preamble()
        if preamble:
            await send({"type": "http.response.body", "body": preamble, "more_body": True})
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
        token = fmt.token
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
                parts.append(fmt.opening())
            for i in range(sent, upto):
                parts.append(token(i))
            sent = upto
            await send({"type": "http.response.body", "body": b"".join(parts), "more_body": True})
        if sent < limit:
            if faults.drop_after is not None and sent == faults.drop_after:
                raise DropConnection(f"injected fault: drop after {sent} tokens")
            await disconnected  # stall: keep the connection open until the client leaves
            return
        await send({"type": "http.response.body", "body": fmt.closing(), "more_body": False})

    async def _complete(
        self,
        send: Send,
        fmt: StreamFormat,
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
                await _half_then_drop(send, fmt.whole(), f"drop after {fault_at} tokens")
            await disconnected
            return
        await _respond(send, 200, fmt.whole())

    async def _embed(
        self,
        send: Send,
        job: Job,
        model: str,
        seq: Sequence,
        faults: RequestFaults,
        disconnected: asyncio.Future[None],
    ) -> None:
        """An embedding: the answer once the prompt is prefilled. A stall or drop fault (at
        any ``after``) hits it as a non-streamed answer with no tokens: none, or half a body."""
        if faults.stall_s is not None and faults.stall_after is not None:
            await asyncio.wait({disconnected}, timeout=faults.stall_s)  # the answer comes late
        while not seq.finished:
            await self.driver.wait(seq, 0)
            if disconnected.done() or seq.state is SeqState.CANCELLED:
                return
        body = embeddings_body(job, model, seq)
        if faults.drop_after is not None:
            await _half_then_drop(send, body, "drop before the end of an embedding")
        if faults.stall_after is not None and faults.stall_s is None:
            await disconnected
            return
        await _respond(send, 200, body)


def _chat_job(body: bytes) -> Job:
    request = decode_request(body)
    return Job(
        api=Api.CHAT,
        model=request.model,
        prompt=prompt_tokens(request.messages),
        output_limit=request.output_limit,
        stream=bool(request.stream),
        include_usage=request.wants_usage_chunk,
        seed=request.seed,
        text_key=encode(request.messages),
        ignore_eos=bool(request.ignore_eos),
        stop=stop_strings(request.stop),
    )


def _format(
    api: Api, model: str, completion: Completion, seq: Sequence, job: Job
) -> StreamFormat:
    if api is Api.CHAT:
        return ChatFormat(model, completion, seq, job.include_usage)
    if api is Api.COMPLETIONS:
        return CompletionsFormat(model, completion, seq, job)
    if api is Api.RESPONSES:
        return ResponsesFormat(model, completion, seq, job)
    return MessagesFormat(model, completion, seq)


async def _half_then_drop(send: Send, body: bytes, what: str) -> None:
    """Promise ``body``, send half of it, and close: an abrupt end mid-response."""
    headers = [*_JSON_HEADERS, (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body[: len(body) // 2], "more_body": True})
    raise DropConnection(f"injected fault: {what}")


class _Errors:
    """How one API says no: OpenAI's envelope, or Anthropic's."""

    def __init__(self, anthropic: bool) -> None:
        self.anthropic = anthropic

    async def send(
        self,
        send: Send,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        if self.anthropic:
            kind = "request_too_large" if status == 413 else "invalid_request_error"
            body = anthropic_error(message, kind)
        else:
            body = encode(error_body(message, "invalid_request_error", param=param, code=code))
        await _respond(send, status, body)

    async def overloaded(self, send: Send, message: str) -> None:
        if self.anthropic:
            body = anthropic_error(message, "overloaded_error")
        else:
            body = encode(error_body(message, "server_error", code="service_unavailable"))
        headers = [*_JSON_HEADERS, (b"retry-after", b"1")]
        await _respond(send, 503, body, headers)


_OPENAI_ERRORS = _Errors(anthropic=False)
_ANTHROPIC_ERRORS = _Errors(anthropic=True)


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
