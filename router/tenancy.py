"""Per-key limits and fair sharing: one API key (or one of its end users) may not take what
the others need, and nothing is refused that the region has room for (sans-IO, clock passed in).

By default a key has no hard cap: it takes what the region has room for. When the region is
full (every backend at its limit: the point where routing would queue or answer
``region_saturated``), the region's capacity is shared by weighted max-min fairness over the
keys asking (:mod:`firstbyte.router.fair_share`, weights from ``[[auth.keys]]``): a key below
its share is still admitted (it waits for the next slot that frees, :attr:`Tenants.queue`; with
``routing.max_fair_wait_ms = 0``, queued on a backend), a key at or above it gets
``key_over_fair_share``. Inside a key the same applies between its *subjects* (its end users:
a client token's subject, or the ``x-firstbyte-subject`` header, ``safety_identifier`` or
``user`` of a server-side request): each gets a fair share of its key's share, so one abusive
user does not starve the others (``subject_over_fair_share``). "The region" is the request's
model pool (the backends serving its model): :class:`Tenants` holds one pool's flows, and the
router keeps one per pool (:meth:`firstbyte.router.state.RouterState.fair_pool`), so a key
flooding one model's backends takes nothing of another model's.

Hard caps are opt-in, for every key in ``[limits]`` or per key in ``[[auth.keys]]``, each
answered with its own 429 code and ``Retry-After``:

- ``max_streams``: completions in flight (streamed or not) per key (``key_concurrency_exceeded``).
  At the cap, the key's subjects share it fairly: a subject at its share of the cap is refused
  (``subject_over_fair_share``) while another subject is still asking.
- ``max_streams_per_subject`` (or a token's own ``max_streams``): per subject
  (``subject_concurrency_exceeded``).
- ``requests_per_s`` / ``request_burst``: a token bucket per key (nginx's ``limit_req`` with
  ``burst``): ``burst`` requests at once, then ``rate`` a second; beyond it ``key_rate_limited``
  with ``Retry-After`` = the seconds until the next token.
- ``max_store_bytes_per_key``: the key's share of the stream store, enforced by the store
  itself as the key's streams grow (:class:`firstbyte.router.streams.StreamStore`): when the
  store is full, a key over its share has its own oldest history trimmed (a resume from
  before the trim point gets ``stream_history_trimmed``), never another key's streams, so a
  key is not refused for its share; when live streams of keys within their shares fill the
  whole store, ``stream_store_full``.

:func:`limit_key` is the pipeline stage for the caps (after admission, before routing, so a
refused request never holds a routing slot); :meth:`Tenants.fair_refusal` is asked by routing
at the point where the region is full. Keys are identified by their digest
(:func:`firstbyte.router.streams.owner_of`), never the key itself. A router without API keys
(``allow_anonymous``) has no per-key cap or rate: every caller is the same "key" there, and the
store's bounds and the fairness between subjects still hold.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from firstbyte.protocol import error_codes
from firstbyte.protocol.tokens import MAX_SUBJECT_CHARS

from .fair_queue import FairQueue, Waiter
from .fair_share import FairShare
from .pipeline.context import CONTINUE, LocalReply, Outcome, RequestContext, error_reply
from .streams import StoreFull, StreamStore

__all__ = [
    "MAX_SUBJECT_CHARS",
    "KeyLimiter",
    "KeyPolicy",
    "Refusal",
    "Tenants",
    "TokenBucket",
    "limit_key",
    "refusal",
    "store_refusal",
    "subject_of",
]



def subject_of(name: str | None) -> str | None:
    """The subject kept for ``name``: itself, a digest when longer than
    :data:`~firstbyte.protocol.tokens.MAX_SUBJECT_CHARS` (every subject the router keeps a
    count for is bounded in size), None when empty."""
    if not name:
        return None
    if len(name) <= MAX_SUBJECT_CHARS:
        return name
    return "sha256:" + hashlib.sha256(name.encode()).hexdigest()


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


@dataclass(frozen=True, slots=True)
class KeyPolicy:
    """One key's weight and hard caps (None: no cap; a rate of 0: no rate limit)."""

    weight: float = 1.0
    max_streams: int | None = None
    rate_per_s: float = 0.0
    burst: int = 100
    max_streams_per_subject: int | None = None


