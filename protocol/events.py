"""Each streamed format's events as typed values, for a client reading a stream (the SDK).

The router reads streams with the codecs (:mod:`.codec` and one module per format); a
client needs more of each event, so this module gives every format an :class:`EventFormat`:
a decoder of its event JSON into a typed msgspec Struct, and the few questions a reader asks
of each event (its output text, does it end the stream, its usage, is it an error), answered
with the codecs' own definitions (their content events and terminal events).

Every transport carries an event's JSON: SSE's ``data``, a long-poll batch's ``data``, a
WebSocket ``event`` message's ``data``. In the Responses and Messages formats the JSON's
``type`` names the event (as SSE's ``event:`` line does), so one decoder reads every transport.
An error the router adds in OpenAI's shape (``{"error": {...}}``, e.g. ``stream_lost``) is not
an event of the format: :meth:`EventFormat.decode` raises for it and the reader handles it as
for chat.
"""

from __future__ import annotations

from typing import Any, ClassVar, Generic, TypeVar

import msgspec

from . import anthropic, responses
from .codec import Usage
from .ws import Endpoint

__all__ = [
    "COMPLETION_EVENTS",
    "MESSAGE_CONTENT_DELTAS",
    "MESSAGE_EVENTS",
    "RESPONSE_CONTENT",
    "RESPONSE_EVENTS",
    "CompletionChoice",
    "CompletionChunk",
    "Embedding",
    "EmbeddingList",
    "EventFormat",
    "MessageDelta",
    "MessageEvent",
    "MessageObject",
    "ResponseEvent",
    "ResponseObject",
    "TokenCounts",
]

E = TypeVar("E")


class TokenCounts(msgspec.Struct, frozen=True):
    """Token usage in any format's naming (OpenAI's ``prompt_tokens`` or ``input_tokens``)."""

    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    input_tokens: int | None = None
    output_tokens: int | None = None

    def usage(self) -> Usage:
        """The same counts as the codecs' :class:`~firstbyte.protocol.codec.Usage`."""
        given = self.input_tokens if self.input_tokens is not None else self.prompt_tokens
        out = self.output_tokens if self.output_tokens is not None else self.completion_tokens
        return Usage(given, out)


# -- completions ------------------------------------------------------------------------------


class CompletionChoice(msgspec.Struct, frozen=True, gc=False):
    index: int = 0
    text: str = ""
    finish_reason: str | None = None


class CompletionChunk(msgspec.Struct, frozen=True, gc=False):
    """One streamed ``text_completion`` chunk (also a whole non-streamed answer); the usage
    chunk (``stream_options.include_usage``) has no choices."""

    id: str = ""
    model: str = ""
    choices: tuple[CompletionChoice, ...] = ()
    usage: TokenCounts | None = None
    created: int = 0
    object: str = "text_completion"

    @property
    def text(self) -> str:
        """The first choice's text ("" for none)."""
        return self.choices[0].text if self.choices else ""

    @property
    def finish_reason(self) -> str | None:
        return self.choices[0].finish_reason if self.choices else None


# -- Responses --------------------------------------------------------------------------------


class ResponseObject(msgspec.Struct, frozen=True, gc=False):
    """The ``response`` of ``response.created`` ... ``response.completed`` (and a whole
    non-streamed answer): what a reader needs of it; the rest is in the event's JSON."""

    id: str = ""
    status: str | None = None
    model: str | None = None
    output: tuple[Any, ...] = ()
    usage: TokenCounts | None = None
    error: Any = None
    incomplete_details: Any = None

    @property
    def output_text(self) -> str:
        """The text of the output's message items (as the openai SDK's ``output_text``)."""
        return "".join(
            part.get("text") or ""
            for item in self.output
            if isinstance(item, dict) and item.get("type") == "message"
            for part in item.get("content") or ()
            if isinstance(part, dict) and part.get("type") == "output_text"
        )


