"""Routing across regions, wired into the router: the routing stage and its background tasks.

:class:`RegionRouting` owns the control-plane cores and connects them to the data plane:

- :meth:`RegionRouting.route` is the pipeline stage between admission and the proxy. It
  locates the client (:mod:`firstbyte.router.geo`), chooses the region by expected TTFT
  (:mod:`firstbyte.router.pipeline.region`), and then either picks a local backend by prefix
  affinity
  (:mod:`firstbyte.router.pipeline.affinity`), forwards/spills to a peer's router (as an upstream,
  with the peer key and the loop-prevention header), or answers 429 with ``Retry-After``.
- An :class:`Observation` rides along in ``ctx.observer``: the proxy reports the
  first token, every later chunk and the end to it (load, TTFT/ITL, spill budget), and asks it
  whether to switch upstream when the first token is late (``first_token_deadline_ms``), or
  where to go when its backend refused the connection (:meth:`RegionRouting.fail_over`).
- Both ways of spilling (a saturated region at admission, a late first token) hold a slot of
  one :class:`~firstbyte.router.spill.SpillBudget` from the decision to the request's end; a
  refused slot means no spill. Requests count as active, and against a peer's capacity, from
  the moment they are routed (not when the proxy's task gets to run), so a burst routed in one
  loop turn sees its own earlier members.
- Background: :class:`~firstbyte.router.peers.PeerPoller` (peer status over the proxy's kept-warm
  pool) and :class:`~firstbyte.router.warmup.WarmupRunner` (backend metrics scrapes, health, warmup
  probes).
- :meth:`status` is ``GET /v1/edge/status``; :meth:`render_metrics` adds to ``/metrics``.

Routers of one deployment share their API keys: a forwarded request carries the client's
``Authorization`` to the peer, plus ``x-firstbyte-peer-key`` (router-to-router
authentication; only then are ``x-firstbyte-forwarded`` and the forwarded client address
believed).
"""

from __future__ import annotations

import hmac
import math
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import httpx

from firstbyte.protocol import error_codes
from firstbyte.protocol.edge import BackendStatus, EdgeStatus, PeerLink, prefix_hash
from firstbyte.protocol.headers import (
    BETTER_REGION_HEADER,
    BETTER_REGION_URL_HEADER,
    FORWARDED_HEADER,
    PEER_KEY_HEADER,
)
from firstbyte.protocol.openai import ChatCompletionRequest, message_text

from .backpressure import BackendLoad, LoadTracker
from .config import RouterConfig
from .geo import GeoLocator, GeoPoint, Location, TrustedProxies, client_address, known_regions
from .hosting.prometheus import Histogram
from .metrics import TTFT_BUCKETS_S
from .observability.logs import describe_error
from .peers import PeerPoller, PeerTable
from .pipeline.affinity import AffinityPolicy, BackendChoice, affinity_key
from .pipeline.backend import PEER_PREFIX, Backend, BackendPool
from .pipeline.context import (
    CONTINUE,
    FailCause,
    Fallback,
    LocalReply,
    Outcome,
    RequestContext,
    error_reply,
)
from .pipeline.region import RegionCandidate, RegionModel, Verdict, choose_region
from .regions_config import warm_prefix_text
from .spill import SpillBudget, SpillSlot
from .upstream_metrics import BackendMetrics
from .warmup import WarmPrefix, WarmupRunner, WarmupScheduler

__all__ = [
    "REJECTION_REASONS", "WAIT_FOR_SLOT", "FairCheck", "Observation", "RegionRouting",
    "draining_reply",
]

FairCheck = Callable[[RequestContext, float], "LocalReply | bool"]
"""``(ctx, now)`` -> queue it (True), refuse it as before (False) or this refusal."""

WAIT_FOR_SLOT = Fallback("below its fair share in a full region: wait for a slot")
"""What :meth:`RegionRouting.route` answers for a request that waits for a slot of the full
region (``routing.max_fair_wait_ms``): the caller waits (:meth:`firstbyte.router.state.
RouterState.wait_for_slot`) and routes it again; it never reaches a client."""

ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)
CHARS_PER_TOKEN = 4.0

PASSIVE_DOWN_S = 10.0
"""How long a backend that refused a connection stays out of rotation when it has no metrics
scrape to say it is back (``kind = "openai"`` without ``models``), as nginx's ``fail_timeout``;
a scraped backend is back at its first answered scrape."""


REJECTION_REASONS = {
    "no_healthy_backend": "none of its backends is answering",
    "no_peer_with_room": "no other region can take this request",
    "spill_budget": "its budget of requests spilled to other regions is used up",
    "saturated_forwarded": "this request was already forwarded by another region",
    "no_local_backend": "no backend of it can take this request",
    "fair_wait": "no slot freed for this request within routing.max_fair_wait_ms",
}
"""Why a request was answered 429 here (the access log's ``reason``), and the sentence the
client reads after "Region R is at capacity and"."""


