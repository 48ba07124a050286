"""The stages between admission and the upstream: the key's limits, then region and backend.

In memory (the default) they are plain synchronous stages, in this order:
:func:`~firstbyte.router.tenancy.limit_key` (concurrency, room in the store, rate),
:meth:`~firstbyte.router.multiregion.RegionRouting.route` (region, then backend by affinity
and load) and :func:`~firstbyte.router.pipeline.backend.choose_backend`. A request below its
fair share in a full region waits for a slot between routing and its retry
(``_wait_and_route``, ``routing.max_fair_wait_ms``; with shared state, for the slots this
process sees free).

With shared state (``state.redis_url``) the counts are region-wide, in Redis
(:mod:`firstbyte.router.shared.admission`). Routing decides first, as in memory, with the other
processes' load on each backend added. A request nothing in Redis can refuse (its key has no
cap nor rate; its affinity key is known here, or it opens a conversation; this process holds
a spare slot of its backend) is admitted at once, its claim sent while it goes upstream.
Otherwise one round trip checks and claims, atomically, a slot of the API key (concurrency and
rate, over every process), the prompt's affinity and a slot of the chosen backend. When the
prompt's affinity key lives on another backend, or the chosen backend is full region-wide,
routing runs again knowing it (at most a few times), so a conversation goes to the same
backend whichever process answers, and a region of processes never puts more than a
backend's ``max_in_flight`` on it. Room in this process's stream store
is made last, so no await separates it from the stream's creation (a refusal there has spent a
rate token, unlike in memory); a request refused by routing is refused before its key's limits
are looked at (in memory, after). Whatever was claimed for a request refused on the way is
given back before the refusal goes out; the key's slot of an admitted request is given back
by ``RequestContext.release_key_slot``. When Redis does not answer, the request gets ``503
state_unavailable`` with nothing held for it: its routing record is undone here, and what
the script may have claimed before the answer was lost is undone by
:meth:`~firstbyte.router.shared.admission.SharedAdmission.reconcile`.

Which of the two runs is chosen once, at start: :func:`place` asks the process's
:class:`~firstbyte.router.regionstate.RegionState`, which calls :func:`place_in_memory` or
:func:`place_shared`. A placement that needs no wait (in memory, nearly every one) is made
without an await: :func:`place_now`, then :func:`place_later` only when it answered
:data:`PLACE_LATER`.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from .multiregion import WAIT_FOR_SLOT, Observation
from .pipeline.affinity import opens_conversation
from .pipeline.backend import choose_backend
from .pipeline.context import CONTINUE, Fallback, Outcome, RequestContext
from .shared.admission import Affinity, Claim, Verdict
from .shared.errors import StateUnavailable, unavailable_reply
from .tenancy import limit_key, refusal, store_refusal, subject_refusal

if TYPE_CHECKING:
    from .shared.admission import SharedAdmission
    from .state import RouterState

__all__ = [
    "PLACE_LATER", "place", "place_in_memory", "place_later", "place_now", "place_shared",
    "release_key_slot", "wait_in_memory",
]

_QUEUED = ("queued", "fair_share")
"""Choices that wait on a backend on purpose (over its limit): no backend limit to claim."""

_STICKY = ("affinity", "new-key")
"""Choices that follow (or start) a prompt's affinity; balance and queue choices do not."""


PLACE_LATER = Fallback("placed only after a wait")
"""What :func:`place_now` answers for a placement that has to wait (for a slot of a full
region, or for the region's shared state): :func:`place_later` finishes it. It never reaches a
client."""


async def place(
    state: RouterState, ctx: RequestContext, gone: Callable[[], Awaitable[object]] | None = None
) -> Outcome:
    """Apply the key's limits and choose the region and backend (see the module docstring).

    ``gone()`` ends when the client disconnects: a request waiting for a slot then gives up
    its place (:data:`~firstbyte.router.state.CLIENT_GONE`)."""
    outcome = place_now(state, ctx)
    if outcome is PLACE_LATER:
        outcome = await place_later(state, ctx, gone)
    return outcome


def place_now(state: RouterState, ctx: RequestContext) -> Outcome:
    """:func:`place` as far as it goes without an await: its outcome, or :data:`PLACE_LATER`
    (await :func:`place_later` then). A coroutine less (two, with the region state's) for a
    placement that does not wait, which is nearly every one.

    The region state's own ``place_now``, which holds the request for its key when it
    answers CONTINUE (only :func:`place_in_memory` does), called here; a caller on the
    request path may call that one itself (a call less)."""
    return state.region_state.place_now(state, ctx)


async def place_later(
    state: RouterState, ctx: RequestContext, gone: Callable[[], Awaitable[object]] | None
) -> Outcome:
    """The rest of a placement :func:`place_now` answered :data:`PLACE_LATER` for."""
    outcome = await state.region_state.place_later(state, ctx, gone)
    if outcome is CONTINUE:
        ctx.placed_at = state.clock()  # after the wait
        _hold(state, ctx)
    return outcome


