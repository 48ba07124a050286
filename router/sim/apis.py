"""The request bodies of the endpoints vLLM serves besides chat, decoded into one :class:`Job`.

Each endpoint's body is a msgspec Struct holding only the fields the sim reads; unknown fields
are accepted, as vLLM and OpenAI accept them. :func:`decode_job` turns a body into what the
engine and the output need: the prompt's token ids, the output limit, whether to stream, and
the bytes the deterministic output is seeded from. An invalid body raises
:class:`~firstbyte.protocol.openai.RequestValidationError` naming the field (``param``).

- ``/v1/completions`` (OpenAI legacy completions): ``prompt`` is a string, a list of one
  string, or a list of token ids; tokenized without a chat template. ``max_tokens`` defaults
  to 16, as OpenAI's and vLLM's.
- ``/v1/responses``: ``input`` is a string or a list of message items (``{"role", "content"}``
  with a string or ``input_text`` / ``output_text`` parts), ``function_call`` and
  ``function_call_output`` items (the assistant's and the tool's turns) and ``reasoning``
  items (skipped); ``instructions`` is a leading system message. Chat-templated like chat.
- ``/v1/embeddings``: ``input`` is a string, a list of strings, or token ids (one list or a
  list of lists); ``encoding_format`` ``float`` (default) or ``base64``; ``dimensions``.
- ``/v1/messages`` (Anthropic): ``max_tokens`` is required; ``system`` (a string or text
  blocks) and ``messages`` with string or text-block content, chat-templated as vLLM's
  Anthropic endpoint does (it converts to a chat request).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Annotated, Any, Literal

import msgspec

from firstbyte.protocol.openai import (
    Message,
    RequestValidationError,
    StreamOptions,
    decode_with,
)
from firstbyte.router.sim.tokens import prompt_tokens, tokenize

__all__ = ["EMBEDDING_DIMENSIONS", "Api", "Job", "decode_job", "stop_strings"]

EMBEDDING_DIMENSIONS = 384
"""Length of an embedding vector unless the request asks for fewer ``dimensions``."""

PosInt = Annotated[int, msgspec.Meta(ge=1)]
TokenId = Annotated[int, msgspec.Meta(ge=0, lt=1 << 32)]
"""A token id as the prefix cache holds it (an unsigned 32-bit array): past it, a 400."""
NonEmptyStr = Annotated[str, msgspec.Meta(min_length=1)]


class Api(Enum):
    """The endpoints, by the wire format they answer in."""

    CHAT = "chat"
    COMPLETIONS = "completions"
    RESPONSES = "responses"
    EMBEDDINGS = "embeddings"
    MESSAGES = "messages"


@dataclass(frozen=True, slots=True)
class Job:
    """One request as the engine and the output see it, whatever the endpoint."""

    api: Api
    model: str
    prompt: Sequence[int]
    """Token ids of the (templated) prompt: its prefill cost and prefix-cache keys."""
    output_limit: int | None
    """The request's output cap (None: the default); unused for embeddings."""
    stream: bool
    include_usage: bool
    seed: int | None
    text_key: bytes
    """What the deterministic output (text or vector) is drawn from."""
    instructions: str | None = None
    """``/v1/responses``: echoed in the response object."""
    encoding_format: str = "float"
    dimensions: int = EMBEDDING_DIMENSIONS
    input_keys: tuple[bytes, ...] = ()
    """``/v1/embeddings``: one key per input, each vector drawn from its own."""
    ignore_eos: bool = False
    """Chat's ``ignore_eos`` (vLLM's): the output runs to its limit."""
    stop: tuple[str, ...] = ()
    """Stop strings (chat's and completions' ``stop``, Messages' ``stop_sequences``)."""


class _Completions(msgspec.Struct):
    model: NonEmptyStr
    prompt: str | list[str | TokenId]
    """A string, one string in a list, or token ids (msgspec takes one array type per union:
    the list's items are checked below)."""
    max_tokens: PosInt | None = 16
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    seed: int | None = None
    n: Literal[1] | None = None
    echo: bool | None = None
    """Only false (checked below: msgspec before 0.19 has no ``Literal[False]``)."""
    stop: str | list[str] | None = None


class _TextPart(msgspec.Struct):
    type: str
    text: str | None = None


class _InputItem(msgspec.Struct):
    """A message item (``type`` "message" or none: ``role`` and ``content``), a function call
    the model made (``arguments``), its output (``output``), or a reasoning item (skipped)."""

    type: Literal["message", "function_call", "function_call_output", "reasoning"] | None = None
    role: Literal["system", "developer", "user", "assistant"] | None = None
    content: str | list[_TextPart] | None = None
    arguments: str | None = None
    output: str | list[_TextPart] | None = None


class _Responses(msgspec.Struct):
    model: NonEmptyStr
    input: str | list[_InputItem]
    instructions: str | None = None
    max_output_tokens: PosInt | None = None
    stream: bool | None = False
    seed: int | None = None


class _Embeddings(msgspec.Struct):
    model: NonEmptyStr
    input: str | list[str | TokenId | list[TokenId]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, msgspec.Meta(ge=1, le=EMBEDDING_DIMENSIONS)] | None = None


class _AnthropicMessage(msgspec.Struct):
    role: Literal["user", "assistant", "system"]
    content: str | list[_TextPart]


class _Messages(msgspec.Struct):
    model: NonEmptyStr
    max_tokens: PosInt
    messages: Annotated[list[_AnthropicMessage], msgspec.Meta(min_length=1)]
    system: str | list[_TextPart] | None = None
    stream: bool | None = False
    stop_sequences: list[str] | None = None


