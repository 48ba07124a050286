"""When a process counts its shared state as down (``/healthz`` 503 ``state_unavailable``):
after two lease renewals in a row failed, up again at the first that reaches Redis.

The rule alone (:class:`Outage`, sans-IO), then a real :class:`Lease` on a real
``valkey-server`` frozen with SIGSTOP, its renewals driven one at a time.
"""

from __future__ import annotations

import os
import signal

from redis.asyncio import Redis

from firstbyte.benchmarks.redis_server import running_redis
from firstbyte.router.config import parse_config
from firstbyte.router.shared import pool_for
from firstbyte.router.shared.keys import Keys
from firstbyte.router.shared.lease import DOWN_AFTER_FAILED_RENEWALS, Lease, Outage


def test_one_failed_renewal_is_not_an_outage() -> None:
    outage = Outage()
    assert DOWN_AFTER_FAILED_RENEWALS == 2
    assert not outage.down  # a process starts up
    assert outage.renewed(False) is None  # one slow or failed command: no change
    assert not outage.down
    assert outage.renewed(True) is None  # and the count starts again
    assert outage.renewed(False) is None
    assert outage.renewed(False) is True  # two in a row: down, said once
    assert outage.renewed(False) is None
    assert outage.down
    assert outage.renewed(True) is False  # the first that answers: up
    assert not outage.down
    assert outage.renewed(True) is None


async def test_a_frozen_redis_is_down_after_two_renewals_and_up_at_the_next() -> None:
    """Each renewal against the frozen server times out after ``state.timeout_s``; the
    process counts Redis down at the second, and up at the first renewal after it wakes."""
    with running_redis() as server:
        config = parse_config(
            {
                "upstreams": [{"url": "http://127.0.0.1:9/v1"}],
                "listen": {"insecure_plain_http": True},
                "auth": {"allow_anonymous": True},
                "state": {"redis_url": server.url, "timeout_s": 0.5, "key_prefix": "lease:"},
            },
            "test",
        )
        redis = Redis(connection_pool=pool_for(config))
        lease = Lease(redis, Keys("lease:"), "p1", 3.0)
        try:
            await lease._renew_or_log()  # taken
            assert lease.reachable
            assert not lease.outage.down
            os.kill(server.pid, signal.SIGSTOP)
            try:
                await lease._renew_or_log()
                assert not lease.reachable
                assert not lease.outage.down
                await lease._renew_or_log()
                assert lease.outage.down
            finally:
                os.kill(server.pid, signal.SIGCONT)
            await lease._renew_or_log()
            assert lease.reachable
            assert not lease.outage.down
            assert lease.renew_failures == 2
            assert await redis.exists(lease.key) == 1
        finally:
            await redis.aclose()
            await redis.connection_pool.disconnect()