class KeyLimiter:
    """Every key's policy, rate buckets and non-streamed in-flight counts (streams in flight
    are counted by the store: :meth:`StreamStore.live_streams`).

    ``max_streams``, ``rate_per_s``, ``burst`` and ``max_streams_per_subject`` are the default
    policy (``[limits]``); ``table`` maps owner digests to their own (``[[auth.keys]]``)."""

    def __init__(
        self,
        *,
        max_streams: int | None = None,
        rate_per_s: float = 0.0,
        burst: int = 100,
        max_streams_per_subject: int | None = None,
        enabled: bool = True,
        table: Mapping[bytes, KeyPolicy] | None = None,
    ) -> None:
        self.default = KeyPolicy(1.0, max_streams, rate_per_s, burst, max_streams_per_subject)
        self.table: dict[bytes, KeyPolicy] = dict(table or {})
        self.enabled = enabled
        self._buckets: dict[bytes, TokenBucket] = {}
        self._unstreamed: dict[bytes, int] = {}

    def configure(self, default: KeyPolicy, table: Mapping[bytes, KeyPolicy]) -> None:
        """New policies (a reload); buckets whose rate or size changed start again, full."""
        old = {owner: self.policy(owner) for owner in self._buckets}
        self.default, self.table = default, dict(table)
        for owner, before in old.items():
            after = self.policy(owner)
            if (after.rate_per_s, after.burst) != (before.rate_per_s, before.burst):
                del self._buckets[owner]

    def policy(self, owner: bytes) -> KeyPolicy:
        return self.table.get(owner, self.default)

    def weight(self, owner: bytes) -> float:
        return self.policy(owner).weight

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

    def max_streams(self, owner: bytes) -> int | None:
        """``owner``'s hard cap on completions in flight (None: none, or no API keys)."""
        return self.policy(owner).max_streams if self.enabled else None

    def over_concurrency(self, owner: bytes, in_flight: int) -> Refusal | None:
        """Refuse when the key already has its ``max_streams`` completions in flight."""
        cap = self.max_streams(owner)
        if cap is None or in_flight < cap:
            return None
        return Refusal(
            error_codes.KEY_CONCURRENCY_EXCEEDED,
            1,  # a slot frees as soon as one of the key's own streams ends
            f"This API key has {in_flight} completions in flight, its limit is"
            f" {cap}; retry when one has finished.",
        )

    def take(self, owner: bytes, now: float) -> Refusal | None:
        """Take a token from the key's bucket; a refusal if it is empty (no rate: never)."""
        if not self.enabled:  # before the policy's lookup: an anonymous router has no rate
            return None
        policy = self.policy(owner)
        if policy.rate_per_s <= 0:
            return None
        bucket = self._buckets.get(owner)
        if bucket is None:
            bucket = self._buckets[owner] = TokenBucket(policy.rate_per_s, policy.burst, now)
        wait_s = bucket.take(now)
        return None if wait_s == 0.0 else self.rate_limited(owner, wait_s)

    def rate_limited(self, owner: bytes, wait_s: float) -> Refusal:
        """The refusal of a key whose bucket has a token again in ``wait_s`` seconds."""
        policy = self.policy(owner)
        return Refusal(
            error_codes.KEY_RATE_LIMITED,
            max(1, math.ceil(wait_s)),
            f"This API key sent more than {policy.burst} requests at once or more than"
            f" {policy.rate_per_s:g} a second.",
        )

    def forget_idle(self, now: float) -> None:
        """Drop buckets that are full again: a key idle that long costs no memory."""
        for owner in [o for o, b in self._buckets.items() if b.full_at() <= now]:
            del self._buckets[owner]


def _one(_: str) -> float:
    return 1.0  # subjects of a key share it equally


