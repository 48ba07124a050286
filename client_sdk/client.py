"""The SDK's front door: :class:`AsyncClient` and the thin synchronous :class:`Client`.

``client.stream(...)`` returns a :class:`ChatStream`: an async context manager (the request is
sent and the response accepted on entry, so HTTP errors raise there) and an async iterator of
:class:`~client_sdk._core.stream.StreamDelta`. Behind it, one reader task pumps the transport's
items into a queue; the iterator waits on that queue with the idle watchdog, so heartbeats
(which never become items) do not count as progress. A cut connection or a sequence gap
resumes from the last delivered event; a stall resumes once on fresh connections, then raises.
With several base URLs (one per region, nearest first), a request that cannot start on one
region (unreachable, 429, 502-504) is sent to the next; a started stream stays on its region,
since only that region's router holds it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Sequence
from concurrent.futures import Future
from types import TracebackType
from typing import Any, Literal, TypeVar

import msgspec

from client_sdk._core.stream import SequenceGapError, StreamAssembler, StreamDelta
from client_sdk._core.timing import TimingRecorder
from client_sdk.errors import (
    ConnectError,
    FirstbyteError,
    RateLimitError,
    ServiceUnavailableError,
    StreamBrokenError,
    StreamStalledError,
)
from client_sdk.pool import ConnectionPool
from client_sdk.regions import Region, RegionSelector
from client_sdk.resolver import Origin
from client_sdk.timings import Timings
from client_sdk.transports.base import Event, Item, Opened, Session, Source, TransportCut
from client_sdk.transports.longpoll import longpoll_source
from client_sdk.transports.sse import sse_source
from client_sdk.transports.websocket import WebSocketPool, websocket_source
from client_sdk.types import Message, Usage

__all__ = ["AsyncClient", "ChatStream", "Client", "SyncChatStream", "build_ssl_context"]

TransportName = Literal["sse", "websocket", "longpoll"]
HTTPVersion = Literal["1.1", "2", "3"]
T = TypeVar("T")

_EOF = object()


def build_ssl_context(
    verify: bool | ssl.SSLContext = True, ca_file: str | None = None
) -> ssl.SSLContext:
    """The one SSLContext a client uses for every TCP connection (verification on by default)."""
    if isinstance(verify, ssl.SSLContext):
        return verify
    context = ssl.create_default_context(cafile=ca_file)
    if not verify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context


class AsyncClient:
    """Streams chat completions over a prewarmed connection (see the README's SDK section).

    ``transport`` is ``"sse"``, ``"websocket"`` or ``"longpoll"``; ``http`` is ``"1.1"``,
    ``"2"`` or ``"3"`` (default ``"2"`` over https, ``"1.1"`` over plain http and for
    WebSocket). ``idle_timeout_s`` is the watchdog: the longest wait for the next event,
    heartbeats excluded. ``base_url`` may be a list of regional base URLs in order of
    preference (failover order).
    """

    def __init__(
        self,
        base_url: str | Sequence[str],
        api_key: str | None = None,
        *,
        transport: TransportName = "sse",
        http: HTTPVersion | None = None,
        verify: bool | ssl.SSLContext = True,
        ca_file: str | None = None,
        idle_timeout_s: float = 30.0,
        max_resumes: int = 5,
        stall_retries: int = 1,
        resume_backoff_s: float = 0.05,
        keepalive_expiry_s: float = 120.0,
        keepalive_interval_s: float = 15.0,
        connect_timeout_s: float = 10.0,
        poll_wait_s: float = 10.0,
    ) -> None:
        if transport not in ("sse", "websocket", "longpoll"):
            raise ValueError(f"transport must be sse, websocket or longpoll, not {transport!r}")
        urls = [base_url] if isinstance(base_url, str) else list(dict.fromkeys(base_url))
        if not urls:
            raise ValueError("base_url: give at least one URL")
        self.origins = [Origin.parse(url) for url in urls]
        self.origin = self.origins[0]
        """The preferred region; :meth:`prewarm` warms it."""
        self.regions = RegionSelector(Region(url, url) for url in urls)
        """Failover state: a region that refused (429 / 5xx / unreachable) is set aside for its
        ``Retry-After`` or a growing backoff, so later requests skip it."""
        if http is None:
            # HTTP/2 is negotiated with TLS (ALPN); over plain http it would need prior knowledge.
            plain = not all(origin.tls for origin in self.origins)
            http = "1.1" if transport == "websocket" or plain else "2"
        if http not in ("1.1", "2", "3"):
            raise ValueError(f"http must be '1.1', '2' or '3', not {http!r}")
        if transport == "websocket" and http != "1.1":
            raise ValueError("WebSocket runs over HTTP/1.1; use http='1.1'")
        if http == "3" and not all(origin.tls for origin in self.origins):
            raise ValueError("HTTP/3 needs an https:// base URL")
        self.transport: TransportName = transport
        self.http: HTTPVersion = http
        self.idle_timeout_s = idle_timeout_s
        self.max_resumes = max_resumes
        self.stall_retries = stall_retries
        self.resume_backoff_s = resume_backoff_s
        self.poll_wait_s = poll_wait_s
        self.headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self.pool = ConnectionPool(
            build_ssl_context(verify, ca_file), verify=verify, ca_file=ca_file,
            keepalive_expiry_s=keepalive_expiry_s, keepalive_interval_s=keepalive_interval_s,
            connect_timeout_s=connect_timeout_s,
        )

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self.pool.aclose()

    def _target(self, origin: Origin | None = None) -> Session | WebSocketPool:
        origin = origin or self.origin
        if self.transport == "websocket":
            return self.pool.websockets(origin, self.headers)
        return self.pool.session(origin, self.http)

    async def prewarm(self, connections: int = 1) -> None:
        """Open connections for the configured transport and HTTP version and keep them warm."""
        await self.pool.prewarm(self._target(), connections)

    def stream(
        self,
        *,
        model: str,
        messages: Sequence[Message | dict[str, Any]],
        max_tokens: int | None = None,
        on_first_token: Callable[[StreamDelta], object] | None = None,
        **options: Any,
    ) -> ChatStream:
        """A streamed chat completion; ``options`` are further request fields (``tools``, ...).

        ``on_first_token`` is called with the first content delta; the time it returns is
        ``timings.render_ms`` (hand the token to the UI there).
        """
        body: dict[str, Any] = {"model": model, "messages": list(messages), "stream": True,
                                "stream_options": {"include_usage": True}}
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
        body.update(options)
        return ChatStream(self, msgspec.json.encode(body), on_first_token)

    def _source(
        self, body: bytes | None, stream_id: str | None, after: int, recorder: TimingRecorder,
        origin: Origin,
    ) -> Source:
        self.pool.touch()
        target = self._target(origin)
        if isinstance(target, WebSocketPool):
            return websocket_source(target, body=body, stream_id=stream_id, after=after,
                                    recorder=recorder)
        prefix = origin.prefix
        if self.transport == "longpoll":
            return longpoll_source(target, prefix, self.headers, body=body, stream_id=stream_id,
                                   after=after, recorder=recorder, wait_s=self.poll_wait_s)
        return sse_source(target, prefix, self.headers, body=body, stream_id=stream_id,
                          after=after, recorder=recorder)


class ChatStream:
    """One streamed completion: iterate for deltas; ``timings``, ``usage``, ``text`` after."""

    def __init__(
        self,
        client: AsyncClient,
        body: bytes,
        on_first_token: Callable[[StreamDelta], object] | None,
    ) -> None:
        self._client = client
        self._body = body
        self._on_first_token = on_first_token
        self._recorder = TimingRecorder(time.perf_counter(), transport=client.transport)
        self._assembler = StreamAssembler()
        self._queue: asyncio.Queue[Item | object | BaseException] = asyncio.Queue()
        self._pump_task: asyncio.Task[None] | None = None
        self._stream_id: str | None = None
        self._opened = False
        self._finished = False
        self._resumes = 0
        self._stalls = 0
        self._pending: list[StreamDelta] = []
        self._parts: list[str] = []
        # Regions to try, best first; set-aside ones last (better a retry than no answer).
        ranked = [r.url for r in client.regions.ranked(time.monotonic())]
        urls = [r.url for r in client.regions.regions]
        self._plan = [urls.index(u) for u in ranked] + [
            i for i, u in enumerate(urls) if u not in ranked]
        self._attempt = 0

    @property
    def _origin(self) -> Origin:
        return self._client.origins[self._plan[self._attempt]]

    @property
    def _region_name(self) -> str:
        return self._client.regions.regions[self._plan[self._attempt]].name

    # -- public ---------------------------------------------------------------------------------
    @property
    def timings(self) -> Timings:
        return self._recorder.timings()

    @property
    def usage(self) -> Usage | None:
        """Token usage from the final chunk (``None`` until the stream has ended)."""
        return self._assembler.usage

    @property
    def stream_id(self) -> str | None:
        return self._stream_id

    @property
    def text(self) -> str:
        """All text delivered so far."""
        return "".join(self._parts)

    async def __aenter__(self) -> ChatStream:
        self._start(self._client._source(self._body, None, 0, self._recorder, self._origin))
        try:
            while not self._opened and not self._finished:
                delta = await self._step()
                if delta is not None:
                    self._pending.append(delta)
        except BaseException:
            await self.aclose()
            raise
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def __aiter__(self) -> AsyncIterator[StreamDelta]:
        return self

    async def __anext__(self) -> StreamDelta:
        if self._pump_task is None:
            raise RuntimeError("use 'async with client.stream(...) as stream' before iterating")
        if self._pending:
            return self._pending.pop(0)
        while not self._finished:
            delta = await self._step()
            if delta is not None:
                return delta
        raise StopAsyncIteration

    async def aclose(self) -> None:
        """Stop reading (also when the stream is abandoned half-way) and free the connection."""
        self._finished = True
        await self._stop_pump()

    # -- machinery ------------------------------------------------------------------------------
    def _start(self, source: Source) -> None:
        self._queue = asyncio.Queue()
        self._pump_task = asyncio.get_running_loop().create_task(self._pump(source, self._queue))

    @staticmethod
    async def _pump(source: Source, queue: asyncio.Queue[Item | object | BaseException]) -> None:
        try:
            async for item in source:
                queue.put_nowait(item)
            queue.put_nowait(_EOF)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            queue.put_nowait(exc)
        finally:
            with contextlib.suppress(Exception):
                await source.aclose()  # type: ignore[attr-defined]

    async def _stop_pump(self) -> None:
        task, self._pump_task = self._pump_task, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._pump_task = task  # keep "started" for __anext__'s check

    async def _step(self) -> StreamDelta | None:
        """Take one item; returns a delta for the user, or None. Sets ``_finished`` at the end."""
        try:
            item = await asyncio.wait_for(self._queue.get(), self._client.idle_timeout_s)
        except TimeoutError:
            await self._recover(None, stalled=True)
            return None
        if item is _EOF:
            if self._assembler.done:
                self._finished = True
                await self._stop_pump()
                return None
            await self._recover(TransportCut("stream ended before its last event"))
            return None
        if isinstance(item, BaseException):
            if self._stream_id is None and isinstance(
                item, ConnectError | RateLimitError | ServiceUnavailableError
            ):
                retry_after = item.retry_after if isinstance(item, RateLimitError) else None
                self._client.regions.failed(self._region_name, time.monotonic(), retry_after)
            if (
                self._stream_id is None
                and isinstance(item, ConnectError | RateLimitError | ServiceUnavailableError)
                and self._attempt + 1 < len(self._plan)
            ):
                # Not started here: the next region may answer. The failed attempt's
                # phases stay in the timings; it is what this request cost.
                await self._stop_pump()
                self._attempt += 1
                self._start(self._client._source(self._body, None, 0, self._recorder,
                                                 self._origin))
                return None
            if isinstance(item, TransportCut | SequenceGapError) or (
                isinstance(item, ConnectError) and self._stream_id is not None
            ):
                await self._recover(item)
                return None
            self._finished = True
            raise item
        if isinstance(item, Opened):
            if not self._opened:
                self._client.regions.succeeded(self._region_name)
            self._opened = True
            if item.stream_id is not None:
                self._stream_id = item.stream_id
            return None
        assert isinstance(item, Event)
        try:
            delta = self._assembler.receive(item.seq, item.payload)
        except SequenceGapError as exc:
            await self._recover(exc)
            return None
        except FirstbyteError:
            self._finished = True
            raise
        if self._assembler.done:
            self._finished = True
            await self._stop_pump()
        if delta is None:
            return None
        if delta.is_content:
            first = self._recorder.record.first_token_ms is None
            self._recorder.feed("token", time.perf_counter())
            if first and self._on_first_token is not None:
                self._on_first_token(delta)
                self._recorder.feed("render", time.perf_counter())
        self._parts.append(delta.text)
        return delta

    async def _recover(self, reason: BaseException | None, *, stalled: bool = False) -> None:
        """Resume after a cut or a stall, or raise when out of attempts."""
        client = self._client
        await self._stop_pump()
        if stalled:
            self._stalls += 1
            if self._stalls > client.stall_retries:
                self._finished = True
                raise StreamStalledError(
                    f"no event for {client.idle_timeout_s:g} s (heartbeats do not count)"
                    f" after event {self._assembler.last_seq}; resumed {self._resumes} times",
                    idle_s=client.idle_timeout_s,
                )
            # A stalled connection may be dead without knowing it: reconnect from scratch.
            with contextlib.suppress(Exception):
                await client._target(self._origin).reset()
        self._resumes += 1
        if self._resumes > client.max_resumes:
            self._finished = True
            raise StreamBrokenError(
                f"stream broken and {client.max_resumes} resumes failed: {reason}"
            ) from reason
        await asyncio.sleep(min(client.resume_backoff_s * 2 ** (self._resumes - 1), 2.0))
        if self._stream_id is None:
            # Never opened: nothing to resume, send the request again.
            self._start(client._source(self._body, None, 0, self._recorder, self._origin))
            return
        self._recorder.feed("resume", time.perf_counter())
        self._start(client._source(None, self._stream_id, self._assembler.last_seq,
                                   self._recorder, self._origin))


class _LoopThread:
    """A private event loop on a daemon thread, for the synchronous API."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="firstbyte-sdk",
                                        daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        future: Future[T] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return future.result()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        self.loop.close()


class Client:
    """The synchronous API: same arguments as :class:`AsyncClient`, run on a private loop."""

    def __init__(self, base_url: str, api_key: str | None = None, **kw: Any) -> None:
        self._runner = _LoopThread()

        async def make() -> AsyncClient:
            return AsyncClient(base_url, api_key, **kw)

        try:
            self._client = self._runner.run(make())
        except BaseException:
            self._runner.stop()
            raise

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        try:
            self._runner.run(self._client.aclose())
        finally:
            self._runner.stop()

    def prewarm(self, connections: int = 1) -> None:
        self._runner.run(self._client.prewarm(connections))

    def stream(self, **kw: Any) -> SyncChatStream:
        """Like :meth:`AsyncClient.stream`; use as ``with client.stream(...) as s: for d in s``."""
        async def make() -> ChatStream:
            return self._client.stream(**kw)

        return SyncChatStream(self._runner, self._runner.run(make()))


class SyncChatStream:
    """A :class:`ChatStream` driven from synchronous code."""

    def __init__(self, runner: _LoopThread, stream: ChatStream) -> None:
        self._runner = runner
        self._stream = stream

    def __enter__(self) -> SyncChatStream:
        self._runner.run(self._stream.__aenter__())
        return self

    def __exit__(self, *exc: object) -> None:
        self._runner.run(self._stream.aclose())

    def __iter__(self) -> Iterator[StreamDelta]:
        return self

    def __next__(self) -> StreamDelta:
        async def step() -> StreamDelta | None:
            try:
                return await self._stream.__anext__()
            except StopAsyncIteration:
                return None

        delta = self._runner.run(step())
        if delta is None:
            raise StopIteration
        return delta

    @property
    def timings(self) -> Timings:
        return self._stream.timings

    @property
    def usage(self) -> Usage | None:
        return self._stream.usage

    @property
    def text(self) -> str:
        return self._stream.text

    @property
    def stream_id(self) -> str | None:
        return self._stream.stream_id
