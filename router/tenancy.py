"""Per-key limits: one API key may not take what the others need (sans-IO, clock passed in).

Three limits, each a ``[limits]`` key, each answered with its own 429 code and ``Retry-After``:

- ``max_streams_per_key``: completions in flight (streamed or not) per key. A key at its limit
  gets ``key_concurrency_exceeded``; the others keep their share of the backends.
- ``requests_per_s_per_key`` / ``request_burst_per_key``: a token bucket per key (nginx's
  ``limit_req`` with ``burst``): ``burst`` requests at once, then ``rate`` a second; beyond it
  ``key_rate_limited`` with ``Retry-After`` = the seconds until the next token.
- ``max_store_bytes_per_key``: the key's share of the stream store, enforced by the store
  itself as the key's streams grow (:class:`firstbyte.router.streams.StreamStore`): when the
  store is full, a key over its share has its own oldest history trimmed (a resume from
  before the trim point gets ``stream_history_trimmed``), never another key's streams, so a
  key is not refused for its share; when live streams of keys within their shares fill the
  whole store, ``stream_store_full``.

:func:`limit_key` is the pipeline stage (after admission, before routing, so a refused request
never holds a routing slot). Keys are identified by their digest
(:func:`firstbyte.router.streams.owner_of`), never the key itself. A router without API keys
(``allow_anonymous``) has no per-key rate or concurrency limit: every caller is the same
"key" there, and the store's bounds still hold.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

from firstbyte.protocol import error_codes

from .pipeline.context import CONTINUE, LocalReply, Outcome, RequestContext, error_reply
from .streams import StoreFull, StreamStore

__all__ = ["KeyLimiter", "Refusal", "TokenBucket", "limit_key", "refusal", "store_refusal"]


class TokenBucket:
    """``burst`` tokens, refilled at ``rate_per_s``; one request takes one token."""

    def __init__(self, rate_per_s: float, burst: int, now: float) -> None:
        self.rate_per_s = rate_per_s
        self.burst = burst
        self.tokens = float(burst)
        self.updated_at = now

    def take(self, now: float) -> float:
        """Take a token: 0.0 if one was there, else the seconds until one will be (none taken)."""
        elapsed = max(0.0, now - self.updated_at)
        self.tokens = min(float(self.burst), self.tokens + elapsed * self.rate_per_s)
        self.updated_at = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate_per_s

    def full_at(self) -> float:
        """When the bucket is full again (then it holds no state worth keeping)."""
        return self.updated_at + (self.burst - self.tokens) / self.rate_per_s


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a key's request is refused: the error code and the ``Retry-After`` seconds."""

    code: str
    retry_after_s: int
    message: str


class KeyLimiter:
    """The rate buckets and non-streamed in-flight counts of every key (streams in flight are
    counted by the store: :meth:`StreamStore.live_streams`)."""

    def __init__(
        self,
        *,
        max_streams: int,
        rate_per_s: float,
        burst: int,
        enabled: bool = True,
    ) -> None:
        self.max_streams = max_streams
        self.rate_per_s = rate_per_s
        self.burst = burst
        self.enabled = enabled
        self._buckets: dict[bytes, TokenBucket] = {}
        self._unstreamed: dict[bytes, int] = {}

    def forget_buckets(self) -> None:
        """Drop every key's token bucket (the rate changed on reload: new buckets, full)."""
        self._buckets.clear()

    def unstreamed(self, owner: bytes) -> int:
        return self._unstreamed.get(owner, 0)

    @contextlib.contextmanager
    def holding(self, owner: bytes) -> Iterator[None]:
        """Count a non-streamed completion in flight for ``owner`` while the block runs."""
        self._unstreamed[owner] = self._unstreamed.get(owner, 0) + 1
        try:
            yield
        finally:
            left = self._unstreamed[owner] - 1
            if left:
                self._unstreamed[owner] = left
            else:
                del self._unstreamed[owner]

    def over_concurrency(self, in_flight: int) -> Refusal | None:
        """Refuse when the key already has ``max_streams`` completions in flight."""
        if not self.enabled or in_flight < self.max_streams:
            return None
        return Refusal(
            error_codes.KEY_CONCURRENCY_EXCEEDED,
            1,  # a slot frees as soon as one of the key's own streams ends
            f"This API key has {in_flight} completions in flight, its limit is"
            f" {self.max_streams}; retry when one has finished.",
        )

    def take(self, owner: bytes, now: float) -> Refusal | None:
        """Take a token from the key's bucket; a refusal if it is empty (no rate: never)."""
        if not self.enabled or self.rate_per_s <= 0:
            return None
        bucket = self._buckets.get(owner)
        if bucket is None:
            bucket = self._buckets[owner] = TokenBucket(self.rate_per_s, self.burst, now)
        wait_s = bucket.take(now)
        return None if wait_s == 0.0 else self.rate_limited(wait_s)

    def rate_limited(self, wait_s: float) -> Refusal:
        """The refusal of a key whose bucket has a token again in ``wait_s`` seconds."""
        return Refusal(
            error_codes.KEY_RATE_LIMITED,
            max(1, math.ceil(wait_s)),
            f"This API key sent more than {self.burst} requests at once or more than"
            f" {self.rate_per_s:g} a second.",
        )

    def forget_idle(self, now: float) -> None:
        """Drop buckets that are full again: a key idle that long costs no memory."""
        for owner in [o for o, b in self._buckets.items() if b.full_at() <= now]:
            del self._buckets[owner]


def refusal(reason: Refusal) -> LocalReply:
    """The 429 for a refused key: OpenAI's error body with the code, and ``Retry-After``."""
    return error_reply(
        429,
        reason.message,
        "rate_limit_error",
        code=reason.code,
        headers=(("retry-after", str(reason.retry_after_s)),),
        outcome="rejected",
    )


_STORE_MESSAGES = {
    StoreFull.STORE: "Live streams fill this router's stream store; retry shortly.",
}


def limit_key(ctx: RequestContext, limiter: KeyLimiter, store: StreamStore, now: float) -> Outcome:
    """The per-key stage: concurrency, then room in the store (streams only), then the rate.

    The rate is checked last so that a request refused for another reason spends no token.
    """
    owner = ctx.owner
    in_flight = store.live_streams(owner) + limiter.unstreamed(owner)
    refused = limiter.over_concurrency(in_flight)
    if refused is None and ctx.stream_requested:
        refused = store_refusal(store, owner, now)
    if refused is None:
        refused = limiter.take(owner, now)
    return CONTINUE if refused is None else refusal(refused)


def store_refusal(store: StreamStore, owner: bytes, now: float) -> Refusal | None:
    """Make room in this process's store for a new stream of ``owner``, or say why not."""
    full = store.make_room(owner, now)
    return None if full is None else Refusal(full.value, 1, _STORE_MESSAGES[full])