def draining_reply() -> LocalReply:
    """503 ``draining`` with ``Retry-After``: this process takes no new work (SIGTERM)."""
    return error_reply(
        503,
        "This router is shutting down; send the request again (another router of the region"
        " takes it).",
        "server_error",
        code=error_codes.DRAINING,
        headers=(("retry-after", "1"),),
        outcome="draining",
    )


def _point(lat: float | None, lon: float | None, name: str) -> GeoPoint | None:
    if lat is not None and lon is not None:
        return GeoPoint(lat, lon)
    known = known_regions().get(name)
    return known.point if known is not None else None


@dataclass(eq=False)
class Observation:
    """One request's routing record; the proxy calls its hooks (see the module docstring)."""

    routing: RegionRouting
    region: str
    backend: str
    local: bool
    spill: bool
    started: float
    location: Location | None
    first_token_deadline_s: float | None = None
    choice: str = ""
    """Why this backend (``affinity``, ``new-key``, ``balance``, ..., ``queued``); empty for
    a peer."""
    ttft_ms: float | None = None
    upstream_ttft_ms: float | None = None
    """From sending the request to its backend (the attempt that served) to its first token."""
    last_chunk: float | None = None
    switched: bool = False
    done: bool = False
    reason: str = ""
    slot: SpillSlot | None = None
    """The spill slot this request holds while it is served by a peer as a spill."""
    claim: tuple[str, SpillSlot] | None = None
    """A first-token-deadline switch decided (target peer, slot taken) but not yet made."""
    extra_headers: dict[str, str] = field(default_factory=dict)

    def first_token(self, ctx: RequestContext, ttft_ms: float) -> None:
        self.ttft_ms = ttft_ms
        self.last_chunk = time.perf_counter()
        if ctx.upstream_sent_at is not None:
            self.upstream_ttft_ms = (self.last_chunk - ctx.upstream_sent_at) * 1000
        self.routing.first_token(self, ttft_ms)

    def chunk(self, ctx: RequestContext, now: float) -> None:
        if self.last_chunk is not None:
            self.routing.itl.observe(now - self.last_chunk)
        self.last_chunk = now

    def claim_switch(self, ctx: RequestContext) -> bool:
        """At the first-token deadline: take a spill slot and a target for :meth:`switch`.

        True means the caller must switch (or the slot goes back at the first token or the
        end); False means stay on this upstream.
        """
        if self.ttft_ms is not None or self.done or self.claim is not None:
            return False
        return self.routing.claim_switch(self, ctx)

    def switch(self, ctx: RequestContext) -> Backend:
        """Move to the peer claimed by :meth:`claim_switch`; the new upstream to send to."""
        return self.routing.switch(self, ctx)

    def first_byte_timeout_s(self) -> float | None:
        """How long the current attempt may wait for its backend's first byte (a local
        backend's, from its observed TTFT); None for a peer region."""
        return self.routing.first_byte_timeout_s(self.backend) if self.local else None

    async def fail_over(
        self, ctx: RequestContext, exc: Exception, cause: FailCause = "refused"
    ) -> Backend | None:
        """This request's backend failed it (``exc``, ``cause``) before anything reached its
        client: the backend to send it to instead, or None (see
        :meth:`RegionRouting.fail_over`)."""
        return await self.routing.fail_over(self, ctx, exc, cause)

    def finished(self, ctx: RequestContext, ok: bool) -> None:
        if not self.done:
            self.done = True
            self.routing.finished(self, ctx, ok)


