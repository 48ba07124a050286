"""OpenAI-compatible wire types for chat completions, as msgspec Structs.

The contract between the SDK, the router and the simulated inference server.
Decoding tolerates unknown fields wherever OpenAI does (every object here), and rejects
invalid values with a :class:`RequestValidationError` that names the offending field,
so a server can answer 400 with OpenAI's error body.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, TypeVar

import msgspec

__all__ = [
    "ChatCompletion",
    "ChatCompletionChunk",
    "ChatCompletionRequest",
    "Choice",
    "ChunkChoice",
    "CompletionTokensDetails",
    "ContentPart",
    "Delta",
    "ErrorBody",
    "ErrorDetail",
    "FunctionCall",
    "Message",
    "Model",
    "ModelList",
    "PromptTokensDetails",
    "RequestValidationError",
    "ResponseMessage",
    "StreamOptions",
    "ToolCall",
    "ToolCallDelta",
    "Usage",
    "decode_chunk",
    "decode_request",
    "decode_with",
    "encode",
    "error_body",
    "message_text",
]

_T = TypeVar("_T")

Role = Literal["system", "developer", "user", "assistant", "tool", "function"]


class ContentPart(msgspec.Struct, omit_defaults=True):
    """One part of a multi-part message content (``{"type": "text", "text": ...}`` etc.)."""

    type: str
    text: str | None = None
    image_url: dict[str, Any] | None = None
    input_audio: dict[str, Any] | None = None
    file: dict[str, Any] | None = None


class FunctionCall(msgspec.Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class ToolCall(msgspec.Struct, omit_defaults=True):
    """An assistant message's tool call: ``function`` (``type`` "function"), or another
    type's own field (OpenAI's ``custom`` tools: ``custom: {name, input}``)."""

    id: str
    function: FunctionCall | None = None
    type: str = "function"
    custom: dict[str, Any] | None = None


class Message(msgspec.Struct, omit_defaults=True):
    """A chat message. ``content`` is a string, a list of content parts, or null."""

    role: Role
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class StreamOptions(msgspec.Struct, omit_defaults=True):
    include_usage: bool = False


NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
PosInt = Annotated[int, msgspec.Meta(ge=1)]


class ChatCompletionRequest(msgspec.Struct, omit_defaults=True):
    """``POST /v1/chat/completions`` body. ``tools`` and ``tool_choice`` pass through untouched."""

    model: Annotated[str, msgspec.Meta(min_length=1)]
    messages: Annotated[list[Message], msgspec.Meta(min_length=1)]
    stream: bool | None = False
    """Null is false, as OpenAI and vLLM take it (``boolean or null``); always a bool once
    decoded."""
    stream_options: StreamOptions | None = None
    max_tokens: PosInt | None = None
    max_completion_tokens: PosInt | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: Literal[1] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    presence_penalty: Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)] | None = None
    logprobs: bool | None = None
    response_format: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    ignore_eos: bool | None = None
    """vLLM's extra sampling parameter: generate up to the output limit, past the end the
    model would stop at (the sim honours it too)."""

    def __post_init__(self) -> None:
        self.stream = bool(self.stream)

    @property
    def output_limit(self) -> int | None:
        """The requested output token cap (``max_completion_tokens`` wins, as at OpenAI)."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    @property
    def wants_usage_chunk(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int = 0


class CompletionTokensDetails(msgspec.Struct):
    reasoning_tokens: int = 0


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None

    @property
    def cached_tokens(self) -> int:
        details = self.prompt_tokens_details
        return details.cached_tokens if details is not None else 0


class ResponseMessage(msgspec.Struct):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None
    refusal: str | None = None


class Choice(msgspec.Struct):
    index: int
    message: ResponseMessage
    finish_reason: str | None
    logprobs: dict[str, Any] | None = None


class ChatCompletion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[Choice]
    usage: Usage | None = None
    object: str = "chat.completion"
    system_fingerprint: str | None = None


class ToolCallDelta(msgspec.Struct, omit_defaults=True):
    index: int
    id: str | None = None
    type: str | None = None
    function: FunctionCall | None = None


class Delta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None
    refusal: str | None = None


class ChunkChoice(msgspec.Struct):
    index: int
    delta: Delta
    finish_reason: str | None = None
    logprobs: dict[str, Any] | None = None


class ChatCompletionChunk(msgspec.Struct):
    """One streamed ``chat.completion.chunk``; the final usage chunk has no choices."""

    id: str
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
    object: str = "chat.completion.chunk"
    system_fingerprint: str | None = None


class Model(msgspec.Struct):
    id: str
    created: int = 0
    owned_by: str = "firstbyte"
    object: str = "model"


class ModelList(msgspec.Struct):
    data: list[Model]
    object: str = "list"


class ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(msgspec.Struct):
    """OpenAI's error envelope: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorDetail


class RequestValidationError(ValueError):
    """A request body that OpenAI would reject with 400; ``param`` names the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def body(self) -> ErrorBody:
        return error_body(self.message, "invalid_request_error", param=self.param)


_PATH = re.compile(r" - at `\$(?P<path>[^`]*)`$")
_MISSING = re.compile(
    r"Object missing required field `(?P<field>[^`]+)`(?: - at `\$(?P<path>[^`]*)`)?$"
)
"""msgspec's text for a missing field (the path: of the object lacking it, none at the top)."""
_LONE_HIGH_SURROGATE = re.compile(
    rb"(?<!\\)(?:\\\\)*(\\u[dD][89abAB][0-9a-fA-F]{2})(?!\\u[dD][c-fC-F])(?=[\s\S])"
)
"""A ``\\uD800``-``\\uDBFF`` escape (not itself escaped) with no low surrogate after it: half
of a character, as a JavaScript string cut inside an emoji serializes. msgspec calls it "Input
data was truncated", which sends the client looking for a cut body."""


def _param_from_path(path: str) -> str | None:
    """Turn msgspec's ``$.messages[0].content`` path into OpenAI's ``messages[0].content``."""
    path = path.lstrip(".")
    return path or None


_request_decoder = msgspec.json.Decoder(ChatCompletionRequest)
_chunk_decoder = msgspec.json.Decoder(ChatCompletionChunk)
_encoder = msgspec.json.Encoder()


_EXPLAINED = {
    "n": "only 1 is served: the router streams, stores and resumes one choice per request;"
         " send n requests for n answers",
}
"""What a refused value of these fields means here (msgspec's own text, "Invalid enum value
2", does not say why)."""


def decode_request(body: bytes) -> ChatCompletionRequest:
    """Decode and validate a chat completion request body.

    Raises :class:`RequestValidationError` naming the field for any invalid value, and for
    bodies that are not JSON objects at all.
    """
    return decode_with(_request_decoder, body)


def decode_with(decoder: msgspec.json.Decoder[_T], body: bytes) -> _T:
    """Decode a request body with ``decoder``, any failure as a
    :class:`RequestValidationError` naming the field (OpenAI's 400)."""
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        text = str(exc)
        missing = _MISSING.match(text)
        if missing is not None:  # OpenAI's wording, and the field named in ``param``
            within = _param_from_path(missing["path"] or "")
            param = missing["field"] if within is None else f"{within}.{missing['field']}"
            raise RequestValidationError(f"Missing required parameter: '{param}'.", param) from None
        match = _PATH.search(text)
        if match is None:
            raise RequestValidationError(text) from None
        param = _param_from_path(match.group("path"))
        message = _EXPLAINED.get(param or "", text[: match.start()])
        if param is not None:
            message = f"Invalid value for '{param}': {message}"
        raise RequestValidationError(message, param) from None
    except msgspec.DecodeError as exc:
        reason = _reason(exc, body)
        raise RequestValidationError(f"The request body is not valid JSON: {reason}") from None
    except RecursionError:
        # Arrays or objects nested deeper than the decoder's recursion bound (~1000 levels).
        raise RequestValidationError("The request body is nested too deeply.") from None


def _reason(exc: msgspec.DecodeError, body: bytes) -> str:
    """msgspec's reason a body is not JSON, unless it blames truncation on a lone surrogate."""
    lone = _LONE_HIGH_SURROGATE.search(body) if str(exc) == "Input data was truncated" else None
    if lone is None:
        return str(exc)
    escape = lone.group(1).decode()
    return (f"{escape} at byte {lone.start(1)} is half of a UTF-16 surrogate pair"
            " (a string cut inside a character?)")


def decode_chunk(data: bytes | str) -> ChatCompletionChunk:
    """Decode one streamed chunk (the ``data:`` payload of an SSE event)."""
    return _chunk_decoder.decode(data)


def encode(obj: Any) -> bytes:
    """Encode a wire object (or plain data) to compact JSON bytes."""
    return _encoder.encode(obj)


def error_body(
    message: str,
    type: str = "invalid_request_error",
    *,
    param: str | None = None,
    code: str | None = None,
) -> ErrorBody:
    """Build OpenAI's error envelope."""
    return ErrorBody(ErrorDetail(message=message, type=type, param=param, code=code))


def message_text(message: Message) -> str:
    """The textual content of a message: the string, or its text parts joined."""
    content = message.content
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.text or "" for part in content if part.type == "text")