_DECODERS: dict[Api, msgspec.json.Decoder[Any]] = {
    Api.COMPLETIONS: msgspec.json.Decoder(_Completions),
    Api.RESPONSES: msgspec.json.Decoder(_Responses),
    Api.EMBEDDINGS: msgspec.json.Decoder(_Embeddings),
    Api.MESSAGES: msgspec.json.Decoder(_Messages),
}


def decode_job(api: Api, body: bytes) -> Job:
    """The job a body for ``api`` (not chat) asks for; :class:`RequestValidationError` if it
    is invalid."""
    request = decode_with(_DECODERS[api], body)
    if isinstance(request, _Completions):
        return _completions(request)
    if isinstance(request, _Responses):
        return _responses(request)
    if isinstance(request, _Embeddings):
        return _embeddings(request)
    assert isinstance(request, _Messages)
    return _messages(request)


def _completions(request: _Completions) -> Job:
    if request.echo:
        raise RequestValidationError("The sim does not echo the prompt.", "echo")
    prompt: str | list[str | TokenId] = request.prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        if len(prompt) != 1:
            raise RequestValidationError(
                "The sim answers one prompt per request; send a string.", "prompt"
            )
        prompt = str(prompt[0])
    if isinstance(prompt, str):
        ids = tokenize(prompt)
        key = prompt.encode()
    elif all(isinstance(i, int) for i in prompt):
        ids = [int(i) for i in prompt]
        key = msgspec.json.encode(ids)
    else:
        raise RequestValidationError(
            "Invalid value for 'prompt': a string, a list of strings or a list of token ids",
            "prompt",
        )
    if not ids:
        raise RequestValidationError("The prompt is empty.", "prompt")
    options = request.stream_options
    return Job(
        api=Api.COMPLETIONS,
        model=request.model,
        prompt=ids,
        output_limit=request.max_tokens,
        stream=bool(request.stream),
        include_usage=bool(request.stream) and options is not None and options.include_usage,
        seed=request.seed,
        text_key=key,
        stop=stop_strings(request.stop),
    )


def stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    """A request's stop strings, however it gave them (one, a list, none)."""
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


def _text(content: str | list[_TextPart]) -> str:
    if isinstance(content, str):
        return content
    return "".join(part.text or "" for part in content if part.type in _TEXT_TYPES)


_TEXT_TYPES = ("text", "input_text", "output_text")


def _responses(request: _Responses) -> Job:
    messages: list[Message] = []
    if request.instructions:
        messages.append(Message(role="system", content=request.instructions))
    if isinstance(request.input, str):
        messages.append(Message(role="user", content=request.input))
    else:
        for index, item in enumerate(request.input):
            message = _input_message(index, item)
            if message is not None:
                messages.append(message)
    if len(messages) == 0:
        raise RequestValidationError("The input is empty.", "input")
    return Job(
        api=Api.RESPONSES,
        model=request.model,
        prompt=prompt_tokens(messages),
        output_limit=request.max_output_tokens,
        stream=bool(request.stream),
        include_usage=True,
        seed=request.seed,
        text_key=msgspec.json.encode(messages),
        instructions=request.instructions,
    )


def _input_message(index: int, item: _InputItem) -> Message | None:
    """A Responses input item as the chat message vLLM templates it: a tool call is the
    assistant's turn, its output the tool's, as a conversation with tools carries them."""
    if item.type == "function_call":
        return Message(role="assistant", content=item.arguments or "")
    if item.type == "function_call_output":
        return Message(role="tool", content=_text(item.output or ""))
    if item.type == "reasoning":
        return None
    if item.role is None or item.content is None:
        field = "role" if item.role is None else "content"
        raise RequestValidationError(
            f"Invalid value for 'input[{index}]': a message needs '{field}'",
            f"input[{index}].{field}",
        )
    return Message(role=item.role, content=_text(item.content))


def _embeddings(request: _Embeddings) -> Job:
    data = request.input
    texts: list[str | list[int]]
    if isinstance(data, str):
        texts = [data]
    elif all(isinstance(i, int) for i in data):
        texts = [[int(i) for i in data]]  # type: ignore[arg-type]  # one prompt as token ids
    elif all(isinstance(i, str) for i in data) or all(isinstance(i, list) for i in data):
        texts = list(data)  # type: ignore[arg-type]
    else:
        raise RequestValidationError(
            "Invalid value for 'input': a string, a list of strings, or token ids", "input"
        )
    if not texts or any(len(t) == 0 for t in texts):
        raise RequestValidationError("The input is empty.", "input")
    ids: list[int] = []
    for text in texts:
        ids += tokenize(text) if isinstance(text, str) else text
    return Job(
        api=Api.EMBEDDINGS,
        model=request.model,
        prompt=ids,
        output_limit=None,
        stream=False,
        include_usage=False,
        seed=None,
        text_key=msgspec.json.encode(texts),
        encoding_format=request.encoding_format,
        dimensions=request.dimensions or EMBEDDING_DIMENSIONS,
        input_keys=tuple(msgspec.json.encode(t) for t in texts),
    )


def _messages(request: _Messages) -> Job:
    messages: list[Message] = []
    system = "" if request.system is None else _text(request.system)
    system += "".join(_text(m.content) for m in request.messages if m.role == "system")
    if system:
        messages.append(Message(role="system", content=system))
    messages += [
        Message(role=m.role, content=_text(m.content))
        for m in request.messages
        if m.role != "system"
    ]
    return Job(
        api=Api.MESSAGES,
        model=request.model,
        prompt=prompt_tokens(messages),
        output_limit=request.max_tokens,
        stream=bool(request.stream),
        include_usage=True,
        seed=None,
        text_key=msgspec.json.encode(messages),
        stop=stop_strings(request.stop_sequences),
    )
