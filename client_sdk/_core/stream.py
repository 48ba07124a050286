"""Stream assembly, sans-IO: numbered events in, deltas out, each event exactly once.

Every transport delivers the same thing: ``(seq, payload)`` pairs, where ``seq`` is the router's
event sequence number (1, 2, 3, ...) and ``payload`` a chunk, an error or ``[DONE]``. The
assembler drops events it has already seen (a resumed stream replays from the last sequence the
client confirmed, and a reconnect may race a replay), refuses to skip over a missing one, and
turns chunks into :class:`StreamDelta` values. This is what makes resume lose and repeat nothing.
"""

from __future__ import annotations

from typing import Any

import msgspec

from firstbyte.client_sdk.errors import StreamBrokenError, api_error_from_response
from firstbyte.protocol.openai import ChatCompletionChunk, ToolCallDelta, Usage
from firstbyte.protocol.sse import DONE

__all__ = ["SequenceGapError", "StreamAssembler", "StreamDelta", "payload_object"]


def payload_object(payload: str | bytes | dict[str, Any]) -> Any:
    """A stream event's payload as an object: JSON text decoded (:class:`StreamBrokenError`
    if it is not JSON), a dict as it is."""
    if not isinstance(payload, (str, bytes)):
        return payload
    try:
        return msgspec.json.decode(payload)
    except msgspec.DecodeError as exc:
        raise StreamBrokenError(f"undecodable stream event: {exc}") from None


class StreamDelta(msgspec.Struct, frozen=True, gc=False):
    """One piece of the answer: text and/or tool-call fragments, as OpenAI streams them.

    A frozen msgspec Struct (one is built per event; a frozen dataclass costs ten times more).
    """

    text: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()
    finish_reason: str | None = None
    role: str | None = None
    seq: int | None = None
    """The router's event sequence number (``None`` from servers that don't number events)."""

    @property
    def is_content(self) -> bool:
        """True when it carries a token (text or tool-call arguments), as TTFT/ITL count."""
        return bool(self.text) or bool(self.tool_calls)


class SequenceGapError(StreamBrokenError):
    """An event arrived after a missing one; the reader must resume from ``expected - 1``."""

    def __init__(self, expected: int, got: int) -> None:
        super().__init__(f"stream skipped from event {expected - 1} to {got}")
        self.expected = expected
        self.got = got


_chunk = msgspec.json.Decoder(ChatCompletionChunk)
_DONE_BYTES = DONE.encode()


class StreamAssembler:
    """Feeds on ``(seq, payload)``; ``last_seq`` is what a resume asks to continue after."""

    def __init__(self, *, after: int = 0) -> None:
        self.last_seq = after
        self.done = False
        self.usage: Usage | None = None
        self.chunk_id: str | None = None
        self.model: str | None = None

    def receive(self, seq: int | None, payload: str | bytes | dict[str, Any]) -> StreamDelta | None:
        """Take one event. Returns a delta for a chunk that carries something, else ``None``.

        Raises :class:`SequenceGapError` for a skipped sequence number and
        :class:`~firstbyte.client_sdk.errors.APIError` for an error event.
        """
        if seq is not None:
            last = self.last_seq
            if seq <= last:
                return None  # already delivered: a replay overlapping what we had
            if last and seq != last + 1:
                raise SequenceGapError(last + 1, seq)
            self.last_seq = seq
        if self.done:
            return None
        if isinstance(payload, (str, bytes)):
            try:
                # The common case in one step: the event is a chunk (no dict in between).
                chunk = _chunk.decode(payload)
            except (msgspec.DecodeError, msgspec.ValidationError):
                if payload == DONE or payload.strip() in (DONE, _DONE_BYTES):
                    self.done = True
                    return None
                chunk = self._not_a_chunk(payload)
        else:
            chunk = self._not_a_chunk(payload)
        self.chunk_id = chunk.id
        self.model = chunk.model
        if chunk.usage is not None:
            self.usage = chunk.usage
        if not chunk.choices:
            return None
        choice = chunk.choices[0]
        delta = choice.delta
        text = delta.content or ""
        tool_calls = delta.tool_calls
        finish_reason = choice.finish_reason
        if not text and not tool_calls and finish_reason is None and delta.role is None:
            return None
        return StreamDelta(text, tuple(tool_calls) if tool_calls else (), finish_reason,
                           delta.role, seq)

    def _not_a_chunk(self, payload: str | bytes | dict[str, Any]) -> ChatCompletionChunk:
        """An error event raises its APIError; anything else that is not a chunk breaks."""
        obj = payload_object(payload)
        if isinstance(obj, dict) and "error" in obj:
            self.done = True
            raise api_error_from_response(None, obj)
        try:
            return msgspec.convert(obj, ChatCompletionChunk)
        except msgspec.ValidationError as exc:
            raise StreamBrokenError(f"invalid chunk in stream: {exc}") from None

    def mark_done(self) -> None:
        """The transport saw the end of the stream by other means (WS ``done``, poll ``done``)."""
        self.done = True
