"""What the sim sends, per endpoint, as bytes: sans-IO encoders of each wire format.

A :class:`StreamFormat` is made per request once the engine has the sequence; the streaming
loop in :mod:`firstbyte.router.sim.app` asks it for the bytes sent at once
(:meth:`~StreamFormat.preamble`), before the first token (:meth:`~StreamFormat.opening`), for
each token (:meth:`~StreamFormat.token`) and after the last (:meth:`~StreamFormat.closing`),
or for the whole non-streamed body (:meth:`~StreamFormat.whole`). Each follows its API's
reference and vLLM's implementation:

- chat: OpenAI's ``chat.completion.chunk`` SSE, a role chunk, one chunk per token, a
  ``finish_reason`` chunk, the usage chunk when asked, ``data: [DONE]``;
- completions: ``text_completion`` chunks with ``choices[0].text``, ``finish_reason`` on the
  last token's chunk (as vLLM), the usage chunk when asked, ``data: [DONE]``;
- responses: typed events, each an SSE event with an ``event:`` line and a ``sequence_number``
  counted from 0: ``response.created`` and ``response.in_progress`` at once (before the first
  token, as vLLM sends them), then with the first token ``response.output_item.added`` and
  ``response.content_part.added``, one ``response.output_text.delta`` per token,
  ``response.output_text.done``, ``response.content_part.done``,
  ``response.output_item.done``, ``response.completed`` (the response with its usage;
  ``status: "incomplete"`` when cut at ``max_output_tokens``); no ``[DONE]``;
- messages (Anthropic): ``message_start``, ``content_block_start``, ``ping``, one
  ``content_block_delta`` (``text_delta``) per token, ``content_block_stop``,
  ``message_delta`` (``stop_reason``, usage), ``message_stop``, each with an ``event:`` line.
"""

from __future__ import annotations

import base64
import secrets
import struct
import time
from collections.abc import Callable
from typing import Any, Protocol

import msgspec

from firstbyte.protocol.openai import (
    ChatCompletion,
    Choice,
    PromptTokensDetails,
    ResponseMessage,
    Usage,
    encode,
)
from firstbyte.protocol.sse import DONE, encode_event
from firstbyte.router.sim.apis import Job
from firstbyte.router.sim.engine import Sequence
from firstbyte.router.sim.output import Completion, embedding

__all__ = [
    "ChatFormat",
    "CompletionsFormat",
    "MessagesFormat",
    "ResponsesFormat",
    "StreamFormat",
    "anthropic_error",
    "embeddings_body",
    "usage",
]

DONE_EVENT = encode_event(DONE)
_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens"}
"""vLLM's Anthropic endpoint's ``stop_reason`` for each ``finish_reason``."""


class StreamFormat(Protocol):
    def preamble(self) -> bytes:
        """What goes out with the response head, before any token is ready."""

    def opening(self) -> bytes:
        """What goes before the first token (sent with it)."""

    def token(self, index: int) -> bytes:
        """The event(s) carrying token ``index``."""

    def closing(self) -> bytes:
        """What goes after the last token: finish, usage, end of stream."""

    def whole(self) -> bytes:
        """The non-streamed response body."""


def usage(seq: Sequence) -> Usage:
    return Usage(
        prompt_tokens=seq.prompt_len,
        completion_tokens=seq.generated,
        total_tokens=seq.prompt_len + seq.generated,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=seq.cached_tokens),
    )


def _text(completion: Completion, seq: Sequence) -> str:
    return completion.text(seq.generated)


def _sse(event: str, data: dict[str, Any]) -> bytes:
    return b"event: " + event.encode() + b"\ndata: " + msgspec.json.encode(data) + b"\n\n"


