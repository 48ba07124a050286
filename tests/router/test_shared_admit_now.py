"""Admission without a round trip (:meth:`SharedAdmission.admit_now`): a request nothing in
Redis can refuse goes upstream at once, its claims sent meanwhile, and spare slots claimed
ahead keep the region within a backend's limit.

Real ``valkey-server`` (:mod:`tests.router.redis_fixture`); "processes" are admissions of
different names on one key prefix, each with its own lease.
"""

from __future__ import annotations

import asyncio

import pytest
from redis.asyncio import Redis

from firstbyte.benchmarks.redis_server import RedisServer
from firstbyte.router.shared.admission import (
    Affinity,
    Claim,
    SharedAdmission,
    Verdict,
    affinity_digest,
    spare_slots,
)
from firstbyte.router.shared.errors import StateUnavailable
from tests.router.redis_fixture import (  # noqa: F401 (fixtures)
    MakeAdmission,
    admitting,
    redis_server,
)

OWNER = b"app"
LIMIT = 1024
"""The default ``routing.backend_max_in_flight``."""


def _now(admission: SharedAdmission, *, limit: int | None = LIMIT, key_limit: int | None = None,
         rate: float = 0.0, affinity_key: str | None = None,
         affinity: Affinity = Affinity.NONE, stream_id: str | None = None
         ) -> asyncio.Future[None] | None:
    return admission.admit_now(Claim(OWNER, "b0", limit, key_limit=key_limit, rate_per_s=rate,
                                     affinity_key=affinity_key, affinity=affinity,
                                     stream_id=stream_id))


async def _wait(admission: SharedAdmission, *, limit: int | None = LIMIT,
                affinity_key: str | None = None, affinity: Affinity = Affinity.NONE) -> Verdict:
    answer = await admission.admit(
        Claim(OWNER, "b0", limit, affinity_key=affinity_key, affinity=affinity))
    return answer.verdict


async def _field(redis: Redis, key: str, process: str = "p1") -> int:
    """What ``process`` has in flight in the slots hash ``key`` (its spare ones:
    ``process + "/s"``)."""
    return int(await redis.hget(key, process) or 0)


async def test_a_request_nothing_can_refuse_goes_without_waiting_on_spare_slots(
    admitting: MakeAdmission,  # noqa: F811
) -> None:
    rig = await admitting()
    redis, keys, admission = rig.redis, rig.keys, rig.admission
    spare = spare_slots(LIMIT)
    assert spare == 16
    assert _now(admission) is None  # no spare slot of b0 yet: Redis decides
    assert await _wait(admission) is Verdict.ADMITTED  # and grants spare ones with it
    assert admission.spare("b0") == spare
    assert await _field(redis, keys.backend_load("b0")) == 1
    assert await _field(redis, keys.backend_load("b0"), "p1/s") == spare

    landed = [_now(admission) for _ in range(spare + 1)]  # in one loop turn: no await
    assert all(f is not None for f in landed[:spare])
    assert landed[-1] is None
    await asyncio.gather(*(f for f in landed if f is not None))
    # In Redis: the key's 17 slots, b0's 17 in flight, and the spare slots granted again
    # when they ran low (half of them: one ask in flight at a time).
    assert await _field(redis, keys.key_slots(OWNER)) == 1 + spare
    assert admission.spare("b0") == spare // 2
    assert await _field(redis, keys.backend_load("b0")) == 1 + spare
    assert await _field(redis, keys.backend_load("b0"), "p1/s") == spare // 2
    assert admission.admitted_now == spare

    # What Redis could refuse still waits for it: a capped key, a rated key, an affinity key
    # this process has not heard Redis hold for b0.
    assert _now(admission, key_limit=100) is None
    assert _now(admission, rate=10.0) is None
    assert _now(admission, affinity_key="hello", affinity=Affinity.FOLLOW) is None
    assert await _wait(admission, affinity_key="hello", affinity=Affinity.FOLLOW) \
        is Verdict.ADMITTED
    heard = _now(admission, affinity_key="hello", affinity=Affinity.FOLLOW, stream_id="s1")
    assert heard is not None
    await heard
    assert await redis.hget(keys.meta("s1"), "owner") == OWNER  # findable once landed