class RegionRouting:
    """This region's routing state and decisions (see the module docstring)."""

    def __init__(
        self,
        config: RouterConfig,
        pool: BackendPool,
        client: httpx.AsyncClient,
        clock: Callable[[], float] = time.monotonic,
        *,
        peer_client: httpx.AsyncClient | None = None,
    ) -> None:
        """``client`` scrapes and warms this region's backends; ``peer_client`` (default:
        ``client``) polls the peers, and should be the pool forwarded requests use, whose
        connections the polls then keep warm."""
        self.config = config
        self.region = config.region
        self.pool = pool
        self.client = client
        self.clock = clock
        routing = config.routing
        self.here_point = _point(config.geo.latitude, config.geo.longitude, config.region)
        self.trusted = TrustedProxies(config.geo.trusted_proxies, config.geo.forwarded_header)
        self.locator = GeoLocator(config.geo.database) if config.geo.database else None
        self.peer_key = routing.peer_key
        self.model = RegionModel(
            prefill_ms_per_1k_tokens=routing.prefill_ms_per_1k_tokens,
            forward_overhead_ms=routing.forward_overhead_ms,
            forward_margin_ms=routing.forward_margin_ms,
        )
        upstreams = config.upstreams
        self.backends: dict[str, Backend] = {b.name: b for b in pool.backends}
        self.kinds = {b.name: u.kind for b, u in zip(pool.backends, upstreams, strict=True)}
        self.tracker = LoadTracker(
            [
                BackendLoad(
                    b.name,
                    max_in_flight=u.max_in_flight or routing.backend_max_in_flight,
                    max_waiting=routing.backend_max_waiting,
                    weight=u.weight,
                )
                for b, u in zip(pool.backends, upstreams, strict=True)
            ],
            metrics_ttl_s=max(2.0, 3 * routing.backend_metrics_interval_s),
        )
        self.policy = AffinityPolicy(
            {b.name: u.weight for b, u in zip(pool.backends, upstreams, strict=True)},
            policy=routing.backend_policy,
            abs_threshold=routing.balance_abs_threshold,
            rel_threshold=routing.balance_rel_threshold,
            bounded_load_factor=routing.bounded_load_factor,
            ttl_s=routing.affinity_ttl_s,
        )
        self.spill = SpillBudget(routing.spill_budget_ratio, routing.spill_min_concurrency)
        self.rejections: Counter[str] = Counter()
        """429s answered here, by reason (see :meth:`_reject`)."""
        self.deadline_s = (
            routing.first_token_deadline_ms / 1000.0 if routing.first_token_deadline_ms else None
        )
        # Peers: their routers are upstreams like any other, with their own Backend record.
        self.peer_table = PeerTable(
            [(p.name, p.url) for p in config.peers], routing.peer_status_ttl_s
        )
        self.peer_backends = {
            p.name: Backend(name=f"{PEER_PREFIX}{p.name}", url=p.url.rstrip("/"))
            for p in config.peers
        }
        self.peer_points = {p.name: _point(p.latitude, p.longitude, p.name) for p in config.peers}
        self.peer_urls = {p.name: p.public_url or p.url for p in config.peers}
        self.poller = PeerPoller(
            self.peer_table, peer_client or client, peer_key=self.peer_key,
            interval_s=routing.peer_poll_interval_s, clock=clock, on_status=self._on_peer_status,
        )
        # Requests routed to each peer and not finished, counted when routed: the proxy's own
        # count starts only when its task runs, after every other request of a burst routed.
        self.peer_routed = dict.fromkeys(self.peer_backends, 0)
        # ``peer_routed`` when the peer's last status arrived: the status counts those;
        # requests routed since are added on top (the status is up to one poll old).
        self._sent_baseline = dict.fromkeys(self.peer_backends, 0)
        # Warm prefixes.
        self.prefixes = [
            WarmPrefix(p.name, warm_prefix_text(p), tuple(p.models)) for p in config.warm_prefixes
        ]
        self.prefix_hashes = {p.name: prefix_hash(p.text) for p in self.prefixes}
        self.scheduler = WarmupScheduler(
            self.prefixes if config.warmup.enabled else [],
            interval_s=config.warmup.interval_s,
            pressure_interval_s=config.warmup.pressure_interval_s,
            cache_pressure_perc=config.warmup.cache_pressure_perc,
            busy_running_threshold=config.warmup.busy_running_threshold,
            retry_s=config.warmup.retry_s,
        )
        scraped: dict[str, str] = {}
        probe_headers: dict[str, dict[str, str]] = {}
        for b, u in zip(pool.backends, upstreams, strict=True):
            if u.kind == "openai" and not u.models:
                continue  # no /metrics and no model list to warm with
            self.scheduler.add_backend(b.name, u.models)
            scraped[b.name] = b.url
            if b.api_key:
                probe_headers[b.name] = {"authorization": f"Bearer {b.api_key}"}
        self.runner = WarmupRunner(
            self.scheduler, client, scraped,
            poll_interval_s=routing.backend_metrics_interval_s, clock=clock,
            on_metrics=self._on_metrics, headers=probe_headers, on_probe=self._on_probe,
        )
        # Metrics.
        self.outcomes: Counter[tuple[str, str, str]] = Counter()
        self.spills: Counter[tuple[str, str]] = Counter()
        self.forwards: Counter[str] = Counter()
        self.choices: Counter[str] = Counter()
        """Backend choices by reason (affinity, new-key, balance, round-robin, least-loaded)."""
        self.ttft: dict[str, Histogram] = {}
        self.itl = Histogram(ITL_BUCKETS_S)
        self.released: Callable[[str], object] | None = None
        """Called with a local backend's name when a request on it ends or moves away (the
        shared state gives back its slot there)."""
        self.claim: Callable[[str, int], Awaitable[bool]] | None = None
        """Claims a slot of a backend (name, limit) for a request moved there, False if the
        backend is full region-wide (the shared state; in memory the tracker's count is all)."""
        self._down_until: dict[str, float] = {}
        """Backends without scrapes taken out of rotation by a refused connection, until when
        (:data:`PASSIVE_DOWN_S`)."""
        self._ejected_until: dict[str, float] = {}
        """Backends ejected by passive health (first-byte timeout, 5xx), until when no scrape
        may re-admit them (``routing.backend_eject_s``)."""
        self.ejections: Counter[tuple[str, str]] = Counter()
        """Passive-health ejections by (backend, cause)."""
        self._started = False
        self.draining = False
        """This process is shutting down: it counts as unhealthy for routing (a request goes
        to a peer with room, or gets 503 ``draining``) and in its edge status."""

    def adopt(self, previous: RegionRouting) -> None:
        """Carry over what ``previous`` (the routing before a reload) learned and still counts:
        the load record of every backend that stays (requests in flight on it finish on the
        previous routing's record, which this one now shares; out of rotation until when it
        was), the status and RTT of every
        peer that stays at the same URL, the draining flag, and the shared state's hooks
        (:attr:`released`, :attr:`claim`)."""
        self.released, self.claim = previous.released, previous.claim
        for name, load in self.tracker.backends.items():
            old = previous.tracker.backends.get(name)
            if old is not None and self.backends[name] is previous.backends.get(name):
                old.max_in_flight, old.max_waiting, old.weight = (
                    load.max_in_flight, load.max_waiting, load.weight
                )
                self.tracker.backends[name] = old
                # Out of rotation it stays, until when it was to be tried again.
                for mine, theirs in (
                    (self._down_until, previous._down_until),
                    (self._ejected_until, previous._ejected_until),
                ):
                    if name in theirs:
                        mine[name] = theirs[name]
        for name, peer in self.peer_table.peers.items():
            was = previous.peer_table.peers.get(name)
            if was is not None and was.url == peer.url:
                self.peer_table.peers[name] = was
        self.draining = previous.draining

    # --- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        """Start peer polls and backend scrapes/warmup in the running loop (idempotent)."""
        if self._started:
            return
        self._started = True
        if self.peer_table.peers:
            self.poller.start()
        if self.runner.urls:
            self.runner.start()

    async def wait_warm(self) -> bool:
        """Before serving: warm every prefix on every backend (bounded by the start-up timeout)."""
        if not self.prefixes or not self.runner.urls:
            return True
        return await self.runner.wait_all_warm(self.config.warmup.startup_timeout_s)

    async def aclose(self) -> None:
        await self.poller.stop()
        await self.runner.stop()
        if self.locator is not None:
            self.locator.close()

    def _on_peer_status(self, name: str) -> None:
        self._sent_baseline[name] = self.peer_routed[name]

    def _on_probe(self, name: str, started: bool, answered_ms: float | None) -> None:
        """A warmup probe is load on ``name`` as our requests are: a scrape that shows it
        running must not count it as someone else's once it ended (the start-up warmup's
        last scrape saw its probes, and the first request after it was refused as if the
        backend were full). An answered probe (one token) is a TTFT sample for the
        first-byte deadline, known before any user request."""
        if name not in self.tracker.backends:
            return
        if started:
            self.tracker.started(name, self.clock(), probe=True)
            return
        self.tracker.finished(name)
        if answered_ms is not None:
            self.tracker.observe_probe(name, answered_ms)

    def _on_metrics(self, name: str, metrics: BackendMetrics | None) -> bool:
        """A scrape's result (None: unreachable); False if ``name`` answered but stays out
        of rotation: ejected for failing requests, a scrape proves the server listens, not
        that it serves, so only one after ``backend_eject_s`` re-admits it."""
        healthy = metrics is not None
        until = self._ejected_until.get(name)
        if until is not None and healthy:
            if self.clock() < until:
                return False
            del self._ejected_until[name]
        self.tracker.set_health(name, healthy)
        self.backends[name].healthy = healthy
        if metrics is not None:
            self.tracker.observe_metrics(name, metrics, self.clock())
        return healthy

    # --- the stage ---------------------------------------------------------------------
    def peer_authenticated(self, ctx: RequestContext) -> bool:
        given = ctx.headers.get(PEER_KEY_HEADER)
        if not given or not self.peer_key:
            return False
        return hmac.compare_digest(given.encode(), self.peer_key.encode())

    def locate(self, ctx: RequestContext, from_peer: bool) -> Location | None:
        if self.locator is None:
            return None  # no database: the client's address (parsed per request) is not needed
        peer = ctx.client[0] if ctx.client else None
        trusted = self.trusted
        if from_peer and peer is not None:
            # A peer router states the client's address in x-forwarded-for (see _to_peer).
            trusted = TrustedProxies([*self.config.geo.trusted_proxies, peer], "x-forwarded-for")
        address = client_address(peer, ctx.headers, trusted)
        return self.locator.locate(address)

    def _prefix(self, request: ChatCompletionRequest) -> WarmPrefix | None:
        first = request.messages[0]
        if first.role not in ("system", "developer"):
            return None
        text = message_text(first)
        for p in self.prefixes:
            if (not p.models or request.model in p.models) and text.startswith(p.text):
                return p
        return None

    def _here(self, now: float) -> RegionCandidate:
        warm = {
            self.prefix_hashes[name]
            for backend in self.tracker.healthy()
            for name in self.scheduler.warm(backend)
        }
        return RegionCandidate(
            self.region, self.here_point, bool(self.tracker.healthy()) and not self.draining,
            self.tracker.region_saturated(now), self.tracker.queue_wait_ms(now), frozenset(warm),
        )

    def _peers(self, now: float) -> dict[str, RegionCandidate]:
        out: dict[str, RegionCandidate] = {}
        for name, status in self.peer_table.fresh(now).items():
            rtt = self.peer_table.peers[name].rtt_ms
            point = self.peer_points.get(name)
            if point is None and status.latitude is not None and status.longitude is not None:
                point = GeoPoint(status.latitude, status.longitude)
            # The status counted our requests of that moment; adjust by ours since (+ or -).
            ours = self.peer_routed[name] - self._sent_baseline[name]
            load = status.in_flight + ours
            saturated = load >= status.capacity if ours else status.saturated
            out[name] = RegionCandidate(
                name, point, status.healthy, saturated, status.queue_wait_ms,
                frozenset(status.warm_prefixes), rtt.value if rtt is not None else None,
                status.public_url or self.peer_urls.get(name),
            )
        return out

    def active(self) -> int:
        """Requests routed from here and not finished: to local backends and to peers."""
        return self.tracker.in_flight() + sum(self.peer_routed.values())

    def route(self, ctx: RequestContext, share: FairCheck | None = None) -> Outcome:
        """Choose the region and backend for an admitted chat request (sets ``ctx.backend``).

        Where the region is full and the request would be refused, ``share`` (the fair
        share of the keys asking, :meth:`firstbyte.router.tenancy.Tenants.fair_refusal`) says
        whether it waits for a slot (below its share: :data:`WAIT_FOR_SLOT`; queued on a
        backend past its limit when ``routing.max_fair_wait_ms`` is 0), is refused with its own
        answer (above it), or refused as before (``False``: it alone fills the region)."""
        request = ctx.request
        assert request is not None
        now = self.clock()
        if self._down_until:
            self._back_in_rotation(now)
        from_peer = self.peer_authenticated(ctx)
        forwarded = from_peer and FORWARDED_HEADER in ctx.headers
        location = self.locate(ctx, from_peer)
        prefix = self._prefix(request)
        chars = sum(len(message_text(m)) for m in request.messages)
        decision = choose_region(
            self.model, self._here(now), self._peers(now), client=location,
            prompt_tokens=int(chars / CHARS_PER_TOKEN),
            prefix=self.prefix_hashes[prefix.name] if prefix else None,
            prefix_tokens=int(len(prefix.text) / CHARS_PER_TOKEN) if prefix else 0,
            forwarded=forwarded,
        )
        ctx.location = location
        ctx.region_decision = decision
        headers: list[tuple[str, str]] = []
        if decision.better_region is not None:
            headers.append((BETTER_REGION_HEADER, decision.better_region))
            url = self.peer_urls.get(decision.better_region)
            if url:
                headers.append((BETTER_REGION_URL_HEADER, url))
        ctx.response_headers = headers
        if self.draining and decision.verdict in (Verdict.LOCAL, Verdict.REJECT):
            return draining_reply()
        if decision.verdict is Verdict.LOCAL:
            chosen = self._local_backend(request, now)
            if chosen is None:  # raced to saturation since the region check
                return self.reject(ctx, now, "no_local_backend")
            return self._serve_local(ctx, chosen, location, now)
        if decision.verdict is Verdict.REJECT:
            reason = "saturated_forwarded" if forwarded else "no_peer_with_room"
            return self._queue_or_reject(ctx, request, location, now, reason, share)
        slot: SpillSlot | None = None
        if decision.verdict is Verdict.SPILL:
            # This request counts as active: it is one, wherever it goes.
            slot = self.spill.acquire(self.active() + 1, "saturated")
            if slot is None:
                return self._queue_or_reject(
                    ctx, request, location, now, "spill_budget", share
                )
            self.spills[(decision.region, "saturated")] += 1
        else:
            self.forwards[decision.region] += 1
        self._to_peer(ctx, decision.region, location, slot)
        return CONTINUE

    def _queue_or_reject(
        self,
        ctx: RequestContext,
        request: ChatCompletionRequest,
        location: Location | None,
        now: float,
        reason: str,
        share: FairCheck | None = None,
    ) -> Outcome:
        queued = self._queue_locally(request, now)
        if queued is None and share is not None and self.tracker.healthy():
            verdict = share(ctx, now)
            if isinstance(verdict, LocalReply):
                self.outcomes[(self.region, "", "rejected")] += 1
                return verdict
            if verdict and self.config.routing.max_fair_wait_ms > 0:
                return WAIT_FOR_SLOT  # below its fair share: it waits here for a slot
            if verdict:  # below its fair share: it waits on a backend, others are held
                queued = self._choose(request, self.tracker.healthy(), now, "fair_share")
        if queued is not None:
            return self._serve_local(ctx, queued, location, now)
        return self.reject(ctx, now, reason)

    def affinity_key(self, request: ChatCompletionRequest) -> str:
        """The key that decides ``request``'s backend (:func:`affinity_key`)."""
        texts = [p.text for p in self.prefixes]
        return affinity_key(request, texts, self.config.routing.affinity_chars)

    def _local_backend(self, request: ChatCompletionRequest, now: float) -> BackendChoice | None:
        return self._choose(request, self.tracker.available(now), now, None)

    def _queue_locally(self, request: ChatCompletionRequest, now: float) -> BackendChoice | None:
        """A backend to queue on when the expected wait is within ``max_queue_wait_ms``."""
        healthy = self.tracker.healthy()
        limit = self.config.routing.max_queue_wait_ms
        if not healthy or limit <= 0 or self.tracker.queue_wait_ms(now) > limit:
            return None
        return self._choose(request, healthy, now, "queued")

    def _choose(
        self, request: ChatCompletionRequest, candidates: list[str], now: float, reason: str | None
    ) -> BackendChoice | None:
        """The affinity policy's pick among ``candidates``, counted in ``choices`` under
        ``reason`` (the policy's own reason when None); None if it picks nothing."""
        loads = {n: self.tracker.load(n, now) for n in candidates}
        choice = self.policy.choose(self.affinity_key(request), candidates, loads, now)
        if choice is None:
            return None
        if reason is not None:
            choice = BackendChoice(choice.backend, reason)
        self.choices[choice.reason] += 1
        return choice

    def _serve_local(
        self, ctx: RequestContext, choice: BackendChoice, location: Location | None, now: float
    ) -> Outcome:
        name = choice.backend
        ctx.backend = self.backends[name]
        ctx.region = self.region
        self.tracker.started(name, now)
        ctx.observer = Observation(
            self, self.region, name, True, False, time.perf_counter(), location,
            first_token_deadline_s=self.deadline_s if ctx.stream_requested else None,
            choice=choice.reason,
        )
        return CONTINUE

    def unroute(self, ctx: RequestContext) -> Observation | None:
        """Undo :meth:`route` for a request that will not go (its backend turned out full
        region-wide): its record, without counting an outcome; returns that record."""
        observer, ctx.observer = ctx.observer, None
        if not isinstance(observer, Observation):
            return None
        observer.done = True
        if observer.local:
            self.tracker.unstarted(observer.backend)
        else:
            self.peer_routed[observer.region] -= 1
            if observer.slot is not None:
                self.spill.release(observer.slot)
        ctx.backend = None
        return observer

    def _to_peer(
        self, ctx: RequestContext, peer: str, location: Location | None, slot: SpillSlot | None
    ) -> None:
        """Send the request to ``peer`` (a spill when it holds ``slot``)."""
        backend = self.peer_backends[peer]
        self.peer_routed[peer] += 1
        ctx.backend = backend
        ctx.region = peer
        headers = {FORWARDED_HEADER: self.region}
        if self.peer_key:
            headers[PEER_KEY_HEADER] = self.peer_key
        auth = ctx.headers.get("authorization")
        if auth:
            headers["authorization"] = auth
        address = client_address(ctx.client[0] if ctx.client else None, ctx.headers, self.trusted)
        if address is not None:
            headers["x-forwarded-for"] = str(address)
        ctx.upstream_headers = headers
        observer = ctx.observer
        if isinstance(observer, Observation):
            observer.region, observer.backend, observer.local = peer, backend.name, False
            observer.spill = observer.spill or slot is not None
            observer.slot = slot
        else:
            ctx.observer = Observation(
                self, peer, backend.name, False, slot is not None, time.perf_counter(), location,
                slot=slot,
            )

    def down_retry_after_s(self, now: float) -> int:
        """``Retry-After`` when no backend is healthy: until the first ejected one is tried
        again, else (down by its scrapes) the scrape interval; whole seconds, 1 to 10."""
        until = [
            t for t in (*self._down_until.values(), *self._ejected_until.values()) if t > now
        ]
        wait = min(until) - now if until else self.config.routing.backend_metrics_interval_s
        return max(1, min(10, math.ceil(wait)))

    def retry_after_s(self) -> int:
        """``Retry-After`` for a 429 from here (also put on a peer's 429 passed through)."""
        return self.tracker.retry_after_s(self.clock())

    def reject(self, ctx: RequestContext, now: float, reason: str) -> Outcome:
        """429 with ``Retry-After``; ``reason`` (a key of :data:`REJECTION_REASONS`) goes to the
        access log and the ``route_rejections_total`` metric, its sentence to the client.
        With no healthy backend here the cause is not load: 503 ``no_healthy_backend``
        (reason ``no_healthy_backend``), so clients and operators do not read it as one."""
        self.outcomes[(self.region, "", "rejected")] += 1
        if not self.tracker.healthy():
            reason = "no_healthy_backend"
            self.rejections[reason] += 1
            ctx.route_reason = reason
            retry = self.down_retry_after_s(now)
            return error_reply(
                503,
                f"No backend of region {self.region} is answering and no other region can"
                f" take this request; retry after {retry} s.",
                "server_error",
                code=error_codes.NO_HEALTHY_BACKEND,
                headers=(("retry-after", str(retry)),),
                outcome="rejected",
            )
        retry = self.tracker.retry_after_s(now)
        self.rejections[reason] += 1
        ctx.route_reason = reason  # for the access log
        return error_reply(
            429,
            f"Region {self.region} is at capacity and {REJECTION_REASONS[reason]};"
            f" retry after {retry} s.",
            "rate_limit_error",
            code=error_codes.REGION_SATURATED,
            headers=(("retry-after", str(retry)),),
            outcome="rejected",
        )

    # --- observer callbacks ------------------------------------------------------------
    def first_token(self, obs: Observation, ttft_ms: float) -> None:
        if obs.claim is not None:  # the token beat the switch it had claimed: no switch
            self.spill.release(obs.claim[1])
            obs.claim = None
        if obs.local:
            self.tracker.observe_ttft(obs.backend, ttft_ms, obs.upstream_ttft_ms)
            backend = self.backends[obs.backend]
            if backend.healthy and obs.backend in self.runner.changes.down_since:
                # Back in rotation after PASSIVE_DOWN_S, and it answered: say it is up.
                self.runner.changes.up(obs.backend, url=backend.url)
        hist = self.ttft.get(obs.region)
        if hist is None:
            hist = self.ttft[obs.region] = Histogram(TTFT_BUCKETS_S)
        hist.observe(ttft_ms / 1000.0)

    def claim_switch(self, obs: Observation, ctx: RequestContext) -> bool:
        """A late first token: claim a peer and a spill slot for :meth:`switch`, or refuse."""
        if obs.switched or not obs.local:
            return False
        target = self._switch_target(ctx)
        if target is None:
            return False
        # ``active`` already counts this request (it is in flight locally).
        slot = self.spill.acquire(self.active(), "first_token_deadline")
        if slot is None:
            return False
        obs.claim = (target, slot)
        return True

    def _switch_target(self, ctx: RequestContext) -> str | None:
        now = self.clock()
        forwarded = self.peer_authenticated(ctx) and FORWARDED_HEADER in ctx.headers
        if forwarded:
            return None
        candidates = [c for c in self._peers(now).values() if c.healthy and not c.saturated]
        if not candidates:
            return None
        location = ctx.location
        point = location.point if isinstance(location, Location) else None
        here = self._here(now)
        return min(
            candidates,
            key=lambda c: self.model.expected_ms(point, here, c, 0, None, 0),
        ).name

    def switch(self, obs: Observation, ctx: RequestContext) -> Backend:
        """The first token is late: move the request to the peer it claimed (a spill)."""
        assert obs.claim is not None, "switch() without a successful claim_switch()"
        target, slot = obs.claim
        obs.claim = None
        self.tracker.finished(obs.backend)
        if self.released is not None:
            self.released(obs.backend)
        self.spills[(target, "first_token_deadline")] += 1
        obs.switched = True
        obs.first_token_deadline_s = None
        self._to_peer(ctx, target, obs.location, slot)
        obs.reason = "first_token_deadline"
        backend: Backend = ctx.backend
        return backend

    async def fail_over(
        self, obs: Observation, ctx: RequestContext, exc: Exception,
        cause: FailCause = "refused",
    ) -> Backend | None:
        """``obs``'s local backend failed the request before anything reached its client:
        it refused the connection or did not accept it in time (``refused``: the request
        never reached it), closed or reset it before any byte of its answer, sent no byte
        by the first-byte deadline, or answered 5xx. Take
        that backend out of rotation (:meth:`unreachable`, :meth:`eject`) and move the
        request to the backend the policy picks among the region's others with room,
        holding a slot there before giving back the old one. None when no other can take
        it (the request then fails as it would have); a peer region is not tried, as a
        request that just found its backend gone should not also pay a forward."""
        request = ctx.request
        if not obs.local or request is None:
            return None
        old = obs.backend
        if cause == "refused":
            self.unreachable(old, exc)
        elif cause != "5xx" or (
            self.tracker.observe_5xx(old) >= self.config.routing.backend_eject_consecutive_5xx
        ):
            self.eject(old, exc, cause)
        now = self.clock()
        refused = {old}  # still in rotation if it is the region's last (see unreachable)
        while True:
            candidates = [n for n in self.tracker.available(now) if n not in refused]
            choice = self._choose(request, candidates, now, "failover") if candidates else None
            if choice is None:
                return None
            name = choice.backend
            self.tracker.started(name, now)
            if self.claim is None or await self.claim(name, self.tracker[name].limit):
                break
            self.tracker.unstarted(name)  # full region-wide meanwhile
            refused.add(name)
        self.tracker.finished(old)
        if self.released is not None:
            self.released(old)
        obs.backend, obs.choice = name, "failover"
        obs.reason = "backend_unreachable" if cause == "refused" else f"backend_{cause}"
        moved = ctx.backend = self.backends[name]
        return moved

    def unreachable(self, name: str, exc: Exception) -> None:
        """A request could not connect to local backend ``name``: out of rotation now rather
        than at its next metrics scrape (one warning line, as a failed scrape writes), and
        back when a scrape answers, or after :data:`PASSIVE_DOWN_S` for one without scrapes.
        The region's last backend with no peer region to go to stays in rotation, as nginx
        keeps a lone server: out of it, requests would be refused without being tried."""
        backend = self.backends[name]
        self.runner.changes.down(name, describe_error(exc), url=backend.url)
        if not self.peer_table.peers and self.tracker.healthy() in ([], [name]):
            return
        backend.healthy = False
        self.tracker.set_health(name, False)
        if name in self.runner.urls:
            self.scheduler.health(name, False)  # as a failed scrape: it may come back restarted
        else:
            self._down_until[name] = self.clock() + PASSIVE_DOWN_S

    def eject(self, name: str, exc: Exception, cause: FailCause) -> None:
        """Passive health: local backend ``name`` failed a request it had accepted (reset it
        or sent no byte by the first-byte deadline, or its run of 5xx reached
        ``backend_eject_consecutive_5xx``).
        Out of rotation now, for ``backend_eject_s`` at least (one warning line), then back
        when a scrape answers (without scrapes: tried again). The region's last healthy
        backend is never ejected: such failures may be load, and without it every request
        would be refused untried."""
        backend = self.backends[name]
        if not backend.healthy or self.tracker.healthy() in ([], [name]):
            return
        self.ejections[(name, cause)] += 1
        self.runner.changes.down(name, f"ejected ({cause}): {describe_error(exc)}", url=backend.url)
        backend.healthy = False
        self.tracker.set_health(name, False)
        until = self.clock() + self.config.routing.backend_eject_s
        if name in self.runner.urls:
            self._ejected_until[name] = until
            self.scheduler.health(name, False)  # warm it again when it is back
        else:
            self._down_until[name] = until

    def first_byte_timeout_s(self, name: str) -> float:
        """The first-byte deadline of local backend ``name`` (see
        :meth:`LoadTracker.first_byte_timeout_s` and the ``routing.first_byte_*`` keys)."""
        routing = self.config.routing
        return self.tracker.first_byte_timeout_s(
            name, multiple=routing.first_byte_timeout_ttft_multiple,
            min_s=routing.first_byte_timeout_min_s, max_s=routing.first_byte_timeout_max_s,
        )

    def _back_in_rotation(self, now: float) -> None:
        """Backends without scrapes whose :data:`PASSIVE_DOWN_S` passed: tried again (a line
        saying they are up comes with their first answered request)."""
        for name, until in list(self._down_until.items()):
            if now >= until:
                del self._down_until[name]
                self.backends[name].healthy = True
                self.tracker.set_health(name, True)

    def finished(self, obs: Observation, ctx: RequestContext, ok: bool) -> None:
        duration_ms = (time.perf_counter() - obs.started) * 1000
        if obs.local:
            self.tracker.finished(obs.backend, duration_ms)
            if self.released is not None:
                self.released(obs.backend)
        else:
            self.peer_routed[obs.region] -= 1
        for slot in (obs.slot, obs.claim[1] if obs.claim else None):
            if slot is not None:
                self.spill.release(slot)
        outcome = "ok" if ok else "error"
        self.outcomes[(obs.region, obs.backend, outcome)] += 1

    # --- status and metrics ------------------------------------------------------------
    def status(self) -> EdgeStatus:
        now = self.clock()
        here = self._here(now)
        backends = [
            BackendStatus(
                name=name, healthy=b.healthy, in_flight=b.in_flight,
                load=self.tracker.load(name, now), max_in_flight=b.limit,
                saturated=self.tracker.saturated(name, now), ttft_ms=b.ttft_ms.value,
                warm_prefixes=self.scheduler.warm(name),
            )
            for name, b in self.tracker.backends.items()
        ]
        wait = here.queue_wait_ms
        fresh = self._peers(now)
        return EdgeStatus(
            region=self.region, healthy=here.healthy, saturated=here.saturated,
            in_flight=self.tracker.in_flight(), capacity=self.tracker.capacity(),
            queue_wait_ms=wait if math.isfinite(wait) else 1e9,
            latitude=self.here_point.lat if self.here_point else None,
            longitude=self.here_point.lon if self.here_point else None,
            public_url=self.config.geo.public_url, ttft_ms=self.tracker.ttft_ms(),
            warm_prefixes=sorted(here.warm_prefixes), backends=backends,
            peers=[
                PeerLink(
                    name=name,
                    url=url,
                    up=name in fresh and fresh[name].healthy and not fresh[name].saturated,
                )
                for name, url in self.peer_urls.items()
            ],
        )

    def render_metrics(self) -> str:
        from .routing_metrics import render

        return render(self)
