"""What a request claims, region-wide, before it goes upstream: a slot of its API key (the
per-key concurrency limit and rate bucket), the backend its prefix has affinity with, and a
slot of that backend (its ``max_in_flight``).

In memory these are counts in one process (:mod:`firstbyte.router.tenancy`,
:mod:`firstbyte.router.backpressure`, :mod:`firstbyte.router.pipeline.affinity`). Shared, every
count is a Redis hash of *per-process contributions*, ``process -> in flight``, claimed and
checked atomically by a Lua script that sums the processes whose lease (:mod:`.lease`) still
exists and drops the others: a process that dies holding slots gives them back when its lease
lapses (``lease_s``), without anyone having to clean up after it. Releases are
fire-and-forget ``HINCRBY -1`` (a field at zero is deleted); every hash expires
``streams.max_age_s`` after its last claim, the longest a claimed request can live.

- Key slots: ``{prefix}c:{owner}`` and the token bucket ``{prefix}q:{owner}`` (``tokens``, ``at``
  on Redis's own clock, so every process refills one bucket alike); one script checks the
  concurrency, takes a token and claims the slot, one round trip per request, pipelined with
  the affinity lookup.
- Affinity: ``{prefix}a:{digest}`` holds the backend of an affinity key for
  ``routing.affinity_ttl_s``, refreshed on every use; a new key is written only if absent
  (``SET NX``), so two processes that place the same new key at once agree from the next
  request on. The bounded-load count of keys per backend stays per process.
- Backend slots: ``{prefix}l:{backend}``; the claim is refused when the processes together hold
  the backend's limit, and returns what the *other* processes hold, which this process adds to
  its own count when it routes (refreshed every housekeeping tick as well).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from redis.exceptions import NoScriptError

from .background import Background
from .keys import Keys

if TYPE_CHECKING:
    from redis.asyncio import Redis

__all__ = ["KeyClaim", "SharedAdmission"]

# live(hash, me, lease prefix): in flight over the processes whose lease exists (me always),
# and mine; the fields of processes whose lease lapsed are deleted on the way.
_LIVE = """
local function live(hash, me, lease_prefix)
  local fields = redis.call('HGETALL', hash)
  local total, mine = 0, 0
  for i = 1, #fields, 2 do
    local proc, n = fields[i], tonumber(fields[i + 1])
    if proc == me then
      mine = n
      total = total + n
    elseif redis.call('EXISTS', lease_prefix .. proc) == 1 then
      total = total + n
    else
      redis.call('HDEL', hash, proc)
    end
  end
  return total, mine
end
"""

# KEYS: slots, bucket. ARGV: process, lease prefix, max in flight, rate/s, burst, expiry ms.
# Returns {0, in flight now} (claimed), {1, in flight} (at the limit) or {2, ms to a token}.
_ADMIT_KEY = _LIVE + """
local total = live(KEYS[1], ARGV[1], ARGV[2])
if total >= tonumber(ARGV[3]) then return {1, total} end
local rate = tonumber(ARGV[4])
if rate > 0 then
  local burst = tonumber(ARGV[5])
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  local bucket = redis.call('HMGET', KEYS[2], 'tokens', 'at')
  local tokens = tonumber(bucket[1]) or burst
  local at = tonumber(bucket[2]) or now
  tokens = math.min(burst, tokens + math.max(0, now - at) * rate / 1000)
  if tokens < 1 then return {2, math.ceil((1 - tokens) / rate * 1000)} end
  redis.call('HSET', KEYS[2], 'tokens', tostring(tokens - 1), 'at', tostring(now))
  redis.call('PEXPIRE', KEYS[2], math.ceil(burst / rate * 1000) + 1000)
end
redis.call('HINCRBY', KEYS[1], ARGV[1], 1)
redis.call('PEXPIRE', KEYS[1], ARGV[6])
return {0, total + 1}
"""

# KEYS: a backend's slots. ARGV: process, lease prefix, limit (-1: none), expiry ms.
# Returns {1 claimed | 0 at the limit, in flight on the other processes}.
_CLAIM = _LIVE + """
local total, mine = live(KEYS[1], ARGV[1], ARGV[2])
local limit = tonumber(ARGV[3])
if limit >= 0 and total >= limit then return {0, total - mine} end
redis.call('HINCRBY', KEYS[1], ARGV[1], 1)
redis.call('PEXPIRE', KEYS[1], ARGV[4])
return {1, total - mine}
"""

# KEYS: slots hashes. ARGV: process, lease prefix. In flight on the other processes, per key.
_OTHERS = _LIVE + """
local out = {}
for i = 1, #KEYS do
  local total, mine = live(KEYS[i], ARGV[1], ARGV[2])
  out[i] = total - mine