def place_in_memory(state: RouterState, ctx: RequestContext) -> Outcome:
    """:func:`place_now` in memory (:class:`~firstbyte.router.regionstate.InMemory`): placed
    and held for its key (CONTINUE), refused, or :data:`PLACE_LATER` when the request waits
    for a slot (:func:`wait_in_memory` goes on from there; :func:`place_later` holds it)."""
    # One moment for the stages, and one scan of the backends' room at it (the fair gate,
    # the region's choice and the backend's each scanned them): nothing between them
    # changes a backend's load or health, and no await separates them unless it waits.
    ctx.placed_at = now = state.clock()  # the hold and the stream's start read it too
    outcome = limit_key(ctx, state.limiter, state.store, now, state.tenants)
    if outcome is CONTINUE:
        room = state.room(ctx, now)
        outcome = state.fair_gate(ctx, now, room)
        if outcome is CONTINUE:  # _route's first try, inlined
            outcome = state.fair_turn(ctx, now, room)
            if outcome is CONTINUE:
                outcome = state.routing.route(ctx, state.fair_check, now=now, room=room)
            if outcome is WAIT_FOR_SLOT:
                return PLACE_LATER
    if outcome is CONTINUE:
        if ctx.backend is not None:  # routing chose it (nearly always): choose_backend's stamp
            ctx.routed_at = time.perf_counter()
        else:
            outcome = choose_backend(ctx, state.pool)
        if outcome is CONTINUE:
            # _hold for a request without a region-wide slot (none in memory), with its pool
            # from its room (RouterState.fair_pool's answer): two calls a request less.
            ctx.release_key_slot = state.hold(ctx, now, room)
    return outcome


async def wait_in_memory(
    state: RouterState, ctx: RequestContext, gone: Callable[[], Awaitable[object]] | None
) -> Outcome:
    """:func:`place_later` in memory: ``ctx`` was told to wait for a slot by
    :func:`place_in_memory`; wait, route it, choose its backend."""
    outcome = await _wait_and_route(state, ctx, gone)
    if outcome is CONTINUE:
        outcome = choose_backend(ctx, state.pool)
    return outcome


async def _route(
    state: RouterState, ctx: RequestContext, first: bool = True,
    gone: Callable[[], Awaitable[object]] | None = None,
) -> Outcome:
    """Route ``ctx`` (:meth:`~firstbyte.router.multiregion.RegionRouting.route`). Below its
    fair share in a full region it waits for a slot (:func:`_wait_and_route`); a ``first``
    try does not overtake requests already waiting
    (:meth:`~firstbyte.router.state.RouterState.fair_turn`). (:func:`place_in_memory` has
    its first try inlined.)"""
    outcome = state.fair_turn(ctx) if first else CONTINUE
    if outcome is CONTINUE:
        outcome = state.routing.route(ctx, state.fair_check)
    if outcome is WAIT_FOR_SLOT:
        outcome = await _wait_and_route(state, ctx, gone)
    return outcome


async def _wait_and_route(
    state: RouterState, ctx: RequestContext, gone: Callable[[], Awaitable[object]] | None
) -> Outcome:
    """``ctx`` was told to wait for a slot (:data:`~firstbyte.router.multiregion.WAIT_FOR_SLOT`):
    wait (``routing.max_fair_wait_ms`` in all, from now), and route it again the moment one
    is handed to it (reading the clock and the backends again)."""
    until = state.clock() + state.config.routing.max_fair_wait_ms / 1000.0
    outcome: Outcome = WAIT_FOR_SLOT
    while outcome is WAIT_FOR_SLOT:
        outcome = await state.wait_for_slot(ctx, until, gone)
        if outcome is CONTINUE:
            outcome = state.routing.route(ctx, state.fair_check)
    return outcome


def _hold(state: RouterState, ctx: RequestContext) -> None:
    """Count the admitted request for its key and subject until it ends (with the region-wide
    key slot, if any: both go back through ``ctx.release_key_slot``)."""
    release_share = state.hold(ctx, ctx.placed_at)
    release_slot = ctx.release_key_slot
    if release_slot is None:  # no region-wide slot (in memory): no call around the share's
        ctx.release_key_slot = release_share
        return

    def release() -> None:
        release_share()
        release_slot()

    ctx.release_key_slot = release


def release_key_slot(ctx: RequestContext) -> None:
    """Give back the key's slot a non-streamed request held (no-op in memory)."""
    release, ctx.release_key_slot = ctx.release_key_slot, None
    if release is not None:
        release()


