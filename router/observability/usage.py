"""Usage per key: completions and their input and output tokens, as metrics (sans-IO).

Any wire format plugs in with a plain ``(input_tokens, output_tokens)`` pair from its final
event (chat completions: the usage chunk, :func:`chat_chunk_usage`); :meth:`UsageMeter.record`
counts it for the key that asked. The label set is the operator's: a key of ``[[auth.keys]]``
with a ``usage_label`` is counted under that label, every other key (and a router without
keys) under ``other``, so the number of series is bounded by the config, never by callers.
Keys are known by their owner digest (:func:`firstbyte.router.streams.owner_of`), the same
for a key and the client tokens minted with it.

Families: ``firstbyte_key_requests_total{key}`` (completions served by this region's
backends) and ``firstbyte_key_tokens_total{key,direction}`` (``direction`` = ``input`` or
``output``; tokens the upstream reported, or, for output without a report, content chunks).
A request forwarded to a peer region is counted there, where its backend served it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import msgspec

from firstbyte.protocol.codec import Codec

from ..hosting.prometheus import labels, render_counter

__all__ = [
    "OTHER",
    "TokenUsage",
    "UsageMeter",
    "UsageReader",
    "chat_chunk_usage",
    "usage_reader",
    "with_usage_option",
]

OTHER = "other"
"""The label of every key without a ``usage_label`` of its own."""


class TokenUsage(msgspec.Struct, frozen=True, gc=False):
    """What one completion cost, as its upstream said (None: not said).

    A msgspec Struct (its ``__init__`` is C): one is made a stream, from its usage chunk."""

    input_tokens: int | None = None
    output_tokens: int | None = None


UsageReader = Callable[[bytes], tuple[TokenUsage, bool] | None]
"""A wire format's reader of the usage its final event reports: an event's payload -> (the
usage, whether the event carries nothing else, so it may be dropped), or None."""


class _Usage(msgspec.Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


class _UsageChunk(msgspec.Struct):
    choices: list[msgspec.Raw] | None = None
    usage: _Usage | None = None


_usage_chunk = msgspec.json.Decoder(_UsageChunk)


def chat_chunk_usage(payload: bytes) -> tuple[TokenUsage, bool] | None:
    """The usage a ``chat.completion.chunk`` reports, and whether the chunk is nothing else
    (no choices: the final usage chunk of ``stream_options.include_usage``); None when it
    reports none. Callers pass only candidates: a usage chunk's JSON ends with ``}}``."""
    try:
        chunk = _usage_chunk.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    if chunk.usage is None:
        return None
    usage = TokenUsage(chunk.usage.prompt_tokens, chunk.usage.completion_tokens)
    return usage, not chunk.choices


def usage_reader(codec: Codec) -> UsageReader:
    """The usage reader of ``codec``'s wire format: chat's and completions' usage chunk
    (dropped when the router asked for it), or the usage a named format's events report
    (never dropped: those events say more than usage)."""
    if not codec.named_events:
        return chat_chunk_usage  # completions' usage chunk has chat's shape

    def read(payload: bytes) -> tuple[TokenUsage, bool] | None:
        found = codec.usage(payload)
        if found is None:
            return None
        return TokenUsage(found.input_tokens, found.output_tokens), False

    return read


_OPTION = b'"stream_options":{"include_usage":true},'


def with_usage_option(body: bytes) -> bytes:
    """A chat request body (a JSON object without ``stream_options``) asking for the usage
    chunk: the member is put first, so the client's bytes are otherwise sent as they came."""
    start = body.index(b"{") + 1
    return body[:start] + _OPTION + body[start:]


class UsageMeter:
    """Completions and tokens per key label (see the module docstring)."""

    def __init__(self, names: Mapping[bytes, str] | None = None) -> None:
        self._names: dict[bytes, str] = dict(names or {})
        self.requests: dict[str, int] = {}
        self.tokens: dict[tuple[str, str], int] = {}

    def configure(self, names: Mapping[bytes, str]) -> None:
        """Owner digest -> label, from the config (a reload may add or move keys; counts
        already made stay under the label they were made with)."""
        self._names = dict(names)

    def label(self, owner: bytes) -> str:
        return self._names.get(owner, OTHER)

    def record(self, owner: bytes, input_tokens: int | None, output_tokens: int | None) -> None:
        """One completion served for ``owner``'s key, with the tokens known of it."""
        name = self._names.get(owner, OTHER)
        requests, tokens = self.requests, self.tokens
        requests[name] = requests.get(name, 0) + 1
        # The two directions written out: no pairs to build and loop over, once a request.
        if input_tokens:
            series = (name, "input")
            tokens[series] = tokens.get(series, 0) + input_tokens
        if output_tokens:
            series = (name, "output")
            tokens[series] = tokens.get(series, 0) + output_tokens

    def render(self) -> list[str]:
        return [
            *render_counter(
                "firstbyte_key_requests_total",
                "Completions served by this region's backends, by key label (auth.keys"
                " usage_label; other keys: other).",
                [(labels(key=k), n) for k, n in sorted(self.requests.items())],
            ),
            *render_counter(
                "firstbyte_key_tokens_total",
                "Tokens of those completions by key label and direction (input, output).",
                [(labels(key=k, direction=d), n) for (k, d), n in sorted(self.tokens.items())],
            ),
        ]
