"""Reading a stream from the store: as SSE (follow) and as long-poll batches.

Both start after a sequence number the reader already has and deliver every later event
exactly once, whether the stream is finished or still being produced. A reader is
"attached" to the stream while it reads, which keeps the upstream request alive (see the
resume grace period in ``router.pipeline.proxy``).
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Callable
from typing import Protocol

import msgspec

from firstbyte.protocol.poll import PollBatch, PollEvent
from firstbyte.protocol.sse import HEARTBEAT, encode_event

from .streams import StreamEvent

__all__ = ["ReadableStream", "follow", "parse_after", "poll", "sse_events"]


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

    def after(self, seq: int) -> list[StreamEvent]: ...

    async def wait(self, seq: int, timeout_s: float | None) -> bool: ...

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


async def follow(
    stream: ReadableStream,
    after: int,
    *,
    idle_s: float,
    clock: Callable[[], float] = time.monotonic,
) -> AsyncGenerator[list[StreamEvent], None]:
    """Batches of the events after ``after``, following the stream up to ``[DONE]``.

    Events already in the store come as one batch (a resuming reader catches up at once);
    live events come as they arrive. An empty batch means ``idle_s`` passed with nothing new
    (time for a heartbeat). Ends after ``[DONE]``, or if the stream is evicted.
    """
    stream.attach(clock())
    try:
        seq = after
        while True:
            pending = stream.after(seq)
            if pending:
                yield pending
                seq = pending[-1].seq
                if pending[-1].is_done:
                    return
                continue
            if stream.evicted or stream.done:
                return
            if not await stream.wait(seq, idle_s):
                yield []
    finally:
        stream.detach(clock())


async def sse_events(
    stream: ReadableStream,
    after: int,
    *,
    heartbeat_s: float,
    clock: Callable[[], float] = time.monotonic,
) -> AsyncGenerator[bytes, None]:
    """SSE bytes for every event after ``after`` (``id: SEQ`` framing); :data:`HEARTBEAT`
    (no event for any SSE client) when idle."""
    events = follow(stream, after, idle_s=heartbeat_s, clock=clock)
    try:
        async for batch in events:
            if batch:
                yield b"".join(encode_event(e.data, id=e.seq) for e in batch)
            else:
                yield HEARTBEAT
    finally:
        await events.aclose()


async def poll(
    stream: ReadableStream,
    after: int,
    wait_s: float,
    *,
    clock: Callable[[], float] = time.monotonic,
) -> PollBatch:
    """The events after ``after``, waiting up to ``wait_s`` for at least one."""
    stream.attach(clock())
    try:
        if not stream.after(after) and not stream.done:
            await stream.wait(after, wait_s)  # with wait_s 0 a remote stream still catches up
        pending = stream.after(after)
        done = stream.done  # read together with ``pending``: nothing can come in between
    finally:
        stream.detach(clock())
    events = [PollEvent(e.seq, msgspec.Raw(e.data)) for e in pending if not e.is_done]
    next_seq = events[-1].seq if events else after
    return PollBatch(stream=stream.id, events=events, done=done, next=next_seq)
