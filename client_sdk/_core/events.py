"""Stream assembly for the typed formats (completions, Responses, Messages), sans-IO.

The same contract as :class:`~firstbyte.client_sdk._core.stream.StreamAssembler` for chat:
``(seq, payload)`` pairs in, each sequence number passed once (a replay's duplicates dropped,
a skipped one refused with :class:`SequenceGapError`), out the format's typed events, decoded
by its :class:`~firstbyte.protocol.events.EventFormat` (the SDK does not parse events itself).
The stream is done at ``[DONE]`` (chat's end, which completions share, and the end a
long-poll or WebSocket reader is given for every format) or at the format's terminal event
(Responses and Messages over SSE end with it, without ``[DONE]``). An error event raises its
:class:`~firstbyte.client_sdk.errors.APIError`, whatever its shape (the format's own, or
OpenAI's that the router adds).
"""

from __future__ import annotations

from typing import Any, Generic, NoReturn, TypeVar

import msgspec

from firstbyte.client_sdk._core.stream import SequenceGapError, payload_object
from firstbyte.client_sdk.errors import StreamBrokenError, api_error_from_response
from firstbyte.protocol.codec import DONE_BYTES, Usage
from firstbyte.protocol.events import EventFormat
from firstbyte.protocol.sse import DONE

__all__ = ["EventAssembler", "merge_usage"]

E = TypeVar("E")


def merge_usage(old: Usage | None, new: Usage) -> Usage:
    """``new``, its missing counts taken from ``old`` (Messages says its input tokens in
    ``message_start`` and its output tokens in the last ``message_delta``)."""
    if old is None:
        return new
    return Usage(
        new.input_tokens if new.input_tokens is not None else old.input_tokens,
        new.output_tokens if new.output_tokens is not None else old.output_tokens,
    )


class EventAssembler(Generic[E]):
    """Feeds on ``(seq, payload)``; ``last_seq`` is what a resume asks to continue after."""

    def __init__(self, events: EventFormat[E], *, after: int = 0) -> None:
        self.events = events
        self.last_seq = after
        self.done = False
        self.usage: Usage | None = None
        self.last: E | None = None
        """The last event passed (the terminal one once ``done``)."""

    def receive(self, seq: int | None, payload: str | bytes | dict[str, Any]) -> E | None:
        """Take one event; returns it typed, or None for a duplicate, ``[DONE]`` or anything
        after the end. Raises :class:`SequenceGapError` for a skipped sequence number and
        :class:`~firstbyte.client_sdk.errors.APIError` for an error event."""
        if seq is not None:
            last = self.last_seq
            if seq <= last:
                return None
            if last and seq != last + 1:
                raise SequenceGapError(last + 1, seq)
            self.last_seq = seq
        if self.done:
            return None
        events = self.events
        try:
            if isinstance(payload, dict):
                event = msgspec.convert(payload, events.event_type)
            else:
                event = events.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError):
            if isinstance(payload, (str, bytes)) and payload.strip() in (DONE, DONE_BYTES):
                self.done = True
                return None
            self._not_an_event(payload)
        error = events.error(event)
        if error is not None:
            self.done = True
            raise api_error_from_response(None, error)
        usage = events.usage(event)
        if usage is not None:
            self.usage = merge_usage(self.usage, usage)
        if events.ends(event):
            self.done = True
        self.last = event
        return event

    def _not_an_event(self, payload: str | bytes | dict[str, Any]) -> NoReturn:
        """An OpenAI-shaped error raises its APIError; anything else breaks the stream."""
        obj = payload_object(payload)
        if isinstance(obj, dict) and "error" in obj:
            self.done = True
            raise api_error_from_response(None, obj)
        raise StreamBrokenError(f"not a {self.events.name} event: {str(obj)[:200]}")

    def mark_done(self) -> None:
        self.done = True
