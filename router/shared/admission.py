"""What a request claims, region-wide, before it goes upstream: a slot of its API key (the
per-key concurrency limit and rate bucket), the backend its prefix has affinity with, and a
slot of that backend (its ``max_in_flight``).

In memory these are counts in one process (:mod:`firstbyte.router.tenancy`,
:mod:`firstbyte.router.backpressure`, :mod:`firstbyte.router.pipeline.affinity`). Shared, every
count is a Redis hash of *per-process contributions*, ``process -> in flight`` (and, for a
backend, ``process/s -> spare``, below), claimed and checked atomically by a Lua script that
sums the processes whose lease (:mod:`.lease`) still exists and drops the others: a process
that dies holding slots gives them back when its lease lapses (``lease_s``), without anyone
having to clean up after it. Releases are fire-and-forget ``HINCRBY -1`` (a field at zero is
deleted), those of one event-loop turn in one script call: a stream's end gives back its
key's slot and its backend's together. The admissions, claims and releases of one event-loop
turn go in one round trip, packed by hand (:class:`~.wire.Calls`): a round trip costs the
router ~0.1 ms of CPU whatever it carries, and redis-py's own path as much again per
command. Every hash expires ``streams.max_age_s`` after its last claim, the longest a
claimed request can live.

**Waiting for Redis** (:meth:`SharedAdmission.admit`): one script, one round trip before the
upstream request, checks and claims everything at once (after the process routed the request
with what it knows): the key's concurrency, the prompt's affinity, the backend's slots, then
the key's rate; all pass, or nothing is claimed and the answer says which failed
(:class:`Verdict`):

- Key slots: ``{prefix}c:{owner}``, and the token bucket ``{prefix}q:{owner}`` (``tokens``,
  ``at`` on Redis's own clock, so every process refills one bucket alike).
- Affinity: ``{prefix}a:{digest}`` holds the backend of an affinity key for
  ``routing.affinity_ttl_s``, refreshed on every use. A process whose choice differs from the
  stored one learns it and routes again, so a conversation goes to the same backend whichever
  process answers (the bounded-load count of keys per backend stays per process).
- Backend slots: ``{prefix}l:{backend}``; full when the processes together hold the backend's
  limit (spare slots included); the answer carries what the *other* processes have in flight,
  which this process adds to its own count when it routes (refreshed every housekeeping tick
  as well).

**Not waiting** (:meth:`SharedAdmission.admit_now`): a request nothing in Redis can refuse is
admitted at once, and goes upstream while its claim (``_CLAIM``: the same counts, the
affinity key, the stream's metadata) travels in the next batch. That is a request whose key
has no cap nor rate (the default), whose affinity key this process heard Redis hold for the
backend it chose, or which opens a conversation (no other process can have placed its key
yet: the claim says if one did, and the next turn follows), and for whose backend this
process holds a *spare slot*: slots claimed in Redis ahead, with admissions and claims, as far
as they fit under the backend's limit (:func:`spare_slots`: 1/64 of it, at most 32), asked for
again when half are used, kept when a stream ends while fewer are held, and given back after a
housekeeping tick that used none, and on exit. They count toward the limit, not toward the
load the other processes route by. A ramp of new conversations then starts without a round
trip before any upstream request, and limits stay exact: what a process holds spare, the
others cannot claim.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import TYPE_CHECKING, Any

from ..observability.logs import describe_error
from .background import Background
from .errors import StateUnavailable
from .keys import Keys

if TYPE_CHECKING:
    from redis.asyncio import Redis

__all__ = ["Admission", "Affinity", "Claim", "SharedAdmission", "Verdict"]

log = logging.getLogger("firstbyte.router.shared")

# add(hash, field, n): HINCRBY that deletes a field falling to 0 or below.
_ADD = """
local function add(hash, field, n)
  if redis.call('HINCRBY', hash, field, n) <= 0 then redis.call('HDEL', hash, field) end
