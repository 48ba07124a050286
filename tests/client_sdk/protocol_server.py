"""A small real server speaking docs/protocol.md, for the SDK's tests.

It is not the router: one in-memory stream store, a deterministic token producer per stream
(independent of any connection, so a cut connection can be resumed), SSE, SSE resume, long-poll,
``POST /v1/streams``, WebSocket ``/v1/ws``, ``/healthz``, bearer auth and heartbeats. It runs in
hypercorn on its own thread and event loop with real TLS (h1, h2 and h3 on QUIC).

Behaviour is chosen per request through the model name: ``stall-K`` stops producing after K
tokens (heartbeats continue), ``slow-MS`` waits MS milliseconds before the first token,
``tools`` streams one tool call (``get_weather``) in fragments, ``busy`` answers 429;
``busy-N`` (429) and ``draining-N`` (503, code ``draining``) refuse the first N requests of
that model name with ``Retry-After: 1`` (``refusal_retry_after`` seconds), then serve (over
SSE, ``POST /v1/streams`` and WebSocket alike: a WebSocket ``error`` message with the status
and ``retry_after``, as the router sends; without ``retry_after`` while ``ws_retry_after`` is
False, as an older router sends).
``POST /v1/streams?wait=S`` answers with the first poll batch, unless ``post_batch`` is False
(then it answers the bare ``{"stream": ID}``, as a router from before ``wait`` did).
``/healthz`` answers ``health`` (status, ``Retry-After`` or None; default 200), which a test
may change while the server runs; the next ``health_draining`` answers are the router's
``503`` ``draining`` (plain text) instead. ``peers`` says which connection (the client's
address and port) each request came on.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from hypercorn.asyncio import serve
from hypercorn.config import Config

from firstbyte.protocol.sse import HEARTBEAT

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

WORDS = ("The", " quick", " brown", " fox", " jumps", " over", " the", " lazy", " dog", ".")


def expected_text(n: int) -> str:
    """The text every stream of ``max_tokens=n`` produces."""
    return "".join(WORDS[i % len(WORDS)] for i in range(n))


@dataclass
class _Stream:
    key: str | None
    events: list[bytes] = field(default_factory=list)  # JSON payloads; b"[DONE]" last
    cond: asyncio.Condition = field(default_factory=asyncio.Condition)
    done: bool = False


TOOL_ARGUMENTS = ('{"city"', ': "Par', 'is"}')


def _chunk(sid: str, model: str, *, content: str | None = None, role: str | None = None,
           finish: str | None = None, usage: dict[str, int] | None = None,
           tool_call: dict[str, Any] | None = None) -> bytes:
    delta: dict[str, Any] = {}
    if tool_call is not None:
        delta["tool_calls"] = [tool_call]
    if role is not None:
        delta["role"] = role
    if content is not None:
        delta["content"] = content
    choices = [] if usage is not None else [
        {"index": 0, "delta": delta, "finish_reason": finish}]
    obj: dict[str, Any] = {"id": "chatcmpl-" + sid[:8], "object": "chat.completion.chunk",
                           "created": 0, "model": model, "choices": choices}
    if usage is not None:
        obj["usage"] = usage
    return json.dumps(obj, separators=(",", ":")).encode()


class ProtocolApp:
    """The ASGI app. ``token_interval`` seconds between tokens, heartbeats every ``heartbeat``."""

    def __init__(self, *, api_key: str | None = None, token_interval: float = 0.005,
                 heartbeat: float = 0.1, post_batch: bool = True) -> None:
        self.api_key = api_key
        self.post_batch = post_batch
        self.token_interval = token_interval
        self.heartbeat = heartbeat
        self.streams: dict[str, _Stream] = {}
        self.requests: list[tuple[str, str]] = []
        self.peers: list[tuple[str, int] | None] = []
        """Each request's client address and port (``requests``' order): a connection's."""
        self.refused: dict[str, int] = {}
        """Requests refused so far per ``busy-N`` / ``draining-N`` model name."""
        self.refusal_retry_after = 1
        """The ``Retry-After`` seconds of a ``busy-N`` / ``draining-N`` refusal."""
        self.ws_retry_after = True
        """Whether a WebSocket refusal carries ``retry_after`` (False: an older router's)."""
        self.batches: list[tuple[str, list[int]]] = []
        """Long-poll answers in order: (method, the seqs of the events they carried)."""
        self.health: tuple[int, str | None] = (200, None)
        """What ``/healthz`` answers: the status and its ``Retry-After`` (None: none)."""
        self.health_draining = 0
        """How many of the next ``/healthz`` answers are ``503`` ``draining`` (the router's
        while it drains), before ``health``'s."""
        self._tasks: set[asyncio.Task[None]] = set()

    # -- producer -------------------------------------------------------------------------------
    def _start(self, body: dict[str, Any], key: str | None) -> str:
        sid = secrets.token_urlsafe(16)
        stream = _Stream(key)
        self.streams[sid] = stream
        task = asyncio.get_running_loop().create_task(self._produce(sid, stream, body))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return sid

    async def _emit(self, stream: _Stream, payload: bytes) -> None:
        async with stream.cond:
            stream.events.append(payload)
            stream.cond.notify_all()

    async def _produce(self, sid: str, stream: _Stream, body: dict[str, Any]) -> None:
        model = str(body.get("model", "m"))
        n = int(body.get("max_tokens") or 16)
        stall_after: int | None = None
        if model.startswith("stall-"):
            stall_after = int(model.split("-", 1)[1])
        if model.startswith("slow-"):
            await asyncio.sleep(int(model.split("-", 1)[1]) / 1000)
        await self._emit(stream, _chunk(sid, model, role="assistant", content=""))
        if model == "tools":
            await self._emit(stream, _chunk(sid, model, tool_call={
                "index": 0, "id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": ""}}))
            for fragment in TOOL_ARGUMENTS:
                await asyncio.sleep(self.token_interval)
                await self._emit(stream, _chunk(sid, model, tool_call={
                    "index": 0, "function": {"arguments": fragment}}))
            await self._emit(stream, _chunk(sid, model, content=None, finish="tool_calls"))
            await self._emit(stream, b"[DONE]")
            stream.done = True
            return
        for i in range(n):
            if stall_after is not None and i >= stall_after:
                await asyncio.sleep(3600)
            await asyncio.sleep(self.token_interval)
            await self._emit(stream, _chunk(sid, model, content=WORDS[i % len(WORDS)]))
        await self._emit(stream, _chunk(sid, model, content="", finish="length"))
        await self._emit(stream, _chunk(sid, model, usage={
            "prompt_tokens": 5, "completion_tokens": n, "total_tokens": n + 5}))
        await self._emit(stream, b"[DONE]")
        stream.done = True

    async def _wait_events(self, stream: _Stream, after: int, wait_s: float) -> bool:
        """Wait until an event with seq > after exists; False on timeout."""
        async with stream.cond:
            try:
                await asyncio.wait_for(
                    stream.cond.wait_for(lambda: len(stream.events) > after), wait_s)
            except TimeoutError:
                return False
        return True

    # -- ASGI -----------------------------------------------------------------------------------
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    for task in list(self._tasks):
                        task.cancel()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        headers: dict[str, str] = {
            k.decode().lower(): v.decode() for k, v in scope.get("headers", [])}
        path: str = scope["path"]
        self.requests.append((scope.get("method", "WS"), path))
        client = scope.get("client")
        self.peers.append(None if client is None else (client[0], client[1]))
        key = None
        auth = headers.get("authorization", "")
        if auth.startswith("Bearer "):
            key = auth[7:]
        if scope["type"] == "websocket":
            await self._websocket(scope, receive, send, key)
            return
        if self.api_key is not None and key != self.api_key and path != "/healthz":
            await _json(send, 401, {"error": {"message": "bad key", "type": "authentication_error",
                                              "param": None, "code": "invalid_api_key"}})
            return
        method = scope["method"]
        query: dict[str, str] = dict(
            p.split("=", 1) for p in scope["query_string"].decode().split("&") if "=" in p)
        if path == "/healthz" and self.health_draining:
            self.health_draining -= 1
            await send({"type": "http.response.start", "status": 503,
                        "headers": [(b"content-type", b"text/plain")]})
            await send({"type": "http.response.body", "body": b"draining\n"})
        elif path == "/healthz":
            status, retry_after = self.health
            await _json(send, status, {"status": "ok" if status == 200 else "refused"},
                        extra=None if retry_after is None else [
                            (b"retry-after", retry_after.encode())])
        elif method == "POST" and path == "/v1/chat/completions":
            body = json.loads(await _body(receive))
            if body.get("model") == "busy":
                await _json(send, 429, {"error": {"message": "saturated", "type": "rate_limit",
                                                  "param": None, "code": None}},
                            extra=[(b"retry-after", b"2")])
                return
            if await self._refused(send, str(body.get("model", ""))):
                return
            sid = self._start(body, key)
            await self._sse(send, sid, 0)
        elif method == "POST" and path == "/v1/streams":
            body = json.loads(await _body(receive))
            if await self._refused(send, str(body.get("model", ""))):
                return
            sid = self._start(body, key)
            wait = float(query.get("wait", "0"))
            if wait > 0 and self.post_batch:
                await self._poll(send, sid, self.streams[sid], 0, wait, status=201)
            else:
                await _json(send, 201, {"stream": sid},
                            extra=[(b"x-firstbyte-stream", sid.encode())])
        elif method == "GET" and path.startswith("/v1/streams/"):
            rest = path[len("/v1/streams/"):]
            sid, _, tail = rest.partition("/")
            stream = self.streams.get(sid)
            if stream is None or stream.key != key:
                await _json(send, 404, {"error": {"message": "no such stream",
                                                  "type": "invalid_request_error"}})
                return
            if tail == "poll":
                await self._poll(send, sid, stream, int(query.get("after", "0")),
                                 float(query.get("wait", "10")))
            else:
                after = int(headers.get("last-event-id", query.get("after", "0")))
                await self._sse(send, sid, after)
        else:
            await _json(send, 404, {"error": {"message": "not found", "type": "not_found"}})

    async def _sse(self, send: Send, sid: str, after: int) -> None:
        stream = self.streams[sid]
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"),
            (b"x-firstbyte-stream", sid.encode()), (b"x-firstbyte-region", b"test"),
            (b"server-timing", b"queue;dur=0.5, route;dur=0.1, upstream-ttft;dur=3")]})
        seq = after
        while True:
            if not await self._wait_events(stream, seq, self.heartbeat):
                await send({"type": "http.response.body", "body": HEARTBEAT,
                            "more_body": True})
                continue
            batch = stream.events[seq:]
            out = b"".join(b"id: %d\ndata: %s\n\n" % (seq + i + 1, p) for i, p in enumerate(batch))
            seq += len(batch)
            last = batch[-1] == b"[DONE]"
            await send({"type": "http.response.body", "body": out, "more_body": not last})
            if last:
                return

    async def _poll(self, send: Send, sid: str, stream: _Stream, after: int, wait: float,
                    status: int = 200) -> None:
        await self._wait_events(stream, after, wait)
        events, done = [], False
        for i, payload in enumerate(stream.events[after:]):
            if payload == b"[DONE]":
                done = True
                break
            events.append({"seq": after + i + 1, "data": json.loads(payload)})
        nxt = after + len(events)  # the highest seq returned; [DONE]'s own seq is not in it
        self.batches.append(("POST" if status == 201 else "GET", [e["seq"] for e in events]))
        await _json(send, status, {"stream": sid, "events": events, "done": done, "next": nxt},
                    extra=[(b"x-firstbyte-stream", sid.encode())])

    async def _websocket(self, scope: Scope, receive: Receive, send: Send, key: str | None) -> None:
        await receive()  # websocket.connect
        if self.api_key is not None and key != self.api_key:
            await send({"type": "websocket.close", "code": 1008, "reason": "bad key"})
            return
        await send({"type": "websocket.accept"})
        pumps: set[asyncio.Task[None]] = set()
        try:
            while True:
                msg = await receive()
                if msg["type"] == "websocket.disconnect":
                    return
                req = json.loads(msg.get("text") or "{}")
                if req.get("type") == "request":
                    refused = self._refusal(str(req["body"].get("model", "")))
                    if refused is not None:
                        status, error = refused
                        message = {"type": "error", "stream": None, "error": error,
                                   "status": status}
                        if self.ws_retry_after:
                            message["retry_after"] = self.refusal_retry_after
                        await send({"type": "websocket.send", "text": json.dumps(message)})
                        continue
                    sid = self._start(req["body"], key)
                    after = 0
                elif req.get("type") == "resume":
                    sid, after = req["stream"], int(req["after"])
                    if sid not in self.streams or self.streams[sid].key != key:
                        await send({"type": "websocket.send", "text": json.dumps(
                            {"type": "error", "stream": sid, "error": {
                                "message": "no such stream", "type": "invalid_request_error"}})})
                        continue
                else:
                    await send({"type": "websocket.close", "code": 1007, "reason": "bad type"})
                    return
                await send({"type": "websocket.send",
                            "text": json.dumps({"type": "start", "stream": sid})})
                pump = asyncio.create_task(self._ws_pump(send, sid, after))
                pumps.add(pump)
                pump.add_done_callback(pumps.discard)
        finally:
            for pump in pumps:
                pump.cancel()

    async def _ws_pump(self, send: Send, sid: str, after: int) -> None:
        stream = self.streams[sid]
        seq = after
        while True:
            await self._wait_events(stream, seq, 3600)
            for payload in stream.events[seq:]:
                seq += 1
                if payload == b"[DONE]":
                    await send({"type": "websocket.send", "text": json.dumps(
                        {"type": "done", "stream": sid, "seq": seq})})
                    return
                await send({"type": "websocket.send", "text": json.dumps(
                    {"type": "event", "stream": sid, "seq": seq, "data": json.loads(payload)})})

    def _refusal(self, model: str) -> tuple[int, dict[str, Any]] | None:
        """The status and error a ``busy-N`` / ``draining-N`` request is refused with (429 /
        503) if it is one of the first N (counted in ``refused``)."""
        kind, _, count = model.partition("-")
        if kind not in ("busy", "draining") or not count.isdigit():
            return None
        if self.refused.get(model, 0) >= int(count):
            return None
        self.refused[model] = self.refused.get(model, 0) + 1
        status, code = (429, "region_saturated") if kind == "busy" else (503, "draining")
        return status, {"message": kind, "type": "server_error", "param": None, "code": code}

    async def _refused(self, send: Send, model: str) -> bool:
        """Answer a ``busy-N`` / ``draining-N`` request 429 / 503 with ``Retry-After`` if it
        is one of the first N."""
        refused = self._refusal(model)
        if refused is None:
            return False
        status, error = refused
        retry_after = str(self.refusal_retry_after).encode()
        await _json(send, status, {"error": error}, extra=[(b"retry-after", retry_after)])
        return True


