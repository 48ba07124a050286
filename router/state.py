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
import contextlib
import logging
import secrets
import time
from collections.abc import Callable

from .client_timings import ClientLatency
from .client_tokens import TokenSigner
from .config import RouterConfig
from .cors import CorsPolicy
from .hosting.limits import Throttle
from .metrics import Metrics
from .multiregion import RegionRouting
from .observability.access import RequestLog, SpanSink
from .pipeline.backend import Backend, BackendPool
from .pipeline.proxy import DRAIN_CANCEL, Proxy
from .readers import ReadableStream
from .shared import SharedState, connect
from .shared.errors import describe
from .streams import Stream, StreamStore
from .tenancy import KeyLimiter

__all__ = ["RouterState"]

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
        self._set_keys(config)
        self.draining = False
        """Set by :meth:`start_draining` (SIGTERM): no new work, ``/healthz`` says so."""
        self.metrics = Metrics()
        self.tokens = TokenSigner(
            _token_secret(config),
            max_ttl_s=config.auth.client_token_max_ttl_s,
            default_ttl_s=config.auth.client_token_default_ttl_s,
        )
        self.cors = CorsPolicy(config.cors)
        self.store = StreamStore(
            max_total_bytes=config.streams.max_total_bytes,
            max_age_s=config.streams.max_age_s,
            max_owner_bytes=config.store_bytes_per_key(),
        )
        limits = config.limits
        self.limiter = KeyLimiter(
            max_streams=limits.max_streams_per_key,
            rate_per_s=limits.requests_per_s_per_key,
            burst=limits.request_burst_per_key,
            enabled=bool(self.api_keys),  # anonymous: every caller is one "key"
        )
        reports = config.client_timings
        self.report_limiter = KeyLimiter(
            max_streams=1,  # unused: reports hold nothing in flight
            rate_per_s=reports.reports_per_s_per_key,
            burst=reports.report_burst_per_key,
            enabled=bool(self.api_keys),
        )
        """Per-key rate of client timing reports (``[client_timings]``)."""
        self.client_latency = ClientLatency(
            [config.region, *(peer.name for peer in config.peers)],
            max_countries=reports.max_countries,
            max_records=reports.max_records_per_report,
        )
        """Client-felt TTFT and network time from ``POST /v1/edge/timings``."""
        self.metrics.add_section(self.client_latency.render)
        self.pool = BackendPool(_backends(config))
        self.proxy = Proxy(config.limits, self.metrics, clock, ca_file=config.upstream_ca_file)
        # Region choice, backend affinity, backpressure, peers and warmup (router/multiregion.py).
        self.routing = RegionRouting(
            config, self.pool, self.proxy.client, clock, peer_client=self.proxy.peer_client
        )
        self.shared: SharedState | None = connect(config)
        """The region's shared state (Redis), or None: everything in this process's memory."""
        if self.shared is not None:
            self.routing.released = self.shared.admission.release_backend
            self.routing.claim = self.shared.admission.claim_backend
        self._sharing: asyncio.Task[None] | None = None
        self._state_throttle = Throttle(10.0)
        spans: SpanSink | None = None
        if config.telemetry.otlp_endpoint is not None:
            from .observability.traces import OtlpTraces

            spans = OtlpTraces(config.telemetry, config.region)
        self.requests = RequestLog(config.region, spans)
        """Access log lines and traces, written as requests end."""
        self.cancelled_unattended = 0
        self._maintainer: asyncio.Task[None] | None = None
        self._warming: asyncio.Task[bool] | None = None
        self.metrics.add_gauge_source(
            "firstbyte_router_streams", "Streams held in the store.", lambda: len(self.store)
        )
        self.metrics.add_gauge_source(
            "firstbyte_router_stream_store_bytes",
            "Bytes held in the stream store.",
            lambda: self.store.total_bytes,
        )
        self.metrics.add_counter_source(
            "firstbyte_router_stream_evictions_total",
            "Streams evicted from the store, by reason (age, key_share, bytes).",
            "reason",
            lambda: self.store.evicted_by,
        )

    def _set_keys(self, config: RouterConfig) -> None:
        self.api_keys = [key.encode() for key in config.auth.api_keys]
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
        limits = config.limits
        rate_changed = limits.requests_per_s_per_key != self.limiter.rate_per_s
        self.limiter.max_streams = limits.max_streams_per_key
        self.limiter.rate_per_s = limits.requests_per_s_per_key
        self.limiter.burst = limits.request_burst_per_key
        self.limiter.enabled = bool(self.api_keys)
        if rate_changed:
            self.limiter.forget_buckets()
        self.store.set_bounds(
            max_total_bytes=config.streams.max_total_bytes,
            max_age_s=config.streams.max_age_s,
            max_owner_bytes=config.store_bytes_per_key(),
        )
        self.proxy.limits = limits
        if not _routing_changed(old, config):
            self.routing.config = config
            return
        kept = {(b.name, b.url, b.api_key): b for b in self.pool.backends}
        fresh = [kept.get((b.name, b.url, b.api_key), b) for b in _backends(config)]
        pool = BackendPool(fresh)
        routing = RegionRouting(
            config, pool, self.proxy.client, self.clock, peer_client=self.proxy.peer_client
        )
        routing.adopt(self.routing)
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
            if self.shared is not None:
                self._sharing = asyncio.create_task(self.shared.start())
            self._maintainer = asyncio.create_task(self._maintain())
            self.routing.start()
            self._warming = asyncio.create_task(self.routing.wait_warm())

    async def until_warm(self) -> None:
        """Return once every warm prefix is on every backend, or the start-up timeout passed.

        The router listens at once (so ``/healthz`` can say ``warming``) but holds user
        requests until then: the first request already finds the shared prompts cached.
        """
        self.ensure_started()
        if self._sharing is not None and not self._sharing.done():
            await asyncio.shield(self._sharing)  # the lease covers every stream we create
        assert self._warming is not None
        if not self._warming.done():
            await asyncio.shield(self._warming)

    def new_stream(self, owner: bytes, on_finish: Callable[[], object] | None = None) -> Stream:
        """A new stream of ``owner`` in this process's store, shared when the state is;
        ``on_finish`` runs when it ends (e.g. :attr:`RequestContext.release_key_slot`)."""
        stream = self.store.create(owner, self.clock())
        stream.on_finish = on_finish
        if self.shared is not None:
            self.shared.streams.publish(stream)
        return stream

    async def announced(self, stream: Stream) -> None:
        """Return once other processes can find ``stream``: await before its id goes out."""
        if self.shared is not None:
            await self.shared.streams.announced(stream)

    async def find_stream(self, stream_id: str, owner: bytes) -> ReadableStream | None:
        """``owner``'s stream: from this process's store, else from the shared state; None
        for an unknown id or another owner's stream alike."""
        stream = self.store.get(stream_id, owner)
        if stream is not None or self.shared is None:
            return stream
        return await self.shared.streams.lookup(stream_id, owner)

    def tick(self, now: float) -> None:
        """Evict what the store's bounds say must go; cancel unattended upstream requests;
        forget the rate buckets of idle keys."""
        self.store.evict(now)
        self.limiter.forget_idle(now)
        self.report_limiter.forget_idle(now)
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
            if self.shared is not None:
                try:
                    # Slots a failed claim or release may have left: rewritten first.
                    await self.shared.admission.reconcile(self.config.state.timeout_s)
                    await self.shared.streams.keep_attended(
                        self.store.running(), self.clock(), grace
                    )
                    await self._load_elsewhere(self.shared)
                except Exception as exc:  # Redis away: only local readers count this turn
                    held = self._state_throttle.allow("maintain", time.monotonic())
                    if held is not None:
                        more = f" ({held} more since the last report)" if held else ""
                        log.warning("cannot check for readers or load elsewhere: %s%s",
                                    describe(exc), more)
            self.tick(self.clock())

    async def _load_elsewhere(self, shared: SharedState) -> None:
        """Learn what the region's other processes have in flight on each backend (a claim
        refreshes one backend's figure; this refreshes all, for routing between claims)."""
        tracker = self.routing.tracker
        names = list(tracker.backends)
        for name, others in zip(names, await shared.admission.backends_elsewhere(names),
                                strict=True):
            tracker.observe_elsewhere(name, others)

    async def aclose(self) -> None:
        if self._warming is not None:
            self._warming.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._warming
        if self._maintainer is not None:
            self._maintainer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._maintainer
            self._maintainer = None
        await self.routing.aclose()
        await self.proxy.aclose()  # producers append their last events (to Redis too) ...
        if self._sharing is not None:
            self._sharing.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._sharing
        if self.shared is not None:
            await self.shared.aclose()  # ... which are flushed before the lease is released
        await self.requests.aclose()


def _token_secret(config: RouterConfig) -> bytes:
    if config.auth.token_secret is not None:
        return config.auth.token_secret.encode()
    if config.cors.allow_origins:
        log.info("auth.token_secret is not set: client tokens minted here are valid on this"
                 " process only (set it for several processes or hosts)")
    return secrets.token_bytes(32)


def _backends(config: RouterConfig) -> list[Backend]:
    return [
        Backend(name=u.name or f"upstream{i}", url=u.url.rstrip("/"), api_key=u.api_key)
        for i, u in enumerate(config.upstreams)
    ]


def _routing_changed(old: RouterConfig, new: RouterConfig) -> bool:
    return any(getattr(old, name) != getattr(new, name) for name in _ROUTING_SECTIONS)