class ChatFormat:
    """``/v1/chat/completions``: pre-encoded byte templates with each token's JSON spliced in
    (the hot path of the sim's CPU benchmark)."""

    def __init__(
        self, model: str, completion: Completion, seq: Sequence, include_usage: bool
    ) -> None:
        self.model = model
        self.completion = completion
        self.seq = seq
        self.include_usage = include_usage
        self.id = "chatcmpl-" + secrets.token_hex(12)
        self.created = int(time.time())
        self._head = (
            b'data: {"id":"' + self.id.encode() + b'","object":"chat.completion.chunk",'
            b'"created":'
            + str(self.created).encode()
            + b',"model":'
            + encode(model)
            + b',"system_fingerprint":null,"choices":[{"index":0,"delta":'
        )
        self._usage_null = b',"usage":null' if include_usage else b""
        self._tail = b'},"logprobs":null,"finish_reason":null}]' + self._usage_null + b"}\n\n"
        self._content_head = self._head + b'{"content":'
        self._token_text: Callable[[int], str] = completion.token_text

    def preamble(self) -> bytes:
        return b""

    def opening(self) -> bytes:
        return self._head + b'{"role":"assistant","content":""' + self._tail

    def token(self, index: int) -> bytes:
        return self._content_head + encode(self._token_text(index)) + self._tail

    def closing(self) -> bytes:
        reason = self.seq.finish_reason.encode()
        final = [
            self._head
            + b'{},"logprobs":null,"finish_reason":"'
            + reason
            + b'"}]'
            + self._usage_null
            + b"}\n\n"
        ]
        if self.include_usage:
            # vLLM's member order (pydantic's, unset members left out): usage comes last,
            # which the router's usage reader relies on (it decodes only an event ending
            # in ``}}``).
            chunk = {
                "id": self.id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.model, "choices": [], "usage": usage(self.seq),
            }
            final.append(encode_event(encode(chunk)))
        final.append(DONE_EVENT)
        return b"".join(final)

    def whole(self) -> bytes:
        seq = self.seq
        return encode(
            ChatCompletion(
                id=self.id,
                created=self.created,
                model=self.model,
                choices=[
                    Choice(
                        index=0,
                        message=ResponseMessage(content=_text(self.completion, seq)),
                        finish_reason=seq.finish_reason,
                    )
                ],
                usage=usage(seq),
            )
        )


class CompletionsFormat:
    """``/v1/completions``: ``text_completion`` chunks, as vLLM streams them."""

    def __init__(self, model: str, completion: Completion, seq: Sequence, job: Job) -> None:
        self.model = model
        self.completion = completion
        self.seq = seq
        self.include_usage = job.include_usage
        self.id = "cmpl-" + secrets.token_hex(12)
        self.created = int(time.time())
        self._head = (
            b'data: {"id":"' + self.id.encode() + b'","object":"text_completion","created":'
            + str(self.created).encode()
            + b',"model":'
            + encode(model)
            + b',"choices":[{"index":0,"text":'
        )
        usage_null = b',"usage":null' if job.include_usage else b""
        self._tail = b',"logprobs":null,"finish_reason":null,"stop_reason":null}]' + usage_null
        self._tail += b"}\n\n"
        self._last_tail = (
            b',"logprobs":null,"finish_reason":"'
            + seq.finish_reason.encode()
            + b'","stop_reason":'
            + encode(completion.stop_sequence)  # vLLM's: the stop string it ended at
            + b"}]"
            + usage_null
            + b"}\n\n"
        )
        self._last = seq.max_output - 1

    def preamble(self) -> bytes:
        return b""

    def opening(self) -> bytes:
        return b""

    def token(self, index: int) -> bytes:
        tail = self._last_tail if index == self._last else self._tail
        return self._head + encode(self.completion.token_text(index)) + tail

    def closing(self) -> bytes:
        parts = []
        if self.include_usage:
            chunk = {
                "id": self.id,
                "object": "text_completion",
                "created": self.created,
                "model": self.model,
                "choices": [],
                "usage": usage(self.seq),
            }
            parts.append(encode_event(encode(chunk)))
        parts.append(DONE_EVENT)
        return b"".join(parts)

    def whole(self) -> bytes:
        seq = self.seq
        return encode(
            {
                "id": self.id,
                "object": "text_completion",
                "created": self.created,
                "model": self.model,
                "choices": [
                    {
                        "index": 0,
                        "text": _text(self.completion, seq),
                        "logprobs": None,
                        "finish_reason": seq.finish_reason,
                        "stop_reason": self.completion.stop_sequence,
                        "prompt_logprobs": None,
                    }
                ],
                "usage": usage(seq),
                "system_fingerprint": None,
            }
        )