async def _body(receive: Receive) -> bytes:
    chunks = []
    while True:
        msg = await receive()
        chunks.append(msg.get("body", b""))
        if not msg.get("more_body"):
            return b"".join(chunks)


async def _json(send: Send, status: int, obj: Any,
                extra: list[tuple[bytes, bytes]] | None = None) -> None:
    body = json.dumps(obj).encode()
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), *(extra or [])]})
    await send({"type": "http.response.body", "body": body})


@dataclass
class RunningServer:
    app: ProtocolApp
    port: int
    """TCP (h1/h2) and UDP (h3) port; the same number on both."""

    @property
    def base_url(self) -> str:
        return f"https://localhost:{self.port}/v1"


def _bound_pair() -> tuple[socket.socket, socket.socket]:
    for _ in range(50):
        tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        tcp.bind(("127.0.0.1", 0))
        port = tcp.getsockname()[1]
        udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            udp.bind(("127.0.0.1", port))
        except OSError:
            tcp.close()
            udp.close()
            continue
        tcp.listen(128)
        return tcp, udp
    raise RuntimeError("no free TCP+UDP port pair")


@contextlib.contextmanager
def running_protocol_server(cert_file: str, key_file: str, **app_kw: Any) -> Iterator[RunningServer]:
    """Run :class:`ProtocolApp` under hypercorn (TLS h1/h2 + QUIC h3) on a thread."""
    app = ProtocolApp(**app_kw)
    tcp, udp = _bound_pair()
    port = tcp.getsockname()[1]
    config = Config()
    # hypercorn owns (and closes) the descriptors from here on.
    config.bind = [f"fd://{tcp.detach()}"]
    config.quic_bind = [f"fd://{udp.detach()}"]
    config.certfile = cert_file
    config.keyfile = key_file
    config.alpn_protocols = ["h2", "http/1.1"]
    config.keep_alive_timeout = 300
    config.graceful_timeout = 0.5
    config.loglevel = "WARNING"
    config.accesslog = None
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    started = threading.Event()

    def _run() -> None:
        asyncio.set_event_loop(loop)

        async def main() -> None:
            started.set()
            await serve(app, config, shutdown_trigger=stop.wait)  # type: ignore[arg-type]

        loop.run_until_complete(main())

    thread = threading.Thread(target=_run, daemon=True)
    thread.start()
    started.wait(10)
    server = RunningServer(app, port)
    _wait_listening(server.port)
    try:
        yield server
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(10)
        loop.close()


def _wait_listening(port: int) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.02)
    raise RuntimeError("protocol server did not start")
