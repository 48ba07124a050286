"""One streamed request, from the application's side: :class:`ChatStream` (chat completions,
``client.stream(...)``) and :class:`EventStream` (completions, Responses, Messages: the typed
calls of :mod:`firstbyte.client_sdk.resources`), on one machinery.

A stream is an async context manager (the request is sent and the response accepted on entry,
so HTTP errors raise there) and an async iterator of what its format yields
(:class:`~firstbyte.client_sdk._core.stream.StreamDelta` for chat, the format's typed events
from :mod:`firstbyte.protocol.events` otherwise). Behind it, one reader task pumps the
transport's items (a batch of events per network read) into a queue bounded in events; the
iterator hands out a batch's events one at a time and waits on the queue, with the idle
watchdog, only when the batch is used up, so heartbeats (which never become events) do not
count as progress. A cut connection or a sequence gap resumes from the last delivered event
(the rest of its batch is dropped: the resume sends it again); a stall resumes once on fresh
connections, then raises. A request that cannot start on one region (unreachable, 429,
502-504) is sent to the next; a started stream stays on its region, since only that region's
router holds it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from types import TracebackType
from typing import TYPE_CHECKING, Any, Generic, Protocol, Self, TypeVar

from firstbyte.client_sdk._core.events import EventAssembler
from firstbyte.client_sdk._core.resume import ResumePolicy
from firstbyte.client_sdk._core.retry import RETRY_STATUSES, RetryBudget
from firstbyte.client_sdk._core.stream import SequenceGapError, StreamAssembler, StreamDelta
from firstbyte.client_sdk._core.timing import TimingRecorder
from firstbyte.client_sdk.errors import (
    APIError,
    ConnectError,
    FirstbyteError,
    RateLimitError,
    ServiceUnavailableError,
    StreamBrokenError,
    StreamHistoryTrimmedError,
    StreamLostError,
)
from firstbyte.client_sdk.resolver import Origin
from firstbyte.client_sdk.timings import Timings
from firstbyte.client_sdk.transports.base import Batch, Event, Item, Opened, Source, TransportCut
from firstbyte.protocol import codec, error_codes
from firstbyte.protocol.events import CompletionChunk, EventFormat, MessageEvent, ResponseEvent
from firstbyte.protocol.openai import Usage

if TYPE_CHECKING:
    from firstbyte.client_sdk.client import AsyncClient

__all__ = ["ChatStream", "CompletionStream", "EventStream", "MessageStream", "ResponseStream"]

_EOF = object()
_QUEUE_ITEMS = 256
"""Events read ahead of a slow consumer; beyond this the transport stops reading (bounded
memory whatever the server sends: this many events plus one network read's)."""

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)
E = TypeVar("E")


class _ReadAhead(asyncio.Queue[Item | object | BaseException]):
    """The reader task's queue, bounded in events: a batch takes one place per event.

    ``put`` waits while ``maxsize`` events are queued, then takes a whole batch, so the queue
    holds at most ``maxsize - 1`` events plus one batch.
    """

    def _init(self, maxsize: int) -> None:
        super()._init(maxsize)
        self._events = 0

    def _put(self, item: Item | object | BaseException) -> None:
        self._events += len(item) if type(item) is list else 1
        super()._put(item)

    def _get(self) -> Item | object | BaseException:
        item = super()._get()
        self._events -= len(item) if type(item) is list else 1
        return item

    def qsize(self) -> int:
        """Events queued (a batch counts its events; any other item counts one)."""
        return self._events


class _Assembler(Protocol[T_co]):
    """What a stream reads its events with (:class:`StreamAssembler` for chat,
    :class:`EventAssembler` for the typed formats)."""

    last_seq: int
    done: bool

    def receive(self, seq: int | None, payload: str | bytes | dict[str, Any]) -> T_co | None: ...


