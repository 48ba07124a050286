"""Anthropic's Messages API (``POST /v1/messages``) as the router reads it.

Streamed as named events: ``message_start`` (input tokens in ``message.usage``), then
``content_block_start`` / ``content_block_delta`` / ``content_block_stop`` per block, ``ping``
at any time, ``message_delta`` (the output tokens so far in ``usage``) and ``message_stop``
last; ``error`` ends a stream that failed. Output is in ``content_block_delta`` events of
text and tool-call JSON. The API key may come as ``x-api-key`` (Anthropic's header).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any

import msgspec

from .codec import Codec, Usage, _Tokens, event_data, event_name, named_event
from .openai import ChatCompletionRequest, Message, decode_with, encode

__all__ = ["API_KEY_HEADER", "MESSAGES", "MessagesCodec", "MessagesRequest"]

API_KEY_HEADER = "x-api-key"

PosInt = Annotated[int, msgspec.Meta(ge=1)]

ENDS = {b"message_stop": "ok", b"error": "upstream_error"}
"""The terminal events, and how the stream ended with each."""


class AnthropicMessage(msgspec.Struct):
    role: str
    content: str | list[Any]


class Metadata(msgspec.Struct):
    user_id: str | None = None


class MessagesRequest(msgspec.Struct):
    """What the router reads of a Messages body; the rest passes through untouched."""

    model: Annotated[str, msgspec.Meta(min_length=1)]
    messages: Annotated[list[AnthropicMessage], msgspec.Meta(min_length=1)]
    max_tokens: PosInt
    system: str | list[Any] | None = None
    stream: bool | None = False
    """Null is false, as vLLM's Messages endpoint takes it."""
    metadata: Metadata | None = None


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            block["text"]
            for block in content
            if isinstance(block, dict) and isinstance(block.get("text"), str)
        )
    return ""


class _Message(msgspec.Struct):
    usage: _Tokens | None = None


class _Start(msgspec.Struct):
    message: _Message | None = None


_decoder = msgspec.json.Decoder(MessagesRequest)
_start = msgspec.json.Decoder(_Start)


class MessagesCodec(Codec):
    name = "messages"
    path = "/v1/messages"
    named_events = True

    def decode_request(self, body: bytes) -> ChatCompletionRequest:
        request = decode_with(_decoder, body)
        messages = [] if not request.system else [
            Message(role="system", content=_text(request.system))
        ]
        messages += [
            Message(role="assistant" if m.role == "assistant" else "user", content=_text(m.content))
            for m in request.messages
        ]
        user = request.metadata.user_id if request.metadata is not None else None
        return ChatCompletionRequest(
            model=request.model,
            messages=messages,
            stream=bool(request.stream),
            max_tokens=request.max_tokens,
            user=user,
        )

    def is_content(self, payload: bytes) -> bool:
        return event_name(payload) == b"content_block_delta" and (
            b'"text_delta"' in payload or b'"input_json_delta"' in payload
        )

    def end_of(self, payload: bytes) -> str | None:
        name = event_name(payload)
        return None if name is None else ENDS.get(name)

    def usage(self, payload: bytes) -> Usage | None:
        if event_name(payload) == b"message_start":
            try:
                message = _start.decode(event_data(payload)).message
            except (msgspec.DecodeError, msgspec.ValidationError):
                return None
            return message.usage.usage() if message and message.usage else None
        return super().usage(payload)

    def stream_usage(self, payloads: Sequence[bytes]) -> Usage | None:
        """Output tokens from the last ``message_delta``; input tokens from it when it says
        them, else from ``message_start``."""
        last = super().stream_usage(payloads)
        if last is not None and last.input_tokens is not None:
            return last
        start = None
        for payload in payloads[:3]:
            start = self.usage(payload) if event_name(payload) == b"message_start" else None
            if start is not None:
                break
        if start is None:
            return last
        if last is None:
            return start
        return Usage(start.input_tokens, last.output_tokens)

    def error_event(
        self,
        message: str,
        type: str = "server_error",
        code: str | None = None,
        *,
        after: bytes | None = None,
    ) -> bytes:
        """Anthropic's ``error`` event; ``code`` (ours) rides along in the error object
        (Anthropic's events are not numbered: ``after`` changes nothing)."""
        error = {"type": "api_error", "message": message, "code": code or type}
        return named_event(b"error", encode({"type": "error", "error": error}))


MESSAGES = MessagesCodec()
