"""OpenAI's legacy completions (``POST /v1/completions``) as the router reads them.

Streamed like chat: ``data:`` events with ``choices[].text``, ``[DONE]`` last, usage in the
last chunk when ``stream_options.include_usage`` (see :mod:`.codec`).
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from .codec import Codec
from .openai import ChatCompletionRequest, Message, StreamOptions, decode_with

__all__ = ["COMPLETIONS", "CompletionRequest", "CompletionsCodec"]

PosInt = Annotated[int, msgspec.Meta(ge=1)]


class CompletionRequest(msgspec.Struct):
    """What the router reads of a completions body; the rest passes through untouched."""

    model: Annotated[str, msgspec.Meta(min_length=1)]
    prompt: str | list[Any]
    """Text, a list of texts, or token ids (no text to route by)."""
    stream: bool | None = False
    """Null is false, as at OpenAI."""
    stream_options: StreamOptions | None = None
    max_tokens: PosInt | None = None
    user: str | None = None


def prompt_text(prompt: str | list[Any]) -> str:
    """The prompt's text (a list's texts joined; token ids have none)."""
    if isinstance(prompt, str):
        return prompt
    return "".join(item for item in prompt if isinstance(item, str))


_decoder = msgspec.json.Decoder(CompletionRequest)


class CompletionsCodec(Codec):
    name = "completions"
    path = "/v1/completions"

    def decode_request(self, body: bytes) -> ChatCompletionRequest:
        request = decode_with(_decoder, body)
        return ChatCompletionRequest(
            model=request.model,
            messages=[Message(role="user", content=prompt_text(request.prompt))],
            stream=bool(request.stream),
            stream_options=request.stream_options,
            max_tokens=request.max_tokens,
            user=request.user,
        )

    def is_content(self, payload: bytes) -> bool:
        if b'"text"' not in payload:
            return False
        try:
            chunk: Any = msgspec.json.decode(payload)
            return any(choice.get("text") for choice in chunk.get("choices") or ())
        except (msgspec.DecodeError, AttributeError, TypeError):
            return False


COMPLETIONS = CompletionsCodec()
