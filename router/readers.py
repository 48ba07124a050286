"""Reading a stream from the store: as SSE (follow) and as long-poll batches.

Both start after a sequence number the reader already has and deliver every later event
exactly once, whether the stream is finished or still being produced. A reader is
"attached" to the stream while it reads, which keeps the upstream request alive (see the
resume grace period in ``router.pipeline.proxy``). A reader from before a stream's trim point
(its key went over its share of the store) gets ``stream_history_trimmed``: a 410 when it asks
(:func:`trimmed_reply`), an error event without an ``id`` in the stream's own format when it
falls behind mid-follow (:func:`trimmed_event`).

A named event (Responses, Anthropic Messages: stored as ``event: NAME\\ndata: ...``, see
:mod:`firstbyte.protocol.codec`) goes out over SSE as the upstream sent it with our ``id:``
line first; such a stream ended with its own terminal event, so the store's ``[DONE]`` is
not sent after it. Long-poll and WebSocket carry the event's JSON (its ``type`` names it).
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Callable, MutableMapping, Sequence
from typing import Protocol

import msgspec

from firstbyte.protocol import error_codes
from firstbyte.protocol.codec import NAMED_PREFIX, event_data
from firstbyte.protocol.formats import BY_NAME, CHAT
from firstbyte.protocol.openai import ErrorBody, encode, error_body
from firstbyte.protocol.poll import PollBatch, PollEvent
from firstbyte.protocol.sse import HEARTBEAT, encode_event

from . import chunkpath
from .asgi import LastPart
from .pipeline.context import LocalReply, error_reply
from .streams import DONE_DATA, HistoryTrimmed, StreamEvent

__all__ = [
    "BATCH_BYTES",
    "BodyWriter",
    "HistoryTrimmed",
    "ReadableStream",
    "SSEEvents",
    "SSEFramer",
    "follow",
    "parse_after",
    "poll",
    "sse_events",
    "trimmed_body",
    "trimmed_event",
    "trimmed_reply",
]

TRIMMED_STATUS = 410
"""Gone: the events asked for existed and were dropped for good."""

BATCH_BYTES = 32 * 1024
"""The most event data a reader takes from the store at once (at least one event). The rest
waits in the store, in its bounds, trimmed and evicted with it. A connection's server takes a
whole batch at once (hypercorn's HTTP/2 stream buffer, a transport's write buffer), so a
reader that stopped reading while far behind (a client that never reads its streams, a
resume of a long one) held a copy of the stream's whole backlog outside those bounds:
~70 KB a stalled HTTP/2 stream of 46 KB, and 4,000 of them 290 MB past a 4 MiB store."""


def _capped(pending: list[StreamEvent]) -> list[StreamEvent]:
    """The first events of ``pending`` within :data:`BATCH_BYTES` (at least one)."""
    size = 0
    for count, event in enumerate(pending):
        size += len(event.data)
        if size > BATCH_BYTES and count:
            return pending[:count]
    return pending


def _trimmed_message(trimmed: HistoryTrimmed) -> str:
    if trimmed.unwritten:
        why = (
            "the region's shared state (Redis) could not take them when they were made (away"
            " or full)"
        )
    elif trimmed.cap is not None:
        why = (
            f"the region's shared state (Redis) keeps about the last {trimmed.cap} events of"
            " a stream (state.max_events_per_stream)"
        )
    else:
        why = "its API key's streams went over the key's share of the stream store"
    return (
        f"Events {trimmed.after + 1} to {trimmed.trimmed} of this stream were dropped: {why}."
        f" Read on from after={trimmed.trimmed}, or send the request again."
    )


def trimmed_body(trimmed: HistoryTrimmed) -> ErrorBody:
    """The error body of a read from before the trim point (SSE event, WebSocket error)."""
    return error_body(
        _trimmed_message(trimmed), param="after", code=error_codes.STREAM_HISTORY_TRIMMED
    )


def trimmed_event(stream: ReadableStream, trimmed: HistoryTrimmed) -> bytes:
    """The SSE event of a reader overtaken by a trim, in ``stream``'s wire format, without an
    ``id`` (it is not one of the stream's events): for chat and completions a ``data:`` event
    of :func:`trimmed_body`; for Responses and Anthropic Messages the format's own ``event:
    error`` (:meth:`~firstbyte.protocol.codec.Codec.error_event`), a Responses one numbered
    after the stream's last event at hand, as every error the router adds to a stream."""
    codec = BY_NAME.get(stream.format, CHAT)
    if not codec.named_events:
        return encode_event(encode(trimmed_body(trimmed)))
    last = next((e.data for e in reversed(stream.events[-2:]) if not e.is_done), None)
    error = codec.error_event(
        _trimmed_message(trimmed),
        code=error_codes.STREAM_HISTORY_TRIMMED,
        # None would number it 0, the first event's; with none at hand (not met: a reader
        # learns of a trim from events after it) an empty one leaves it unnumbered.
        after=b"" if last is None else last,
    )
    return error + b"\n\n"


def trimmed_reply(trimmed: HistoryTrimmed) -> LocalReply:
    """``410 stream_history_trimmed`` for a resume or a poll from before the trim point."""
    return error_reply(
        TRIMMED_STATUS,
        _trimmed_message(trimmed),
        param="after",
        code=error_codes.STREAM_HISTORY_TRIMMED,
        outcome="trimmed",
    )


class ReadableStream(Protocol):
    """What a reader needs of a stream: a :class:`~firstbyte.router.streams.Stream` in this
    process's store, or a :class:`~firstbyte.router.shared.streams.RemoteStream` produced by
    another process of the region and read through Redis."""

    @property
    def id(self) -> str: ...

    @property
    def done(self) -> bool: ...

    @property
    def evicted(self) -> bool: ...

    @property
    def upstream_ttft_ms(self) -> float | None: ...

    @property
    def subject(self) -> str | None: ...

    @property
    def trimmed(self) -> int:
        """Events dropped from the front: a reader from before this one cannot be served."""
        ...

    @property
    def format(self) -> str:
        """Its wire format (a codec's name): the shape of an error a reader is sent."""
        ...

    @property
    def events(self) -> Sequence[StreamEvent]:
        """The events at hand, oldest first (those kept, or those read so far)."""
        ...

    def after(self, seq: int) -> list[StreamEvent]:
        """The events after ``seq``; raises :class:`HistoryTrimmed` if some were dropped."""
        ...

    async def wait(self, seq: int, timeout_s: float | None) -> bool: ...

    async def relay_live(
        self, seq: int, write: Callable[[list[StreamEvent]], bool], idle_s: float | None
    ) -> tuple[int, bool]:
        """Caught up at ``seq``: events from now on to ``write`` as they come, where the
        stream can (:meth:`~firstbyte.router.streams.Stream.relay_live`); returns the last
        written and whether ``idle_s`` passed without an event."""
        ...

    def attach(self, now: float) -> None: ...

    def detach(self, now: float) -> None: ...


def parse_after(value: str | None) -> int | None:
    """A sequence number from ``Last-Event-ID`` / ``after``: a non-negative integer, else None.

    An absent value is 0; a malformed one is ``None`` (the caller answers 400).
    """
    if value is None or value == "":
        return 0
    value = value.strip()
    if not value.isascii() or not value.isdigit() or len(value) > 18:
        return None
    return int(value)


BodyWriter = Callable[[bytes], bool]
"""Writes a part of a response body now if its connection can take it (True), else writes
nothing (False): :func:`firstbyte.router.asgi.body_writer`."""


async def follow(
    stream: ReadableStream,
    after: int,
    *,
    idle_s: float,
    clock: Callable[[], float] = time.monotonic,
    live: Callable[[list[StreamEvent]], bool] | None = None,
) -> AsyncGenerator[list[StreamEvent], None]:
    """Batches of the events after ``after``, following the stream up to ``[DONE]``.

    Events already in the store come in batches of :data:`BATCH_BYTES` (a resuming reader
    catches up a batch at a time, each taken when the last was sent); live events come as
    they arrive. An empty batch means ``idle_s`` passed with nothing new (time for a
    heartbeat). Ends after ``[DONE]``, or once the stream is evicted; raises
    :class:`HistoryTrimmed` if the events after the reader's position were trimmed.

    With ``live``, a reader caught up is handed each new event by the producer itself
    (:meth:`~firstbyte.router.streams.Stream.relay_live`), and only what ``live`` refused
    (the reader fell behind), the stream's end and idle periods come as batches.

    :func:`sse_events` runs this loop in line (SSE is every streamed request's reader):
    a change here is a change there.
    """
    stream.attach(clock())
    try:
        seq = after
        while True:
            if stream.evicted:
                return  # gone from the store: what it still holds is no longer sent
            pending = stream.after(seq)
            if pending:
                if len(pending) > 1:
                    pending = _capped(pending)
                yield pending
                seq = pending[-1].seq
                if pending[-1].is_done:
                    return
                continue
            if stream.evicted or stream.done:
                return
            if live is not None:
                seq, idle = await stream.relay_live(seq, live, idle_s)
                if idle:
                    yield []
            elif not await stream.wait(seq, idle_s):
                yield []
    finally:
        stream.detach(clock())


def _named_before(stream: ReadableStream, seq: int) -> bool:
    """Is the event before ``seq`` a named one (a resume right after a named stream's
    terminal event, with only the store's ``[DONE]`` left)? False when it is not at hand (a
    stream of another process is read from the resume point on)."""
    try:
        previous = stream.after(seq - 2)[:1] if seq >= 2 else []
    except HistoryTrimmed:
        return False
    return bool(previous) and previous[0].seq == seq - 1 and previous[0].data[:7] == NAMED_PREFIX


class SSEFramer:
    """Stored events in, the SSE bytes a reader sends out (``id: SEQ`` framing).

    A named event (``event: NAME\\ndata: ...``) goes out as stored with its ``id:`` line
    first; a stream of named events ended with its own terminal event, so once one was seen
    the store's ``[DONE]`` is not sent."""

    __slots__ = ("direct", "named")

    def __init__(self) -> None:
        self.named = False
        """The stream's events carry names: it ends with its own, not ``[DONE]``."""
        self.direct = 0
        """Events written by :meth:`writer`'s function (the direct path), so far."""

    def frame(self, batch: list[StreamEvent], stream: ReadableStream | None = None) -> bytes:
        """The SSE bytes of ``batch`` (possibly none); ``stream``: where it came from, to
        tell a named stream's leftover ``[DONE]`` on a resume after its terminal event (not
        needed where this framer framed the event before ``batch``: it marked a named one)."""
        first = batch[0]
        if (
            not self.named
            and first.data[:7] != NAMED_PREFIX
            and not (
                first.data == DONE_DATA
                and stream is not None
                and _named_before(stream, first.seq)
            )
        ):
            # Chat's path, as cheap as before. One look per batch is enough: a stream of
            # a named format holds named events only (the relay names a bare one
            # ``message``), but for the error and [DONE] that end an abandoned one.
            if chunkpath.SSE_FRAMES is not None:
                # encode_event's frames in one C call: None if an event has a line end.
                frames: bytes | None = chunkpath.SSE_FRAMES(batch)
                if frames is not None:
                    return frames
            return b"".join([encode_event(e.data, id=e.seq) for e in batch])
        self.named = True
        return b"".join(
            [
                b"id: %d\n%b\n\n" % (e.seq, e.data)
                if e.data[:7] == NAMED_PREFIX
                else encode_event(e.data, id=e.seq)
                for e in batch
                if e.data != DONE_DATA
            ]
        )

    def frame_one(self, event: StreamEvent) -> bytes:
        """:meth:`frame` of one event (the direct path's, never ``[DONE]``)."""
        data = event.data
        if data[:7] == NAMED_PREFIX:
            self.named = True
            return b"id: %d\n%b\n\n" % (event.seq, data)
        if 10 in data or 13 in data:  # several lines: encode_event splits them
            return encode_event(data, id=event.seq)
        return b"id: %d\ndata: %b\n\n" % (event.seq, data)

    def writer(self, write: BodyWriter) -> Callable[[list[StreamEvent]], bool]:
        """Frame events (:meth:`frame_one`) and write them as one part of the body: the
        direct path's work per upstream read, in one call (it runs in the producer's data
        callback)."""

        def live(events: list[StreamEvent]) -> bool:
            if len(events) == 1:
                event = events[0]
                data = event.data
                # A named event has a line end (``event: NAME\ndata: ...``): one test
                # finds both what encode_event splits and what frame_one names.
                if 10 in data or 13 in data:
                    written = write(self.frame_one(event))
                else:
                    written = write(b"id: %d\ndata: %b\n\n" % (event.seq, data))
            else:
                written = write(b"".join([self.frame_one(event) for event in events]))
            if written:
                self.direct += len(events)
            return written

        cycle = getattr(write, "cycle", None)
        if chunkpath.SSE_WRITER is not None and cycle is not None:
            # uvicorn's body writer: the same frames and checks, compiled; ``live`` for an
            # event with a line end.
            compiled: Callable[[list[StreamEvent]], bool] = chunkpath.SSE_WRITER(
                cycle, self, live
            )
            return compiled
        return live


class SSEEvents:
    """SSE bytes for every event after ``after`` (:class:`SSEFramer`); :data:`HEARTBEAT`
    (no event for any SSE client) when idle. A reader overtaken by a trim gets a
    ``stream_history_trimmed`` error event in the stream's format (:func:`trimmed_event`) and
    the response ends.

    With ``direct`` (the connection's body writer), live events caught up with are written
    by the producer as they are appended, not returned (see :func:`follow`); what is
    returned goes out after them, in order, as the writer is idle while a step runs.

    ``tally``: when the response ends, the events it carried are added to ``tally["direct"]``
    (written by the producer) and ``tally["send"]`` (returned by a step), once per
    response: which path a deployment's streams take shows on the metrics page.

    An async iterator as an async generator behaves: the reader attaches at the first step
    and detaches (and tallies) when a step ends it, raises or is cancelled, or on
    :meth:`aclose` (nothing, if never stepped). A class, not an async generator: its end is
    a call, where a generator's ``aclose()`` threw ``GeneratorExit`` through its frame, and
    the loop's first-iteration hook put each generator in a weak set (~1.9k instructions a
    request, ``chunk_instructions``).

    :func:`follow`'s loop, in line: one async iterator a response instead of one stepping
    another (each ~1 us to set up and close, and a step of both per batch sent)."""

    __slots__ = (
        "after",
        "clock",
        "direct",
        "framer",
        "heartbeat_s",
        "live",
        "sent",
        "seq",
        "state",
        "stream",
        "tally",
    )

    def __init__(
        self,
        stream: ReadableStream,
        after: int,
        *,
        heartbeat_s: float,
        clock: Callable[[], float] = time.monotonic,
        direct: BodyWriter | None = None,
        tally: MutableMapping[str, int] | None = None,
    ) -> None:
        self.stream = stream
        self.after = after
        self.seq = after
        self.heartbeat_s = heartbeat_s
        self.clock = clock
        self.direct = direct
        self.tally = tally
        self.state = _UNSTARTED
        self.framer = SSEFramer()
        self.live: Callable[[list[StreamEvent]], bool] | None = None
        self.sent = 0

    def __aiter__(self) -> SSEEvents:
        return self

    async def __anext__(self) -> bytes:
        state = self.state
        stream = self.stream
        if state:  # not reading: not started, or ended
            if state != _UNSTARTED:
                self._end()
                raise StopAsyncIteration
            framer = self.framer
            direct = self.direct
            live = self.live = None if direct is None else framer.writer(direct)
            stream.attach(self.clock())
            self.state = _READING
        else:
            framer = self.framer
            live = self.live
        try:
            try:
                seq = self.seq
                while True:
                    if stream.evicted:
                        break  # gone from the store: what it still holds is no longer sent
                    pending = stream.after(seq)
                    if pending:
                        if len(pending) > 1:
                            pending = _capped(pending)
                        last = pending[-1]
                        # The stream only while this reader sent none of its events: after
                        # one, the event before ``pending`` went through ``framer``, which
                        # marked the stream named if it was (no look back into the stream
                        # for the [DONE] that ends every response: ~3k instructions a
                        # response, ``chunk_instructions``).
                        frames = framer.frame(pending, stream if seq == self.after else None)
                        seq = self.seq = last.seq
                        if last.data == DONE_DATA:
                            if frames:
                                self.sent += len(pending)
                                self.state = _ENDING
                                # the stream's end: the response's too, at once
                                return LastPart(frames)
                            break
                        if frames:
                            self.sent += len(pending)
                            return frames
                        continue
                    if stream.evicted or stream.done:
                        break
                    if live is not None:
                        seq, idle = await stream.relay_live(seq, live, self.heartbeat_s)
                        self.seq = seq
                        if idle:
                            return HEARTBEAT
                    elif not await stream.wait(seq, self.heartbeat_s):
                        return HEARTBEAT
            except HistoryTrimmed as trimmed:
                self.state = _ENDING
                return trimmed_event(stream, trimmed)
        except BaseException:  # the generator's ``finally``: an error, a cancel
            self._end()
            raise
        self._end()
        raise StopAsyncIteration

    def _end(self) -> None:
        """Detach and tally, once, if the reader attached."""
        if self.state == _READING or self.state == _ENDING:
            self.state = _ENDED
            self.stream.detach(self.clock())
            tally = self.tally
            if tally is not None:
                tally["direct"] += self.framer.direct
                tally["send"] += self.sent

    async def aclose(self) -> None:
        """End the reading (detach, tally) unless a step already did; no step after."""
        state = self.state
        if state != _ENDED:
            self.state = _ENDED
            if state != _UNSTARTED:
                self.stream.detach(self.clock())
                tally = self.tally
                if tally is not None:
                    tally["direct"] += self.framer.direct
                    tally["send"] += self.sent


_READING = 0
_UNSTARTED = 1
_ENDING = 2
"""Its last part was returned: the next step or :meth:`SSEEvents.aclose` ends it."""
_ENDED = 3


sse_events = SSEEvents
"""The SSE reader of a stream: :class:`SSEEvents`."""


async def poll(
    stream: ReadableStream,
    after: int,
    wait_s: float,
    *,
    clock: Callable[[], float] = time.monotonic,
) -> PollBatch:
    """The events after ``after``, waiting up to ``wait_s`` for at least one; raises
    :class:`HistoryTrimmed` if some of them were trimmed (before or during the wait)."""
    stream.attach(clock())
    try:
        if not stream.after(after) and not stream.done:
            await stream.wait(after, wait_s)  # with wait_s 0 a remote stream still catches up
        pending = stream.after(after)
        done = stream.done  # read together with ``pending``: nothing can come in between
    finally:
        stream.detach(clock())
    events = [PollEvent(e.seq, msgspec.Raw(event_data(e.data))) for e in pending if not e.is_done]
    next_seq = events[-1].seq if events else after
    return PollBatch(stream=stream.id, events=events, done=done, next=next_seq)
