"""A process's lease: one Redis key that exists while the process runs.

The process sets ``{prefix}p:{process}`` with a time to live of ``lease_s`` and renews it
every ``lease_s / 3``. Its streams record the process id; a reader elsewhere that finds a
stream unfinished and the lease gone knows the producer died (killed, crashed, its host lost)
and ends the stream with a ``stream_lost`` error event instead of waiting forever. One key
per process, not per stream: 2,000 live streams cost one ``PEXPIRE`` a second, not 2,000
(a ``SET`` when the key is gone: the first, or after a lapse; a full Redis refuses a ``SET``,
not a ``PEXPIRE``).

The renewals are also the process's one steady look at Redis, whatever the traffic: their
outcomes say whether the shared state counts as down (:class:`Outage`), which ``/healthz``
reads without asking Redis itself.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from firstbyte.tasks import cancel_and_wait

from ..hosting.limits import Throttle
from ..observability.logs import describe_error
from .keys import Keys

if TYPE_CHECKING:
    from redis.asyncio import Redis

__all__ = ["DOWN_AFTER_FAILED_RENEWALS", "Lease", "Outage", "eviction_policy", "lapse_reason"]

log = logging.getLogger("firstbyte.router.shared")

DOWN_AFTER_FAILED_RENEWALS = 2
"""Renewals that must fail in a row before the shared state counts as down: one slow or
failed command is not an outage (every process of a region shares the one Redis, so a blip
counted as one would take them all out of their balancer at once)."""


class Outage:
    """Whether the shared state counts as down, from the lease renewals' outcomes (sans-IO):
    down once :data:`DOWN_AFTER_FAILED_RENEWALS` renewals in a row failed, up again at the
    first that reaches Redis (requests are admitted again from then on)."""

    def __init__(self, down_after: int = DOWN_AFTER_FAILED_RENEWALS) -> None:
        self.down_after = down_after
        self.failed_in_a_row = 0

    @property
    def down(self) -> bool:
        return self.failed_in_a_row >= self.down_after

    def renewed(self, ok: bool) -> bool | None:
        """Count one renewal's outcome; the new :attr:`down` when this one changed it, else
        None."""
        was = self.down
        self.failed_in_a_row = 0 if ok else self.failed_in_a_row + 1
        return self.down if self.down != was else None


def eviction_policy(info: Mapping[str, Any] | None) -> str | None:
    """The ``maxmemory-policy`` of a Redis (its ``INFO``) that evicts keys and has evicted
    some, so a key found gone before its expiry may have been evicted; None otherwise (no
    ``INFO``, ``noeviction``, or nothing evicted yet)."""
    if info is None:
        return None
    policy = info.get("maxmemory_policy", "noeviction")
    if policy != "noeviction" and info.get("evicted_keys", 0) > 0:
        return str(policy)
    return None


def lapse_reason(
    since_renewed_s: float | None, lease_s: float, info: Mapping[str, Any] | None,
    run_id: str | None = None,
) -> str:
    """Why a lease found gone at renewal was gone, from the time since its last renewal that
    reached Redis, Redis's ``INFO`` then and its ``run_id`` before (None: not known). A new
    ``run_id``: Redis restarted. Renewed less than ``lease_s`` before, the lease cannot have
    expired: Redis evicted it (a ``maxmemory-policy`` that evicts, evictions counted) or
    something deleted it."""
    if info is None or since_renewed_s is None:
        return "Redis restarted or away"
    if run_id is not None and info.get("run_id", run_id) != run_id:
        return "Redis restarted"
    if since_renewed_s >= lease_s:
        return f"expired: Redis away or this process stalled for over {lease_s:g} s"
    policy = eviction_policy(info)
    if policy is not None:
        return (f"evicted by Redis (maxmemory-policy {policy}; run it with noeviction: the"
                " other processes took this one for dead)")
    return "removed before its expiry (deleted, or Redis emptied)"


async def redis_info(redis: Redis) -> dict[str, Any] | None:
    """Redis's whole ``INFO`` (every server has the default sections; Redis 6 takes one
    section name at most), None if it does not answer."""
    try:
        info: dict[str, Any] = await redis.info()
    except Exception:
        return None
    return info


def _run_id(info: Mapping[str, Any] | None) -> str | None:
    run_id = None if info is None else info.get("run_id")
    return run_id if isinstance(run_id, str) else None


class Lease:
    """Take, renew and release this process's lease (see the module docstring)."""

    def __init__(self, redis: Redis, keys: Keys, process: str, lease_s: float) -> None:
        self._redis = redis
        self.key = keys.lease(process)
        self.lease_s = lease_s
        self._task: asyncio.Task[None] | None = None
        self._taken = False
        self.renew_failures = 0
        self.reachable = False
        """Did the last renewal reach Redis (``firstbyte_router_redis_up``)?"""
        self.outage = Outage()
        """Whether Redis counts as down (``/healthz`` 503 ``state_unavailable``)."""
        self.lapses = 0
        """Renewals that found the lease gone (Redis restarted or was away past ``lease_s``)."""
        self.on_lapse: Callable[[], object] | None = None
        """Called when a renewal finds the lease gone: meanwhile the other processes dropped
        this process's counts as a dead process's (:meth:`SharedAdmission.reconcile` writes
        them again)."""
        self._throttle = Throttle(10.0)
        self._stopping = False
        """Set by :meth:`aclose`: the renewals end."""
        self._run_id: str | None = None
        """Redis's ``run_id`` when this process took its lease: another one at a lapse says
        Redis restarted."""
        self._renewed_at: float | None = None
        """When a renewal last reached Redis (``time.monotonic``): a lapse found sooner
        than ``lease_s`` after it is no expiry (:func:`lapse_reason`)."""

    @property
    def check_interval_s(self) -> float:
        """How often readers look at a producer's lease (and the producer renews its own)."""
        return self.lease_s / 3

    async def start(self) -> None:
        """Take the lease now (so streams created at once are covered), then keep renewing;
        a Redis away at start is retried by the renewals (the CLI checked it was there)."""
        await self._renew_or_log()
        if self._task is None:
            self._task = asyncio.create_task(self._keep())

    async def _renew(self) -> None:
        # PEXPIRE while the key is there: a full Redis (maxmemory, noeviction) refuses a SET
        # (OOM) but not a PEXPIRE, and with SET alone every process's lease lapsed while it
        # was full: the others took it for dead, dropped its counts and, once Redis had room,
        # could declare its live streams lost (cancelling them).
        px = int(self.lease_s * 1000)
        if self._taken and await self._redis.pexpire(self.key, px):
            self._renewed_at = time.monotonic()
            return
        was = await self._redis.set(self.key, b"1", px=px, get=True)
        renewed_at, self._renewed_at = self._renewed_at, time.monotonic()
        if was is None and self._taken:
            self.lapses += 1
            info = await self._info()
            why = lapse_reason(None if renewed_at is None else self._renewed_at - renewed_at,
                               self.lease_s, info, self._run_id)
            self._run_id = _run_id(info) or self._run_id
            log.warning("the process lease had lapsed (%s); taken again", why)
            if self.on_lapse is not None:
                self.on_lapse()
        elif not self._taken:  # first taken, Redis just answered: which Redis, once
            self._run_id = _run_id(await self._info())
        self._taken = True

    async def _info(self) -> dict[str, Any] | None:
        """Redis's ``INFO`` (``run_id``, memory policy, evictions): asked when the lease is
        first taken and at each lapse, never per renewal; None if it does not answer."""
        return await redis_info(self._redis)

    async def _renew_or_log(self) -> None:
        try:
            await self._renew()
        except Exception as exc:  # Redis away: keep trying; readers may call us lost
            self.reachable = False
            self.renew_failures += 1
            more = self._throttle.report("renew", time.monotonic(), "failures")
            if more is not None:
                log.warning("cannot renew the process lease: %s%s", describe_error(exc), more)
            if self.outage.renewed(False):
                log.warning("shared state unreachable (%d lease renewals in a row failed):"
                            " /healthz answers 503 state_unavailable until it answers",
                            self.outage.failed_in_a_row)
        else:
            self.reachable = True
            if self.outage.renewed(True) is False:
                log.warning("shared state reachable again: /healthz no longer says so")

    async def _keep(self) -> None:
        # Until aclose says stop, not only until it cancels: a cancel that lands inside a
        # renewal can be absorbed by redis-py (the renewal returns), and the loop slept on
        # with the cancel spent, holding aclose (and the process's exit) for ever.
        while not self._stopping:
            await asyncio.sleep(self.check_interval_s)
            if not self._stopping:
                await self._renew_or_log()

    async def aclose(self) -> None:
        """Stop renewing and delete the key (a clean exit ends no one's stream as lost:
        its producers have finished or appended their own error by then)."""
        self._stopping = True
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None
        await self._redis.delete(self.key)