end
return out
"""

# KEYS: slots. ARGV: process.
_RELEASE = """
if redis.call('HINCRBY', KEYS[1], ARGV[1], -1) <= 0 then redis.call('HDEL', KEYS[1], ARGV[1]) end
"""


@dataclass(frozen=True, slots=True)
class KeyClaim:
    """The answer to a key's admission: ``refused`` is ``None`` (a slot claimed), ``"slots"``
    (``value`` = its completions in flight) or ``"rate"`` (``value`` = seconds to a token);
    ``backend`` is where its affinity key went before, if anywhere."""

    refused: str | None
    value: float
    backend: str | None


def affinity_digest(key: str) -> str:
    """A fixed-size name for an affinity key (which holds up to ``affinity_chars`` of prompt)."""
    return hashlib.blake2b(key.encode(), digest_size=16).hexdigest()


class SharedAdmission:
    """Claims and releases of key slots, backend slots and affinity (see the module docstring)."""

    def __init__(
        self, redis: Redis, keys: Keys, process: str, *, expiry_s: float, affinity_ttl_s: float
    ) -> None:
        self._redis = redis
        self.keys = keys
        self.process = process
        self._lease_prefix = keys.lease("")
        self._expiry_ms = int(expiry_s * 1000)
        self._affinity_ms = max(1, int(affinity_ttl_s * 1000))
        self._admit_key = redis.register_script(_ADMIT_KEY)
        self._claim = redis.register_script(_CLAIM)
        self._others = redis.register_script(_OTHERS)
        self._release = redis.register_script(_RELEASE)
        self.background = Background()

    async def start(self) -> None:
        """Load the admission script (the others load themselves when first used)."""
        await self._redis.script_load(_ADMIT_KEY)

    async def admit_key(
        self,
        owner: bytes,
        affinity_key: str | None,
        *,
        max_in_flight: int | None,
        rate_per_s: float,
        burst: int,
    ) -> KeyClaim:
        """Claim a slot of ``owner`` (``max_in_flight`` None: no concurrency or rate limit, no
        slot) and look up where ``affinity_key`` went, in one round trip."""
        try:
            replies = await self._admit_pipeline(owner, affinity_key, max_in_flight, rate_per_s,
                                                 burst)
        except NoScriptError:  # Redis restarted (or SCRIPT FLUSH): load it again, once
            self._admit_key.sha = await self._redis.script_load(_ADMIT_KEY)
            replies = await self._admit_pipeline(owner, affinity_key, max_in_flight, rate_per_s,
                                                 burst)
        backend = replies.pop() if affinity_key is not None else None
        if max_in_flight is None:
            return KeyClaim(None, 0, _text(backend))
        code, value = replies[0]
        refused = {0: None, 1: "slots", 2: "rate"}[int(code)]
        return KeyClaim(refused, value / 1000 if refused == "rate" else value, _text(backend))

    async def _admit_pipeline(
        self, owner: bytes, affinity_key: str | None, max_in_flight: int | None,
        rate_per_s: float, burst: int,
    ) -> list[Any]:
        # EVALSHA in a plain pipeline: redis-py's Script in a pipeline asks SCRIPT EXISTS
        # first, a second round trip on every request.
        async with self._redis.pipeline(transaction=False) as pipe:
            if max_in_flight is not None:
                pipe.evalsha(
                    self._admit_key.sha, 2, self.keys.key_slots(owner), self.keys.key_bucket(owner),
                    self.process, self._lease_prefix, max_in_flight, rate_per_s, burst,
                    self._expiry_ms,
                )
            if affinity_key is not None:
                pipe.get(self.keys.affinity(affinity_digest(affinity_key)))
            replies: list[Any] = await pipe.execute()
        return replies

    def release_key(self, owner: bytes) -> None:
        """Give back a slot of ``owner`` claimed by :meth:`admit_key`."""
        self._spawn_release(self.keys.key_slots(owner))

    async def claim_backend(self, backend: str, limit: int | None) -> tuple[bool, int]:
        """Claim a slot of ``backend`` unless the processes together hold ``limit`` (None: no
        limit, e.g. a request queued on purpose); returns (claimed, in flight elsewhere)."""
        claimed, others = await self._claim(
            keys=[self.keys.backend_load(backend)],
            args=[self.process, self._lease_prefix, -1 if limit is None else limit,
                  self._expiry_ms],
        )
        return bool(claimed), int(others)

    def release_backend(self, backend: str) -> None:
        """Give back a slot of ``backend`` claimed by :meth:`claim_backend`."""
        self._spawn_release(self.keys.backend_load(backend))

    async def backends_elsewhere(self, backends: Sequence[str]) -> list[int]:
        """What the other processes have in flight on each of ``backends``."""
        if not backends:
            return []
        others: list[Any] = await self._others(
            keys=[self.keys.backend_load(b) for b in backends],
            args=[self.process, self._lease_prefix],
        )
        return [int(n) for n in others]

    def remember_affinity(self, affinity_key: str, backend: str, *, new: bool) -> None:
        """``affinity_key`` goes to ``backend`` for the next ``affinity_ttl_s``; a ``new`` key
        only if no process placed it meanwhile."""
        key = self.keys.affinity(affinity_digest(affinity_key))
        self.background.spawn(self._redis.set(key, backend, px=self._affinity_ms, nx=new))

    def _spawn_release(self, key: str) -> None:
        self.background.spawn(self._release(keys=[key], args=[self.process]))

    async def aclose(self) -> None:
        """Let the releases in flight finish (a clean exit gives its slots back at once)."""
        await self.background.drain()
        await self.background.aclose()


def _text(value: bytes | None) -> str | None:
    return None if value is None else value.decode()