class ResponseEvent(msgspec.Struct, frozen=True, gc=False):
    """One streamed Responses event; ``type`` names it (``response.output_text.delta`` ...).

    ``delta`` is a ``*.delta`` event's increment, ``text`` a ``*.done`` event's whole text,
    ``response`` the response of the lifecycle events; ``code`` and ``message`` an ``error``'s.
    """

    type: str
    sequence_number: int | None = None
    delta: Any = None
    text: str | None = None
    item_id: str | None = None
    output_index: int | None = None
    content_index: int | None = None
    item: Any = None
    part: Any = None
    response: ResponseObject | None = None
    code: str | None = None
    message: str | None = None
    param: str | None = None


# -- Anthropic Messages -----------------------------------------------------------------------


class MessageDelta(msgspec.Struct, frozen=True, gc=False):
    """A ``content_block_delta``'s delta (``text_delta``, ``input_json_delta``, ...) or a
    ``message_delta``'s (``stop_reason``)."""

    type: str | None = None
    text: str | None = None
    partial_json: str | None = None
    thinking: str | None = None
    stop_reason: str | None = None
    stop_sequence: str | None = None


class MessageObject(msgspec.Struct, frozen=True, gc=False):
    """``message_start``'s message (and a whole non-streamed answer)."""

    id: str = ""
    model: str | None = None
    role: str = "assistant"
    content: tuple[Any, ...] = ()
    stop_reason: str | None = None
    usage: TokenCounts | None = None

    @property
    def text(self) -> str:
        """The text of its text blocks."""
        return "".join(
            block.get("text") or ""
            for block in self.content
            if isinstance(block, dict) and block.get("type") == "text"
        )


class MessageEvent(msgspec.Struct, frozen=True, gc=False):
    """One streamed Messages event; ``type`` names it (``message_start``,
    ``content_block_delta``, ``ping`` ...)."""

    type: str
    index: int | None = None
    delta: MessageDelta | None = None
    message: MessageObject | None = None
    content_block: Any = None
    usage: TokenCounts | None = None
    error: Any = None


# -- the formats ------------------------------------------------------------------------------


class EventFormat(Generic[E]):
    """One streamed format as a client reads it: its path, its event type and decoder, and
    per event its output text, whether it ends the stream, its usage and its error."""

    name: ClassVar[Endpoint]
    """The codec's name: ``completions``, ``responses``, ``messages``."""
    path: ClassVar[str] = ""
    """The path a request of this format is sent to."""
    terminal: ClassVar[frozenset[str]] = frozenset()
    """The names (``type``) of the events that end a stream; none: ``[DONE]`` ends it."""

    def __init__(self, event_type: type[E]) -> None:
        self.event_type = event_type
        self._decoder = msgspec.json.Decoder(event_type)

    def decode(self, data: str | bytes) -> E:
        """The typed event; raises :class:`msgspec.DecodeError` (or ``ValidationError``) for
        JSON that is not one of this format's events (``[DONE]``, an OpenAI-shaped error)."""
        return self._decoder.decode(data)

    def text(self, event: E) -> str:
        """The output text this event adds ("" for none)."""
        raise NotImplementedError

    def is_content(self, event: E) -> bool:
        """Does it carry output (text, tool-call arguments, a refusal): TTFT and ITL count
        these, as the router's codec does."""
        raise NotImplementedError

    def ends(self, event: E) -> bool:
        """Is it the format's terminal event (an error included)?"""
        raise NotImplementedError

    def usage(self, event: E) -> Usage | None:
        """The usage it reports, if any."""
        raise NotImplementedError

    def error(self, event: E) -> dict[str, Any] | None:
        """For an error event, the body to raise as (``{"error": {"message", "type",
        "code"}}``); None for any other event."""
        return None

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} {self.path}>"


