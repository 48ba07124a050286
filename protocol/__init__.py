"""firstbyte's wire protocol, the one definition the SDK and the router both import.

It depends on msgspec and the standard library only. docs/protocol.md describes the protocol
in prose; these modules are its source:

- :mod:`~firstbyte.protocol.openai`: the OpenAI chat completion types (request, response,
  chunk, models, error body) with their encoder and validating decoders.
- :mod:`~firstbyte.protocol.sse`: the sans-IO server-sent events codec and ``[DONE]``.
- :mod:`~firstbyte.protocol.codec` and one module per API format
  (:mod:`~firstbyte.protocol.completions`, :mod:`~firstbyte.protocol.responses`,
  :mod:`~firstbyte.protocol.anthropic`; all by path in :mod:`~firstbyte.protocol.formats`):
  what a router reads of each format's requests and streamed events (docs/endpoints.md).
- :mod:`~firstbyte.protocol.events`: each streamed format's events as typed values, as a
  client (the SDK) reads them.
- :mod:`~firstbyte.protocol.poll`: long-poll batches and the ``POST /v1/streams`` answer.
- :mod:`~firstbyte.protocol.ws`: the WebSocket ``/v1/ws`` messages and close codes.
- :mod:`~firstbyte.protocol.edge`: the ``/v1/edge/status`` documents.
- :mod:`~firstbyte.protocol.timings`: the ``/v1/edge/timings`` report (client-felt latency).
- :mod:`~firstbyte.protocol.tokens`: the browser's client tokens (``/v1/edge/tokens``).
- :mod:`~firstbyte.protocol.headers`, :mod:`~firstbyte.protocol.paths`,
  :mod:`~firstbyte.protocol.error_codes`: header names, URL paths, the router's error codes.

A change to the wire format is an edit here plus its test in ``tests/protocol``.
"""

from __future__ import annotations

from . import edge, error_codes, headers, openai, paths, poll, sse, timings, tokens, ws
from .edge import BackendStatus, EdgeStatus, EdgeStatusReport, PeerLink, PublicEdgeStatus
from .openai import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ErrorBody,
    ErrorDetail,
    Message,
    RequestValidationError,
    Usage,
    decode_chunk,
    decode_request,
    encode,
    error_body,
)
from .poll import PollBatch, PollEvent, StreamStarted
from .sse import (
    DONE,
    HEARTBEAT,
    SSEDecoder,
    SSEEvent,
    SSEProtocolError,
    encode_comment,
    encode_event,
)

__all__ = [
    "DONE",
    "HEARTBEAT",
    "BackendStatus",
    "ChatCompletion",
    "ChatCompletionChunk",
    "ChatCompletionRequest",
    "EdgeStatus",
    "EdgeStatusReport",
    "ErrorBody",
    "ErrorDetail",
    "Message",
    "PeerLink",
    "PollBatch",
    "PollEvent",
    "PublicEdgeStatus",
    "RequestValidationError",
    "SSEDecoder",
    "SSEEvent",
    "SSEProtocolError",
    "StreamStarted",
    "Usage",
    "decode_chunk",
    "decode_request",
    "edge",
    "encode",
    "encode_comment",
    "encode_event",
    "error_body",
    "error_codes",
    "headers",
    "openai",
    "paths",
    "poll",
    "sse",
    "timings",
    "tokens",
    "ws",
]