end
"""

# live(hash, me, lease prefix): the slots held in a hash over the processes whose lease
# exists (me always), in flight (field '<process>') and spare (field '<process>/s'): all of
# them, mine, and the other processes' in flight alone; the fields of processes whose lease
# lapsed are deleted on the way.
_LIVE = _ADD + """
local function live(hash, me, lease_prefix)
  local fields = redis.call('HGETALL', hash)
  local total, mine, others = 0, 0, 0
  local alive = {}
  for i = 1, #fields, 2 do
    local name, n = fields[i], tonumber(fields[i + 1])
    local spare = string.sub(name, -2) == '/s'
    local proc = spare and string.sub(name, 1, -3) or name
    local ok = proc == me or alive[proc]
    if ok == nil then
      ok = redis.call('EXISTS', lease_prefix .. proc) == 1
      alive[proc] = ok
    end
    if not ok then
      redis.call('HDEL', hash, name)
    else
      total = total + n
      if proc == me then
        mine = mine + n
      elseif not spare then
        others = others + n
      end
    end
  end
  return total, mine, others
end
"""

# KEYS: the key's slots, its bucket, the affinity key, the backend's slots, the metadata of
# the stream the request will make ('' if none).
# ARGV: 1 process, 2 lease prefix, 3 key's max in flight (-1: no key limits at all, 0: the
# key's slots are counted but not capped), 4 rate/s, 5 burst, 6 expiry ms, 7 backend ('': a
# peer region, nothing to claim), 8 backend limit (-1: none), 9 affinity mode (0 none, 1
# follow what is stored, 2 overwrite it), 10 affinity ms, 11 the stream's owner, 12 its
# subject, 13 its wire format ('': chat, no field written), 14 spare slots of the backend
# wanted (granted as far as they fit under its limit), 15 1 if the request takes one of this
# process's spare slots of the backend (its limit is not checked again), else 0.
# Checks everything first, then claims both slots (and the spare ones), takes the token and
# writes the stream's metadata (as the stream writer would: owner, process, subject);
# returns {0, in flight on the backend elsewhere, spare slots granted} (admitted), {1, key's
# in flight} (key at its limit), {2, ms to a token}, {3, stored backend} (the affinity key
# lives elsewhere) or {4, in flight elsewhere} (backend full region-wide).
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
local others, granted, spared = 0, 0, tonumber(ARGV[15])
if backend ~= '' then
  local total, mine
  total, mine, others = live(KEYS[4], ARGV[1], ARGV[2])
  local limit = tonumber(ARGV[8])
  if limit >= 0 and spared == 0 and total >= limit then return {4, others} end
  if limit >= 0 then
    granted = math.max(0, math.min(tonumber(ARGV[14]), limit - total - 1 + spared))
  end
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
  if granted ~= spared then add(KEYS[4], ARGV[1] .. '/s', granted - spared) end
  redis.call('PEXPIRE', KEYS[4], ARGV[6])
end
if mode ~= '0' then redis.call('SET', KEYS[3], backend, 'PX', ARGV[10]) end
if KEYS[5] ~= '' then
  redis.call('HSET', KEYS[5], 'owner', ARGV[11], 'proc', ARGV[1], 'subj', ARGV[12],
             'v', '2', 'intact', '1')
  if ARGV[13] ~= '' then redis.call('HSET', KEYS[5], 'fmt', ARGV[13]) end
  redis.call('PEXPIRE', KEYS[5], ARGV[6])
end
return {0, others, granted}
"""

