"""The stages between admission and the upstream: the key's limits, then region and backend.

In memory (the default) they are plain synchronous stages, in this order:
:func:`~firstbyte.router.tenancy.limit_key` (concurrency, room in the store, rate),
:meth:`~firstbyte.router.multiregion.RegionRouting.route` (region, then backend by affinity
and load) and :func:`~firstbyte.router.pipeline.backend.choose_backend`.

With shared state (``state.redis_url``) the counts are region-wide, in Redis
(:mod:`firstbyte.router.shared.admission`), and the stage awaits two round trips: the first
claims a slot of the API key (its concurrency and rate, over every process) and finds where
the prompt's affinity key went, which routing then follows; routing decides as in memory
with the other processes' load on each backend added; the second claims a slot of the chosen
backend, refused when the processes together hold its limit, in which case routing runs
again knowing that load (at most once per backend), and so a region of processes never puts
more than a backend's ``max_in_flight`` on it. Room in this process's stream store is made
last, so no await separates it from the stream's creation (a refusal there has spent a rate
token, unlike in memory). Whatever was claimed for a request refused on the way is given
back before the refusal goes out; the key's slot of an admitted request is given back by
``RequestContext.release_key_slot``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .multiregion import Observation
from .pipeline.backend import choose_backend
from .pipeline.context import CONTINUE, Outcome, RequestContext
from .streams import owner_of
from .tenancy import limit_key, refusal, store_refusal

if TYPE_CHECKING:
    from .shared.admission import SharedAdmission
    from .state import RouterState

__all__ = ["place", "release_key_slot"]

_STICKY = ("affinity", "new-key")
"""Choices that follow (or start) a prompt's affinity; balance and queue choices do not."""


async def place(state: RouterState, ctx: RequestContext) -> Outcome:
    """Apply the key's limits and choose the region and backend (see the module docstring)."""
    if state.shared is None:
        outcome = limit_key(ctx, state.limiter, state.store, state.clock())
        if outcome is CONTINUE:
            outcome = state.routing.route(ctx)
        if outcome is CONTINUE:
            outcome = choose_backend(ctx, state.pool)
        return outcome
    return await _place_shared(state, state.shared.admission, ctx)


def release_key_slot(ctx: RequestContext) -> None:
    """Give back the key's slot a non-streamed request held (no-op in memory)."""
    release, ctx.release_key_slot = ctx.release_key_slot, None
    if release is not None:
        release()


async def _place_shared(
    state: RouterState, admission: SharedAdmission, ctx: RequestContext
) -> Outcome:
    limiter, routing = state.limiter, state.routing
    owner = owner_of(ctx.api_key)
    key = routing.affinity_key(ctx.request) if ctx.request is not None else None
    claim = await admission.admit_key(
        owner, key, max_in_flight=limiter.max_streams if limiter.enabled else None,
        rate_per_s=limiter.rate_per_s, burst=limiter.burst,
    )
    if claim.refused == "rate":
        return refusal(limiter.rate_limited(claim.value))
    if claim.refused == "slots":
        over = limiter.over_concurrency(int(claim.value))
        assert over is not None  # the script counted at least max_streams
        return refusal(over)
    if claim.backend is not None and key is not None:
        routing.policy.learn(key, claim.backend, state.clock())
    outcome = await _route(state, admission, ctx, key)
    if outcome is CONTINUE and ctx.stream_requested:
        refused = store_refusal(state.store, owner, state.clock())
        if refused is not None:
            observer = routing.unroute(ctx)
            if observer is not None and observer.local:
                admission.release_backend(observer.backend)
            outcome = refusal(refused)
    if limiter.enabled:
        if outcome is not CONTINUE:
            admission.release_key(owner)
        else:
            ctx.release_key_slot = lambda: admission.release_key(owner)
    return outcome


async def _route(
    state: RouterState, admission: SharedAdmission, ctx: RequestContext, key: str | None
) -> Outcome:
    """Route, then claim the chosen backend's slot region-wide; route around a full one."""
    routing = state.routing
    for _ in range(len(routing.tracker.backends) + 1):
        outcome = routing.route(ctx)
        if outcome is CONTINUE:
            outcome = choose_backend(ctx, state.pool)
        observer = ctx.extra.get("observer")
        if outcome is not CONTINUE or not isinstance(observer, Observation) or not observer.local:
            return outcome  # refused, or a peer region's router (it counts its own backends)
        name = observer.backend
        limit = None if observer.choice == "queued" else routing.tracker[name].limit
        claimed, elsewhere = await admission.claim_backend(name, limit)
        routing.tracker.observe_elsewhere(name, elsewhere)
        if claimed:
            if key is not None and observer.choice in _STICKY:
                admission.remember_affinity(key, name, new=observer.choice == "new-key")
            return CONTINUE
        routing.unroute(ctx)
    return routing.reject(ctx, state.clock())
