"""The WebSocket ``/v1/ws`` message protocol (docs/protocol.md, "WebSocket").

JSON text messages tagged by ``type``. The client sends :class:`Request` (start a stream) or
:class:`Resume` (replay after a sequence number and follow); the router answers each stream
with :class:`Start`, then :class:`Event` messages, then :class:`Done`, or an :class:`Error`.
Chunk payloads and error objects travel as :class:`msgspec.Raw`: they are relayed, not
re-encoded. Both sides encode with :func:`encode` and decode with the decoders here.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

__all__ = [
    "CLOSE_INVALID_PAYLOAD",
    "CLOSE_POLICY",
    "SUBPROTOCOL",
    "TOKEN_SUBPROTOCOL_PREFIX",
    "ClientMessage",
    "Done",
    "Endpoint",
    "Error",
    "Event",
    "Request",
    "Resume",
    "ServerMessage",
    "Start",
    "decode_client_message",
    "decode_server_message",
    "encode",
]

CLOSE_INVALID_PAYLOAD = 1007
"""Close code: a message that is not JSON, has an unknown type or an invalid request body."""
CLOSE_POLICY = 1008
"""Close code: authentication, an unknown or foreign stream (not told apart), too many streams."""

SUBPROTOCOL = "firstbyte.v1"
"""The subprotocol the router selects when a client offers it (a browser passing its client
token as a subprotocol must offer this one too: the handshake must select one it offered)."""
TOKEN_SUBPROTOCOL_PREFIX = "firstbyte.token."
"""A client token offered as subprotocol ``firstbyte.token.TOKEN`` (never selected)."""


Endpoint = Literal["chat", "completions", "responses", "messages"]
"""The formats a stream can be started in (a codec's name, :mod:`firstbyte.protocol.formats`)."""


class Request(msgspec.Struct, tag="request", tag_field="type", omit_defaults=True):
    """Client: start a stream; ``body`` is a request in ``endpoint``'s format (default a chat
    completion; ``stream`` is forced)."""

    body: msgspec.Raw
    endpoint: Endpoint = "chat"


class Resume(msgspec.Struct, tag="resume", tag_field="type"):
    """Client: replay the stream's events after ``after``, then follow it."""

    stream: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
    after: Annotated[int, msgspec.Meta(ge=0)] = 0


class Start(msgspec.Struct, tag="start", tag_field="type", omit_defaults=True):
    """Router: the stream exists. On a new request, ``region`` serves it and ``better_region``
    (and its ``better_region_url``) are the ``x-firstbyte-better-region`` hint SSE sends as
    headers: a WebSocket has no per-request headers, so the hint rides on the stream's first
    message. A resume's ``start`` carries only ``stream``."""

    stream: str
    region: str | None = None
    better_region: str | None = None
    better_region_url: str | None = None


class Event(msgspec.Struct, tag="event", tag_field="type"):
    """Router: one stream event, ``data`` a chunk or ``{"error": {...}}``."""

    stream: str
    seq: int
    data: msgspec.Raw


class Done(msgspec.Struct, tag="done", tag_field="type"):
    """Router: the stream ended; ``seq`` is the number of its ``[DONE]`` event."""

    stream: str
    seq: int


class Error(msgspec.Struct, tag="error", tag_field="type"):
    """Router: an error, ``error`` the inner OpenAI error object (``{"message", "type", ...}``);
    ``stream`` is null when the error belongs to no stream (e.g. a malformed message).
    ``status`` is the HTTP status the same answer has over SSE (``429`` region saturated,
    ``503`` draining, ``404`` no such stream, ...), so a client handles both alike; absent from
    an older router. ``retry_after`` is the seconds the same answer's ``Retry-After`` header
    says over SSE (a ``429``'s, a ``503``'s: when to send the request again), null when that
    answer has none or from an older router."""

    stream: str | None = None
    error: msgspec.Raw = msgspec.field(default_factory=lambda: msgspec.Raw(b"{}"))
    status: int | None = None
    retry_after: int | None = None


ClientMessage = Request | Resume
ServerMessage = Start | Event | Done | Error


class _Typed(msgspec.Struct):
    type: str


_client = msgspec.json.Decoder(ClientMessage)
_server = msgspec.json.Decoder(ServerMessage)
_typed = msgspec.json.Decoder(_Typed)
_SERVER_TYPES = frozenset(("start", "event", "done", "error"))
_encoder = msgspec.json.Encoder()


def encode(message: ClientMessage | ServerMessage) -> bytes:
    """A message's JSON bytes (send them as a text message)."""
    return _encoder.encode(message)


def decode_client_message(data: str | bytes) -> ClientMessage:
    """Decode a client message; raises :class:`msgspec.DecodeError` (or its subclass
    :class:`msgspec.ValidationError`) for anything else, including an unknown ``type``, and
    JSON nested deeper than the decoder's recursion bound."""
    try:
        return _client.decode(data)
    except RecursionError:
        raise msgspec.DecodeError("JSON nested too deeply") from None


def decode_server_message(data: str | bytes) -> ServerMessage | None:
    """Decode a router message; ``None`` for a well-formed message of a type this version does
    not know (a newer router's), which a reader skips. Raises :class:`msgspec.DecodeError`
    for anything malformed."""
    try:
        return _server.decode(data)
    except msgspec.ValidationError:
        kind = _message_type(data)
        if kind is None or kind in _SERVER_TYPES:
            raise
        return None


def _message_type(data: str | bytes) -> str | None:
    try:
        return _typed.decode(data).type
    except msgspec.DecodeError:
        return None
