"""Slots given back to Redis: those of one loop turn go in one script call, each counted."""

from __future__ import annotations

from redis.asyncio import Redis

from firstbyte.router.shared.admission import _RELEASE, Claim, Verdict
from tests.router.redis_fixture import (  # noqa: F401 (fixtures)
    MakeAdmission,
    admitting,
    redis_server,
)

OWNER = b"owner"


async def test_releases_of_one_turn_are_one_call_and_each_gives_back_a_slot(
    admitting: MakeAdmission,  # noqa: F811
) -> None:
    rig = await admitting()
    redis, keys, admission = rig.redis, rig.keys, rig.admission
    for _ in range(3):  # three streams of one key on one backend
        admitted = await admission.admit(
            Claim(OWNER, "b0", 10, key_limit=10, rate_per_s=100.0, burst=100)
        )
        assert admitted.verdict is Verdict.ADMITTED
    assert await redis.hget(keys.key_slots(OWNER), "p1") == b"3"
    assert await redis.hget(keys.backend_load("b0"), "p1") == b"3"

    await redis.script_load(_RELEASE)  # loaded: no NOSCRIPT retry in the count
    calls = await _script_calls(redis)
    for _ in range(2):  # two of them end in the same loop turn
        admission.release_key(OWNER)
        admission.release_backend("b0")
    await admission.background.drain()
    assert await _script_calls(redis) == calls + 1
    assert await redis.hget(keys.key_slots(OWNER), "p1") == b"1"
    assert await redis.hget(keys.backend_load("b0"), "p1") == b"1"

    admission.release_key(OWNER)  # the last: the field goes, not to 0
    admission.release_backend("b0")
    await admission.background.drain()
    assert await redis.hgetall(keys.key_slots(OWNER)) == {}
    assert await redis.hgetall(keys.backend_load("b0")) == {}


async def _script_calls(redis: Redis) -> int:
    """EVALSHA calls the server has run so far."""
    stats = await redis.info("commandstats")
    return int(stats.get("cmdstat_evalsha", {}).get("calls", 0))