async def place_shared(
    state: RouterState, admission: SharedAdmission, ctx: RequestContext,
    gone: Callable[[], Awaitable[object]] | None, stream_id: str | None = None,
) -> tuple[Outcome, asyncio.Future[None] | None]:
    """:func:`place` with shared state (:class:`~firstbyte.router.regionstate.InRedis`),
    before the request is held for its key, and when an admitted request's ``stream_id``
    (the id of the stream it is to make) is findable region-wide: None, as soon as this
    returns (it waited for Redis); else when the future is done (admitted without waiting:
    its claims and the stream's metadata are on their way to Redis)."""
    limiter, routing = state.limiter, state.routing
    owner = ctx.owner
    policy = limiter.policy(owner)
    refused = subject_refusal(
        ctx, limiter, state.tenants, 0, state.clock(), limiter.max_streams(owner)
    )
    if refused is not None:  # its own cap (the key's is counted region-wide, below)
        return refusal(refused), None
    gate = state.fair_gate(ctx)  # this process's flows (docs/limits.md, "Shared state")
    if gate is not CONTINUE:
        return gate, None
    key = routing.affinity_key(ctx.request) if ctx.request is not None else None
    opening = ctx.request is not None and opens_conversation(ctx.request)
    learned: str | None = None
    for attempt in range(len(routing.tracker.backends) + 2):
        outcome = await _route(state, ctx, first=attempt == 0, gone=gone)
        if outcome is CONTINUE:
            outcome = choose_backend(ctx, state.pool)
        if outcome is not CONTINUE:
            return outcome, None
        observer = ctx.observer
        local = isinstance(observer, Observation) and observer.local
        backend = observer.backend if local and isinstance(observer, Observation) else None
        choice = observer.choice if isinstance(observer, Observation) else ""
        affinity = Affinity.NONE
        if backend is not None and choice in _STICKY:
            affinity = Affinity.OVERWRITE if learned not in (None, backend) else Affinity.FOLLOW
        limit = None if choice in _QUEUED or backend is None else routing.tracker[backend].limit
        claim = Claim(
            owner, backend, limit, keyed=limiter.enabled, key_limit=limiter.max_streams(owner),
            rate_per_s=policy.rate_per_s, burst=policy.burst, affinity_key=key,
            affinity=affinity, stream_id=stream_id, subject=ctx.subject,
            stream_format=ctx.codec.name,
        )
        if learned is None:  # nothing in Redis can refuse it: no round trip before upstream
            landed = admission.admit_now(
                claim, opening=opening, answered=None if backend is None
                else functools.partial(_claimed, state, backend, key),
            )
            if landed is not None:
                return _admitted(state, admission, ctx, owner, backend), landed
        try:
            answer = await admission.admit(claim)
        except StateUnavailable as exc:
            routing.unroute(ctx)  # this process's count too: the request will not go
            return unavailable_reply(exc), None
        except BaseException:  # cancelled: the client left while its claim was in flight
            routing.unroute(ctx)
            raise
        verdict = answer.verdict
        if backend is not None and verdict in (Verdict.ADMITTED, Verdict.BACKEND_FULL):
            routing.tracker.observe_elsewhere(backend, int(answer.value))
        if verdict is Verdict.ADMITTED:
            return _admitted(state, admission, ctx, owner, backend), None
        routing.unroute(ctx)
        if verdict is Verdict.KEY_RATE:
            return refusal(limiter.rate_limited(owner, float(answer.value))), None
        if verdict is Verdict.KEY_BUSY:
            over = limiter.over_concurrency(owner, int(answer.value))
            assert over is not None  # the script counted at least max_streams
            return refusal(over), None
        if verdict is Verdict.AFFINITY_ELSEWHERE and key is not None:
            learned = str(answer.value)
            routing.policy.learn(key, learned, state.clock())
    return routing.reject(ctx, state.clock(), "no_local_backend"), None


def _claimed(
    state: RouterState, backend: str, key: str | None, others: int, stored: str
) -> None:
    """What Redis answered a claim of a request admitted at once: the other processes' load
    on its backend, and where its affinity key lives if another process placed it first
    (learned: its next request follows it)."""
    routing = state.routing
    routing.tracker.observe_elsewhere(backend, others)
    if stored and key is not None:
        routing.policy.learn(key, stored, state.clock())


def _admitted(
    state: RouterState, admission: SharedAdmission, ctx: RequestContext, owner: bytes,
    backend: str | None,
) -> Outcome:
    """Make room in the store for a stream; give back what was claimed if there is none."""
    keyed = state.limiter.enabled
    refused = store_refusal(state.store, owner, state.clock()) if ctx.stream_requested else None
    if refused is None:
        if keyed:
            ctx.release_key_slot = lambda: admission.release_key(owner)
        return CONTINUE
    state.routing.unroute(ctx)
    if backend is not None:
        admission.release_backend(backend)
    if keyed:
        admission.release_key(owner)
    return refusal(refused)