async def test_spare_slots_keep_two_processes_within_a_backends_limit(
    admitting: MakeAdmission,  # noqa: F811
) -> None:
    limit = 128  # two spare slots each
    one = await admitting(process="p1")
    two = await admitting(process="p2", keys=one.keys)
    redis, keys = one.redis, one.keys
    admitted = {"p1": 0, "p2": 0}
    now = 0
    for i in range(3 * limit):
        admission = (one, two)[i % 2].admission
        landed = _now(admission, limit=limit)
        if landed is not None:
            await landed
            now += 1
        elif await _wait(admission, limit=limit) is not Verdict.ADMITTED:
            continue
        admitted[admission.process] += 1
    held = {p: await _field(redis, keys.backend_load("b0"), p) for p in admitted}
    spare = {p: rig.admission.spare("b0") for p, rig in (("p1", one), ("p2", two))}
    assert held == admitted  # what each has in flight, as the other processes read it
    for p, n in spare.items():
        assert await _field(redis, keys.backend_load("b0"), p + "/s") == n
    assert sum(admitted.values()) + sum(spare.values()) == limit, (admitted, spare)
    assert now > limit // 2  # most went without waiting
    assert sum(spare.values()) <= 2 * spare_slots(limit)

    # Each process's in flight ends: its slots are kept spare up to what it keeps, and
    # those go back after a housekeeping tick in which no request took one.
    for rig in (one, two):
        for _ in range(admitted[rig.admission.process]):
            rig.admission.release_backend("b0")
        rig.admission.give_back_idle()  # a request took one since the last tick: kept
        await rig.admission.background.drain()
        assert rig.admission.spare("b0") == spare_slots(limit)
    assert await redis.hgetall(keys.backend_load("b0")) == {b"p1/s": b"2", b"p2/s": b"2"}
    for rig in (one, two):
        rig.admission.give_back_idle()  # none since: given back
        await rig.admission.background.drain()
    assert await redis.hgetall(keys.backend_load("b0")) == {}


async def test_a_claim_redis_never_answers_is_undone_and_the_next_requests_wait(
    admitting: MakeAdmission, redis_server: RedisServer,  # noqa: F811
) -> None:
    rig = await admitting(timeout_s=0.3)
    redis, keys, admission = rig.redis, rig.keys, rig.admission
    assert await _wait(admission) is Verdict.ADMITTED
    control = Redis.from_url(redis_server.url)
    try:
        await control.execute_command("CLIENT", "PAUSE", "1000", "ALL")
        landed = _now(admission)
        assert landed is not None
        with pytest.raises(StateUnavailable):
            await landed
        assert admission.unsure
        assert _now(admission) is None  # Redis failed lately: each request asks it
    finally:
        await control.execute_command("CLIENT", "UNPAUSE")
        await control.aclose()
    assert not await admission.reconcile(2.0)  # two rounds: the lost claim may run late
    assert await admission.reconcile(2.0)
    # What this process holds, whatever the lost claim did: the two admitted, the spare.
    assert await _field(redis, keys.backend_load("b0")) == 2
    assert await _field(redis, keys.backend_load("b0"), "p1/s") == admission.spare("b0") == 15
    assert await _field(redis, keys.key_slots(OWNER)) == 2
    assert _now(admission) is not None  # Redis answers again: no waiting


async def test_an_opening_message_goes_at_once_and_learns_where_another_placed_it(
    admitting: MakeAdmission,  # noqa: F811
) -> None:
    """A conversation's first message has no history anywhere: it is placed without asking
    Redis where its affinity key lives; if another process placed the same first message
    already, the claim's answer says where (the next turn follows it) and nothing is
    overwritten."""
    one = await admitting(process="p1")
    two = await admitting(process="p2", keys=one.keys)
    redis, keys = one.redis, one.keys
    for rig in (one, two):  # spare slots of b0 and b1 for both
        for backend in ("b0", "b1"):
            answer = await rig.admission.admit(Claim(OWNER, backend, LIMIT))
            assert answer.verdict is Verdict.ADMITTED
    heard: dict[str, str] = {}

    def now(rig_admission: SharedAdmission, backend: str, opening: bool, name: str = ""
            ) -> asyncio.Future[None] | None:
        return rig_admission.admit_now(
            Claim(OWNER, backend, LIMIT, affinity_key="Hello", affinity=Affinity.FOLLOW),
            opening=opening, answered=lambda others, stored: heard.update({name: stored}))

    assert now(one.admission, "b0", opening=False) is None  # a later turn asks Redis
    first = now(one.admission, "b0", opening=True, name="first")
    assert first is not None
    await first
    assert heard["first"] == ""  # nobody had it: stored for b0
    digest = affinity_digest("Hello")
    assert await redis.get(keys.affinity(digest)) == b"b0"
    assert now(one.admission, "b0", opening=False) is not None  # p1 knows it now

    second = now(two.admission, "b1", opening=True, name="second")  # p2 opens it elsewhere
    assert second is not None
    await second
    assert heard["second"] == "b0"  # where it lives: p2's routing learns it
    assert await redis.get(keys.affinity(digest)) == b"b0"  # not overwritten
    assert now(two.admission, "b1", opening=False) is None
