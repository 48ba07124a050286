"""OpenAI's Responses API (``POST /v1/responses``) as the router reads it.

Streamed as named events (``event: response.output_text.delta`` and its JSON, whose ``type``
repeats the name and whose ``sequence_number`` counts from 0). Output is in the ``*.delta``
events of text, refusals and function-call arguments; the stream ends with
``response.completed`` (usage inside its ``response``), ``response.incomplete``,
``response.failed`` or ``error``, never ``[DONE]``. The ``error`` event the router adds
(:meth:`ResponsesCodec.error_event`) takes the number after the stream's last event.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from .codec import Codec, Usage, _Tokens, event_data, event_name, named_event
from .openai import ChatCompletionRequest, Message, Role, decode_with, encode

__all__ = [
    "RESPONSES",
    "ResponsesCodec",
    "ResponsesRequest",
    "input_messages",
    "next_sequence_number",
]

PosInt = Annotated[int, msgspec.Meta(ge=1)]

CONTENT_EVENTS = frozenset(
    {
        b"response.output_text.delta",
        b"response.refusal.delta",
        b"response.function_call_arguments.delta",
    }
)
ENDS = {
    b"response.completed": "ok",
    b"response.incomplete": "ok",
    b"response.failed": "upstream_error",
    b"error": "upstream_error",
}
"""The terminal events, and how the stream ended with each."""


class ResponsesRequest(msgspec.Struct):
    """What the router reads of a Responses body; the rest passes through untouched."""

    model: Annotated[str, msgspec.Meta(min_length=1)]
    input: str | list[Any] = ""
    instructions: str | None = None
    stream: bool | None = False
    """Null is false, as at OpenAI."""
    max_output_tokens: PosInt | None = None
    user: str | None = None
    safety_identifier: str | None = None


_ROLES: frozenset[str] = frozenset({"system", "developer", "user", "assistant"})


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            part["text"]
            for part in content
            if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return ""


_CALL_ROLES: dict[str, Role] = {"function_call": "assistant", "function_call_output": "tool"}
"""Input items without ``content`` that routing reads as messages: the model's call of a
function (its arguments) and the function's output, so a request carrying them reads as a
later turn of its conversation, not as its first message."""


def input_messages(request: ResponsesRequest) -> list[Message]:
    """The instructions and input as chat messages (what routing reads: roles and text)."""
    messages: list[Message] = []
    if request.instructions:
        messages.append(Message(role="system", content=request.instructions))
    if isinstance(request.input, str):
        messages.append(Message(role="user", content=request.input))
        return messages
    for item in request.input:
        if not isinstance(item, dict):
            continue
        if "content" in item:
            role: Role = item.get("role") if item.get("role") in _ROLES else "user"  # type: ignore[assignment]
            messages.append(Message(role=role, content=_text(item["content"])))
        elif item.get("type") in _CALL_ROLES:  # a tool call and its result: a later turn
            text = item.get("output" if item["type"] == "function_call_output" else "arguments")
            messages.append(Message(role=_CALL_ROLES[item["type"]],
                                    content=text if isinstance(text, str) else ""))
    return messages or [Message(role="user", content="")]



class _Response(msgspec.Struct):
    usage: _Tokens | None = None


class _Completed(msgspec.Struct):
    response: _Response | None = None


class _Numbered(msgspec.Struct):
    sequence_number: int | None = None


_decoder = msgspec.json.Decoder(ResponsesRequest)
_completed = msgspec.json.Decoder(_Completed)
_numbered = msgspec.json.Decoder(_Numbered)


def next_sequence_number(after: bytes | None) -> int | None:
    """The ``sequence_number`` of the event that follows ``after`` (a stream's last event, a
    stored payload): 0 with none before it, else one more than ``after``'s; None when
    ``after`` carries no number (an upstream that does not number its events)."""
    if after is None:
        return 0
    try:
        number = _numbered.decode(event_data(after)).sequence_number
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    return None if number is None else number + 1


class ResponsesCodec(Codec):
    name = "responses"
    path = "/v1/responses"
    named_events = True

    def decode_request(self, body: bytes) -> ChatCompletionRequest:
        request = decode_with(_decoder, body)
        return ChatCompletionRequest(
            model=request.model,
            messages=input_messages(request),
            stream=bool(request.stream),
            max_tokens=request.max_output_tokens,
            user=request.user,
            safety_identifier=request.safety_identifier,
        )

    def is_content(self, payload: bytes) -> bool:
        return event_name(payload) in CONTENT_EVENTS and b'"delta":""' not in payload

    def end_of(self, payload: bytes) -> str | None:
        name = event_name(payload)
        return None if name is None else ENDS.get(name)

    def usage(self, payload: bytes) -> Usage | None:
        name = event_name(payload)
        if name is None:  # a whole (non-streamed) response: usage at its top
            return super().usage(payload)
        if name not in ENDS or b'"usage"' not in payload:
            return None
        try:
            response = _completed.decode(event_data(payload)).response
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None
        if response is None or response.usage is None:
            return None
        return response.usage.usage()

    def error_event(
        self,
        message: str,
        type: str = "server_error",
        code: str | None = None,
        *,
        after: bytes | None = None,
    ) -> bytes:
        """Responses' ``error`` event (``code``, ``message``, ``param``), numbered as the
        event that follows ``after`` (:func:`next_sequence_number`)."""
        data: dict[str, Any] = {"type": "error"}
        number = next_sequence_number(after)
        if number is not None:
            data["sequence_number"] = number
        data.update(code=code or type, message=message, param=None)
        return named_event(b"error", encode(data))


RESPONSES = ResponsesCodec()
