"""What the router reads of a wire format it streams: one :class:`Codec` per format, sans IO.

A router passes every request and event through untouched; a codec only *reads* them:

- of the request body, what routing needs (:meth:`Codec.decode_request`): the model, the
  stream flag, the prompt text (prefix affinity, the prompt-size estimate), the output token
  cap and the end-user fields, as a :class:`~firstbyte.protocol.openai.ChatCompletionRequest`
  *view* (the prompt as chat messages), so every routing stage reads one type;
- of each streamed event's payload: does it carry output (:meth:`Codec.is_content`, the
  first token), does it end the stream (:meth:`Codec.end_of`), what did the request cost
  (:meth:`Codec.usage`, a :class:`Usage` for every format alike);
- and it writes the one thing the router adds to a stream: an error event in the format's own
  shape (:meth:`Codec.error_event`), when the upstream fails, the stream is cancelled or the
  router drains.

Event payloads are what the store keeps of an event: for a format whose events carry names
(OpenAI Responses, Anthropic Messages) the event's own lines, ``event: NAME\\ndata: JSON``
(:data:`NAMED_PREFIX` first, exactly as the upstream sent them when it sent that shape);
for chat and completions the ``data`` alone, as before. :func:`event_data` gives the JSON of
either (long-poll batches and WebSocket messages carry the JSON; its ``type`` names the event).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import msgspec

from .openai import ChatCompletionRequest, decode_request, encode, error_body
from .sse import DONE

__all__ = [
    "CHAT",
    "DONE_BYTES",
    "NAMED_PREFIX",
    "ChatCodec",
    "Codec",
    "Usage",
    "event_data",
    "event_name",
    "named_event",
]

DONE_BYTES = DONE.encode()
NAMED_PREFIX = b"event: "
"""How a stored payload of a named event starts (``event: NAME\\ndata: JSON``)."""
_DATA_LINE = b"\ndata: "


class Usage(msgspec.Struct, frozen=True):
    """What a request cost in tokens, as its upstream said, in any format (None: not said)."""

    input_tokens: int | None = None
    output_tokens: int | None = None


def named_event(name: bytes | str, data: bytes) -> bytes:
    """The stored payload of an event named ``name`` with ``data`` (one ``data:`` line per
    line of ``data``, as the event-stream format frames it)."""
    if isinstance(name, str):
        name = name.encode()
    lines = data.split(b"\n")
    return NAMED_PREFIX + name + b"".join(_DATA_LINE + line for line in lines)


def event_name(payload: bytes) -> bytes | None:
    """The ``event:`` name of a stored payload, None for a data-only payload."""
    if payload[:7] != NAMED_PREFIX:
        return None
    end = payload.find(b"\n")
    return payload[7:end] if end >= 0 else payload[7:]


def event_data(payload: bytes) -> bytes:
    """The data (JSON) of a stored payload, named or not."""
    if payload[:7] != NAMED_PREFIX:
        return payload
    _, _, data = payload.partition(_DATA_LINE)
    # Several data lines join with LF (the event-stream rule); JSON allows it as whitespace.
    return data.replace(_DATA_LINE, b"\n") if _DATA_LINE in data else data


class _Tokens(msgspec.Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    input_tokens: int | None = None
    output_tokens: int | None = None

    def usage(self) -> Usage:
        input_tokens = self.input_tokens if self.input_tokens is not None else self.prompt_tokens
        output = self.output_tokens if self.output_tokens is not None else self.completion_tokens
        return Usage(input_tokens, output)


class _WithUsage(msgspec.Struct):
    usage: _Tokens | None = None


_with_usage = msgspec.json.Decoder(_WithUsage)


def _top_level_usage(data: bytes) -> Usage | None:
    """``{"usage": {...}}`` at the top of ``data`` (either token naming), else None."""
    # find, not ``in``: ``bytes in bytes`` first tries its operand as an int, and makes (and
    # drops) a TypeError with its message, ~1.7k instructions, once a stream or more.
    if data.find(b'"usage"') < 0:
        return None
    try:
        tokens = _with_usage.decode(data).usage
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    return tokens.usage() if tokens is not None else None


class Codec:
    """One wire format as the router reads it (see the module docstring). Stateless: one
    instance per format, shared by every request."""

    name: ClassVar[str] = ""
    """The endpoint's label (metrics, logs): ``chat``, ``completions``, ``responses``..."""
    path: ClassVar[str] = ""
    """The upstream path a request of this format goes to."""
    named_events: ClassVar[bool] = False
    """Its events carry ``event:`` names, kept with their data; it ends with its own
    terminal event (:meth:`end_of`), not ``[DONE]``."""
    streams: ClassVar[bool] = True
    """Whether it can be streamed (embeddings cannot)."""

    def decode_request(self, body: bytes) -> ChatCompletionRequest:
        """The routing view of a request body; raises
        :class:`~firstbyte.protocol.openai.RequestValidationError` naming the field."""
        raise NotImplementedError

    def is_content(self, payload: bytes) -> bool:
        """Does this event carry output (text, a tool call, a refusal)?"""
        raise NotImplementedError

    def end_of(self, payload: bytes) -> str | None:
        """None if the stream goes on after this event; else how it ended: ``ok``, or the
        requests metric's label of a failure (``upstream_error``). ``[DONE]`` is the relay's
        business, not the codec's."""
        return None

    def usage(self, payload: bytes) -> Usage | None:
        """The tokens an event (or a whole non-streamed answer) reports, if any."""
        return _top_level_usage(event_data(payload))

    def stream_usage(self, payloads: Sequence[bytes]) -> Usage | None:
        """A stream's usage: the last event that reports one (it comes at the end, maybe
        just before an error event), looking at the last few events only."""
        for payload in reversed(payloads[-4:]):
            usage = self.usage(payload)
            if usage is not None:
                return usage
        return None

    def error_event(
        self,
        message: str,
        type: str = "server_error",
        code: str | None = None,
        *,
        after: bytes | None = None,
    ) -> bytes:
        """The payload of an error the router adds to a stream (OpenAI's error body);
        ``after`` is the stream's last event before it (None: there is none), which a
        format that numbers its events numbers it after (Responses)."""
        return encode(error_body(message, type, code=code))

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} {self.path}>"