class _Stream(Generic[T]):
    """One streamed request in any format: the read-ahead, resume, failover and retries.
    Subclasses say how events are assembled and what an item hands the application."""

    _events: EventFormat[Any] | None = None
    """The format's events (None: chat)."""

    def __init__(
        self,
        client: AsyncClient,
        body: bytes,
        on_first_token: Callable[[T], object] | None,
    ) -> None:
        self._client = client
        self._body = body
        self._on_first_token = on_first_token
        self._recorder = TimingRecorder(time.perf_counter(), transport=client.transport)
        self._assembler: _Assembler[T] = self._new_assembler()
        self._queue = _ReadAhead(_QUEUE_ITEMS)
        self._batch: Batch = []
        """The events of the last item taken from the queue; ``_at`` is the next one's index."""
        self._at = 0
        self._pump_task: asyncio.Task[None] | None = None
        self._stream_id: str | None = None
        self._opened = False
        self._finished = False
        self._policy = ResumePolicy(max_resumes=client.max_resumes,
                                    backoff_s=client.resume_backoff_s,
                                    stall_retries=client.stall_retries,
                                    idle_timeout_s=client.idle_timeout_s)
        self._parts: list[str] = []
        self._plan = client._plan()
        self._attempt = 0
        self._retry = RetryBudget(client.retries, client.retry_budget_s)
        """Sends again after a refusal or a ``draining`` end before any token."""
        self._busy_region: str | None = None
        """The region counted in the client's ``_busy`` while a pump reads from it."""
        self._reported = False

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
    def stream_id(self) -> str | None:
        return self._stream_id

    @property
    def text(self) -> str:
        """All text delivered so far."""
        return "".join(self._parts)

    async def __aenter__(self) -> Self:
        self._start(self._fresh_source())
        try:
            # Sources yield Opened before any event; events before it would wait in _batch.
            while not self._opened and not self._finished and self._at >= len(self._batch):
                await self._step()
        except BaseException:
            await self.aclose()
            raise
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def __aiter__(self) -> AsyncIterator[T]:
        return self

    async def __anext__(self) -> T:
        if self._pump_task is None:
            raise RuntimeError("use 'async with client.stream(...) as stream' before iterating")
        assembler = self._assembler
        while not self._finished:
            try:
                delta = self._take()
            except SequenceGapError as exc:
                await self._recover(exc)  # drops the rest of the batch: the resume replays it
                continue
            except FirstbyteError as exc:
                self._finished = True
                if isinstance(exc, APIError) and exc.code == error_codes.DRAINING:
                    if (
                        self._recorder.record.first_token_ms is None
                        and self._retry.delay(0.0) is not None
                    ):
                        await self._resend()
                        assembler = self._assembler
                        continue
                    # Its router shut down mid-stream: nothing more comes on this stream.
                    raise self._lost(
                        f"stream {self._stream_id} is lost (its router shut down before the"
                        f" end) after event {assembler.last_seq}; send a new request for the"
                        " rest"
                    ) from exc
                if isinstance(exc, APIError) and exc.code == error_codes.STREAM_HISTORY_TRIMMED:
                    raise self._trimmed(exc) from exc  # fell behind a trim while following
                if isinstance(exc, APIError) and exc.code == error_codes.STREAM_LOST:
                    # The router process producing the stream died mid-stream; a router with
                    # shared state ends the stream for its readers elsewhere with this event.
                    raise self._lost(
                        f"stream {self._stream_id} is lost (its router process stopped"
                        f" mid-stream) after event {assembler.last_seq}; resumed"
                        f" {self._policy.resumes} times"
                    ) from exc
                raise
            if assembler.done:
                self._finished = True
                await self._stop_pump()
            if delta is not None:
                return self._deliver(delta)
            if not self._finished:
                await self._step()  # the batch is used up: wait for the next item
        raise StopAsyncIteration

    async def aclose(self) -> None:
        """Stop reading (also when the stream is abandoned half-way) and free the connection.

        With ``report_timings``, a stream that got its first token is queued for reporting
        (once)."""
        self._finished = True
        await self._stop_pump()
        reporter = self._client.timings_reporter
        if reporter is not None and not self._reported:
            self._reported = True
            reporter.note(self._origin, self._recorder.timings())

    # -- machinery ------------------------------------------------------------------------------
    def _new_assembler(self) -> _Assembler[T]:
        raise NotImplementedError

    def _deliver(self, item: T) -> T:
        """Record the item's timing and text, then hand it over."""
        raise NotImplementedError

    def _fresh_source(self) -> Source:
        """A source sending the request (again) to the current attempt's region."""
        return self._client._source(self._body, None, 0, self._recorder, self._origin,
                                    self._events)

    def _start(self, source: Source) -> None:
        self._unbusy()
        self._busy_region = self._region_name
        self._client._busy[self._busy_region] += 1
        self._queue = _ReadAhead(_QUEUE_ITEMS)
        self._pump_task = asyncio.get_running_loop().create_task(self._pump(source, self._queue))

    @staticmethod
    async def _pump(source: Source, queue: _ReadAhead) -> None:
        try:
            async for item in source:
                if queue.full():  # stops reading: the server is slowed down
                    await queue.put(item)
                else:
                    queue.put_nowait(item)  # no coroutine per batch in the common case
            await queue.put(_EOF)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            await queue.put(exc)
        finally:
            with contextlib.suppress(Exception):
                await source.aclose()  # type: ignore[attr-defined]

    def _unbusy(self) -> None:
        if self._busy_region is not None:
            self._client._busy[self._busy_region] -= 1
            self._busy_region = None

    async def _stop_pump(self) -> None:
        """Stop the reader task; the events it read and the iterator has not taken are dropped
        (a resume asks for everything after the last event taken, so it sends them again)."""
        self._unbusy()
        self._batch, self._at = [], 0
        task, self._pump_task = self._pump_task, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._pump_task = task  # keep "started" for __anext__'s check

    def _take(self) -> T | None:
        """The next delta from the current batch, or None once the batch is used up or the
        stream is done (``_assembler.done``). Raises what the assembler raises."""
        batch, i = self._batch, self._at
        receive = self._assembler.receive
        while i < len(batch):
            event = batch[i]
            i += 1
            self._at = i  # before receive: an event that raises is not taken twice
            delta = receive(event.seq, event.payload)
            if delta is not None or self._assembler.done:
                return delta
        return None


    async def _step(self) -> None:
        """Take one queue item: a batch (becomes ``_batch``), the response opening, the end or
        an error (resumes, fails over or raises). Sets ``_finished`` at the end."""
        try:
            # Most items are already queued: take them without arming a watchdog timer each.
            item = self._queue.get_nowait()
        except asyncio.QueueEmpty:
            try:
                item = await asyncio.wait_for(self._queue.get(), self._client.idle_timeout_s)
            except TimeoutError:
                await self._recover(None, stalled=True)
                return
        if type(item) is list:
            self._batch, self._at = item, 0
            return
        if isinstance(item, Event):
            self._batch, self._at = [item], 0
            return
        if item is _EOF:
            if self._assembler.done:
                self._finished = True
                await self._stop_pump()
                return
            await self._recover(TransportCut("stream ended before its last event"))
            return
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
                self._start(self._fresh_source())
                return
            if self._stream_id is None and isinstance(item, APIError) and (
                item.status in RETRY_STATUSES
            ):
                wait = self._retry.delay(getattr(item, "retry_after", None))
                if wait is not None:
                    # Refused before the stream started (no token to repeat): once the
                    # server's Retry-After has passed, the preferred region again.
                    await self._stop_pump()
                    await asyncio.sleep(wait)
                    self._attempt = 0
                    self._start(self._fresh_source())
                    return
            if isinstance(item, TransportCut | SequenceGapError) or (
                isinstance(item, ConnectError) and self._stream_id is not None
            ):
                await self._recover(item)
                return
            self._finished = True
            if (
                self._stream_id is not None
                and isinstance(item, APIError)
                and item.code == error_codes.STREAM_HISTORY_TRIMMED
            ):
                raise self._trimmed(item) from item
            if (
                self._stream_id is not None
                and isinstance(item, APIError)
                and item.code == error_codes.STREAM_NOT_FOUND
            ):
                # A resume found no such stream (on every transport: a 404 or a WebSocket
                # error carry the same code): the router restarted or dropped it.
                raise self._lost(
                    f"stream {self._stream_id} is lost (the router no longer has it) after"
                    f" event {self._assembler.last_seq}; resumed {self._policy.resumes} times"
                ) from item
            raise item
        assert isinstance(item, Opened)
        if not self._opened:
            self._client.regions.succeeded(self._region_name)
            self._client._note_hint(self._recorder.record)
        self._opened = True
        if item.stream_id is not None:
            self._stream_id = item.stream_id

    async def _resend(self) -> None:
        """The stream's router shut down (``draining``) before any content was delivered: send
        the request again as a new stream, within the retry budget (the region's other
        routers, or the next region, take it; the wasted attempt stays in the timings)."""
        await self._stop_pump()
        self._finished = False
        self._assembler = self._new_assembler()
        self._stream_id = None
        self._batch, self._at = [], 0
        self._start(self._fresh_source())

    def _trimmed(self, error: APIError) -> StreamHistoryTrimmedError:
        """The error for a resume from before the stream's trim point (on any transport)."""
        return StreamHistoryTrimmedError(
            f"stream {self._stream_id} cannot be resumed after event"
            f" {self._assembler.last_seq}: the router dropped the events after it (its API key's"
            f" streams went over the key's share of the stream store); send a new request for"
            f" the rest ({error.message})",
            stream_id=self._stream_id or "",
            last_seq=self._assembler.last_seq,
            delivered_text=self.text,
        )

    def _lost(self, message: str) -> StreamLostError:
        """The error for this stream, lost for good, with what was delivered."""
        return StreamLostError(
            message,
            stream_id=self._stream_id or "",
            last_seq=self._assembler.last_seq,
            delivered_text=self.text,
        )

    async def _recover(self, reason: BaseException | None, *, stalled: bool = False) -> None:
        """Resume after a cut or a stall, or raise when out of attempts (:class:`ResumePolicy`)."""
        client = self._client
        await self._stop_pump()
        try:
            step = self._policy.broken(reason, opened=self._stream_id is not None,
                                       stalled=stalled, last_seq=self._assembler.last_seq)
        except StreamBrokenError as exc:
            self._finished = True
            raise exc from reason
        if stalled:
            # A stalled connection may be dead without knowing it: reconnect from scratch.
            with contextlib.suppress(Exception):
                await client._target(self._origin).reset()
        if step.delay_s:
            await asyncio.sleep(step.delay_s)
        if step.resend:
            # Never opened: nothing to resume, send the request again.
            self._start(self._fresh_source())
            return
        self._recorder.feed("resume", time.perf_counter())
        self._start(client._source(None, self._stream_id, self._assembler.last_seq,
                                   self._recorder, self._origin, self._events))


