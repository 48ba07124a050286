"""What a request claims, region-wide, before it goes upstream: a slot of its API key (the
per-key concurrency limit and rate bucket), the backend its prefix has affinity with, and a
slot of that backend (its ``max_in_flight``).

In memory these are counts in one process (:mod:`firstbyte.router.tenancy`,
:mod:`firstbyte.router.backpressure`, :mod:`firstbyte.router.pipeline.affinity`). Shared, every
count is a Redis hash of *per-process contributions*, ``process -> in flight``, claimed and
checked atomically by a Lua script that sums the processes whose lease (:mod:`.lease`) still
exists and drops the others: a process that dies holding slots gives them back when its lease
lapses (``lease_s``), without anyone having to clean up after it. Releases are
fire-and-forget ``HINCRBY -1`` (a field at zero is deleted), those of one event-loop turn in
one script call: a stream's end gives back its key's slot and its backend's together. The
admissions and releases of one event-loop turn go in one round trip, packed by hand
(:class:`~.wire.Calls`): a round trip costs the router ~0.1 ms of CPU whatever it carries,
and redis-py's own path as much again per command. Every hash expires
``streams.max_age_s`` after its last claim, the longest a claimed request can live.

One script, one round trip per request, checks and claims everything at once (after the
process routed the request with what it knows): the key's concurrency, the prompt's affinity,
the backend's slots, then the key's rate; all pass, or nothing is claimed and the answer says
which failed (:class:`Verdict`):

- Key slots: ``{prefix}c:{owner}``, and the token bucket ``{prefix}q:{owner}`` (``tokens``,
  ``at`` on Redis's own clock, so every process refills one bucket alike).
- Affinity: ``{prefix}a:{digest}`` holds the backend of an affinity key for
  ``routing.affinity_ttl_s``, refreshed on every use. A process whose choice differs from the
  stored one learns it and routes again, so the same prompt goes to the same backend whichever
  process answers (the bounded-load count of keys per backend stays per process).
- Backend slots: ``{prefix}l:{backend}``; full when the processes together hold the backend's
  limit; the answer carries what the *other* processes hold, which this process adds to its
  own count when it routes (refreshed every housekeeping tick as well).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING, Any

from ..observability.logs import describe_error
from .background import Background
from .errors import StateUnavailable
from .keys import Keys

if TYPE_CHECKING:
    from redis.asyncio import Redis

__all__ = ["Admission", "Affinity", "SharedAdmission", "Verdict"]

log = logging.getLogger("firstbyte.router.shared")

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

# KEYS: the key's slots, its bucket, the affinity key, the backend's slots, the metadata of
# the stream the request will make ('' if none).
# ARGV: 1 process, 2 lease prefix, 3 key's max in flight (-1: no key limits at all, 0: the
# key's slots are counted but not capped), 4 rate/s,
# 5 burst, 6 expiry ms, 7 backend ('': a peer region, nothing to claim), 8 backend limit (-1:
# none), 9 affinity mode (0 none, 1 follow what is stored, 2 overwrite it), 10 affinity ms,
# 11 the stream's owner, 12 its subject, 13 its wire format ('': chat, no field written).
# Checks everything first, then claims both slots, takes the token and writes the stream's
# metadata (as the stream writer would: owner, process, subject); returns {0, in flight
# on the backend elsewhere} (admitted), {1, key's in flight} (key at its limit), {2, ms to a
# token}, {3, stored backend} (the affinity key lives elsewhere) or {4, in flight elsewhere}
# (backend full region-wide).
_ADMIT = _LIVE + """
local keyed = tonumber(ARGV[3]) >= 0
if keyed then
  local total = live(KEYS[1], ARGV[1], ARGV[2])
  local cap = tonumber(ARGV[3])
  if cap > 0 and total >= cap then return {1, total} end
end
local backend, mode = ARGV[7], ARGV[9]
if mode == '1' then
  local stored = redis.call('GET', KEYS[3])
  if stored and stored ~= backend then return {3, stored} end
end
local others = 0
if backend ~= '' then
  local total, mine = live(KEYS[4], ARGV[1], ARGV[2])
  others = total - mine
  local limit = tonumber(ARGV[8])
  if limit >= 0 and total >= limit then return {4, others} end