# What a request admitted without a round trip (:meth:`SharedAdmission.admit_now`) tells Redis
# while it goes upstream: nothing here can refuse it.
# KEYS: the key's slots ('': not counted), the affinity key ('': none), the backend's slots
# ('': a peer region), the stream's metadata ('': none).
# ARGV: 1 process, 2 lease prefix, 3 expiry ms, 4 backend, 5 affinity ms, 6 1 if the request
# took one of this process's spare slots of the backend, 0 if the backend has no limit for
# it, 7 spare slots wanted, 8 the backend's limit (-1: none), 9 the stream's owner, 10 its
# subject, 11 its wire format ('': chat).
# Counts the key's slot; refreshes the affinity key unless another backend holds it (then
# returned, to learn); counts the backend's slot in flight (a spare one less) and grants
# spare slots as far as they fit under its limit; writes the stream's metadata. Returns {in
# flight on the backend elsewhere, spare slots granted, the affinity key's other backend or ''}.
_CLAIM = _LIVE + """
if KEYS[1] ~= '' then
  redis.call('HINCRBY', KEYS[1], ARGV[1], 1)
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
end
local stored = ''
if KEYS[2] ~= '' then
  local held = redis.call('GET', KEYS[2])
  if held and held ~= ARGV[4] then
    stored = held
  else
    redis.call('SET', KEYS[2], ARGV[4], 'PX', ARGV[5])
  end
end
local others, granted = 0, 0
if KEYS[3] ~= '' then
  local total, mine
  total, mine, others = live(KEYS[3], ARGV[1], ARGV[2])
  local spared, limit = tonumber(ARGV[6]), tonumber(ARGV[8])
  if limit >= 0 then
    granted = math.max(0, math.min(tonumber(ARGV[7]), limit - total - 1 + spared))
  end
  redis.call('HINCRBY', KEYS[3], ARGV[1], 1)
  if granted ~= spared then add(KEYS[3], ARGV[1] .. '/s', granted - spared) end
  redis.call('PEXPIRE', KEYS[3], ARGV[3])
end
if KEYS[4] ~= '' then
  redis.call('HSET', KEYS[4], 'owner', ARGV[9], 'proc', ARGV[1], 'subj', ARGV[10],
             'v', '2', 'intact', '1')
  if ARGV[11] ~= '' then redis.call('HSET', KEYS[4], 'fmt', ARGV[11]) end
  redis.call('PEXPIRE', KEYS[4], ARGV[3])
end
return {others, granted, stored}
"""

# KEYS: slots hashes. ARGV: process, lease prefix. In flight on the other processes, per key.
_OTHERS = _LIVE + """
local out = {}
for i = 1, #KEYS do
  local total, mine, others = live(KEYS[i], ARGV[1], ARGV[2])
  out[i] = others
end
return out
"""

# KEYS: slots to give back, one per release (a key twice: two slots). ARGV: 1 process, then
# one per key: 0 a slot in flight given back, 1 a slot in flight kept as a spare one, 2 a
# spare slot given back.
_RELEASE = _ADD + """
for i = 1, #KEYS do
  local kind = ARGV[i + 1]
  if kind ~= '2' then add(KEYS[i], ARGV[1], -1) end
  if kind == '1' then
    redis.call('HINCRBY', KEYS[i], ARGV[1] .. '/s', 1)
  elseif kind == '2' then
    add(KEYS[i], ARGV[1] .. '/s', -1)
  end
end
"""

# KEYS: slots hashes. ARGV: 1 process, 2 expiry ms, then two per key: what this process has
# in flight in it, and spare. Writes this process's true fields in each hash (deletes them
# at 0).
_RECONCILE = """
for i = 1, #KEYS do
  local n, spare = tonumber(ARGV[2 * i + 1]), tonumber(ARGV[2 * i + 2])
  for field, value in pairs({[ARGV[1]] = n, [ARGV[1] .. '/s'] = spare}) do
    if value > 0 then
      redis.call('HSET', KEYS[i], field, value)
    else
      redis.call('HDEL', KEYS[i], field)
    end
  end
  if n > 0 or spare > 0 then redis.call('PEXPIRE', KEYS[i], ARGV[2]) end
end
"""

_GIVE_BACK, _KEEP_SPARE, _SPARE_BACK = "0", "1", "2"
"""What a release does (``_RELEASE``): give a slot in flight back, keep it as a spare one,
give a spare one back."""

_RECONCILE_ROUNDS = 2
"""Successful reconciliations after the last failed command: a command that timed out on a
frozen Redis may still run when it wakes, after the first one."""

