"""Per-key limits, sans sockets and with an injected clock: the token bucket, the concurrency
limit, the store's share, and the stage's 429s (code, ``Retry-After``, OpenAI's body)."""

from __future__ import annotations

import json

import pytest

from firstbyte.router.pipeline.context import CONTINUE, LocalReply, RequestContext
from firstbyte.router.streams import StreamStore, owner_of
from firstbyte.router.tenancy import (
    ALONE,
    KeyLimiter,
    KeyPolicy,
    Tenants,
    TokenBucket,
    limit_key,
    subject_of,
)

KEY_A = "sk-tenant-a-0001"
KEY_B = "sk-tenant-b-0002"


def test_token_bucket_allows_the_burst_then_the_rate() -> None:
    bucket = TokenBucket(rate_per_s=2.0, burst=3, now=100.0)
    assert [bucket.take(100.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert bucket.take(100.0) == pytest.approx(0.5)  # empty: a token in 1/rate seconds
    assert bucket.take(100.25) == pytest.approx(0.25)  # half a token refilled meanwhile
    assert bucket.take(100.5) == 0.0
    assert bucket.take(100.5) == pytest.approx(0.5)
    # An idle key refills to the burst, never beyond.
    assert [bucket.take(1000.0) for _ in range(4)] == [0.0, 0.0, 0.0, pytest.approx(0.5)]


def test_token_bucket_survives_a_clock_that_does_not_move_forward() -> None:
    bucket = TokenBucket(rate_per_s=1.0, burst=1, now=10.0)
    assert bucket.take(10.0) == 0.0
    assert bucket.take(9.0) == pytest.approx(1.0)  # no refill from going backwards


def _ctx(key: str, *, stream: bool = True) -> RequestContext:
    ctx = RequestContext("POST", "/v1/chat/completions", {})
    ctx.api_key = key
    ctx.stream_requested = stream
    return ctx


def _refusal(outcome: object) -> tuple[int, str, str]:
    assert isinstance(outcome, LocalReply)
    headers = dict(outcome.headers)
    error = json.loads(outcome.body)["error"]
    assert error["type"] == "rate_limit_error"
    assert outcome.code == error["code"]
    return outcome.status, error["code"], headers["retry-after"]


def test_rate_limit_is_per_key_with_retry_after_until_the_next_token() -> None:
    limiter = KeyLimiter(max_streams=100, rate_per_s=0.5, burst=2)
    store = StreamStore(max_total_bytes=1 << 20, max_age_s=60)
    assert limit_key(_ctx(KEY_A), limiter, store, 0.0) is CONTINUE
    assert limit_key(_ctx(KEY_A), limiter, store, 0.0) is CONTINUE
    assert _refusal(limit_key(_ctx(KEY_A), limiter, store, 0.0)) == (429, "key_rate_limited", "2")
    assert _refusal(limit_key(_ctx(KEY_A), limiter, store, 1.5)) == (429, "key_rate_limited", "1")
    assert limit_key(_ctx(KEY_B), limiter, store, 0.0) is CONTINUE  # B has its own bucket
    assert limit_key(_ctx(KEY_A), limiter, store, 2.0) is CONTINUE
    limiter.forget_idle(3.0)
    assert list(limiter._buckets) == [owner_of(KEY_A)]  # B's is full again (at 2.0), A's not
    limiter.forget_idle(10.0)
    assert limiter._buckets == {}  # full buckets hold nothing worth keeping


def test_concurrency_counts_live_streams_and_unstreamed_requests_per_key() -> None:
    limiter = KeyLimiter(max_streams=3, rate_per_s=0.0, burst=1)
    store = StreamStore(max_total_bytes=1 << 20, max_age_s=60)
    a = owner_of(KEY_A)
    streams = []
    for _ in range(2):
        assert limit_key(_ctx(KEY_A), limiter, store, 0.0) is CONTINUE
        streams.append(store.create(a, 0.0))
    with limiter.holding(a):  # a non-streamed completion in flight
        refused = limit_key(_ctx(KEY_A, stream=False), limiter, store, 0.0)
        assert _refusal(refused) == (429, "key_concurrency_exceeded", "1")
        assert limit_key(_ctx(KEY_B), limiter, store, 0.0) is CONTINUE  # B is not affected
    assert limit_key(_ctx(KEY_A), limiter, store, 0.0) is CONTINUE
    streams.append(store.create(a, 0.0))
    assert isinstance(limit_key(_ctx(KEY_A), limiter, store, 0.0), LocalReply)
    streams[0].finish(1.0)  # a stream ends: a slot is free again
    assert limit_key(_ctx(KEY_A), limiter, store, 1.0) is CONTINUE


def test_a_key_whose_live_streams_fill_the_store_is_admitted_and_trims_its_own() -> None:
    limiter = KeyLimiter(max_streams=100, rate_per_s=0.0, burst=1)
    store = StreamStore(max_total_bytes=2_500, max_age_s=60, max_owner_bytes=1_000)
    live = store.create(owner_of(KEY_A), 0.0)
    for _ in range(3):  # over its share, and the store has room: nothing is trimmed
        live.append(b"x" * 600, 0.0)
    assert live.trimmed == 0
    live.append(b"x" * 600, 0.0)  # the store full: its own history goes
    assert live.trimmed > 0
    assert store.total_bytes <= 2_500
    assert limit_key(_ctx(KEY_A), limiter, store, 0.0) is CONTINUE
    assert not live.evicted
    assert limit_key(_ctx(KEY_B), limiter, store, 0.0) is CONTINUE


def test_a_refused_request_spends_no_token() -> None:
    limiter = KeyLimiter(max_streams=1, rate_per_s=1.0, burst=1)
    store = StreamStore(max_total_bytes=1 << 20, max_age_s=60)
    store.create(owner_of(KEY_A), 0.0)  # at its concurrency limit
    for _ in range(5):
        assert _refusal(limit_key(_ctx(KEY_A), limiter, store, 0.0))[1] == (
            "key_concurrency_exceeded"
        )
    store.running()[0].finish(0.0)
    assert limit_key(_ctx(KEY_A), limiter, store, 0.0) is CONTINUE  # its one token was kept


def test_an_anonymous_router_has_no_per_key_limits() -> None:
    limiter = KeyLimiter(max_streams=1, rate_per_s=1.0, burst=1, enabled=False)
    store = StreamStore(max_total_bytes=1 << 20, max_age_s=60)
    for _ in range(5):
        ctx = _ctx("")
        ctx.api_key = None
        assert limit_key(ctx, limiter, store, 0.0) is CONTINUE
        store.create(owner_of(None), 0.0)


def _subject_ctx(key: str, subject: str | None) -> RequestContext:
    ctx = _ctx(key)
    ctx.subject = subject
    return ctx


def test_no_default_caps_a_key() -> None:
    limiter = KeyLimiter()  # the [limits] defaults: no cap, no rate
    store = StreamStore(max_total_bytes=1 << 30, max_age_s=60)
    tenants = Tenants(limiter)
    for _ in range(1000):
        assert limit_key(_ctx(KEY_A), limiter, store, 0.0, tenants) is CONTINUE
        store.create(owner_of(KEY_A), 0.0)
        tenants.hold(owner_of(KEY_A), None)


def test_the_key_table_gives_a_key_its_own_weight_and_caps() -> None:
    a, b = owner_of(KEY_A), owner_of(KEY_B)
    limiter = KeyLimiter(max_streams=None, rate_per_s=0.0, burst=1)
    limiter.configure(KeyPolicy(), {b: KeyPolicy(weight=2.0, max_streams=1, rate_per_s=1.0,
                                                 burst=1)})
    assert (limiter.weight(a), limiter.weight(b)) == (1.0, 2.0)
    assert (limiter.max_streams(a), limiter.max_streams(b)) == (None, 1)
    store = StreamStore(max_total_bytes=1 << 20, max_age_s=60)
    assert limit_key(_ctx(KEY_B), limiter, store, 0.0) is CONTINUE
    assert _refusal(limit_key(_ctx(KEY_B), limiter, store, 0.0)) == (429, "key_rate_limited", "1")
    store.create(b, 0.0)
    assert _refusal(limit_key(_ctx(KEY_B), limiter, store, 5.0))[1] == "key_concurrency_exceeded"
    assert limit_key(_ctx(KEY_A), limiter, store, 0.0) is CONTINUE  # A: no cap, no rate
    # A reload that changes B's rate starts B's bucket again; A's policy is the default's.
    limiter.configure(KeyPolicy(), {b: KeyPolicy(weight=2.0, rate_per_s=5.0, burst=3)})
    assert limiter._buckets == {}


def test_a_subject_cap_and_a_fair_share_of_the_keys_cap() -> None:
    a = owner_of(KEY_A)
    limiter = KeyLimiter(max_streams=4, max_streams_per_subject=3)
    store = StreamStore(max_total_bytes=1 << 20, max_age_s=60)
    tenants = Tenants(limiter)

    def admit(subject: str, now: float) -> object:
        outcome = limit_key(_subject_ctx(KEY_A, subject), limiter, store, now, tenants)
        if outcome is CONTINUE:
            store.create(a, now)
            tenants.hold(a, subject)
        return outcome

    assert [admit("greedy", 0.0) for _ in range(3)] == [CONTINUE] * 3
    assert _refusal(admit("greedy", 0.0))[1] == "subject_concurrency_exceeded"
    assert admit("polite", 0.0) is CONTINUE  # the key's 4th slot
    assert _refusal(admit("third", 0.0))[1] == "key_concurrency_exceeded"  # at the cap
    # One of greedy's streams ends: the slot goes to "third", who asked, not back to greedy.
    store.running()[0].finish(0.1)
    tenants.subjects[a].finished("greedy")
    assert _refusal(admit("greedy", 0.2))[1] == "subject_over_fair_share"
    assert admit("third", 0.3) is CONTINUE


def test_a_token_subject_cap_wins_over_the_keys() -> None:
    limiter = KeyLimiter(max_streams_per_subject=10)
    store = StreamStore(max_total_bytes=1 << 20, max_age_s=60)
    tenants = Tenants(limiter)
    ctx = _subject_ctx(KEY_A, "user-1")
    ctx.subject_max_streams = 1
    assert limit_key(ctx, limiter, store, 0.0, tenants) is CONTINUE
    tenants.hold(owner_of(KEY_A), "user-1")
    assert _refusal(limit_key(ctx, limiter, store, 0.0, tenants))[1] == (
        "subject_concurrency_exceeded"
    )
    outcome = limit_key(ctx, limiter, store, 0.0, tenants)
    assert isinstance(outcome, LocalReply)
    assert json.loads(outcome.body)["error"]["message"] == (
        "This user of the application has 1 completions in flight, its limit is 1;"
        " retry when one has finished."
    )


def test_a_full_region_is_shared_between_keys_then_between_subjects() -> None:
    a, b = owner_of(KEY_A), owner_of(KEY_B)
    tenants = Tenants(KeyLimiter())
    for _ in range(8):
        tenants.hold(a, "abuser")
    # Key A alone, one subject: nothing to share, the caller's own "region full".
    assert tenants.fair_refusal(_subject_ctx(KEY_A, "abuser"), 8, 0.0, 3) is ALONE
    # Another subject of A is below its share of A's: admitted (queued).
    assert tenants.fair_refusal(_subject_ctx(KEY_A, "polite"), 8, 0.0, 3) is None
    tenants.hold(a, "polite")
    refused = tenants.fair_refusal(_subject_ctx(KEY_A, "abuser"), 8, 0.0, 3)
    assert refused is not None
    assert (refused.code, refused.retry_after_s) == ("subject_over_fair_share", 3)
    # Key B asks: below its share of the region; A is above its own.
    assert tenants.fair_refusal(_subject_ctx(KEY_B, None), 8, 0.0, 3) is None
    tenants.hold(b, None)
    refused = tenants.fair_refusal(_subject_ctx(KEY_A, "polite"), 8, 0.0, 3)
    assert refused is not None
    assert refused.code == "key_over_fair_share"


def test_with_room_a_subject_asking_for_more_still_gets_its_share() -> None:
    """A region with room admits at once while nobody asks for more; once a subject of the
    key was refused a moment ago, the key's other subject above its share of the key's is
    refused, room or not (the gate's shortcut must not skip the subjects' turn)."""
    a = owner_of(KEY_A)
    tenants = Tenants(KeyLimiter())
    for _ in range(5):
        tenants.hold(a, "abuser")
    assert tenants.fair_refusal(_subject_ctx(KEY_A, "abuser"), 6, 0.0, 3, full=False) is None
    tenants.subjects_of(a).asked("polite", 0.0)
    refused = tenants.fair_refusal(_subject_ctx(KEY_A, "abuser"), 6, 0.0, 3, full=False)
    assert refused is not None
    assert refused.code == "subject_over_fair_share"
    # and the key's subject that asked is admitted
    assert tenants.fair_refusal(_subject_ctx(KEY_A, "polite"), 6, 0.0, 3, full=False) is None


def test_subject_of_bounds_its_size() -> None:
    assert subject_of("") is None
    assert subject_of(None) is None
    assert subject_of("user-1") == "user-1"
    long = subject_of("x" * 1000)
    assert long is not None
    assert long.startswith("sha256:")
    assert len(long) <= 128