end
local rate = tonumber(ARGV[4])
if keyed and rate > 0 then
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
if keyed then
  redis.call('HINCRBY', KEYS[1], ARGV[1], 1)
  redis.call('PEXPIRE', KEYS[1], ARGV[6])
end
if backend ~= '' then
  redis.call('HINCRBY', KEYS[4], ARGV[1], 1)
  redis.call('PEXPIRE', KEYS[4], ARGV[6])
end
if mode ~= '0' then redis.call('SET', KEYS[3], backend, 'PX', ARGV[10]) end
if KEYS[5] ~= '' then
  redis.call('HSET', KEYS[5], 'owner', ARGV[11], 'proc', ARGV[1], 'subj', ARGV[12])
  if ARGV[13] ~= '' then redis.call('HSET', KEYS[5], 'fmt', ARGV[13]) end
  redis.call('PEXPIRE', KEYS[5], ARGV[6])
end
return {0, others}
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

# KEYS: slots to give back, one per release (a key twice: two slots). ARGV: 1 process.
_RELEASE = """
for i = 1, #KEYS do
  if redis.call('HINCRBY', KEYS[i], ARGV[1], -1) <= 0 then redis.call('HDEL', KEYS[i], ARGV[1]) end
end
"""

# KEYS: slots hashes. ARGV: 1 process, 2 expiry ms, then what this process holds in each.
# Writes this process's true contribution to each hash (deletes it at 0).
_RECONCILE = """
for i = 1, #KEYS do
  local n = tonumber(ARGV[i + 2])
  if n > 0 then
    redis.call('HSET', KEYS[i], ARGV[1], n)
    redis.call('PEXPIRE', KEYS[i], ARGV[2])
  else
    redis.call('HDEL', KEYS[i], ARGV[1])
  end
end
"""

_RECONCILE_ROUNDS = 2
"""Successful reconciliations after the last failed command: a command that timed out on a
frozen Redis may still run when it wakes, after the first one."""


class Verdict(IntEnum):
    """The admission script's answer (see :meth:`SharedAdmission.admit`)."""

    ADMITTED = 0
    KEY_BUSY = 1
    """The key has its ``max_in_flight`` completions in flight, region-wide."""
    KEY_RATE = 2
    """The key's bucket is empty."""
    AFFINITY_ELSEWHERE = 3
    """The prompt's affinity key went to another backend: route again, following it."""
    BACKEND_FULL = 4
    """The region's processes hold the backend's limit: route again, knowing it."""


class Affinity(IntEnum):
    """What the admission does with the prompt's affinity key."""

    NONE = 0
    """Nothing (a balance or queue choice, a peer region)."""
    FOLLOW = 1
    """Refuse (:attr:`Verdict.AFFINITY_ELSEWHERE`) if it is stored for another backend; else
    store (or refresh) it for this one."""
    OVERWRITE = 2
    """Store it for this backend (its stored backend cannot take the request here)."""


@dataclass(frozen=True, slots=True)
class Admission:
    """The verdict and its value: ADMITTED and BACKEND_FULL: in flight on the backend on the
    other processes; KEY_BUSY: the key's in flight; KEY_RATE: seconds to a token;
    AFFINITY_ELSEWHERE: the stored backend."""

    verdict: Verdict
    value: float | str


def affinity_digest(key: str) -> str:
    """A fixed-size name for an affinity key (which holds up to ``affinity_chars`` of prompt)."""
    return hashlib.blake2b(key.encode(), digest_size=16).hexdigest()


