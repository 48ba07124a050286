"""Deterministic completions: the same messages and seed always give the same text.

A PRNG seeded from a hash of the request's messages, its ``seed`` and the server's ``--seed``
draws words from a fixed vocabulary, one word per token. It also draws the length the "model"
would naturally stop at (8..256 tokens): when that is within the request's limit the
completion ends there with ``finish_reason: "stop"``, otherwise it is cut at the limit with
``"length"``, as it always is with ``ignore_eos`` (vLLM's extra parameter). Requests without
``max_tokens`` / ``max_completion_tokens`` get :data:`DEFAULT_MAX_TOKENS`.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from firstbyte.protocol.openai import ChatCompletionRequest, encode

__all__ = [
    "DEFAULT_MAX_TOKENS",
    "VOCABULARY",
    "Completion",
    "cut_at_stop",
    "embedding",
    "plan_completion",
    "plan_output",
]

DEFAULT_MAX_TOKENS = 64

# fmt: off
VOCABULARY: tuple[str, ...] = (
    "the", "of", "and", "to", "in", "is", "that", "it", "for", "as", "with", "was", "on", "be",
    "by", "this", "are", "at", "from", "or", "an", "have", "not", "which", "but", "they", "we",
    "can", "more", "their", "has", "one", "all", "been", "there", "were", "also", "its",
    "other", "new", "when", "time", "these", "some", "would", "first", "only", "may", "into",
    "about", "two", "over", "than", "most", "such", "could", "many", "them", "after", "like",
    "between", "used", "made", "through", "where", "before", "well", "our", "because", "each",
    "any", "both", "system", "model", "token", "cache", "region", "latency", "network",
    "stream", "prefix", "request", "server", "client", "budget", "first", "fast", "slow",
    "warm", "cold", "route", "edge", "queue", "batch", "decode", "prefill", "answer",
    "question", "light", "speed", "distance", "ocean", "city", "morning", "river", "mountain",
    "garden", "window", "signal", "packet", "handshake", "connection", "protocol", "measure",
    "every", "second", "millisecond", "careful", "simple", "clear", "quiet", "bright",
)
# fmt: on


@dataclass(frozen=True, slots=True)
class Completion:
    """What the "model" will say: one word per token, and why it stops after the last one."""

    words: tuple[str, ...]
    finish_reason: str
    stop_sequence: str | None = None
    """The request's stop string the output ended at (vLLM's ``stop_reason``); the text ends
    before it."""
    last_text: str | None = None
    """The last token's text when a stop string cut it (maybe empty)."""

    def token_text(self, index: int) -> str:
        """The text of token ``index`` (words after the first carry a leading space)."""
        if self.last_text is not None and index == len(self.words) - 1:
            return self.last_text
        word = self.words[index]
        return word if index == 0 else " " + word

    def text(self, count: int) -> str:
        """The text of the first ``count`` tokens."""
        return "".join(self.token_text(index) for index in range(count))


def plan_completion(request: ChatCompletionRequest, server_seed: int = 0) -> Completion:
    """The deterministic completion for ``request`` (see the module docstring)."""
    return plan_output(
        encode(request.messages), request.seed, request.model, request.output_limit, server_seed,
        ignore_eos=bool(request.ignore_eos),
        stop=[request.stop] if isinstance(request.stop, str) else request.stop or (),
    )


def plan_output(
    key: bytes, seed: int | None, model: str, limit: int | None, server_seed: int = 0,
    *, ignore_eos: bool = False, stop: Sequence[str] = (),
) -> Completion:
    """The deterministic completion for a prompt whose bytes are ``key`` (any endpoint);
    ``ignore_eos`` (vLLM's): to the limit, whatever the natural length. With ``stop``
    strings, it ends before the first one the text contains (:func:`cut_at_stop`)."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(f"{server_seed}/{seed}/{model}/".encode())
    digest.update(key)
    rng = random.Random(digest.digest())
    natural = rng.randint(8, 256)
    if limit is None:
        limit = DEFAULT_MAX_TOKENS
    if natural <= limit and not ignore_eos:
        count, reason = natural, "stop"
    else:
        count, reason = limit, "length"
    vocab = VOCABULARY
    words = tuple(vocab[int(rng.random() * len(vocab))] for _ in range(count))
    return cut_at_stop(Completion(words=words, finish_reason=reason), stop)


def cut_at_stop(completion: Completion, stop: Sequence[str]) -> Completion:
    """``completion`` ended as vLLM ends it at a stop string: its text stops just before the
    first occurrence of any of ``stop``, the token where that occurrence begins is the last
    one generated (its text cut there), and it finishes with ``stop``."""
    text = completion.text(len(completion.words))
    hits = [(at, s) for s in stop if s and (at := text.find(s)) >= 0]
    if not hits:
        return completion
    at, string = min(hits)
    start = 0
    for index in range(len(completion.words)):
        end = start + len(completion.token_text(index))
        if at < end:
            return Completion(
                words=completion.words[: index + 1],
                finish_reason="stop",
                stop_sequence=string,
                last_text=text[start:at],
            )
        start = end
    return completion  # unreachable: ``at`` is inside the text


def embedding(key: bytes, model: str, dimensions: int) -> list[float]:
    """A unit-length vector drawn from ``key``: the same input always gives the same vector,
    and different inputs nearly orthogonal ones."""
    digest = hashlib.blake2b(model.encode() + b"/" + key, digest_size=16).digest()
    rng = random.Random(digest)
    vector = [rng.gauss(0.0, 1.0) for _ in range(dimensions)]
    norm = math.sqrt(sum(x * x for x in vector)) or 1.0
    return [x / norm for x in vector]