class _Completions(EventFormat[CompletionChunk]):
    name = "completions"
    path = "/v1/completions"

    def text(self, event: CompletionChunk) -> str:
        return event.choices[0].text if event.choices else ""

    def is_content(self, event: CompletionChunk) -> bool:
        return any(choice.text for choice in event.choices)

    def ends(self, event: CompletionChunk) -> bool:
        return False  # [DONE] ends it

    def usage(self, event: CompletionChunk) -> Usage | None:
        return event.usage.usage() if event.usage is not None else None


RESPONSE_CONTENT = frozenset(name.decode() for name in responses.CONTENT_EVENTS)
"""The Responses event types that carry output (the codec's)."""
_RESPONSE_ENDS = frozenset(name.decode() for name in responses.ENDS)
_TEXT_DELTA = "response.output_text.delta"


class _Responses(EventFormat[ResponseEvent]):
    name = "responses"
    path = "/v1/responses"
    terminal = _RESPONSE_ENDS

    def text(self, event: ResponseEvent) -> str:
        delta = event.delta
        return delta if event.type == _TEXT_DELTA and isinstance(delta, str) else ""

    def is_content(self, event: ResponseEvent) -> bool:
        return event.type in RESPONSE_CONTENT and bool(event.delta)

    def ends(self, event: ResponseEvent) -> bool:
        return event.type in self.terminal

    def usage(self, event: ResponseEvent) -> Usage | None:
        response = event.response
        if response is None or response.usage is None:
            return None
        return response.usage.usage()

    def error(self, event: ResponseEvent) -> dict[str, Any] | None:
        if event.type != "error":
            return None
        code = event.code or "upstream_error"
        return {"error": {"message": event.message or "(no message)", "type": code,
                          "param": event.param, "code": code}}


_MESSAGE_ENDS = frozenset(name.decode() for name in anthropic.ENDS)
MESSAGE_CONTENT_DELTAS = frozenset({"text_delta", "input_json_delta"})
"""The ``content_block_delta`` delta types that carry output (as the codec reads them)."""


class _Messages(EventFormat[MessageEvent]):
    name = "messages"
    path = "/v1/messages"
    terminal = _MESSAGE_ENDS

    def text(self, event: MessageEvent) -> str:
        delta = event.delta
        if event.type != "content_block_delta" or delta is None or delta.type != "text_delta":
            return ""
        return delta.text or ""

    def is_content(self, event: MessageEvent) -> bool:
        delta = event.delta
        return (
            event.type == "content_block_delta"
            and delta is not None
            and delta.type in MESSAGE_CONTENT_DELTAS
            and bool(delta.text or delta.partial_json)
        )

    def ends(self, event: MessageEvent) -> bool:
        return event.type in self.terminal

    def usage(self, event: MessageEvent) -> Usage | None:
        if event.type == "message_start" and event.message is not None:
            counts = event.message.usage
            return counts.usage() if counts is not None else None
        return event.usage.usage() if event.usage is not None else None

    def error(self, event: MessageEvent) -> dict[str, Any] | None:
        if event.type != "error":
            return None
        error = event.error if isinstance(event.error, dict) else {}
        return {"error": {"message": error.get("message") or "(no message)",
                          "type": error.get("type") or "api_error",
                          "code": error.get("code")}}


COMPLETION_EVENTS = _Completions(CompletionChunk)
RESPONSE_EVENTS = _Responses(ResponseEvent)
MESSAGE_EVENTS = _Messages(MessageEvent)


# -- embeddings (never streamed) --------------------------------------------------------------


class Embedding(msgspec.Struct, frozen=True, gc=False):
    """One input's vector: floats, or base64 of little-endian float32 with
    ``encoding_format: "base64"``."""

    index: int
    embedding: list[float] | str
    object: str = "embedding"


class EmbeddingList(msgspec.Struct, frozen=True):
    """An ``/v1/embeddings`` answer: a vector per input, in input order."""

    data: list[Embedding]
    model: str = ""
    usage: TokenCounts | None = None
    object: str = "list"