@dataclass(eq=False)
class Tenants:
    """The requests in flight of every key and of every subject of a key, and the fair
    shares of a full region (between keys) and of a key's share or cap (between its
    subjects) that they give (:class:`~firstbyte.router.fair_share.FairShare`)."""

    limiter: KeyLimiter
    keys: FairShare[bytes] = field(default_factory=FairShare)
    subjects: dict[bytes, FairShare[str]] = field(default_factory=dict)
    queue: FairQueue[Callable[[], object]] = field(default_factory=FairQueue)
    """Requests below their share waiting for a slot of the full region; an item wakes its
    request (:meth:`wait`, :meth:`hand_slots`)."""

    def active(self) -> bool:
        """Whether anyone holds, waits for or was refused a share here lately (or a slot
        handed to a waiter is not taken yet): shares with nothing of this are forgotten."""
        return self.keys.active() or bool(self.subjects) or self.queue.busy()

    def subjects_of(self, owner: bytes) -> FairShare[str]:
        found = self.subjects.get(owner)
        if found is None:
            found = self.subjects[owner] = FairShare()
        return found

    def hold(
        self, owner: bytes, subject: str | None, now: float | None = None
    ) -> Callable[[], None]:
        """Count a request of ``owner``/``subject`` in flight from ``now``; the call that
        ends it (once)."""
        name = subject or ""
        self.keys.started(owner, now)
        # subjects_of inlined here and in release (once each a request)
        subjects = self.subjects.get(owner)
        if subjects is None:
            subjects = self.subjects[owner] = FairShare()
        subjects.started(name, now)
        held = True

        def release() -> None:
            nonlocal held
            if held:
                held = False
                self.keys.finished(owner)
                # The key's subjects now: those of the hold may have been dropped since.
                subjects = self.subjects.get(owner)
                if subjects is None:
                    subjects = self.subjects[owner] = FairShare()
                subjects.finished(name)
                if not subjects.active():
                    del self.subjects[owner]

        return release

    def wait(
        self, owner: bytes, subject: str | None, wake: Callable[[], object],
        now: float | None = None,
    ) -> Waiter[Callable[[], object]]:
        """Queue a request of ``owner``/``subject`` for a slot; it counts in both flows'
        demand at once (a light user's first request is never refused for fairness).
        ``wake`` is called when a slot is handed to it; :meth:`stop_waiting` ends it."""
        name = subject or ""
        self.keys.wait(owner, now)
        self.subjects_of(owner).wait(name, now)
        return self.queue.push(owner, name, wake)

    def stop_waiting(self, waiter: Waiter[Callable[[], object]]) -> bool:
        """The request of ``waiter`` waits no more (call once); True if it had been handed a
        slot (it takes it now: :attr:`FairQueue.handed` goes down), False if it gave up."""
        handed = not self.queue.remove(waiter)
        if handed:
            self.queue.taken()
        self.keys.unwait(waiter.key)
        subjects = self.subjects_of(waiter.key)
        subjects.unwait(waiter.subject)
        if not subjects.active():
            del self.subjects[waiter.key]
        return handed

    def hand_slots(self, free: int) -> int:
        """Wake waiters, the flow furthest below its share first (:meth:`FairQueue.pop`),
        while the region's ``free`` slots exceed those already handed; how many woke."""
        woken = 0
        while free > self.queue.handed:
            waiter = self.queue.pop(self._key_usage, self._subject_usage)
            if waiter is None:
                break
            waiter.item()
            woken += 1
        return woken

    def _key_usage(self, owner: bytes) -> float:
        return self.keys.in_flight(owner) / self.limiter.weight(owner)

    def _subject_usage(self, owner: bytes, subject: str) -> float:
        return float(self.subjects_of(owner).in_flight(subject))

    def has_room_for(self, owner: bytes, capacity: float) -> bool:
        """:meth:`fair_refusal`'s common case when the region is not full (a region with room
        and nobody asking for more): True admits ``owner``'s request (its answer is None)."""
        # The key's share is what the other keys leave (as decide() finds); its subjects'
        # turn is the same question within that share.
        share = self.keys.room_for(owner, capacity)
        if share is None:
            return False
        subjects = self.subjects.get(owner)
        return subjects is None or subjects.has_room(share)

    def fair_refusal(
        self, ctx: RequestContext, capacity: float, now: float,
        retry_after_s: int | Callable[[], int], *, full: bool = True,
    ) -> Refusal | None:
        """None if ``ctx``'s key stays within its weighted fair share of the region's
        ``capacity`` and its subject within its share of the key's (admit it), else why not.

        ``full``: every backend is at its limit. Then the budget shared is what this process
        has in flight, at most ``capacity`` (the backends' other traffic is not ours to
        share); a request admitted here waits for a slot (:meth:`wait`) while the flows above
        their share are held, and one key's one subject asking alone gets :data:`ALONE` (the
        caller refuses it as a full region). Not full, the budget is ``capacity`` and the answer
        is None unless the demands of the flows asking (in flight, refused a moment ago,
        this request) exceed it: then a free slot goes to a flow below its share, not to
        one above it that happened to ask first.

        ``retry_after_s`` may be the call that computes it: only a refusal needs it, and
        most requests are admitted."""
        owner, subject = ctx.owner, ctx.subject or ""
        if not full and self.has_room_for(owner, capacity):
            return None
        budget = min(capacity, float(self.keys.total())) if full else capacity
        key = self.keys.decide(owner, budget, now, weight_of=self.limiter.weight,
                               contended=True)
        subjects = self.subjects_of(owner)
        if not key.admit:
            if key.flows > 1:
                self.keys.asked(owner, now)
                subjects.asked(subject, now)
                retry_after_s = _resolved(retry_after_s)
                return Refusal(
                    error_codes.KEY_OVER_FAIR_SHARE, retry_after_s,
                    f"The region is full and this API key holds {key.in_flight} requests,"
                    f" its fair share is {key.share:.1f}; retry after {retry_after_s} s.",
                )
            if not full:
                return None  # alone, with room: nothing to share
            self.keys.asked(owner, now)
        mine = subjects.decide(subject, key.share, now, weight_of=_one, contended=True)
        if mine.admit:
            return None
        if mine.flows <= 1:
            if not full:
                return None
            subjects.asked(subject, now)
            return ALONE
        subjects.asked(subject, now)
        return _subject_over_share(mine.in_flight, mine.share, _resolved(retry_after_s))

    def forget_asks(self, now: float) -> None:
        self.keys.forget_asks(now)
        for owner, subjects in list(self.subjects.items()):
            subjects.forget_asks(now)
            if not subjects.active():
                del self.subjects[owner]