class SharedAdmission:
    """Claims and releases of key slots, backend slots and affinity (see the module docstring).

    This process keeps its own ledger of what it holds in each slots hash (:attr:`held`): a
    claim is counted when the script's answer says so, a release when it is asked for. A
    command whose outcome is unknown (a timeout, a connection lost mid-call, a release that
    failed) marks its hashes unsure, and :meth:`reconcile` (the housekeeping tick) writes the
    ledger's figures over this process's fields once Redis answers, with no other claim or
    release in flight meanwhile. So a request that failed never leaves a slot claimed, and
    a process whose lease lapsed (Redis restarted: the others dropped its fields) counts again.
    """

    def __init__(
        self, redis: Redis, keys: Keys, process: str, *, expiry_s: float, affinity_ttl_s: float,
        timeout_s: float = 2.0,
    ) -> None:
        self._redis = redis
        self.keys = keys
        self.process = process
        self._lease_prefix = keys.lease("")
        self._expiry_ms = int(expiry_s * 1000)
        self._affinity_ms = max(1, int(affinity_ttl_s * 1000))
        # redis-py is imported lazily: placement imports this module, with or without it.
        from .wire import Calls, PackedScript

        self._admit = PackedScript(_ADMIT)
        self._release = PackedScript(_RELEASE)
        self.batch = Calls(redis.connection_pool, timeout_s)
        """The admissions and releases of one loop turn go in one round trip, packed here
        (:mod:`.wire`): through redis-py each cost the router ~100 µs of CPU."""
        self._others = redis.register_script(_OTHERS)
        self._reconcile = redis.register_script(_RECONCILE)
        self._releasing: list[str] = []
        """Slots given back this loop turn, not sent yet."""
        self.background = Background()
        self.held: Counter[str] = Counter()
        """Slots this process holds, by hash: what its field in each should say."""
        self._unsure: set[str] = set()
        """Hashes a failed claim or release may or may not have changed."""
        self._rounds_due = 0
        self._calls = 0
        """Claims and releases sent and not answered yet."""
        self._quiet = asyncio.Event()
        self._quiet.set()
        self._gate: asyncio.Future[None] | None = None
        """Set while :meth:`reconcile` runs: claims and releases wait for it."""
        self.failures = 0
        self.reconciled = 0

    async def start(self) -> None:
        """Load the admission and release scripts (the others load themselves when first
        used); a Redis away at start sends them with their first call instead."""
        with contextlib.suppress(Exception):
            await self._redis.script_load(_ADMIT)
            await self._redis.script_load(_RELEASE)

    async def admit(
        self,
        owner: bytes,
        *,
        keyed: bool = True,
        key_limit: int | None,
        rate_per_s: float,
        burst: int,
        backend: str | None,
        backend_limit: int | None,
        affinity_key: str | None,
        affinity: Affinity,
        stream_id: str | None = None,
        subject: str | None = None,
        stream_format: str = "chat",
    ) -> Admission:
        """One round trip: check ``owner``'s concurrency (``keyed`` False: no per-key limits
        nor counts; ``key_limit`` None: counted, no cap), the affinity of ``affinity_key``,
        ``backend``'s slots (None: a peer region, nothing to claim; ``backend_limit`` None: no
        limit, a request queued on purpose) and the key's rate, in that order; if all pass,
        claim a slot of each and take a token, and make ``stream_id`` (``owner``'s, for
        ``subject``, in ``stream_format``) findable by the region's processes: announced
        with the admission, in its round trip, instead of in one of its own before the
        stream's id goes out.

        :class:`StateUnavailable` if Redis does not answer: nothing is counted as held, and
        whatever the script may have claimed is undone by :meth:`reconcile`."""
        digest = affinity_digest(affinity_key or "")
        key_slots = self.keys.key_slots(owner)
        backend_load = self.keys.backend_load(backend or "")
        keys = (key_slots, self.keys.key_bucket(owner), self.keys.affinity(digest), backend_load,
                "" if stream_id is None else self.keys.meta(stream_id))
        args = (
            self.process, self._lease_prefix, -1 if not keyed else (key_limit or 0),
            rate_per_s, burst, self._expiry_ms, backend or "",
            -1 if backend_limit is None else backend_limit,
            int(affinity if affinity_key is not None else Affinity.NONE), self._affinity_ms,
            owner, subject or "", "" if stream_format == "chat" else stream_format,
        )
        claims = ([key_slots] if keyed else []) + (
            [backend_load] if backend is not None else []
        )
        await self._wait_gate()
        self._begin()
        try:
            reply = await self.batch.script(self._admit, keys, args)
        except Exception as exc:
            self._uncertain(claims)
            raise StateUnavailable(f"admission: {describe_error(exc)}") from exc
        except BaseException:  # cancelled (the client left): the script may have run all the same
            self._uncertain(claims)
            raise
        finally:
            self._end()
        verdict = Verdict(int(reply[0]))
        value = reply[1]
        if verdict is Verdict.ADMITTED:
            self.held.update(claims)
        if verdict is Verdict.AFFINITY_ELSEWHERE:
            return Admission(verdict, value.decode())
        if verdict is Verdict.KEY_RATE:
            return Admission(verdict, int(value) / 1000)
        return Admission(verdict, int(value))

    async def claim_backend(self, backend: str, limit: int) -> bool:
        """Claim a slot of ``backend`` alone, for a request moved there after its own
        backend refused the connection (its key's slot and affinity stay as claimed); False
        if the processes together hold ``limit`` on it, or Redis does not answer."""
        try:
            answer = await self.admit(
                b"", keyed=False, key_limit=None, rate_per_s=0.0, burst=0, backend=backend,
                backend_limit=limit, affinity_key=None, affinity=Affinity.NONE,
            )
        except StateUnavailable as exc:
            log.debug("cannot claim a slot of %s for a failover: %s", backend, exc)
            return False
        return answer.verdict is Verdict.ADMITTED

    def release_key(self, owner: bytes) -> None:
        """Give back a slot of ``owner`` claimed by :meth:`admit`."""
        self._spawn_release(self.keys.key_slots(owner))

    def release_backend(self, backend: str) -> None:
        """Give back a slot of ``backend`` claimed by :meth:`admit` or :meth:`claim_backend`."""
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

    def _spawn_release(self, key: str) -> None:
        held = self.held[key] - 1
        if held > 0:
            self.held[key] = held
        else:
            del self.held[key]
        self._releasing.append(key)
        if len(self._releasing) == 1:  # the first of this turn: send them all after it
            self.background.spawn(self._send_releases())

    async def _send_releases(self) -> None:
        await asyncio.sleep(0)  # the rest of this loop turn's releases join this call
        await self._wait_gate()
        keys, self._releasing = self._releasing, []
        if not keys:  # a reconciliation wrote them meanwhile
            return
        self._begin()
        try:
            await self.batch.script(self._release, keys, (self.process,))
        except Exception:
            self._uncertain(keys)
            raise  # logged at debug level by Background; reconcile repairs it
        finally:
            self._end()

    # --- reconciliation -----------------------------------------------------------------
    @property
    def unsure(self) -> bool:
        """Some hash may not say what this process holds: :meth:`reconcile` is due."""
        return self._rounds_due > 0

    def lapsed(self) -> None:
        """The lease had lapsed: the other processes may have dropped every field of ours."""
        self._uncertain(list(self.held))

    def _uncertain(self, keys: Sequence[str]) -> None:
        self.failures += 1
        self._unsure.update(keys)
        self._rounds_due = _RECONCILE_ROUNDS

    def _begin(self) -> None:
        self._calls += 1
        self._quiet.clear()

    def _end(self) -> None:
        self._calls -= 1
        if self._calls == 0:
            self._quiet.set()

    async def _wait_gate(self) -> None:
        while self._gate is not None:
            await asyncio.shield(self._gate)

    async def reconcile(self, timeout_s: float) -> bool:
        """If a claim or release failed (or the lease lapsed), write what this process holds
        over its fields of the hashes concerned: claims and releases wait meanwhile, and it
        waits (up to ``timeout_s``) for those in flight. True once nothing is unsure."""
        if self._rounds_due == 0:
            return True
        if self._gate is not None:
            return False
        gate = self._gate = asyncio.get_running_loop().create_future()
        try:
            async with asyncio.timeout(timeout_s):
                await self._quiet.wait()
            self._releasing.clear()  # already subtracted from the ledger written now
            keys = sorted(self._unsure | set(self.held))
            counts = [self.held.get(key, 0) for key in keys]
            if keys:
                async with asyncio.timeout(timeout_s):
                    await self._reconcile(
                        keys=keys, args=[self.process, self._expiry_ms, *counts]
                    )
        except Exception as exc:
            log.debug("cannot reconcile the slots held here yet: %s", describe_error(exc))
            return False
        finally:
            self._gate = None
            gate.set_result(None)
        self._unsure.difference_update(keys)
        self._rounds_due -= 1
        self.reconciled += 1
        if self._rounds_due == 0:
            log.info("shared state reachable again: the slots held here (%d hashes) rewritten",
                     len(keys))
        return self._rounds_due == 0

    async def aclose(self) -> None:
        """Let the releases in flight finish (a clean exit gives its slots back at once)."""
        await self.background.drain()
        await self.background.aclose()
        await self.batch.aclose()
