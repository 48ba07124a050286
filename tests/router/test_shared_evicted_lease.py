"""A producer's lease gone from a Redis that evicts (``allkeys-lru``): a reader on another
process still ends the stream as lost (the lease is all it can go by), but its ``stream_lost``
says the lease may have been evicted by Redis, naming the policy, instead of asserting that
the producing process stopped (it may well run on). On a real Valkey of the test's own
(``tests/router/test_shared_redis_full.py``'s fixture: a full one would fail other tests).
"""

from __future__ import annotations

import json
import logging

import pytest

from firstbyte.protocol import error_codes
from firstbyte.protocol.codec import event_data
from firstbyte.router.shared import SharedState
from firstbyte.router.shared.lease import eviction_policy
from firstbyte.router.shared.streams import is_lost_event, lost_event
from tests.router.test_shared_redis_full import _evict, _reader_elsewhere, shared  # noqa: F401


async def test_a_reader_elsewhere_says_a_lease_gone_may_have_been_evicted(
    shared: SharedState,  # noqa: F811
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Process ``p-evicted``'s lease is evicted (``allkeys-lru``, Redis filled by another
    program); its stream, events 1 and 2 and its metadata, is still there. The reader that
    waits after event 2 ends it with ``stream_lost`` and ``[DONE]``, the message naming the
    eviction and its policy (it said the process stopped), and so does its log line."""
    caplog.set_level(logging.WARNING, "firstbyte.router.shared")
    redis, keys = shared.redis, shared.keys
    lease = keys.lease("p-evicted")
    await redis.set(lease, b"1", px=60_000)
    await _evict(shared, lease)
    await redis.config_set("maxmemory", 0)  # no more evictions: the stream below stays
    for seq in (1, 2):
        await redis.xadd(keys.events("s-evicted"), {"d": b"data: %d" % seq}, id=f"{seq}-0")
    await redis.hset(keys.meta("s-evicted"), mapping={"owner": b"owner", "proc": b"p-evicted"})
    reader = _reader_elsewhere(shared)
    try:
        remote = await reader.lookup("s-evicted", b"owner")
        assert remote is not None
        assert await remote.wait(0, timeout_s=3)
        assert [e.seq for e in remote.after(0)] == [1, 2]
        assert await remote.wait(2, timeout_s=3)  # its lease checks, every 0.1 s
        ended = remote.after(2)
    finally:
        await reader.aclose()
    assert [e.seq for e in ended] == [3, 4]
    assert ended[-1].is_done
    assert is_lost_event(ended[0].data, "chat")  # a reader further behind tells it as lost
    error = json.loads(event_data(ended[0].data))["error"]
    assert error["code"] == error_codes.STREAM_LOST
    assert "may have been evicted by Redis (maxmemory-policy allkeys-lru)" in error["message"]
    assert "stopped" not in error["message"]
    [line] = [r.getMessage() for r in caplog.records if "s-evicted" in r.getMessage()]
    assert "may have been evicted by Redis (maxmemory-policy allkeys-lru;" in line, line


@pytest.mark.parametrize(("info", "policy"), [
    ({"maxmemory_policy": "allkeys-lru", "evicted_keys": 3}, "allkeys-lru"),
    ({"maxmemory_policy": "volatile-ttl", "evicted_keys": 1}, "volatile-ttl"),
    ({"maxmemory_policy": "allkeys-lru", "evicted_keys": 0}, None),  # none evicted yet
    ({"maxmemory_policy": "noeviction", "evicted_keys": 0}, None),
    ({}, None),  # an INFO without them (a managed Redis's): as before, the process stopped
    (None, None),  # no INFO at all
])
def test_a_lease_is_taken_as_maybe_evicted_only_where_redis_evicted_keys(
    info: dict[str, object] | None, policy: str | None
) -> None:
    assert eviction_policy(info) == policy


@pytest.mark.parametrize("format", ["chat", "responses", "messages"])
def test_both_lost_events_are_told_as_lost(format: str) -> None:
    """The readers of a stream tell its ``stream_lost`` (what a dead producer never wrote is
    gone, not trimmed) whichever of the two texts the declaring reader wrote."""
    for policy in (None, "allkeys-lru", "volatile-lfu"):
        assert is_lost_event(lost_event(format, evicted_by=policy), format)
    assert not is_lost_event(lost_event(format).replace(b"stopped", b"paused"), format)
