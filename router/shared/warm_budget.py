"""Prompt warm-ups per key and user, counted by the region's processes together.

Without shared state each router process keeps its own minute
(:class:`firstbyte.router.prewarm.WarmBudget`), so a region of N processes lets a user warm N
times ``limits.prompt_warms_per_min_per_subject`` a minute. With ``[state] redis_url`` the
budget is the region's: a (key owner, subject) pair has a sorted set
``{prefix}w:{owner}:{subject}`` of its warm-ups in the last minute, scored by Redis's own clock
(every process counts one minute alike), and one script drops those older than the minute,
counts the rest, and either adds this one or answers how long until the oldest leaves, as the
in-memory budget does. The set expires a second after the minute of its last warm-up, so an
idle user costs nothing. One round trip per warm-up, which already costs a backend a prefill.

A Redis that does not answer refuses the warm-up (``503 state_unavailable``, as any request
the shared state cannot answer): a warm-up is best effort, and the message itself goes as
usual.
"""

from __future__ import annotations

import hashlib
import itertools
from typing import TYPE_CHECKING

from ..observability.logs import describe_error
from .errors import StateUnavailable
from .keys import Keys

if TYPE_CHECKING:
    from redis.asyncio import Redis

__all__ = ["SharedWarmBudget"]

# KEYS: the pair's set. ARGV: 1 warm-ups a minute, 2 the window (ms), 3 a member unique to this
# warm-up. Returns 0 (counted) or the ms until one may go (nothing counted).
_TAKE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local window = tonumber(ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - window)
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[1]) then
  local oldest = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
  return math.max(1, tonumber(oldest[2]) + window - now)
end
redis.call('ZADD', KEYS[1], now, ARGV[3])
redis.call('PEXPIRE', KEYS[1], window + 1000)
return 0
"""


class SharedWarmBudget:
    """The region's prompt warm-up budget in Redis (see the module docstring)."""

    def __init__(self, redis: Redis, keys: Keys, process: str, window_s: float = 60.0) -> None:
        self._take = redis.register_script(_TAKE)
        self._keys = keys
        self._process = process
        self._window_ms = round(window_s * 1000)
        self._ids = itertools.count()

    def key(self, owner: bytes, subject: str | None) -> str:
        """The pair's set (a subject of any length or bytes makes a short key: its digest)."""
        who = "-" if subject is None else hashlib.blake2b(
            subject.encode(), digest_size=12).hexdigest()
        return self._keys.warm_budget(owner, who)

    async def take(self, owner: bytes, subject: str | None, per_min: int) -> float | None:
        """Count a warm-up of (``owner``, ``subject``) and answer None, or answer the seconds
        until one may go (nothing counted); :class:`StateUnavailable` if Redis does not
        answer."""
        member = f"{self._process}:{next(self._ids)}"
        try:
            wait_ms = await self._take(
                keys=[self.key(owner, subject)], args=[per_min, self._window_ms, member])
        except Exception as exc:
            raise StateUnavailable(f"prompt warm-up budget: {describe_error(exc)}") from exc
        return None if int(wait_ms) == 0 else int(wait_ms) / 1000
