"""What a router process shares with its region's other processes, behind one interface.

:class:`RegionState` is every place where one process's state meets the region's: placing a
request (the key's limits, its region and backend, and the slots they take), giving a backend's
slot back, making a new stream findable, finding a stream another process produces, and the
housekeeping that keeps the region's counts true. :class:`RouterState` picks an implementation
once, at start (:func:`region_state_for`), and calls it without asking which it is:

- :class:`InMemory` (no ``state.redis_url``, the default): this process is the region; counts
  live in its own tracker and limiter, so giving back, publishing, finding elsewhere and
  housekeeping are no-ops;
- :class:`InRedis`: today's :class:`~firstbyte.router.shared.SharedState`, its admission
  counted region-wide (:mod:`firstbyte.router.shared.admission`) and its streams mirrored into
  Redis (:mod:`firstbyte.router.shared.streams`).

The two placements themselves are :func:`~firstbyte.router.placement.place_in_memory` (with
:func:`~firstbyte.router.placement.wait_in_memory`) and
:func:`~firstbyte.router.placement.place_shared` (their differences are in that module's
docstring). ``redis`` is not imported here: :class:`InRedis` is only built around a
:class:`~firstbyte.router.shared.SharedState` that :func:`~firstbyte.router.shared.connect`
made.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Protocol

from firstbyte.tasks import cancel_and_wait

from .hosting.limits import Throttle
from .observability.logs import describe_error
from .pipeline.context import CONTINUE
from .placement import PLACE_LATER, place_in_memory, place_shared, wait_in_memory
from .shared.warm_budget import SharedWarmBudget
from .streams import new_stream_id

if TYPE_CHECKING:
    from .pipeline.context import Outcome, RequestContext
    from .readers import ReadableStream
    from .shared import SharedState
    from .state import RouterState
    from .streams import Stream, StreamStore

__all__ = ["InMemory", "InRedis", "RegionState", "region_state_for"]

log = logging.getLogger("firstbyte.router")

Gone = Callable[[], Awaitable[object]] | None
"""A coroutine function that returns when the client disconnects (or None)."""


class RegionState(Protocol):
    """One process's view of the state its region's processes share (module docstring)."""

    @property
    def readable_elsewhere(self) -> bool:
        """Whether this process's streams stay readable from the region's other processes
        once it exits (the drain's log line says so)."""
        ...

    @property
    def unreachable(self) -> bool:
        """Whether the region's state has stopped answering this process, so that new
        requests get ``503 state_unavailable`` (``/healthz`` says so): read from what the
        process already tracks, never a command of its own."""
        ...

    @property
    def claim_backend(self) -> Callable[[str, int], Awaitable[bool]] | None:
        """Claims a slot of a backend (name, limit) for a request moved there, False if it is
        full region-wide; None when this process's tracker counts everything
        (:attr:`~firstbyte.router.multiregion.RegionRouting.claim`)."""
        ...

    def start(self) -> None:
        """Start what runs in the background (in the running loop; once)."""
        ...

    async def started(self) -> None:
        """Return once streams created from now on are covered (the lease is taken, or
        tried); never raises."""
        ...

    def place_now(self, state: RouterState, ctx: RequestContext) -> Outcome:
        """Apply the key's limits and choose the region and backend, claiming what the choice
        takes, as far as that goes without an await; CONTINUE (the request held for its key
        as well), or a refusal with nothing left claimed, or
        :data:`~firstbyte.router.placement.PLACE_LATER`: :meth:`place_later` finishes it."""
        ...

    async def place_later(self, state: RouterState, ctx: RequestContext, gone: Gone) -> Outcome:
        """The rest of a placement :meth:`place_now` answered ``PLACE_LATER`` for (the same
        answers, but that one)."""
        ...

    def release_backend(self, backend: str) -> None:
        """Give back the slot a request ending on (or moved away from) ``backend`` held."""
        ...

    def new_stream(
        self, store: StreamStore, owner: bytes, now: float,
        on_finish: Callable[[], object] | None, subject: str | None,
    ) -> Stream:
        """A new stream of ``owner`` (for ``subject``) in this process's ``store``, made at
        ``now``, findable region-wide as :meth:`announced_id` and :meth:`publish` make it
        (:meth:`~firstbyte.router.state.RouterState.new_stream`)."""
        ...

    def announced_id(self, owner: bytes, subject: str | None) -> str | None:
        """The id for a stream ``owner`` makes (for ``subject``) right after :meth:`place`
        admitted it (in the same event-loop turn), already findable region-wide; None: a new
        id, announced by :meth:`publish`."""
        ...

    def publish(self, stream: Stream, announced: bool = False) -> None:
        """``stream`` (new, empty) is to be findable from the region's other processes
        (``announced``: it is already, its id from :meth:`announced_id`)."""
        ...

    def announced(self, stream: Stream) -> Awaitable[None] | None:
        """What to await before ``stream``'s id goes out: it ends once other processes can
        find the stream. None: nothing to wait for (no other process reads it)."""
        ...

    async def lookup(self, stream_id: str, owner: bytes) -> ReadableStream | None:
        """``owner``'s stream produced by another process, or None (an unknown id and another
        owner's alike); :class:`~firstbyte.router.shared.errors.StateUnavailable` when the
        state does not answer."""
        ...

    def shared_warm_budget(self, window_s: float) -> SharedWarmBudget | None:
        """Prompt warm-ups counted region-wide (in Redis), or None: count them in this
        process (:mod:`firstbyte.router.prewarm`)."""
        ...

    async def housekeep(self, state: RouterState, grace_s: float) -> None:
        """One housekeeping turn before :meth:`RouterState.tick`: make the region's counts and
        readers true again. Never raises."""
        ...

    async def aclose(self) -> None:
        """Stop the background work and give back what this process holds."""
        ...


def region_state_for(shared: SharedState | None) -> RegionState:
    """The implementation for this process: in Redis when ``shared`` is given, else in
    memory."""
    return InMemory() if shared is None else InRedis(shared)


class InMemory:
    """The region is this process: its tracker and limiter count everything."""

    readable_elsewhere = False
    unreachable = False  # this process's memory always answers
    claim_backend = None

    def shared_warm_budget(self, window_s: float) -> SharedWarmBudget | None:
        return None

    def start(self) -> None:
        pass

    async def started(self) -> None:
        pass

    # The functions themselves, not methods calling them: a call a request less.
    place_now = staticmethod(place_in_memory)
    place_later = staticmethod(wait_in_memory)

    def release_backend(self, backend: str) -> None:
        pass

    def new_stream(
        self, store: StreamStore, owner: bytes, now: float,
        on_finish: Callable[[], object] | None, subject: str | None,
    ) -> Stream:
        # No id announced, nothing to publish: announced_id and publish not called (two calls
        # a stream).
        stream = store.create(owner, now)
        stream.subject = subject
        stream.on_finish = on_finish
        return stream

    def announced_id(self, owner: bytes, subject: str | None) -> str | None:
        return None

    def publish(self, stream: Stream, announced: bool = False) -> None:
        pass

    def announced(self, stream: Stream) -> None:
        return None  # not a coroutine that does nothing: one made, run and closed a stream

    async def lookup(self, stream_id: str, owner: bytes) -> ReadableStream | None:
        return None

    async def housekeep(self, state: RouterState, grace_s: float) -> None:
        pass

    async def aclose(self) -> None:
        pass


class InRedis:
    """The region's processes share their counts and streams through Redis."""

    readable_elsewhere = True

    def __init__(self, shared: SharedState) -> None:
        self.shared = shared
        self.claim_backend: Callable[[str, int], Awaitable[bool]] | None = (
            shared.admission.claim_backend
        )
        self._starting: asyncio.Task[None] | None = None
        self._throttle = Throttle(10.0)
        self._announced: dict[tuple[bytes, str | None], list[str]] = {}
        """Stream ids admitted (and announced) this loop turn, by owner and subject, for
        :meth:`announced_id`; what a request did not take is forgotten at the turn's end
        (its metadata expires in Redis, never found: nobody learns the id)."""
        self._landing: dict[str, asyncio.Future[None]] = {}
        """Streams admitted without waiting for Redis whose metadata has not landed yet."""

    @property
    def unreachable(self) -> bool:
        # The lease's renewals, every lease_s / 3 whatever the traffic: a health check costs
        # no round trip, and a burst of them cannot add load to a Redis in trouble.
        return self.shared.lease.outage.down

    def shared_warm_budget(self, window_s: float) -> SharedWarmBudget | None:
        shared = self.shared
        return SharedWarmBudget(shared.redis, shared.keys, shared.process, window_s)

    def start(self) -> None:
        self._starting = asyncio.create_task(self.shared.start())

    async def started(self) -> None:
        if self._starting is not None and not self._starting.done():
            await asyncio.shield(self._starting)  # the lease covers every stream we create

    def place_now(self, state: RouterState, ctx: RequestContext) -> Outcome:
        return PLACE_LATER  # it asks Redis (or sends its claim there): all in place_later

    async def place_later(self, state: RouterState, ctx: RequestContext, gone: Gone) -> Outcome:
        # A stream's metadata goes with its admission, not in a call of its own (which cost
        # a round trip's CPU per stream start in a ramp): before the first byte if the
        # admission waits for Redis; else on its way while the request goes upstream, and
        # the stream's id goes out once it landed (:meth:`announced`).
        stream_id = new_stream_id() if ctx.stream_requested else None
        outcome, landed = await place_shared(state, self.shared.admission, ctx, gone, stream_id)
        if outcome is CONTINUE and stream_id is not None:
            if not self._announced:
                asyncio.get_running_loop().call_soon(self._announced.clear)
            self._announced.setdefault((ctx.owner, ctx.subject), []).append(stream_id)
            if landed is not None and not landed.done():
                self._landing[stream_id] = landed
                landed.add_done_callback(lambda _: self._landing.pop(stream_id, None))
        return outcome

    def release_backend(self, backend: str) -> None:
        self.shared.admission.release_backend(backend)

    def new_stream(
        self, store: StreamStore, owner: bytes, now: float,
        on_finish: Callable[[], object] | None, subject: str | None,
    ) -> Stream:
        stream_id = self.announced_id(owner, subject)
        stream = store.create(owner, now, stream_id)
        stream.subject = subject
        stream.on_finish = on_finish
        self.publish(stream, announced=stream_id is not None)
        return stream

    def announced_id(self, owner: bytes, subject: str | None) -> str | None:
        ids = self._announced.get((owner, subject))
        return ids.pop() if ids else None

    def publish(self, stream: Stream, announced: bool = False) -> None:
        self.shared.streams.publish(stream, announced)

    async def announced(self, stream: Stream) -> None:
        landed = self._landing.get(stream.id)
        if landed is not None:  # admitted without waiting: its claim carries the metadata
            with contextlib.suppress(Exception):  # Redis away: served here, found nowhere else
                await asyncio.shield(landed)
        await self.shared.streams.announced(stream)

    async def lookup(self, stream_id: str, owner: bytes) -> ReadableStream | None:
        return await self.shared.streams.lookup(stream_id, owner)

    async def housekeep(self, state: RouterState, grace_s: float) -> None:
        try:
            self.shared.admission.give_back_idle()
            # Slots a failed claim or release may have left: rewritten first.
            await self.shared.admission.reconcile(state.config.state.timeout_s)
            await self.shared.streams.keep_attended(state.store.running(), state.clock(), grace_s)
            await self._load_elsewhere(state)
            await self.shared.streams.writer.end_dropped()  # last: Redis full refuses it
        except Exception as exc:  # Redis away: only local readers count this turn
            more = self._throttle.report("maintain", time.monotonic())
            if more is not None:
                log.warning("cannot check for readers or load elsewhere: %s%s",
                            describe_error(exc), more)

    async def _load_elsewhere(self, state: RouterState) -> None:
        """Learn what the region's other processes have in flight on each backend (a claim
        refreshes one backend's figure; this refreshes all, for routing between claims)."""
        tracker = state.routing.tracker
        names = list(tracker.backends)
        elsewhere = await self.shared.admission.backends_elsewhere(names)
        for name, others in zip(names, elsewhere, strict=True):
            tracker.observe_elsewhere(name, others)

    async def aclose(self) -> None:
        if self._starting is not None:
            with contextlib.suppress(Exception):
                await cancel_and_wait(self._starting)
        await self.shared.aclose()  # flushes what producers appended before the lease goes