SPARE_SHARE = 64
"""A process holds up to this fraction of a backend's limit in spare slots (1/64)..."""
SPARE_MAX = 32
"""...and never more than this many: what the region's other processes cannot claim
while this one has them spare (given back after a housekeeping tick that used none)."""
AFFINITY_KNOWN_MAX = 4096
"""Affinity keys this process remembers Redis holding for a backend (the oldest forgotten
first): the bound on what clients' prompts can make it keep."""


def spare_slots(limit: int) -> int:
    """Spare slots a process keeps of a backend whose limit is ``limit`` (0: none, so every
    admission on it waits for Redis)."""
    return min(SPARE_MAX, limit // SPARE_SHARE)


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


_NO_AFFINITY = affinity_digest("")
"""The affinity key an admission without one names (the script does not touch it)."""


@dataclass(frozen=True, slots=True)
class Claim:
    """What one request claims region-wide, whether it waits for Redis
    (:meth:`SharedAdmission.admit`) or not (:meth:`SharedAdmission.admit_now`): built once a
    routing attempt, read by both.

    A slot of ``owner``'s key (``keyed`` False: no per-key limits nor counts; ``key_limit``
    None: counted, no cap; ``rate_per_s`` 0: no rate, else ``burst`` tokens at most), the
    affinity of ``affinity_key`` (what to do with it: ``affinity``), a slot of ``backend``
    (None: a peer region, nothing to claim; ``backend_limit`` None: no limit, a request queued
    on purpose), and ``stream_id`` made findable by the region's processes (``owner``'s, for
    ``subject``, in ``stream_format``) if the request makes a stream."""

    owner: bytes
    backend: str | None
    backend_limit: int | None = None
    keyed: bool = True
    key_limit: int | None = None
    rate_per_s: float = 0.0
    burst: int = 1
    affinity_key: str | None = None
    affinity: Affinity = Affinity.NONE
    stream_id: str | None = None
    subject: str | None = None
    stream_format: str = "chat"
    digest: str = field(init=False)
    """``affinity_key``'s :func:`affinity_digest` ('' without one), computed once a claim (an
    admission that could not go at once asks Redis with the same)."""

    def __post_init__(self) -> None:
        key = self.affinity_key
        object.__setattr__(self, "digest", affinity_digest(key) if key is not None else "")


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
        self._releasing: list[tuple[str, str]] = []
        """Slots given back this loop turn, not sent yet, each with its kind (``_RELEASE``)."""
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
        self._claim = PackedScript(_CLAIM)
        self._spare: dict[str, int] = {}
        """Slots claimed in Redis for requests to come, by backend slots hash: a request
        takes one without a round trip (:meth:`admit_now`). Counted in :attr:`held`."""
        self._target: dict[str, int] = {}
        """Spare slots kept of each backend (:func:`spare_slots` of its limit, as last asked)."""
        self._topping: set[str] = set()
        """Backend slots hashes with more spare slots asked for and not answered yet."""
        self._drawn: set[str] = set()
        """Hashes whose spare slots a request took since the last :meth:`give_back_idle`."""
        self._known: dict[str, tuple[str, float]] = {}
        """Affinity digest -> (the backend Redis holds it for, until when this process
        trusts that without asking: half its time to live after Redis said so)."""
        self.failures = 0
        self.reconciled = 0
        self.admitted_now = 0
        """Requests admitted without waiting for Redis (:meth:`admit_now`)."""
        self.waited = 0
        """Admissions that waited for Redis's answer (:meth:`admit`), admitted or not."""

    async def start(self) -> None:
        """Load the admission, claim and release scripts (the others load themselves when first
        used); a Redis away at start sends them with their first call instead."""
        with contextlib.suppress(Exception):
            await self._redis.script_load(_ADMIT)
            await self._redis.script_load(_RELEASE)
            await self._redis.script_load(_CLAIM)

    async def admit(self, claim: Claim) -> Admission:
        """One round trip: check ``claim``'s key concurrency, the affinity of its affinity key,
        its backend's slots and the key's rate, in that order; if all pass, claim a slot of
        each and take a token, and make its stream findable by the region's processes:
        announced with the admission, in its round trip, instead of in one of its own before
        the stream's id goes out.

        :class:`StateUnavailable` if Redis does not answer: nothing is counted as held, and
        whatever the script may have claimed is undone by :meth:`reconcile`."""
        owner, backend, backend_limit = claim.owner, claim.backend, claim.backend_limit
        keyed, affinity_key, stream_id = claim.keyed, claim.affinity_key, claim.stream_id
        digest = claim.digest or _NO_AFFINITY
        key_slots = self.keys.key_slots(owner)
        backend_load = self.keys.backend_load(backend or "")
        spared = 0
        if backend is not None and backend_limit is not None:
            spared = self._take_spare(backend_load)
        wanted = self._spare_wanted(backend_load, backend_limit) if backend is not None else 0
        keys = (key_slots, self.keys.key_bucket(owner), self.keys.affinity(digest), backend_load,
                "" if stream_id is None else self.keys.meta(stream_id))
        args = (
            self.process, self._lease_prefix, -1 if not keyed else (claim.key_limit or 0),
            claim.rate_per_s, claim.burst, self._expiry_ms, backend or "",
            -1 if backend_limit is None else backend_limit,
            int(claim.affinity if affinity_key is not None else Affinity.NONE),
            self._affinity_ms, owner, claim.subject or "",
            "" if claim.stream_format == "chat" else claim.stream_format, wanted, spared,
        )
        claims = ([key_slots] if keyed else []) + (
            [backend_load] if backend is not None else []
        )
        await self._wait_gate()
        self._begin()
        self.waited += 1
        try:
            reply = await self.batch.script(self._admit, keys, args)
        except Exception as exc:
            self._uncertain(claims)
            self._spare_back(backend_load, spared)
            raise StateUnavailable(f"admission: {describe_error(exc)}") from exc
        except BaseException:  # cancelled (the client left): the script may have run all the same
            self._uncertain(claims)
            self._spare_back(backend_load, spared)
            raise
        finally:
            self._end()
            if wanted:
                self._topping.discard(backend_load)
        verdict = Verdict(int(reply[0]))
        value = reply[1]
        if verdict is Verdict.ADMITTED:
            self.held.update(claims)
            if int(reply[2]):
                self._granted(backend_load, int(reply[2]))
            if affinity_key is not None and claim.affinity is not Affinity.NONE and backend:
                self._know(digest, backend)
        else:
            self._spare_back(backend_load, spared)  # nothing was claimed
        if verdict is Verdict.AFFINITY_ELSEWHERE:
            return Admission(verdict, value.decode())
        if verdict is Verdict.KEY_RATE:
            return Admission(verdict, int(value) / 1000)
        return Admission(verdict, int(value))

    def admit_now(
        self, claim: Claim, *, opening: bool = False,
        answered: Callable[[int, str], None] | None = None,
    ) -> asyncio.Future[None] | None:
        """Admit a request without waiting for Redis, when nothing Redis holds could refuse
        it: its key has no cap and no rate (or there are no key limits); its affinity key is
        one Redis holds for ``backend`` (as this process learned from an answer less than
        half its time to live ago), or one this process has not seen in a request that
        ``opening`` a conversation (no other process can have placed it yet); and
        ``backend`` has no limit or this process has a spare slot of it (claimed in Redis
        ahead, so the region never holds more than the limit). None if any of that does not
        hold: :meth:`admit` decides.

        Admitted, the request's claims are counted here at once and sent to Redis (with
        ``stream_id``'s metadata, as :meth:`admit`'s) while it goes upstream; the future
        returned is done when Redis has them (an exception if it did not answer: what the
        claim may have done is undone by :meth:`reconcile`). ``answered`` is then told what
        the other processes hold on ``backend``, and the backend Redis holds the affinity
        key for if not ``backend`` ('' if it is: it went the same way, or is stored now)."""
        if self._gate is not None or self._rounds_due:
            return None  # Redis failed lately: each request asks it (and hears it is away)
        keyed, backend, backend_limit = claim.keyed, claim.backend, claim.backend_limit
        if keyed and (claim.key_limit is not None or claim.rate_per_s > 0):
            return None
        digest = ""
        affinity = claim.affinity
        if claim.affinity_key is not None and affinity is not Affinity.NONE:
            if affinity is not Affinity.FOLLOW or backend is None:
                return None
            digest = claim.digest
            known = self._known.get(digest)
            if known is not None and known[1] < asyncio.get_running_loop().time():
                del self._known[digest]
                known = None
            if known is None:
                if not opening:
                    return None
            elif known[0] != backend:
                return None
        backend_load = self.keys.backend_load(backend) if backend is not None else ""
        limited = backend is not None and backend_limit is not None
        if limited and not self._take_spare(backend_load):
            return None
        owner, stream_id, stream_format = claim.owner, claim.stream_id, claim.stream_format
        key_slots = self.keys.key_slots(owner) if keyed else ""
        claims = [key_slots] if keyed else []
        if backend is not None:
            claims.append(backend_load)
        self.held.update(claims)
        wanted = self._spare_wanted(backend_load, backend_limit) if limited else 0
        keys = (key_slots, self.keys.affinity(digest) if digest else "", backend_load,
                "" if stream_id is None else self.keys.meta(stream_id))
        args = (
            self.process, self._lease_prefix, self._expiry_ms, backend or "",
            self._affinity_ms, 1 if limited else 0, wanted,
            -1 if backend_limit is None else backend_limit,
            owner, claim.subject or "", "" if stream_format == "chat" else stream_format,
        )
        landed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        unsure = claims

        def claimed(reply: asyncio.Future[Any]) -> None:
            self._end()
            if wanted:
                self._topping.discard(backend_load)
            exc = reply.exception() if not reply.cancelled() else asyncio.CancelledError()
            if exc is not None:
                self._uncertain(unsure)
                if not landed.done():
                    landed.set_exception(StateUnavailable(f"claim: {describe_error(exc)}"))
                    landed.exception()  # nobody may wait for it: no "never retrieved" log
                return
            others, granted, stored = reply.result()
            if granted:
                self._granted(backend_load, int(granted))
            if digest and not stored:
                self._know(digest, backend or "")
            elif stored:
                self._known.pop(digest, None)
            if answered is not None:
                answered(int(others), stored.decode() if stored else "")
            if not landed.done():
                landed.set_result(None)

        self._begin()
        self.batch.script_then(self._claim, keys, args, claimed)
        self.admitted_now += 1
        return landed

    def _spare_wanted(self, backend_load: str, limit: int | None) -> int:
        """Spare slots of a backend to ask for with a claim on it (0: it has enough, one ask
        is in flight, or it has no limit); counted as asked for until its answer."""
        if limit is None or backend_load in self._topping:
            return 0
        target = self._target[backend_load] = spare_slots(limit)
        spare = self._spare.get(backend_load, 0)
        if spare > target // 2:
            return 0
        self._topping.add(backend_load)
        return target - spare

    def spare(self, backend: str) -> int:
        """Spare slots this process holds of ``backend``."""
        return self._spare.get(self.keys.backend_load(backend), 0)

    def _spare_target(self, backend_load: str) -> int:
        return self._target.get(backend_load, 0)

    def _take_spare(self, backend_load: str) -> int:
        """1 if a spare slot of the backend was taken (now one less), else 0."""
        spare = self._spare.get(backend_load, 0)
        if spare <= 0:
            return 0
        self._spare[backend_load] = spare - 1
        self._drawn.add(backend_load)
        return 1

    def _spare_back(self, backend_load: str, spared: int) -> None:
        """A spare slot taken for a claim that did not happen is spare again."""
        if spared:
            self._spare[backend_load] = self._spare.get(backend_load, 0) + 1

    def _granted(self, backend_load: str, granted: int) -> None:
        self._spare[backend_load] = self._spare.get(backend_load, 0) + granted

    def _know(self, digest: str, backend: str) -> None:
        """Redis holds the affinity key ``digest`` for ``backend`` (it just said so)."""
        known = self._known
        known.pop(digest, None)  # re-inserted last: the oldest are the first forgotten
        if len(known) >= AFFINITY_KNOWN_MAX:
            del known[next(iter(known))]
        known[digest] = (backend, asyncio.get_running_loop().time() + self._affinity_ms / 2000)

    def give_back_idle(self) -> None:
        """Give back the spare slots of each backend no request took since the last call
        (the housekeeping tick's): a process that stopped sending to a backend does not
        keep the region's other processes from its slots."""
        for backend_load, spare in list(self._spare.items()):
            if backend_load not in self._drawn and backend_load not in self._topping:
                del self._spare[backend_load]
                for _ in range(spare):
                    self._spawn_release(backend_load, _SPARE_BACK)
        self._drawn.clear()

    async def claim_backend(self, backend: str, limit: int) -> bool:
        """Claim a slot of ``backend`` alone, for a request moved there after its own
        backend refused the connection (its key's slot and affinity stay as claimed); False
        if the processes together hold ``limit`` on it, or Redis does not answer."""
        try:
            answer = await self.admit(Claim(b"", backend, limit, keyed=False, burst=0))
        except StateUnavailable as exc:
            log.debug("cannot claim a slot of %s for a failover: %s", backend, exc)
            return False
        return answer.verdict is Verdict.ADMITTED

    def release_key(self, owner: bytes) -> None:
        """Give back a slot of ``owner`` claimed by :meth:`admit`."""
        self._spawn_release(self.keys.key_slots(owner), _GIVE_BACK)

    def release_backend(self, backend: str) -> None:
        """Give back a slot of ``backend`` claimed by :meth:`admit`, :meth:`admit_now` or
        :meth:`claim_backend`: kept as a spare one, without a round trip, while this
        process has fewer than it keeps of that backend."""
        backend_load = self.keys.backend_load(backend)
        spare = self._spare.get(backend_load)
        if spare is not None and spare < self._spare_target(backend_load):
            self._spare[backend_load] = spare + 1
            self._spawn_release(backend_load, _KEEP_SPARE)
        else:
            self._spawn_release(backend_load, _GIVE_BACK)

    async def backends_elsewhere(self, backends: Sequence[str]) -> list[int]:
        """What the other processes have in flight on each of ``backends``."""
        if not backends:
            return []
        others: list[Any] = await self._others(
            keys=[self.keys.backend_load(b) for b in backends],
            args=[self.process, self._lease_prefix],
        )
        return [int(n) for n in others]

    def _spawn_release(self, key: str, kind: str) -> None:
        if kind != _SPARE_BACK:
            held = self.held[key] - 1
            if held > 0:
                self.held[key] = held
            else:
                del self.held[key]
        self._releasing.append((key, kind))
        if len(self._releasing) == 1:  # the first of this turn: send them all after it
            self.background.spawn(self._send_releases())

    async def _send_releases(self) -> None:
        await asyncio.sleep(0)  # the rest of this loop turn's releases join this call
        await self._wait_gate()
        releasing, self._releasing = self._releasing, []
        if not releasing:  # a reconciliation wrote them meanwhile
            return
        keys = [key for key, _ in releasing]
        self._begin()
        try:
            await self.batch.script(self._release, keys,
                                    (self.process, *(kind for _, kind in releasing)))
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
        self._uncertain([*self.held, *self._spare])

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
            keys = sorted(self._unsure | set(self.held) | set(self._spare))
            counts = [n for key in keys for n in (self.held.get(key, 0), self._spare.get(key, 0))]
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
        """Give back the spare slots and let the releases in flight finish (a clean exit
        gives its slots back at once)."""
        for backend_load, spare in list(self._spare.items()):
            del self._spare[backend_load]
            for _ in range(spare):
                self._spawn_release(backend_load, _SPARE_BACK)
        await self.background.drain()
        await self.background.aclose()
        await self.batch.aclose()
