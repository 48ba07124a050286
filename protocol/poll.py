"""Long-poll documents: the ``GET /v1/streams/{id}/poll`` batch and the ``POST /v1/streams``
answer (docs/protocol.md, "Resuming / reading a stream").

An event's ``data`` is the stream event's JSON exactly as stored (a chat completion chunk or
``{"error": {...}}``), carried as :class:`msgspec.Raw`: the router never re-encodes it and a
reader decodes it once, where it assembles chunks.
"""

from __future__ import annotations

import msgspec

__all__ = ["PollBatch", "PollEvent", "StreamStarted"]


class PollEvent(msgspec.Struct):
    """One stream event: its sequence number and its JSON payload."""

    seq: int
    data: msgspec.Raw


class PollBatch(msgspec.Struct):
    """The events after the poll's ``after``; ``next`` is the highest ``seq`` returned (or
    ``after`` if none), ``done`` true once ``[DONE]`` has been returned (it is not an event)."""

    stream: str
    events: list[PollEvent]
    done: bool
    next: int


class StreamStarted(msgspec.Struct, omit_defaults=True):
    """``POST /v1/streams?wait=S`` answer: ``{"stream": ID}`` when ``wait`` is 0; a whole
    :class:`PollBatch` (its first batch) when ``wait`` > 0. Decodes both; ``events`` is
    ``None`` for the bare answer."""

    stream: str
    events: list[PollEvent] | None = None
    done: bool = False
    next: int = 0

    def batch(self) -> PollBatch | None:
        """The first batch, when the answer carried one."""
        if self.events is None:
            return None
        return PollBatch(self.stream, self.events, self.done, self.next)