def _resolved(retry_after_s: int | Callable[[], int]) -> int:
    return retry_after_s if isinstance(retry_after_s, int) else retry_after_s()


ALONE = Refusal(error_codes.REGION_SATURATED, 1, "")
"""One key's one subject alone fills the region: the caller refuses it as a full region."""


def _subject_over_share(in_flight: int, share: float, retry_after_s: int) -> Refusal:
    return Refusal(
        error_codes.SUBJECT_OVER_FAIR_SHARE, retry_after_s,
        f"This user of the application holds {in_flight} requests, its fair share of the"
        f" application's is {share:.1f}; retry after {retry_after_s} s.",
    )


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


def subject_refusal(
    ctx: RequestContext, limiter: KeyLimiter, tenants: Tenants, key_in_flight: int, now: float,
    key_cap: int | None,
) -> Refusal | None:
    """The subject's caps: its own (the token's ``max_streams``, else the key's
    ``max_streams_per_subject``), then, at the key's cap (``key_cap``:
    :meth:`KeyLimiter.max_streams`, which the caller has), its fair share of that cap."""
    owner, subject = ctx.owner, ctx.subject or ""
    subjects = tenants.subjects.get(owner)
    cap = ctx.subject_max_streams or (
        limiter.policy(owner).max_streams_per_subject if ctx.subject else None
    )
    if cap is not None:  # the subject's count is asked only of a capped subject (a call)
        mine = subjects.in_flight(subject) if subjects is not None else 0
        if mine >= cap:
            return Refusal(
                error_codes.SUBJECT_CONCURRENCY_EXCEEDED, 1,
                f"This user of the application has {mine} completions in flight, its limit"
                f" is {cap}; retry when one has finished.",
            )
    if subjects is None or key_cap is None:  # nobody else of the key holds, or no cap
        return None
    decision = subjects.decide(subject, key_cap, now, weight_of=_one,
                               contended=key_in_flight >= key_cap)
    if decision.admit:
        return None
    subjects.asked(subject, now)
    return _subject_over_share(decision.in_flight, decision.share, 1)


def limit_key(
    ctx: RequestContext, limiter: KeyLimiter, store: StreamStore, now: float,
    tenants: Tenants | None = None,
) -> Outcome:
    """The per-key stage: the key's cap, its subject's caps, room in the store (streams
    only), then the rate.

    The rate is checked last so that a request refused for another reason spends no token.
    """
    owner = ctx.owner
    # The key's policy looked up once, here (KeyLimiter.policy inlined), where
    # KeyLimiter.max_streams (twice) and take each looked it up: None on a router without API
    # keys, which has no per-key cap or rate.
    policy = limiter.table.get(owner, limiter.default) if limiter.enabled else None
    key_cap = None if policy is None else policy.max_streams
    # The key's completions in flight are counted only for a key with a cap (none by default,
    # none without API keys): nothing else here reads the count (subject_refusal's share of
    # the key's cap neither), and counting it is three calls a request.
    refused: Refusal | None = None
    in_flight = 0
    if key_cap is not None:
        in_flight = store.live_streams(owner) + limiter.unstreamed(owner)
        refused = limiter.over_concurrency(owner, in_flight)
        if refused is not None and tenants is not None:
            tenants.subjects_of(owner).asked(ctx.subject or "", now)  # a slot that frees is its
    # Nothing for subject_refusal to refuse without a cap of the key's or of the subject's
    # (a subject's own cap, or the key's per-subject cap, needs a subject): no call then.
    if (
        refused is None and tenants is not None
        and (key_cap is not None or ctx.subject or ctx.subject_max_streams)
    ):
        refused = subject_refusal(ctx, limiter, tenants, in_flight, now, key_cap)
    if refused is None and ctx.stream_requested:
        full = store.make_room(owner, now)  # store_refusal inlined (a call a stream)
        if full is not None:
            refused = Refusal(full.value, 1, _STORE_MESSAGES[full])
    if refused is None and policy is not None and policy.rate_per_s > 0:
        refused = limiter.take(owner, now)  # no rate (the default): no token to take
    return CONTINUE if refused is None else refusal(refused)


def store_refusal(store: StreamStore, owner: bytes, now: float) -> Refusal | None:
    """Make room in this process's store for a new stream of ``owner``, or say why not."""
    full = store.make_room(owner, now)
    return None if full is None else Refusal(full.value, 1, _STORE_MESSAGES[full])
