"""``build_app(config) -> ASGI app``: the router's routes, composed from its parts.

No logic lives here: the endpoints run the pipeline stages, the state holds the store,
backends and proxy. The returned app also serves the ASGI lifespan (housekeeping starts
with the first request or at startup; shutdown cancels producers and closes the pool).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Awaitable, Callable

from firstbyte.protocol import error_codes, paths

from . import endpoints
from .asgi import Message, Receive, Scope, Send, header_dict, send_bytes
from .config import RouterConfig
from .cors import Preflight, ResponseHeaders
from .edge_client import serve_client_file
from .observability.access import CONTEXT_KEY
from .overload import MemoryGuard
from .pipeline.context import error_reply
from .prewarm import edge_warm, warm_prompt
from .state import RouterState
from .ws import refuse_upgrade, websocket_session

__all__ = ["RouterApp", "build_app"]

log = logging.getLogger("firstbyte.router")

Handler = Callable[[RouterState, Scope, Receive, Send], Awaitable[None]]

_ROUTES: dict[str, dict[str, Handler]] = {
    **{path: {"POST": post} for path, post in endpoints.FORMAT_ROUTES.items()},
    paths.STREAMS: {"POST": endpoints.start_detached_stream},
    paths.MODELS: {"GET": endpoints.models},
    paths.HEALTHZ: {"GET": endpoints.healthz},
    paths.METRICS: {"GET": endpoints.metrics},
    paths.EDGE_STATUS: {"GET": endpoints.edge_status},
    paths.EDGE_TIMINGS: {"POST": endpoints.edge_timings},
    paths.EDGE_TOKENS: {"POST": endpoints.mint_token},
    paths.EDGE_WARM: {"GET": edge_warm, "POST": warm_prompt},
}
# Answered while the start-up warmup runs; every other request waits for it.
_UNGATED = frozenset({paths.HEALTHZ, paths.METRICS, paths.EDGE_STATUS, paths.EDGE_TOKENS})
_HTTP1 = ("1.1", "1.0")
"""The ASGI ``http_version`` values of a connection without GOAWAY."""
_CLOSE = (("connection", "close"),)
# paths.edge_client(NAME)
_CLIENT_FILE = re.compile("^" + re.escape(paths.EDGE_CLIENT) + r"/(?P<name>[a-z0-9_-]{1,40}\.js)$")
_CLIENT_PREFIX = paths.EDGE_CLIENT + "/"
_MODEL_PREFIX = paths.MODELS + "/"
# paths.stream(ID) and paths.stream_poll(ID)
_STREAM_PATH = re.compile(
    "^" + re.escape(paths.STREAMS) + r"/(?P<id>[A-Za-z0-9_-]{1,64})(?P<poll>/poll)?$"
)


class RouterApp:
    """The ASGI application; ``state`` is exposed for tests and for the routing stages."""

    def __init__(self, config: RouterConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.state = RouterState(config, clock)
        self.memory = MemoryGuard(config.limits.max_rss_bytes, clock)
        self.requests_in_flight = 0
        """HTTP requests being answered, but for the operational ones (``/healthz`` ...)."""

    def in_flight(self) -> int:
        """What a drain waits for: requests being answered and streams being produced."""
        return self.requests_in_flight + len(self.state.store.running())

    async def reconfigure(self, config: RouterConfig) -> None:
        """Swap in a reloaded config (:mod:`firstbyte.router.reload`)."""
        self.memory.max_rss_bytes = config.limits.max_rss_bytes
        await self.state.reconfigure(config)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "lifespan":
            await self._lifespan(receive, send)
            return
        if (
            (kind == "websocket" or scope["method"] == "POST")
            and self.memory.max_rss_bytes is not None  # no bound (the default): no question
            and self.memory_refusal() is not None
        ):
            await self._shed(scope, send)
            return
        if not self.state.warm:  # warm: started
            self.state.ensure_started()
        if self.state.draining and kind == "http" and scope.get("http_version") in _HTTP1:
            # Whatever the answer (a refusal, /healthz, a request forwarded to a peer), it is
            # this connection's last: an HTTP/1.1 client has no GOAWAY, and a balancer keeps
            # its connection on this process, so the client's next request opens a new one,
            # which the balancer sends to a healthy process. Every server honours the header
            # (uvicorn's send and h11 close after the answer; uvicorn_send leaves a head with
            # it to uvicorn's send). HTTP/2 and HTTP/3 forbid it: they get a GOAWAY (drain).
            send = _adding_headers(send, _CLOSE)
        if kind == "http":
            counted = scope["path"] not in _UNGATED
            self.requests_in_flight += counted
            requests = self.state.requests
            try:
                # RequestLog.serve's steps in this coroutine, not in one of its own that this
                # one awaits: a frame less on each of the request's resumptions (~1.5k
                # instructions a request).
                watching = requests.watch(scope, send)
                if watching is None:
                    await self._route(scope, receive, send)
                else:
                    exchange, watched = watching
                    try:
                        await self._route(scope, receive, watched)
                    finally:
                        requests.finish(exchange, scope.get(CONTEXT_KEY))
            finally:
                self.requests_in_flight -= counted
        else:
            await self._route(scope, receive, send)

    def _route(self, scope: Scope, receive: Receive, send: Send) -> Awaitable[None]:
        """The run of ``scope``'s handler, for the caller to await. A plain call returning the
        handler's coroutine, not a coroutine awaiting it: every request's resumptions went
        through one more frame. A request that needs more than its method and path to be
        dispatched (an ``Origin``, the client's files, the start-up warmup not over, a
        WebSocket) goes the awaiting way (:meth:`_route_slow`)."""
        path: str = scope["path"]
        if (
            scope["type"] == "http"
            and (self.state.warm or path in _UNGATED)
            and not path.startswith(_CLIENT_PREFIX)
            and "origin" not in header_dict(scope)
        ):
            return self._dispatch(scope, receive, send, path)
        return self._route_slow(scope, receive, send)

    async def _route_slow(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        path: str = scope["path"]
        if kind == "http":
            headers = header_dict(scope)
            for_client = path.startswith(_CLIENT_PREFIX)
            # CORS asks nothing of a request without Origin but for the client's files
            # (CorsPolicy.decide): most requests, answered without its call.
            if "origin" in headers or for_client:
                cors = self.state.cors.decide(scope["method"], path, headers)
                if isinstance(cors, Preflight):
                    await send_bytes(send, cors.status, b"", content_type="text/plain",
                                     headers=cors.headers)
                    return
                if cors is not None:
                    send = _adding_headers(send, cors.headers)
            client_file = _CLIENT_FILE.match(path) if for_client else None
            if client_file is not None and scope["method"] == "GET":
                await serve_client_file(scope, receive, send, client_file.group("name"))
                return
        if path not in _UNGATED and not self.state.warm:
            await self.state.until_warm()
        if kind == "websocket":
            if path == paths.WEBSOCKET:
                await websocket_session(self.state, scope, receive, send)
            else:
                await send({"type": "websocket.close", "code": 1008, "reason": "no such path"})
            return
        await self._dispatch(scope, receive, send, path)

    def _dispatch(self, scope: Scope, receive: Receive, send: Send, path: str) -> Awaitable[None]:
        """The run of the handler of an HTTP request's method and ``path`` (or of its 404 or
        405), not awaited."""
        method: str = scope["method"]
        methods = _ROUTES.get(path)
        if methods is not None:
            handler = methods.get(method)
            if handler is None:
                return endpoints.not_found(scope, send, allowed=", ".join(methods))
            return handler(self.state, scope, receive, send)
        match = _STREAM_PATH.match(path)
        if match is not None:
            if method != "GET":
                return endpoints.not_found(scope, send, allowed="GET")
            if match.group("poll"):
                return endpoints.poll_stream(self.state, scope, receive, send, match.group("id"))
            return endpoints.read_stream(self.state, scope, receive, send, match.group("id"))
        if path.startswith(_MODEL_PREFIX) and len(path) > len(_MODEL_PREFIX):
            if method != "GET":
                return endpoints.not_found(scope, send, allowed="GET")
            # The id is the rest of the (decoded) path: it may hold slashes (org/model).
            return endpoints.model(self.state, scope, receive, send, path[len(_MODEL_PREFIX):])
        return endpoints.not_found(scope, send)

    def memory_refusal(self) -> str | None:
        """Why new work is refused for memory now, or None; logs when shedding starts and
        stops (the hosting layer asks too, for its per-address connection cap)."""
        was = self.memory.shedding
        reason = self.memory.refusal()
        if self.memory.shedding != was:
            if reason is not None:
                log.warning("shedding new work: %s", reason)
            else:
                log.warning("memory back under limits.max_rss_bytes: new work accepted")
        return reason

    async def _shed(self, scope: Scope, send: Send) -> None:
        """Refuse new work (a POST, a WebSocket) while memory is short (called only then:
        no coroutine for the others). Streams in flight and their readers (GETs) go on. The
        refusal comes before :meth:`_route`, so it carries the CORS headers itself."""
        self.state.metrics.count("shed", "memory")
        websocket = scope["type"] == "websocket"
        refusal = error_reply(
            503,
            "The router is short of memory; retry, or use another region.",
            "server_error",
            code=error_codes.OVERLOADED,
            headers=(("retry-after", "1"), *(() if websocket else self._cors_headers(scope))),
            outcome="overloaded",
        )
        if websocket:
            # The POST's answer, Retry-After included: a close before the accept reached the
            # client as a bare 403, which it does not retry. 1013 where the server cannot.
            await refuse_upgrade(scope, send, refusal, 1013, "overloaded",
                                 draining=self.state.draining)
            return
        await endpoints.reply(send, None, refusal)

    def _cors_headers(self, scope: Scope) -> tuple[tuple[str, str], ...]:
        cors = self.state.cors.decide(scope["method"], scope["path"], header_dict(scope))
        return cors.headers if isinstance(cors, ResponseHeaders) else ()

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                # Warming starts now and runs while the router listens; user requests wait
                # for it (RouterState.until_warm), /healthz answers 503 "warming" meanwhile.
                self.state.ensure_started()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.state.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return


def _adding_headers(send: Send, headers: tuple[tuple[str, str], ...]) -> Send:
    """``send`` with ``headers`` added to the response start."""
    extra = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers]

    async def wrapped(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", ()), *extra]}
        await send(message)

    return wrapped


def build_app(config: RouterConfig, clock: Callable[[], float] = time.monotonic) -> RouterApp:
    """The router as an ASGI app for ``config``."""
    return RouterApp(config, clock)