class ResponsesFormat:
    """``/v1/responses``: OpenAI's typed events, numbered by ``sequence_number``."""

    def __init__(self, model: str, completion: Completion, seq: Sequence, job: Job) -> None:
        self.model = model
        self.completion = completion
        self.seq = seq
        self.job = job
        self.id = "resp_" + secrets.token_hex(16)
        self.item_id = "msg_" + secrets.token_hex(16)
        self.created_at = int(time.time())
        self._number = 0
        self._delta_head = (
            b',"item_id":"' + self.item_id.encode() + b'","output_index":0,"content_index":0,'
            b'"delta":'
        )

    def _event(self, data: dict[str, Any]) -> bytes:
        event = {"type": data["type"], "sequence_number": self._number, **data}
        self._number += 1
        return _sse(data["type"], event)

    def _message(self, status: str, text: str | None) -> dict[str, Any]:
        content = [] if text is None else [_output_text(text)]
        return {
            "id": self.item_id,
            "type": "message",
            "status": status,
            "role": "assistant",
            "content": content,
        }

    def _response(self, status: str, text: str | None) -> dict[str, Any]:
        seq = self.seq
        done = status != "in_progress"
        cut = done and seq.finish_reason == "length"
        if done:
            status = "incomplete" if cut else "completed"
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": False,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "instructions": self.job.instructions,
            "max_output_tokens": self.job.output_limit,
            "max_tool_calls": None,
            "model": self.model,
            "output": [self._message("completed", text)] if done else [],
            "parallel_tool_calls": True,
            "previous_response_id": None,
            "reasoning": None,
            "service_tier": "auto",
            "store": False,
            "temperature": 1.0,
            "text": {"format": {"type": "text"}},
            "tool_choice": "auto",
            "tools": [],
            "top_logprobs": 0,
            "top_p": 1.0,
            "truncation": "disabled",
            "usage": self._usage() if done else None,
            "user": None,
            "metadata": None,
        }

    def _usage(self) -> dict[str, Any]:
        seq = self.seq
        return {
            "input_tokens": seq.prompt_len,
            "input_tokens_details": {"cached_tokens": seq.cached_tokens},
            "output_tokens": seq.generated,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": seq.prompt_len + seq.generated,
        }

    def preamble(self) -> bytes:
        snapshot = self._response("in_progress", None)
        return self._event({"type": "response.created", "response": snapshot}) + self._event(
            {"type": "response.in_progress", "response": snapshot}
        )

    def opening(self) -> bytes:
        return b"".join(
            [
                self._event(
                    {
                        "type": "response.output_item.added",
                        "output_index": 0,
                        "item": self._message("in_progress", None),
                    }
                ),
                self._event(
                    {
                        "type": "response.content_part.added",
                        "item_id": self.item_id,
                        "output_index": 0,
                        "content_index": 0,
                        "part": _output_text(""),
                    }
                ),
            ]
        )

    def token(self, index: int) -> bytes:
        number = self._number
        self._number += 1
        return (
            b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta",'
            b'"sequence_number":'
            + str(number).encode()
            + self._delta_head
            + encode(self.completion.token_text(index))
            + b',"logprobs":[]}\n\n'
        )

    def closing(self) -> bytes:
        text = _text(self.completion, self.seq)
        where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        return b"".join(
            [
                self._event(
                    {"type": "response.output_text.done", **where, "text": text, "logprobs": []}
                ),
                self._event(
                    {"type": "response.content_part.done", **where, "part": _output_text(text)}
                ),
                self._event(
                    {
                        "type": "response.output_item.done",
                        "output_index": 0,
                        "item": self._message("completed", text),
                    }
                ),
                self._event(
                    {"type": "response.completed", "response": self._response("done", text)}
                ),
            ]
        )

    def whole(self) -> bytes:
        return msgspec.json.encode(self._response("done", _text(self.completion, self.seq)))