class ChatStream(_Stream[StreamDelta]):
    """One streamed chat completion: iterate for deltas; ``timings``, ``usage``, ``text`` after."""

    _assembler: StreamAssembler

    def _new_assembler(self) -> StreamAssembler:
        return StreamAssembler()

    @property
    def usage(self) -> Usage | None:
        """Token usage from the final chunk (``None`` until the stream has ended)."""
        return self._assembler.usage

    def _deliver(self, delta: StreamDelta) -> StreamDelta:
        """Record the delta's timing (one clock read per content chunk: TTFT and ITL are
        defined per content chunk) and its text, then hand it over."""
        if delta.text or delta.tool_calls:  # StreamDelta.is_content, without the call
            recorder, callback = self._recorder, self._on_first_token
            first = callback is not None and recorder.record.first_token_ms is None
            recorder.feed("token", time.perf_counter())
            if first and callback is not None:
                callback(delta)
                recorder.feed("render", time.perf_counter())
        self._parts.append(delta.text)
        return delta


class EventStream(_Stream[E]):
    """One stream of a typed format (completions, Responses, Messages): iterate for its
    events, typed by :mod:`firstbyte.protocol.events` (every event the upstream sent, once, in
    order, across resumes); ``timings``, ``usage``, ``text`` after.

    ``text`` is the output text so far; ``usage`` the tokens the stream reported
    (:class:`~firstbyte.protocol.codec.Usage`, the same for every format); ``last_event`` the
    last event (the terminal one once the stream has ended)."""

    _assembler: EventAssembler[E]

    def __init__(
        self,
        client: AsyncClient,
        events: EventFormat[E],
        body: bytes,
        on_first_token: Callable[[E], object] | None,
    ) -> None:
        self._events = events
        super().__init__(client, body, on_first_token)

    def _new_assembler(self) -> EventAssembler[E]:
        assert self._events is not None
        return EventAssembler(self._events)

    @property
    def usage(self) -> codec.Usage | None:
        """Tokens used, as the stream said them (``None`` until it said them)."""
        return self._assembler.usage

    @property
    def last_event(self) -> E | None:
        return self._assembler.last

    def _deliver(self, event: E) -> E:
        events = self._assembler.events
        if events.is_content(event):
            recorder, callback = self._recorder, self._on_first_token
            first = callback is not None and recorder.record.first_token_ms is None
            recorder.feed("token", time.perf_counter())
            if first and callback is not None:
                callback(event)
                recorder.feed("render", time.perf_counter())
        text = events.text(event)
        if text:
            self._parts.append(text)
        return event


CompletionStream = EventStream[CompletionChunk]
"""``client.completions.stream(...)``: :class:`~firstbyte.protocol.events.CompletionChunk`s."""
ResponseStream = EventStream[ResponseEvent]
"""``client.responses.stream(...)``: :class:`~firstbyte.protocol.events.ResponseEvent`s."""
MessageStream = EventStream[MessageEvent]
"""``client.messages.stream(...)``: :class:`~firstbyte.protocol.events.MessageEvent`s."""
