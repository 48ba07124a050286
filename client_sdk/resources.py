"""The typed calls beside chat, named as in the openai and anthropic SDKs.

``client.completions``, ``client.responses`` and ``client.messages`` each have ``stream(...)``
(an :class:`~firstbyte.client_sdk.client.EventStream` of the format's typed events, with the
same transports, timings, resume and failover as ``client.stream(...)`` for chat) and
``create(...)`` (one non-streamed answer, typed); ``client.embeddings.create(...)`` is
never streamed. Request bodies are built here and sent as they are; events and answers are
decoded with :mod:`firstbyte.protocol.events`' types.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec

from firstbyte.client_sdk.errors import StreamBrokenError
from firstbyte.protocol.events import (
    COMPLETION_EVENTS,
    MESSAGE_EVENTS,
    RESPONSE_EVENTS,
    CompletionChunk,
    EmbeddingList,
    MessageEvent,
    MessageObject,
    ResponseEvent,
    ResponseObject,
)
from firstbyte.protocol.formats import EMBEDDINGS

if TYPE_CHECKING:
    from firstbyte.client_sdk.client import AsyncClient, EventStream

__all__ = ["Completions", "Embeddings", "Messages", "Responses", "message_list"]

W = TypeVar("W")


def message_list(messages: Any) -> list[Any]:
    """``messages`` as the list a request body carries; a ``TypeError`` that says what is
    wanted for something that is no sequence of messages (``None``; a string, which ``list``
    would cut into characters for the router to refuse one by one)."""
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Iterable):
        raise TypeError(
            f"messages must be a list of messages ({{'role': ..., 'content': ...}}), not"
            f" {type(messages).__name__}")
    return list(messages)


def _body(fields: dict[str, Any], options: dict[str, Any]) -> dict[str, Any]:
    """The request body: the named fields that are set, then the caller's other fields."""
    body = {key: value for key, value in fields.items() if value is not None}
    body.update(options)
    return body


def _decode(raw: bytes, kind: type[W], what: str) -> W:
    try:
        return msgspec.json.decode(raw, type=kind)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise StreamBrokenError(f"invalid {what} answer: {exc}") from None


class Completions:
    """``POST /v1/completions`` (OpenAI's legacy completions)."""

    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    def stream(
        self,
        *,
        model: str,
        prompt: str | Sequence[str],
        max_tokens: int | None = None,
        on_first_token: Callable[[CompletionChunk], object] | None = None,
        **options: Any,
    ) -> EventStream[CompletionChunk]:
        """A streamed completion (usage asked for: ``stream.usage`` after the end)."""
        body = _body({"model": model, "prompt": prompt, "max_tokens": max_tokens,
                      "stream": True, "stream_options": {"include_usage": True}}, options)
        return self._client._event_stream(COMPLETION_EVENTS, body, on_first_token)

    async def create(
        self, *, model: str, prompt: str | Sequence[str], max_tokens: int | None = None,
        **options: Any,
    ) -> CompletionChunk:
        """A whole completion (its ``text``, ``choices`` and ``usage``)."""
        body = _body({"model": model, "prompt": prompt, "max_tokens": max_tokens}, options)
        raw = await self._client._post_json(COMPLETION_EVENTS.path, body)
        return _decode(raw, CompletionChunk, "completions")


class Responses:
    """``POST /v1/responses`` (OpenAI's Responses API)."""

    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    def stream(
        self,
        *,
        model: str,
        input: str | Sequence[Any],
        instructions: str | None = None,
        max_output_tokens: int | None = None,
        on_first_token: Callable[[ResponseEvent], object] | None = None,
        **options: Any,
    ) -> EventStream[ResponseEvent]:
        """A streamed response: its typed events, ``response.completed`` (or another
        terminal event) last."""
        body = _body({"model": model, "input": input, "instructions": instructions,
                      "max_output_tokens": max_output_tokens, "stream": True}, options)
        return self._client._event_stream(RESPONSE_EVENTS, body, on_first_token)

    async def create(
        self, *, model: str, input: str | Sequence[Any], instructions: str | None = None,
        max_output_tokens: int | None = None, **options: Any,
    ) -> ResponseObject:
        """A whole response (its ``output_text``, ``status`` and ``usage``)."""
        body = _body({"model": model, "input": input, "instructions": instructions,
                      "max_output_tokens": max_output_tokens}, options)
        raw = await self._client._post_json(RESPONSE_EVENTS.path, body)
        return _decode(raw, ResponseObject, "responses")


class Messages:
    """``POST /v1/messages`` (Anthropic's Messages API)."""

    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    def stream(
        self,
        *,
        model: str,
        messages: Sequence[dict[str, Any]],
        max_tokens: int,
        system: str | Sequence[Any] | None = None,
        on_first_token: Callable[[MessageEvent], object] | None = None,
        **options: Any,
    ) -> EventStream[MessageEvent]:
        """A streamed message: its typed events, ``message_stop`` last."""
        body = _body({"model": model, "messages": message_list(messages), "max_tokens": max_tokens,
                      "system": system, "stream": True}, options)
        return self._client._event_stream(MESSAGE_EVENTS, body, on_first_token)

    async def create(
        self, *, model: str, messages: Sequence[dict[str, Any]], max_tokens: int,
        system: str | Sequence[Any] | None = None, **options: Any,
    ) -> MessageObject:
        """A whole message (its ``text``, ``stop_reason`` and ``usage``)."""
        body = _body({"model": model, "messages": message_list(messages), "max_tokens": max_tokens,
                      "system": system}, options)
        raw = await self._client._post_json(MESSAGE_EVENTS.path, body)
        return _decode(raw, MessageObject, "messages")


class Embeddings:
    """``POST /v1/embeddings`` (never streamed)."""

    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    async def create(
        self, *, model: str, input: str | Sequence[str], **options: Any
    ) -> EmbeddingList:
        """A vector per input, in input order."""
        body = _body({"model": model, "input": input}, options)
        raw = await self._client._post_json(EMBEDDINGS.path, body)
        return _decode(raw, EmbeddingList, "embeddings")