class _Delta(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    """A chat chunk's ``delta`` with the members chat servers send (OpenAI's, vLLM's,
    SGLang's), each decoded as ``msgspec.json.decode`` decodes it (``Any``). Not tracked by
    the cyclic GC: decoded JSON holds no cycle."""

    role: Any = None
    content: Any = None
    tool_calls: Any = None
    refusal: Any = None
    function_call: Any = None
    reasoning_content: Any = None
    reasoning: Any = None


class _Choice(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    index: Any = None
    delta: _Delta | None = None
    logprobs: Any = None
    finish_reason: Any = None
    stop_reason: Any = None
    matched_stop: Any = None


class _Chunk(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    """A chat chunk as :meth:`ChatCodec.is_content` reads it first. Every member is decoded
    (none is skipped: skipping checks neither a string's UTF-8 nor a number's range, which
    ``msgspec.json.decode`` refuses); any other member or shape is a ValidationError."""

    id: Any = None
    object: Any = None
    created: Any = None
    model: Any = None
    system_fingerprint: Any = None
    service_tier: Any = None
    choices: list[_Choice] | None = None
    usage: Any = None


_chunk = msgspec.json.Decoder(_Chunk)


class ChatCodec(Codec):
    """``POST /v1/chat/completions``: ``data:`` events, ``[DONE]`` last."""

    name = "chat"
    path = "/v1/chat/completions"

    def decode_request(self, body: bytes) -> ChatCompletionRequest:
        return decode_request(body)

    def is_content(self, payload: bytes) -> bool:
        # find, not ``in`` (see _top_level_usage): the relay asks of each event until the
        # first content, two or three a stream.
        if payload.find(b'"delta"') < 0:
            return False
        # A chunk of the usual shape decoded into structs (~half the work of dicts, and the
        # same answer: its members are decoded alike, a null or missing delta is an empty
        # one); anything else, a chunk with another member or not JSON, read as dicts.
        try:
            typed = _chunk.decode(payload)
        except msgspec.DecodeError:  # a ValidationError too
            pass
        else:
            for member in typed.choices or ():
                said = member.delta
                if said is not None and (said.content or said.tool_calls or said.refusal):
                    return True
            return False
        try:
            chunk: Any = msgspec.json.decode(payload)
            for choice in chunk.get("choices") or ():
                delta = choice.get("delta") or {}
                if delta.get("content") or delta.get("tool_calls") or delta.get("refusal"):
                    return True
        except (msgspec.DecodeError, AttributeError, TypeError):
            return False
        return False


CHAT = ChatCodec()