def _output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class MessagesFormat:
    """``/v1/messages``: Anthropic's streamed events. ``input_tokens`` counts the uncached
    prompt and ``cache_read_input_tokens`` the prefix-cache hit, as Anthropic's usage does."""

    def __init__(self, model: str, completion: Completion, seq: Sequence) -> None:
        self.model = model
        self.completion = completion
        self.seq = seq
        self.id = "msg_" + secrets.token_hex(12)

    def _usage(self, output_tokens: int) -> dict[str, int]:
        seq = self.seq
        return {
            "input_tokens": seq.prompt_len - seq.cached_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": seq.cached_tokens,
            "output_tokens": output_tokens,
        }

    def _message(self, content: list[dict[str, Any]], stop_reason: str | None) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "content": content,
            "model": self.model,
            "stop_reason": stop_reason,
            "stop_sequence": self.completion.stop_sequence if stop_reason else None,
            "usage": self._usage(self.seq.generated if stop_reason else 0),
        }

    def preamble(self) -> bytes:
        return b""

    def opening(self) -> bytes:
        start = {"type": "message_start", "message": self._message([], None)}
        block = {"type": "content_block_start", "index": 0, "content_block": _text_block("")}
        return (
            _sse("message_start", start)
            + _sse("content_block_start", block)
            + _sse("ping", {"type": "ping"})
        )

    def token(self, index: int) -> bytes:
        return (
            b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
            b'"delta":{"type":"text_delta","text":'
            + encode(self.completion.token_text(index))
            + b"}}\n\n"
        )

    def closing(self) -> bytes:
        delta = {
            "type": "message_delta",
            "delta": {
                "stop_reason": self._stop_reason(),
                "stop_sequence": self.completion.stop_sequence,
            },
            "usage": self._usage(self.seq.generated),
        }
        return (
            _sse("content_block_stop", {"type": "content_block_stop", "index": 0})
            + _sse("message_delta", delta)
            + _sse("message_stop", {"type": "message_stop"})
        )

    def whole(self) -> bytes:
        content = [_text_block(_text(self.completion, self.seq))]
        return msgspec.json.encode(self._message(content, self._stop_reason()))

    def _stop_reason(self) -> str:
        """Anthropic's name for why the output ended (a stop string: ``stop_sequence``)."""
        if self.completion.stop_sequence is not None:
            return "stop_sequence"
        return _STOP_REASONS[self.seq.finish_reason]


def _text_block(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


def embeddings_body(job: Job, model: str, seq: Sequence) -> bytes:
    """``/v1/embeddings``' answer: one deterministic unit vector per input, as floats or as
    base64 of little-endian float32 (what the openai SDK asks for by default)."""
    data = []
    for index, key in enumerate(job.input_keys):
        vector = embedding(key, model, job.dimensions)
        value: list[float] | str = vector
        if job.encoding_format == "base64":
            value = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
        data.append({"object": "embedding", "embedding": value, "index": index})
    return msgspec.json.encode(
        {
            "id": "embd-" + secrets.token_hex(12),
            "object": "list",
            "created": int(time.time()),
            "model": model,
            "data": data,
            "usage": {
                "prompt_tokens": seq.prompt_len,
                "total_tokens": seq.prompt_len,
                "completion_tokens": 0,
                "prompt_tokens_details": None,
            },
        }
    )


def anthropic_error(message: str, type_: str) -> bytes:
    """Anthropic's error envelope, as vLLM's Anthropic endpoint translates its errors."""
    return msgspec.json.encode({"type": "error", "error": {"type": type_, "message": message}})
