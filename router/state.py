"""Everything one router process holds: config, stream store, per-key limits, backends,
proxy, metrics, and (with ``state.redis_url``) its link to the state the region's processes share.

:meth:`RouterState.tick` is the periodic housekeeping, with the clock passed in: evict
streams over the store's age and byte bounds, forget the rate buckets of idle keys, and
cancel upstream requests nobody has read for ``resume_grace_s`` (a client that disconnected
and did not resume; with shared state, a reader on another process counts as a reader).

Streams are created with :meth:`RouterState.new_stream` and found with
:meth:`RouterState.find_stream`: in this process's store first, then (shared state) in Redis.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from firstbyte.tasks import cancel_and_wait

from .client_timings import ClientLatency
from .client_tokens import TokenSigner
from .config import RouterConfig
from .cors import CorsPolicy
from .metrics import Metrics
from .multiregion import WAIT_FOR_SLOT, RegionRouting
from .observability.access import RequestLog, SpanSink
from .observability.process import render as process_metrics
from .pipeline.backend import Backend, BackendPool
from .pipeline.chooser import Room
from .pipeline.context import CONTINUE, Fallback, LocalReply, Outcome, RequestContext
from .pipeline.proxy import DRAIN_CANCEL, Proxy
from .readers import ReadableStream
from .regionstate import RegionState, region_state_for
from .shared import SharedState, connect
from .streams import Stream, StreamStore, owner_of
from .tenancy import ALONE, KeyLimiter, KeyPolicy, Tenants, refusal

if TYPE_CHECKING:
    from .hosting.quic import Http3Status

__all__ = ["CLIENT_GONE", "RouterState"]

CLIENT_GONE = Fallback("the client went away while its request waited for a slot")
"""What :meth:`RouterState.wait_for_slot` answers when the client left first: nothing is
sent (the caller counts it as ``client_gone``)."""

_ROUTING_SECTIONS = ("upstreams", "peers", "warm_prefixes", "warmup", "routing", "geo")
"""Config sections :class:`RegionRouting` is built from."""

log = logging.getLogger("firstbyte.router")


class RouterState:
    def __init__(self, config: RouterConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        self.region = config.region
        self.api_keys: list[bytes] = []
        self.observer_keys: list[bytes] = []
        self.metrics = Metrics()
        self._set_keys(config)
        self.draining = False
        """Set by :meth:`start_draining` (SIGTERM): no new work, ``/healthz`` says so."""
        self.http3: Http3Status | None = None
        """The HTTP/3 server's status when this process serves HTTP/3 (set by
        :mod:`firstbyte.router.serve`); ``/healthz`` says when it is down."""
        self._token_secret = _token_secret(config)
        self.tokens = TokenSigner(
            self._token_secret,
            max_ttl_s=config.auth.client_token_max_ttl_s,
            default_ttl_s=config.auth.client_token_default_ttl_s,
        )
        self.cors = CorsPolicy(config.cors)
        self.store = StreamStore(
            max_total_bytes=config.streams.max_total_bytes,
            max_age_s=config.streams.max_age_s,
            max_owner_bytes=config.store_bytes_per_key(),
        )
        self.limiter = KeyLimiter(enabled=bool(self.api_keys))  # anonymous: all one "key"
        self.limiter.configure(*key_policies(config))
        self.tenants = Tenants(self.limiter)
        """Requests in flight per key and subject, every model's: the subjects' caps, and the
        fair shares of a full region whose backends all serve the request's model."""
        self.pools: dict[frozenset[str], Tenants] = {}
        """The fair shares of each model pool (the backends serving a model) other than the
        whole region: the requests of the models served by exactly those backends share them,
        and nothing else counts there (:meth:`fair_pool`). A pool nobody holds, waits in or
        was refused from lately has no entry."""
        reports = config.client_timings
        self.report_limiter = KeyLimiter(
            max_streams=1,  # unused: reports hold nothing in flight
            rate_per_s=reports.reports_per_s_per_key,
            burst=reports.report_burst_per_key,
            enabled=bool(self.api_keys),
        )
        """Per-key rate of client timing reports (``[client_timings]``)."""
        self.client_latency = ClientLatency(
            _report_regions(config),
            max_countries=reports.max_countries,
            # Like the other per-key limits, only with keys: anonymous, every caller is one.
            max_countries_per_key=reports.max_countries_per_key if self.api_keys else 0,
            max_records=reports.max_records_per_report,
        )
        """Client-felt TTFT and network time from ``POST /v1/edge/timings``."""
        self.metrics.add_section(self.client_latency.render)
        self.pool = BackendPool(_backends(config))
        self.proxy = Proxy(config.limits, self.metrics, clock,
                           max_connections=config.upstream_connections(),
                           ca_file=config.upstream_ca_file)
        # Region choice, backend affinity, backpressure, peers and warmup (router/multiregion.py).
        self.routing = RegionRouting(
            config, self.pool, self.proxy.client, clock, peer_client=self.proxy.peer_client,
            scrape_pool=self.proxy.scrape_pool,
        )
        self.shared: SharedState | None = connect(config)
        """The region's shared state (Redis), or None: everything in this process's memory.
        For tests and inspection: the router goes through :attr:`region_state`."""
        self.region_state: RegionState = region_state_for(self.shared)
        """Placement, stream lookup and slots, in memory or in Redis (chosen once, here)."""
        self.routing.claim = self.region_state.claim_backend
        # A backend's slot freed: given back region-wide, then handed to a waiter. Without a
        # region-wide claim (in memory) there is nothing to give back: handed only (two calls
        # a request fewer, when nobody waits).
        self.routing.released = (
            self._released if self.region_state.claim_backend is not None else self._freed
        )
        spans: SpanSink | None = None
        if config.telemetry.otlp_endpoint is not None:
            from .observability.traces import OtlpTraces

            spans = OtlpTraces(config.telemetry, config.region)
        self.requests = RequestLog(config.region, spans, usage_key=self.metrics.usage.label)
        """Access log lines and traces, written as requests end."""
        self.cancelled_unattended = 0
        self._maintainer: asyncio.Task[None] | None = None
        self._warming: asyncio.Task[bool] | None = None
        self.warm = False
        """:meth:`until_warm` returned since the last new routing: a request need not ask it
        (nor :meth:`ensure_started`) again, five Python calls and coroutines a request."""
        self.metrics.add_gauge_source(
            "firstbyte_router_streams", "Streams held in the store.", lambda: len(self.store)
        )
        self.metrics.add_gauge_source(
            "firstbyte_router_requests_waiting_for_slot",
            "Requests below their fair share waiting for a slot of the full region.",
            lambda: len(self.tenants.queue) + sum(len(t.queue) for t in self.pools.values()),
        )
        self.metrics.add_gauge_source(
            "firstbyte_router_stream_store_bytes",
            "Bytes held in the stream store.",
            lambda: self.store.total_bytes,
        )
        self.metrics.add_gauge_source(
            "firstbyte_router_stream_store_limit_bytes",
            "The stream store's bound (streams.max_total_bytes): evictions start there.",
            lambda: self.store.max_total_bytes,
        )
        self.metrics.add_gauge_source(
            "firstbyte_router_draining",
            "1 from SIGTERM on: no new work, streams in flight finish.",
            lambda: int(self.draining),
        )
        if self.shared is not None:
            lease = self.shared.lease
            self.metrics.add_gauge_source(
                "firstbyte_router_redis_up",
                "1 if this process's last round trip to the shared state (its lease renewal,"
                " every lease_s / 3) succeeded.",
                lambda: int(lease.reachable),
            )
            admission = self.shared.admission
            self.metrics.add_counter_source(
                "firstbyte_router_shared_admissions_total",
                "Requests admitted region-wide, by what they waited for: redis (a round trip"
                " before the upstream request) or none (nothing in Redis could refuse them:"
                " a spare backend slot, a key with no cap nor rate, a known affinity key).",
                "waited",
                lambda: {"redis": admission.waited, "none": admission.admitted_now},
            )
        self.metrics.add_section(process_metrics)
        self.metrics.add_counter_source(
            "firstbyte_router_stream_evictions_total",
            "Streams evicted from the store, by reason (age, key_share, bytes).",
            "reason",
            lambda: self.store.evicted_by,
        )
        self.metrics.add_counter_source(
            "firstbyte_router_stream_trimmed_events_total",
            "Events trimmed from the front of streams, by reason (key_share: a key over its"
            " share of the store).",
            "reason",
            lambda: {"key_share": self.store.trimmed_events},
        )

    def _set_keys(self, config: RouterConfig) -> None:
        self.api_keys = [key.encode() for key in config.auth.all_keys()]
        self.metrics.usage.configure(
            {owner_of(k.key): k.usage_label for k in config.auth.keys if k.usage_label}
        )
        # Who may read /metrics and the load part of /v1/edge/status (the peer key may too).
        self.observer_keys = self.api_keys + [key.encode() for key in config.auth.metrics_keys]

    def start_draining(self) -> None:
        """Take no new work from now on (SIGTERM): ``/healthz`` answers 503 ``draining``, new
        requests go to a peer region with room or get 503, streams in flight go on."""
        self.draining = True
        self.routing.draining = True

    def end_unfinished_streams(self) -> int:
        """The drain timed out: end every stream still produced here with a ``draining`` error
        event (its upstream request is cancelled); the number ended."""
        ended = 0
        for stream in self.store.running():
            if stream.cancel_producer is not None:
                stream.cancel_producer(DRAIN_CANCEL)
                stream.cancel_producer = None
                ended += 1
        return ended

    async def reconfigure(self, config: RouterConfig) -> None:
        """Swap in ``config`` (checked, and differing only in what can change in place:
        :func:`firstbyte.router.reload.needs_restart`) without dropping a stream.

        Keys and limits apply to the next request. New upstreams, peers, warm prefixes or
        routing settings give a new :class:`RegionRouting`; backends that stay (same name and
        URL) keep their live counts and health, and requests in flight on a removed backend
        finish there.
        """
        old = self.config
        self.config = config
        self._set_keys(config)
        if old.auth.token_secret != config.auth.token_secret or (
            old.auth.client_token_max_ttl_s,
            old.auth.client_token_default_ttl_s,
        ) != (config.auth.client_token_max_ttl_s, config.auth.client_token_default_ttl_s):
            # A rotated secret revokes every token the old one signed, from now on. An unset
            # secret (drawn at start) is kept: a reload that does not touch it revokes nothing.
            if config.auth.token_secret is not None or old.auth.token_secret is not None:
                self._token_secret = _token_secret(config)
            self.tokens = TokenSigner(
                self._token_secret,
                max_ttl_s=config.auth.client_token_max_ttl_s,
                default_ttl_s=config.auth.client_token_default_ttl_s,
            )
        limits = config.limits
        self.limiter.configure(*key_policies(config))
        self.limiter.enabled = bool(self.api_keys)
        self.store.set_bounds(
            max_total_bytes=config.streams.max_total_bytes,
            max_age_s=config.streams.max_age_s,
            max_owner_bytes=config.store_bytes_per_key(),
        )
        self.proxy.limits = limits
        self.client_latency.regions = frozenset(_report_regions(config))
        if old.cors != config.cors:  # else keep which refused origins were logged
            self.cors = CorsPolicy(config.cors)
        if not _routing_changed(old, config):
            self.routing.config = config
            return
        kept = {(b.name, b.url, b.api_key): b for b in self.pool.backends}
        fresh = [kept.get((b.name, b.url, b.api_key), b) for b in _backends(config)]
        pool = BackendPool(fresh)
        routing = RegionRouting(
            config, pool, self.proxy.client, self.clock, peer_client=self.proxy.peer_client,
            scrape_pool=self.proxy.scrape_pool,
        )
        routing.adopt(self.routing)
        self.warm = False  # its model lists are asked for again (adopted when known)
        previous, self.routing, self.pool = self.routing, routing, pool
        if self._maintainer is not None:
            routing.start()
        await previous.aclose()

    @property
    def healthy(self) -> bool:
        return any(b.healthy for b in self.pool.backends)

    @property
    def warming(self) -> bool:
        """True while the start-up warmup runs (``/healthz`` says ``warming``)."""
        return self._warming is None or not self._warming.done()

    def ensure_started(self) -> None:
        """Start housekeeping and the start-up warmup in the running loop (idempotent; called
        at lifespan start-up and on every request)."""
        if self._maintainer is None:
            self.region_state.start()
            self._maintainer = asyncio.create_task(self._maintain())
            self.routing.start()
            self._warming = asyncio.create_task(self.routing.wait_warm())

    async def until_warm(self) -> None:
        """Return once every warm prefix is on every backend, or the start-up timeout passed.

        The router listens at once (so ``/healthz`` can say ``warming``) but holds user
        requests until then: the first request already finds the shared prompts cached.
        """
        self.ensure_started()
        await self.region_state.started()  # the lease covers every stream we create
        assert self._warming is not None
        if not self._warming.done():
            await asyncio.shield(self._warming)
        routing = self.routing
        await routing.wait_models()  # which backend serves which model
        self.warm = routing is self.routing  # not if a reload swapped it in the meantime

    def new_stream(
        self, owner: bytes, on_finish: Callable[[], object] | None = None,
        subject: str | None = None, now: float | None = None,
    ) -> Stream:
        """A new stream of ``owner`` (for ``subject``) in this process's store, shared when
        the state is, made at ``now`` (the clock's time if None); ``on_finish`` runs when it
        ends (e.g. :attr:`RequestContext.release_key_slot`)."""
        # The region state's: in memory, no id announced nor stream published (no call).
        return self.region_state.new_stream(
            self.store, owner, self.clock() if now is None else now, on_finish, subject
        )

    def announced(self, stream: Stream) -> Awaitable[None] | None:
        """Await it, unless None, before ``stream``'s id goes out: it returns once other
        processes can find the stream (None: in memory, nobody else reads it). The region
        state's own awaitable, not a coroutine awaiting it: one coroutine made, run and closed
        a stream less."""
        return self.region_state.announced(stream)

    async def find_stream(
        self, stream_id: str, owner: bytes, subject: str | None = None
    ) -> ReadableStream | None:
        """``owner``'s stream (made for ``subject``, when one is given: a client token's
        subject reads only its own): from this process's store, else from the shared state;
        None for an unknown id, another owner's or another subject's stream alike."""
        stream: ReadableStream | None = self.store.get(stream_id, owner)
        if stream is None:
            stream = await self.region_state.lookup(stream_id, owner)
        if stream is not None and subject is not None and stream.subject != subject:
            return None
        return stream

    def fair_pool(self, ctx: RequestContext) -> frozenset[str] | None:
        """The backends whose slots ``ctx``'s key shares with the other keys: those serving
        its model. None: every backend of the region (a region serving one model, or a
        model every backend serves), whose shares are :attr:`tenants`'."""
        request = ctx.request
        if request is None:
            return None
        # RegionRouting.serving and RouteChooser.serving inlined: asked at every request's
        # hold (its placement's stages read the pool in its room instead: room()).
        routing = self.routing
        models = routing.chooser.models
        serving = models.by_model.get(request.model) or models.unknown_set
        if serving.issuperset(routing.tracker.backends):
            return None
        return serving

    def room(self, ctx: RequestContext, now: float) -> Room | None:
        """``ctx``'s :data:`~firstbyte.router.pipeline.chooser.Room` at ``now``: worked out
        once for its placement, in one scan of the backends (None: no chat request)."""
        request = ctx.request
        if request is None:
            return None
        routing = self.routing
        models = routing.chooser.models  # RouteChooser.serving inlined
        serving = models.by_model.get(request.model) or models.unknown_set
        tracker = routing.tracker
        pool = None if serving.issuperset(tracker.backends) else serving  # fair_pool's
        available, capacity = tracker.room(now, serving)
        return serving, pool, available, capacity

    def tenants_of(self, pool: frozenset[str] | None) -> Tenants:
        """The fair shares of ``pool`` (:meth:`fair_pool`)."""
        if pool is None:
            return self.tenants
        found = self.pools.get(pool)
        if found is None:
            found = self.pools[pool] = Tenants(self.limiter)
        return found

    def _forget_pool(self, pool: frozenset[str] | None) -> None:
        """Drop ``pool``'s shares once nobody holds, waits in or was refused from it."""
        if pool is None:
            return
        tenants = self.pools.get(pool)
        if tenants is not None and not tenants.active():
            del self.pools[pool]

    def hold(
        self, ctx: RequestContext, now: float | None = None, room: Room | None = None
    ) -> Callable[[], None]:
        """Count ``ctx`` in flight for its key and subject, in the region and in its model's
        pool, from ``now`` (the clock's time if None); the call that ends it (once).
        ``room``: ``ctx``'s (:meth:`room`), if the caller has it (its pool is
        :meth:`fair_pool`'s)."""
        if now is None:
            now = self.clock()
        release_region = self.tenants.hold(ctx.owner, ctx.subject, now)
        pool = self.fair_pool(ctx) if room is None else room[1]
        if pool is None:
            return release_region
        release_pool = self.tenants_of(pool).hold(ctx.owner, ctx.subject, now)

        def release() -> None:
            release_region()
            release_pool()
            self._forget_pool(pool)

        return release

    def fair_check(self, ctx: RequestContext, now: float) -> LocalReply | bool:
        """The backends serving ``ctx``'s model are full: queue ``ctx`` (True: below its
        fair share of them), refuse it with its own 429 (above it), or refuse it as a full
        region (False: it alone asks)."""
        pool = self.fair_pool(ctx)
        tracker = self.routing.tracker
        refused = self.tenants_of(pool).fair_refusal(
            ctx, self._fair_capacity(pool), now, tracker.retry_after_s(now, pool)
        )
        self._forget_pool(pool)
        if refused is None:
            return True
        return False if refused is ALONE else refusal(refused)

    def fair_gate(
        self, ctx: RequestContext, now: float | None = None, room: Room | None = None
    ) -> Outcome:
        """Before routing, with room on the backends serving ``ctx``'s model: refuse a key
        (or subject) above its fair share of them while flows below theirs are asking for
        the room there is (full, it is :meth:`fair_check`'s, at the point routing would
        refuse). ``now`` defaults to the clock's; ``room`` is ``ctx``'s at ``now``
        (:meth:`room`), if the caller has it."""
        if now is None:
            now = self.clock()
        tracker = self.routing.tracker
        # Not saturated means some backend of the pool is healthy (an unhealthy one counts as
        # saturated): a pool with nobody healthy is saturated too.
        if room is None:
            pool = self.fair_pool(ctx)
            if tracker.region_saturated(now, pool):
                return CONTINUE
        else:
            pool = room[1]
            if not room[2]:  # nobody serving it has room: the region is saturated
                return CONTINUE
        # The region's shares (pool None) asked without tenants_of and _forget_pool, which
        # have nothing to do for them, and its capacity without _fair_capacity (inlined):
        # each is a Python call.
        # The room's capacity is its pool's (over the same backends, at the same moment).
        if pool is None:
            tenants = self.tenants
            here = tracker.capacity() if room is None else room[3]
            capacity = float(here + sum(self.routing.peer_routed.values()))
        else:
            tenants = self.tenants_of(pool)
            capacity = (
                self._fair_capacity(pool) if room is None
                else float(room[3] + self.routing.routed_to_peers(pool))
            )
        # Its common case first, without the call that would work out a refusal's
        # Retry-After (a closure made a request) and fair_refusal's own call.
        refused = None if tenants.has_room_for(ctx.owner, capacity) else tenants.fair_refusal(
            ctx, capacity, now, lambda: tracker.retry_after_s(now, pool), full=False,
        )
        if pool is not None:
            self._forget_pool(pool)
        return CONTINUE if refused is None else refusal(refused)

    def _released(self, backend: str) -> None:
        """A request on ``backend`` ended or moved away: give back its region-wide slot
        (shared state), then hand the slot to whoever waits for one."""
        self.region_state.release_backend(backend)
        self.hand_slots()

    def _freed(self, backend: str) -> None:
        """:meth:`_released` for a region state without region-wide slots (in memory): hand
        the slot to whoever waits for one (:meth:`hand_slots`, called only when somebody
        may)."""
        if self.tenants.queue.waiting or self.pools:
            self.hand_slots()

    def hand_slots(self) -> int:
        """Wake, in the region and in each model pool, as many waiting requests as its
        backends have free slots not yet handed (:meth:`Tenants.hand_slots`); how many woke."""
        # Asked at every request's end, when mostly nobody waits: the clock is read, and the
        # pools listed, only when somebody does.
        woken = 0
        now: float | None = None
        if self.tenants.queue.waiting:
            now = self.clock()
            woken += self.tenants.hand_slots(self.free_slots(now, None))
        if self.pools:
            for pool, tenants in list(self.pools.items()):
                if tenants.queue.waiting:
                    if now is None:
                        now = self.clock()
                    woken += tenants.hand_slots(self.free_slots(now, pool))
        return woken

    def free_slots(self, now: float, pool: frozenset[str] | None = None) -> int:
        """Slots free on this region's backends (of ``pool``: those serving a model) below
        their limits, by the tracker."""
        tracker = self.routing.tracker
        return sum(max(0, tracker[n].limit - tracker.load(n, now))
                   for n in tracker.available(now, pool))

    def fair_turn(
        self, ctx: RequestContext, now: float | None = None, room: Room | None = None
    ) -> Outcome:
        """A new request while others wait for a slot (or hold one handed to them): it does
        not take a slot before them. CONTINUE when a free slot is left over; else below its
        fair share it waits too (:data:`WAIT_FOR_SLOT`), above it it is refused with its own
        429, and a flow asking alone is refused as a full region. ``now`` and ``room`` as
        :meth:`fair_gate`'s."""
        pool = self.fair_pool(ctx) if room is None else room[1]
        queue = (self.tenants if pool is None else self.tenants_of(pool)).queue
        if now is None:
            now = self.clock()
        # FairQueue.busy and len() in line: two calls a request (its attributes, read).
        waiting = queue.waiting
        if not (waiting or queue.handed) or (
            not waiting and self.free_slots(now, pool) > queue.handed
        ):
            if pool is not None:
                self._forget_pool(pool)
            return CONTINUE
        verdict = self.fair_check(ctx, now)
        if isinstance(verdict, LocalReply):
            return verdict
        return WAIT_FOR_SLOT if verdict else self.routing.reject(ctx, now, "no_local_backend")

    async def wait_for_slot(
        self, ctx: RequestContext, until: float,
        gone: Callable[[], Awaitable[object]] | None = None,
    ) -> Outcome:
        """Hold ``ctx`` (below its fair share in a full region: :data:`WAIT_FOR_SLOT`) until a
        slot is handed to it: CONTINUE (route it again now, before anything else runs), or a
        429 ``region_saturated`` at ``until`` (the clock's time), or :data:`CLIENT_GONE` when
        ``gone()`` (the client's disconnect) ends first. Its wait counts in its flows'
        demand from the start."""
        woken: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def wake() -> None:
            if not woken.done():
                woken.set_result(None)

        pool = self.fair_pool(ctx)
        tenants = self.tenants_of(pool)
        waiter = tenants.wait(ctx.owner, ctx.subject, wake, self.clock())
        listener = asyncio.ensure_future(gone()) if gone is not None else None
        try:
            self.hand_slots()  # a slot may have freed without a request ending (metrics)
            waits: set[asyncio.Future[Any]] = {woken} if listener is None else {woken, listener}
            await asyncio.wait(waits, timeout=max(0.0, until - self.clock()),
                               return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # cancelled: a slot handed to it goes on
            tenants.stop_waiting(waiter)
            self.hand_slots()
            self._forget_pool(pool)
            raise
        finally:
            if listener is not None and not listener.done():
                # settled before the next receive (the stream's own)
                await cancel_and_wait(listener)
        handed = tenants.stop_waiting(waiter)
        self._forget_pool(pool)
        if listener is not None and listener.done() and not listener.cancelled():
            listener.exception()  # a receive that failed: gone as well
            if handed:
                self.hand_slots()  # its slot goes to the next one
            return CLIENT_GONE
        if handed:
            return CONTINUE
        return self.routing.reject(ctx, self.clock(), "fair_wait")

    def _fair_capacity(self, pool: frozenset[str] | None = None) -> float:
        """What the keys share: the limits of the region's backends (of ``pool``: those
        serving a model), plus the requests (of its models) routed to peer regions: they hold
        no slot here, but count in each key's in-flight."""
        routing = self.routing
        if pool is not None:
            return float(routing.tracker.capacity(pool) + routing.routed_to_peers(pool))
        # The region's own requests hold slots of its backends; those routed to peers do not.
        # (RegionRouting.routed_to_any_peer inlined: asked once a request.)
        return float(routing.tracker.capacity() + sum(routing.peer_routed.values()))

    def tick(self, now: float) -> None:
        """Evict what the store's bounds say must go; cancel unattended upstream requests;
        forget the rate buckets of idle keys."""
        self.store.evict(now)
        self.limiter.forget_idle(now)
        self.report_limiter.forget_idle(now)
        self.tenants.forget_asks(now)
        for pool, tenants in list(self.pools.items()):
            tenants.forget_asks(now)
            self._forget_pool(pool)
        self.client_latency.served.forget_old(now)
        self.hand_slots()  # slots freed by others' traffic going (backend metrics)
        grace = self.config.streams.resume_grace_s
        for stream in self.store.running():
            if stream.unattended_for(now) >= grace and stream.cancel_producer is not None:
                stream.cancel_producer()
                stream.cancel_producer = None
                self.cancelled_unattended += 1

    async def _maintain(self) -> None:
        # Check often enough that the grace period is honoured within ~25%.
        interval = min(1.0, max(0.05, self.config.streams.resume_grace_s / 4))
        grace = self.config.streams.resume_grace_s
        while True:
            await asyncio.sleep(interval)
            await self.region_state.housekeep(self, grace)
            self.tick(self.clock())

    async def aclose(self) -> None:
        self.warm = False
        if self._warming is not None:
            await cancel_and_wait(self._warming)
        if self._maintainer is not None:
            await cancel_and_wait(self._maintainer)
            self._maintainer = None
        await self.routing.aclose()
        await self.proxy.aclose()  # producers append their last events (to Redis too) ...
        await self.region_state.aclose()  # ... which are flushed before the lease is released
        await self.requests.aclose()


def _token_secret(config: RouterConfig) -> bytes:
    if config.auth.token_secret is not None:
        return config.auth.token_secret.encode()
    if config.cors.allow_origins:
        log.info("auth.token_secret is not set: client tokens minted here are valid on this"
                 " process only (set it for several processes or hosts)")
    return secrets.token_bytes(32)


def key_policies(config: RouterConfig) -> tuple[KeyPolicy, dict[bytes, KeyPolicy]]:
    """The default key policy (``[limits]``) and each ``[[auth.keys]]`` key's, by owner
    digest; a table entry's unset cap is the default's."""
    limits = config.limits
    default = KeyPolicy(
        1.0, limits.max_streams_per_key, limits.requests_per_s_per_key,
        limits.request_burst_per_key, limits.max_streams_per_subject,
    )
    table = {
        owner_of(k.key): KeyPolicy(
            k.weight,
            default.max_streams if k.max_streams is None else k.max_streams,
            default.rate_per_s if k.requests_per_s is None else k.requests_per_s,
            default.burst if k.request_burst is None else k.request_burst,
            default.max_streams_per_subject if k.max_streams_per_subject is None
            else k.max_streams_per_subject,
        )
        for k in config.auth.keys
    }
    return default, table


def _backends(config: RouterConfig) -> list[Backend]:
    return [
        Backend(name=u.backend_name, url=u.base_url, api_key=u.api_key)
        for u in config.upstreams
    ]


def _routing_changed(old: RouterConfig, new: RouterConfig) -> bool:
    return any(getattr(old, name) != getattr(new, name) for name in _ROUTING_SECTIONS)


def _report_regions(config: RouterConfig) -> list[str]:
    """The regions clients' timing reports may name: this one and its peers (reloaded too:
    a peer added by a reload is one a client may have been served by)."""
    return [config.region, *(peer.name for peer in config.peers)]
