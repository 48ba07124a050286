"""Every format the router serves, by path: the codecs of :mod:`.codec`'s shape."""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from .anthropic import MESSAGES
from .codec import CHAT, Codec
from .completions import COMPLETIONS
from .openai import ChatCompletionRequest, Message, decode_with
from .responses import RESPONSES

__all__ = [
    "BY_NAME", "BY_PATH", "CHAT", "COMPLETIONS", "EMBEDDINGS", "MAX_EMBEDDING_INPUTS", "MESSAGES",
    "RESPONSES", "STREAMED",
]


MAX_EMBEDDING_INPUTS = 2048
"""The most inputs one embeddings request may carry: OpenAI's own limit, so no client written
against it sends more. The answer holds a vector per input, so an unbounded count made one
request's answer grow with the client's choice (20,000 inputs in a 640 KB body took a
router from 83 to 287 MB)."""


class EmbeddingRequest(msgspec.Struct):
    """What the router reads of an embeddings body; the rest passes through untouched."""

    model: Annotated[str, msgspec.Meta(min_length=1)]
    input: str | Annotated[list[Any], msgspec.Meta(max_length=MAX_EMBEDDING_INPUTS)]
    user: str | None = None


_embedding = msgspec.json.Decoder(EmbeddingRequest)


class EmbeddingsCodec(Codec):
    """``POST /v1/embeddings``: never streamed; read for its model, input and user."""

    name = "embeddings"
    path = "/v1/embeddings"
    streams = False

    def decode_request(self, body: bytes) -> ChatCompletionRequest:
        request = decode_with(_embedding, body)
        text = request.input if isinstance(request.input, str) else "".join(
            item for item in request.input if isinstance(item, str)
        )
        return ChatCompletionRequest(
            model=request.model, messages=[Message(role="user", content=text)], user=request.user
        )

    def is_content(self, payload: bytes) -> bool:
        return False


EMBEDDINGS = EmbeddingsCodec()

BY_PATH: dict[str, Codec] = {
    codec.path: codec for codec in (CHAT, COMPLETIONS, RESPONSES, MESSAGES, EMBEDDINGS)
}
BY_NAME: dict[str, Codec] = {codec.name: codec for codec in BY_PATH.values()}
"""The codecs by name (``chat``, ``completions``, ``responses``, ``messages``, ...)."""

STREAMED: dict[str, Codec] = {name: codec for name, codec in BY_NAME.items() if codec.streams}
"""The formats a stream can be started in by name (``POST /v1/streams?endpoint=NAME``, a
WebSocket ``request``'s ``endpoint``): ``chat``, ``completions``, ``responses``, ``messages``."""
