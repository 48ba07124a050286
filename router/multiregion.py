"""Routing across regions, wired into the router: the routing stage and its background tasks.

:class:`RegionRouting` owns the control-plane cores and connects them to the data plane. The
decisions are the pure chooser's (:class:`~firstbyte.router.pipeline.chooser.RouteChooser`:
region, backend and model from the request, the known load and ``now``); this class applies
them (counters, spill slots, the request's context), runs the services that feed the chooser
(below) and answers for the region (:mod:`firstbyte.router.routing_status`,
:mod:`firstbyte.router.routing_metrics`):

- :meth:`RegionRouting.route` is the pipeline stage between admission and the proxy. It
  locates the client (:mod:`firstbyte.router.geo`), chooses the region by expected TTFT
  among the regions serving the request's model (:mod:`firstbyte.router.pipeline.region`),
  and then either picks a local backend serving it by prefix affinity
  (:mod:`firstbyte.router.pipeline.affinity`), forwards/spills to a peer's router (as an upstream,
  with the peer key and the loop-prevention header), or answers 429 with ``Retry-After``
  (404 ``model_not_found`` for a model served nowhere).
- An :class:`Observation` rides along in ``ctx.observer``: the proxy reports the
  first token, every later chunk and the end to it (load, TTFT/ITL, spill budget), and asks it
  whether to switch upstream when the first token is late (``first_token_deadline_ms``), or
  where to go when its backend refused the connection (:meth:`RegionRouting.fail_over`).
- Both ways of spilling (a saturated region at admission, a late first token) hold a slot of
  the request's model's :class:`~firstbyte.router.spill.SpillBudget` (a share of that model's
  active requests, :meth:`RegionRouting.model_active`) from the decision to the request's end;
  a refused slot means no spill. Requests count as active, and against a peer's capacity, from
  the moment they are routed (not when the proxy's task gets to run), so a burst routed in one
  loop turn sees its own earlier members.
- Background (:class:`~firstbyte.router.routing_services.RoutingServices`):
  :class:`~firstbyte.router.peers.PeerPoller` (peer status over the proxy's kept-warm
  pool), :class:`~firstbyte.router.warmup.WarmupRunner` (backend metrics scrapes, health, warmup
  probes) and :class:`~firstbyte.router.models.ModelLister` (each backend's ``/v1/models``).
- :meth:`status` is ``GET /v1/edge/status``; :meth:`render_metrics` adds to ``/metrics``.

Routers of one deployment share their API keys: a forwarded request carries the client's
``Authorization`` to the peer, plus ``x-firstbyte-peer-key`` (router-to-router
authentication; only then are ``x-firstbyte-forwarded`` and the forwarded client address
believed).
"""

from __future__ import annotations

import hmac
import logging
import math
import time
from bisect import bisect_left
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import httpx

from firstbyte.protocol import error_codes
from firstbyte.protocol.edge import EdgeStatus
from firstbyte.protocol.headers import (
    BETTER_REGION_HEADER,
    BETTER_REGION_URL_HEADER,
    FORWARDED_HEADER,
    PEER_KEY_HEADER,
)
from firstbyte.protocol.openai import ChatCompletionRequest

from .backpressure import BackendLoad, LoadTracker
from .config import RouterConfig
from .geo import GeoLocator, GeoPoint, Location, TrustedProxies, client_address, known_regions
from .hosting.limits import Throttle
from .hosting.prometheus import GapTimer, Histogram
from .metrics import TTFT_BUCKETS_S
from .models import ModelMap
from .observability.logs import describe_error
from .peers import PeerTable
from .pipeline.affinity import AffinityPolicy, BackendChoice
from .pipeline.backend import PEER_PREFIX, Backend, BackendPool
from .pipeline.chooser import ModelMissing, Room, RouteChooser, RouteInput
from .pipeline.context import (
    CONTINUE,
    FailCause,
    Fallback,
    LocalReply,
    Outcome,
    RequestContext,
    error_reply,
    transport_of,
)
from .pipeline.region import RegionCandidate, RegionModel, Verdict
from .regions_config import warm_prefix_text
from .routing_services import RoutingServices
from .spill import SpillBudget, SpillSlot
from .upstream_h1 import H1Pool
from .warmup import WarmPrefix, WarmupScheduler

log = logging.getLogger("firstbyte.router")

__all__ = [
    "DRAINING_RETRY_AFTER_S", "REJECTION_REASONS", "WAIT_FOR_SLOT", "FairCheck", "Observation",
    "RegionRouting", "draining_reply",
]

FairCheck = Callable[[RequestContext, float], "LocalReply | bool"]
"""``(ctx, now)`` -> queue it (True), refuse it as before (False) or this refusal."""

WAIT_FOR_SLOT = Fallback("below its fair share in a full region: wait for a slot")
"""What :meth:`RegionRouting.route` answers for a request that waits for a slot of the full
region (``routing.max_fair_wait_ms``): the caller waits (:meth:`firstbyte.router.state.
RouterState.wait_for_slot`) and routes it again; it never reaches a client."""

ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)

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
    "model_elsewhere_full": "the regions serving this request's model have no room",
}
"""Why a request was answered 429 here (the access log's ``reason``), and the sentence the
client reads after "Region R is at capacity and"."""


DRAINING_RETRY_AFTER_S = 1
"""The ``Retry-After`` of a draining process's 503s (the request refusal and ``/healthz``'s):
another router of the region takes the request at once, so a second is enough."""


def draining_reply() -> LocalReply:
    """503 ``draining`` with ``Retry-After``: this process takes no new work (SIGTERM)."""
    return error_reply(
        503,
        "This router is shutting down; send the request again (another router of the region"
        " takes it).",
        "server_error",
        code=error_codes.DRAINING,
        headers=(("retry-after", str(DRAINING_RETRY_AFTER_S)),),
        outcome="draining",
    )


def _point(lat: float | None, lon: float | None, name: str) -> GeoPoint | None:
    if lat is not None and lon is not None:
        return GeoPoint(lat, lon)
    known = known_regions().get(name)
    return known.point if known is not None else None


# Slots: made once a request, its ~20 fields set and read faster than in an instance dict.
@dataclass(eq=False, slots=True)
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
    gaps: GapTimer = field(kw_only=True, repr=False)
    """The gaps between its chunks, into the region's inter-token histogram (ticked from
    the first token on): ``GapTimer(routing.itl)``, given by its maker (a
    ``__post_init__`` making it was a Python call a request)."""
    switched: bool = False
    done: bool = False
    reason: str = ""
    slot: SpillSlot | None = None
    """The spill slot this request holds while it is served by a peer as a spill."""
    claim: tuple[str, SpillSlot] | None = None
    """A first-token-deadline switch decided (target peer, slot taken) but not yet made."""
    route: RouteInput | None = None
    """What of the request decided where it went (its model, affinity key, ...): a failover
    or a late first token's switch decides by it again."""

    def first_token(self, ctx: RequestContext, ttft_ms: float) -> None:
        self.ttft_ms = ttft_ms
        # The proxy's reading of the first token's arrival, set just before it calls this:
        # one clock reading a first token, not two (a clock only where it set none).
        now = ctx.first_token_at
        if now is None:
            now = time.perf_counter()
        self.gaps.last = now
        if ctx.upstream_sent_at is not None:
            self.upstream_ttft_ms = (now - ctx.upstream_sent_at) * 1000
        # The region's part in line (it was RegionRouting.first_token's): a call a request.
        routing = self.routing
        if self.claim is not None:  # the token beat the switch it had claimed: no switch
            routing.spill.release(self.claim[1])
            self.claim = None
        if self.local:
            name = self.backend
            routing.tracker.observe_ttft(name, ttft_ms, self.upstream_ttft_ms)
            backend = routing.backends[name]
            if backend.healthy and name in routing.runner.changes.down_since:
                # Back in rotation after PASSIVE_DOWN_S, and it answered: say it is up.
                routing.runner.changes.up(name, url=backend.url)
        # transport_of, not the transport property (read through a call from C).
        series = (self.region, transport_of(ctx), ctx.model_label)
        hist = routing.ttft.get(series)
        if hist is None:
            hist = routing.ttft[series] = Histogram(TTFT_BUCKETS_S)
        # Histogram.observe in line (as Metrics.observe_ttft has it): a call less a request.
        seconds = ttft_ms / 1000.0
        hist.counts[bisect_left(hist.bounds, seconds)] += 1
        hist.total += seconds
        hist.count += 1

    def chunk(self, ctx: RequestContext, now: float) -> None:
        self.gaps.tick(now)

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
        if not self.local:
            return None
        # RegionRouting.first_byte_timeout_s inlined (a call a request).
        routing = self.routing
        config = routing.config.routing
        return routing.tracker.first_byte_timeout_s(
            self.backend, multiple=config.first_byte_timeout_ttft_multiple,
            min_s=config.first_byte_timeout_min_s, max_s=config.first_byte_timeout_max_s,
        )

    async def fail_over(
        self, ctx: RequestContext, exc: Exception, cause: FailCause = "refused"
    ) -> Backend | None:
        """This request's backend failed it (``exc``, ``cause``) before anything reached its
        client: the backend to send it to instead, or None (see
        :meth:`RegionRouting.fail_over`)."""
        return await self.routing.fail_over(self, ctx, exc, cause)

    def finished(self, ctx: RequestContext, ok: bool) -> None:
        if self.done:
            return
        self.done = True
        # The region's part in line (it was RegionRouting.finished's): a call a request.
        routing = self.routing
        duration_ms = (time.perf_counter() - self.started) * 1000
        # _uncount in line, and the two spill slots tested one by one, not looped over as a
        # tuple: a call, a tuple and a loop a request fewer (~1k instructions).
        model = self.route.model if self.route is not None else ""  # _model_of, inlined
        active = routing.active_by_model
        left = active.get(model, 0) - 1
        if left > 0:
            active[model] = left
        else:
            active.pop(model, None)
        if self.local:
            routing.tracker.finished(self.backend, duration_ms)
            released = routing.released
            if released is not None:
                released(self.backend)
        else:
            _decrement(routing.peer_routed_by_model, model)
            routing.peer_routed[self.region] -= 1
        slot = self.slot
        if slot is not None:
            routing.spill.release(slot)
        claim = self.claim
        if claim and claim[1] is not None:
            routing.spill.release(claim[1])
        outcome = "ok" if ok else "error"
        routing.outcomes[(self.region, self.backend, outcome, ctx.model_label)] += 1


_new_observation = object.__new__
_init_observation = Observation.__init__
_new_gap_timer = object.__new__


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
        scrape_pool: H1Pool | None = None,
    ) -> None:
        """``client`` scrapes and warms this region's backends (``scrape_pool``, if given,
        scrapes them); ``peer_client`` (default: ``client``) polls the peers, and should be
        the pool forwarded requests use, whose connections the polls then keep warm."""
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
        self.rejections: Counter[tuple[str, str]] = Counter()
        """429s (and 404s, 503s) answered here, by (reason, model label) (see :meth:`reject`)."""
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
        # Requests routed to each peer and not finished, counted when routed: the proxy's own
        # count starts only when its task runs, after every other request of a burst routed.
        self.peer_routed = dict.fromkeys(self.peer_backends, 0)
        self.active_by_model: Counter[str] = Counter()
        """Requests routed from here and not finished, by model (local and to peers); a model
        with none has no entry, so it holds the models in flight (bounded: an unknown model
        is refused before it is routed)."""
        self.peer_routed_by_model: Counter[str] = Counter()
        """Those of them routed to peers, by model."""
        # ``peer_routed`` when the peer's last status arrived: the status counts those;
        # requests routed since are added on top (the status is up to one poll old).
        self._sent_baseline = dict.fromkeys(self.peer_backends, 0)
        # Warm prefixes.
        self.prefixes = [
            WarmPrefix(p.name, warm_prefix_text(p), tuple(p.models)) for p in config.warm_prefixes
        ]
        self.scheduler = WarmupScheduler(
            self.prefixes if config.warmup.enabled else [],
            interval_s=config.warmup.interval_s,
            pressure_interval_s=config.warmup.pressure_interval_s,
            cache_pressure_perc=config.warmup.cache_pressure_perc,
            busy_running_threshold=config.warmup.busy_running_threshold,
            retry_s=config.warmup.retry_s,
        )
        # Models: configured, or listed by each backend (refreshed in the background).
        self.models = ModelMap(
            {b.name: u.models for b, u in zip(pool.backends, upstreams, strict=True)}
        )
        # The pure chooser over the sans-IO state above; this class applies its decisions.
        self.chooser = RouteChooser(
            self.region, self.here_point, self.model, self.tracker, self.models,
            self.scheduler, self.prefixes, self.peer_table, self.peer_points, self.peer_urls,
            self.policy, affinity_chars=routing.affinity_chars,
            max_queue_wait_ms=routing.max_queue_wait_ms,
        )
        # Metrics.
        self.outcomes: Counter[tuple[str, str, str, str]] = Counter()
        """Finished or refused requests by (serving region, backend, outcome, model label)."""
        self.spills: Counter[tuple[str, str]] = Counter()
        self.forwards: Counter[str] = Counter()
        self.choices: Counter[str] = Counter()
        """Backend choices by reason (affinity, new-key, balance, round-robin, least-loaded)."""
        self.ttft: dict[tuple[str, str, str], Histogram] = {}
        """TTFT by (serving region, transport, model label): four transports, so bounded by
        the regions and the models they list."""
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
        self._kept = Throttle(10.0)
        """Failures of a region's last backend, kept in rotation: a line per 10 s each."""
        self.draining = False
        """This process is shutting down: it counts as unhealthy for routing (a request goes
        to a peer with room, or gets 503 ``draining``) and in its edge status."""
        # The background services feeding the state above.
        self.services = RoutingServices(
            self, client, peer_client or client, clock, scrape_pool=scrape_pool
        )
        self.poller, self.runner, self.lister = (
            self.services.poller, self.services.runner, self.services.lister
        )

    def adopt(self, previous: RegionRouting) -> None:
        """Carry over what ``previous`` (the routing before a reload) learned and still counts:
        its metrics' counters and histograms, the load record of every backend that stays
        (requests in flight on it finish on the previous routing's record, which this one now
        shares; out of rotation until when it was), the status and RTT of every peer that stays
        at the same URL, the draining flag, and the shared state's hooks (:attr:`released`,
        :attr:`claim`)."""
        self.released, self.claim = previous.released, previous.claim
        # The counters are the process's, not the config's: a reload zeroed every route,
        # TTFT, spill and ejection series (a reset to Prometheus, and series that went
        # missing). Shared, not copied: requests finishing on the previous routing count too.
        self.outcomes, self.rejections, self.choices = (
            previous.outcomes, previous.rejections, previous.choices
        )
        self.spills, self.forwards, self.ejections = (
            previous.spills, previous.forwards, previous.ejections
        )
        self.ttft, self.itl = previous.ttft, previous.itl
        self.spill.acquired, self.spill.refused = previous.spill.acquired, previous.spill.refused
        warmed, warming = previous.scheduler, self.scheduler
        warming.warmups_total, warming.evictions_total = (
            warmed.warmups_total, warmed.evictions_total
        )
        warming.restarts_total.update(warmed.restarts_total)
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
        # What the previous services reported down stays reported (their logs say changes
        # once each; a reload is not one): peers at the same URL, backends that stay.
        staying_peers = [name for name, peer in self.peer_table.peers.items()
                         if previous.peer_table.peers.get(name) is peer]
        staying = [name for name, backend in self.backends.items()
                   if previous.backends.get(name) is backend]
        self.poller.changes.carry(previous.poller.changes, staying_peers)
        self.runner.changes.carry(previous.runner.changes, staying)
        self.lister.carry_failures(previous.lister, staying)
        for name in self.models.to_learn():  # a list learned stays until asked again
            if self.backends[name] is previous.backends.get(name):
                self.models.keep(name, previous.models.lists.get(name))
        if previous.lister.ready.is_set():
            self.lister.ready.set()  # requests need not wait for this routing's first asks

    # --- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        """Start peer polls, backend scrapes/warmup and model lists in the running loop
        (idempotent)."""
        self.services.start()

    async def wait_warm(self) -> bool:
        """Before serving: warm every prefix on every backend (bounded by the start-up
        timeout; :meth:`RoutingServices.wait_warm`)."""
        return await self.services.wait_warm()

    async def wait_models(self) -> None:
        """Return once every backend without configured models was asked for its list (or
        after the ask's timeout): user requests wait for it, ``/healthz`` does not."""
        await self.services.wait_models()

    async def aclose(self) -> None:
        await self.services.aclose()
        if self.locator is not None:
            self.locator.close()

    def peer_status_arrived(self, name: str) -> None:
        """A status of peer ``name`` arrived: it counts the requests routed there so far."""
        self._sent_baseline[name] = self.peer_routed[name]

    def readmit(self, name: str, now: float) -> bool:
        """A scrape of ``name`` answered: False while it is ejected for failing requests (a
        scrape proves the server listens, not that it serves; ``backend_eject_s``)."""
        until = self._ejected_until.get(name)
        if until is not None:
            if now < until:
                return False
            del self._ejected_until[name]
        return True

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

    def serving(self, ctx: RequestContext) -> frozenset[str] | None:
        """The local backends serving ``ctx``'s model (None: no request, every backend)."""
        return self.chooser.serving(ctx.request.model) if ctx.request is not None else None

    def sent_since(self) -> dict[str, int]:
        """Requests routed to each peer since its last status (which counted those before)."""
        baseline = self._sent_baseline
        out: dict[str, int] = {}
        for n, routed in self.peer_routed.items():  # a loop: a comprehension is a call
            out[n] = routed - baseline[n]
        return out

    def _here(self, now: float) -> RegionCandidate:
        return self.chooser.here(now, draining=self.draining)

    def _peers(self, now: float) -> dict[str, RegionCandidate]:
        return self.chooser.peers(now, None, self.sent_since())

    def model_missing(
        self, ctx: RequestContext, model: str, why: ModelMissing, now: float
    ) -> LocalReply:
        """Nobody here or among the peers serves ``model``: 404 ``model_not_found``, nothing
        sent upstream; or 503 ``no_healthy_backend`` with ``Retry-After`` when a peer that
        served it is not answering (:attr:`ModelMissing.UNKNOWN_YET`)."""
        self.outcomes[(self.region, "", "rejected", "")] += 1
        self.rejections[(why.value, "")] += 1  # a model nobody lists: not a label value
        ctx.route_reason = why.value  # for the access log
        if why is ModelMissing.UNKNOWN_YET:
            retry = self.down_retry_after_s(now)
            return error_reply(
                503,
                f"No region serving model {model!r} is answering (region {self.region} does"
                f" not serve it); retry after {retry} s.",
                "server_error",
                code=error_codes.NO_HEALTHY_BACKEND,
                headers=(("retry-after", str(retry)),),
                outcome="rejected",
            )
        return error_reply(
            404,
            f"The model {model!r} does not exist in region {self.region} or its peers;"
            " GET /v1/models lists the models served.",
            "invalid_request_error",
            param="model",
            code=error_codes.MODEL_NOT_FOUND,
            outcome="model_not_found",
        )

    def active(self) -> int:
        """Requests routed from here and not finished: to local backends and to peers."""
        return self.tracker.in_flight() + self.routed_to_any_peer()

    def routed_to_any_peer(self) -> int:
        """Requests routed from here to peer regions and not finished."""
        return sum(self.peer_routed.values())

    def model_active(self, model: str) -> int:
        """``model``'s requests routed from here and not finished (local and to peers): what
        its spill budget is a share of."""
        return self.active_by_model.get(model, 0)

    def routed_to_peers(self, pool: frozenset[str]) -> int:
        """Requests routed to peers, of the models whose local backends are ``pool``: they
        hold no slot here but count in their keys' share of that pool."""
        serving = self.chooser.serving
        return sum(n for model, n in self.peer_routed_by_model.items()
                   if serving(model) == pool)

    def _uncount(self, obs: Observation) -> None:
        """``obs``'s request no longer counts as active (it ended, or will not go)."""
        model = obs.route.model if obs.route is not None else ""  # _model_of, inlined
        active = self.active_by_model
        left = active.get(model, 0) - 1  # _decrement inlined: a call a request
        if left > 0:
            active[model] = left
        else:
            active.pop(model, None)
        if not obs.local:
            _decrement(self.peer_routed_by_model, model)

    def route(
        self, ctx: RequestContext, share: FairCheck | None = None, *,
        route_input: RouteInput | None = None, now: float | None = None,
        room: Room | None = None,
    ) -> Outcome:
        """Choose the region and backend for an admitted request (sets ``ctx.backend``), by
        ``route_input`` (its model, affinity key, warm prefix, size; default: those of the
        chat request ``ctx.request``, :meth:`RouteChooser.route_input`).

        Where the region is full and the request would be refused, ``share`` (the fair
        share of the keys asking, :meth:`firstbyte.router.tenancy.Tenants.fair_refusal`) says
        whether it waits for a slot (below its share: :data:`WAIT_FOR_SLOT`; queued on a
        backend past its limit when ``routing.max_fair_wait_ms`` is 0), is refused with its own
        answer (above it), or refused as before (``False``: it alone fills the region).

        ``now``: the placement's moment (default: the clock's); ``room``: the request's
        :data:`~firstbyte.router.pipeline.chooser.Room` at that moment, if the caller has it."""
        chooser = self.chooser
        if route_input is None:
            assert ctx.request is not None
            route_input = chooser.route_input(ctx.request)
        route = route_input
        if now is None:
            now = self.clock()
        if self._down_until:
            self._back_in_rotation(now)
            room = None  # a backend may be back: its room is not in it
        # Without a peer key nobody is a peer, without a database nobody is located: neither
        # asked then (two calls a request).
        from_peer = bool(self.peer_key) and self.peer_authenticated(ctx)
        forwarded = from_peer and FORWARDED_HEADER in ctx.headers
        location = None if self.locator is None else self.locate(ctx, from_peer)
        chosen_region = chooser.region_for(
            route, location, now, forwarded=forwarded, draining=self.draining,
            sent_since=self.sent_since() if self.peer_routed else None,  # None: no peers
            room=room,
        )
        if isinstance(chosen_region, ModelMissing):
            return self.model_missing(ctx, route.model, chosen_region, now)
        model = route.model
        # A model a local backend lists (nearly every request's): its own label, no call; nor
        # for another without peers (RouteChooser.model_label's answer then: none lists it).
        ctx.model_label = (
            model if model in chooser.models.by_model
            else chooser.model_label(model, now) if chooser.peer_table.peers else ""
        )
        decision, serving = chosen_region.region, chosen_region.serving
        ctx.location = location
        ctx.region_decision = decision
        if decision.better_region is not None:
            headers = [(BETTER_REGION_HEADER, decision.better_region)]
            url = self.peer_urls.get(decision.better_region)
            if url:
                headers.append((BETTER_REGION_URL_HEADER, url))
            ctx.response_headers = headers
        elif ctx.response_headers:  # a route before this one's (nearly always none: no list)
            ctx.response_headers = []
        if self.draining and decision.verdict in (Verdict.LOCAL, Verdict.REJECT):
            return draining_reply()
        if decision.verdict is Verdict.LOCAL:
            # RouteChooser.local_backend inlined for a room worked out for ``serving``.
            chosen = (
                chooser.backend(route, room[2], now) if room is not None and room[0] is serving
                else chooser.local_backend(route, now, serving, room)
            )
            if chosen is None:  # raced to saturation since the region check
                return self.reject(ctx, now, "no_local_backend")
            self.choices[chosen.reason] += 1  # _counted inlined (every request's call)
            return self._serve_local(ctx, chosen, location, now, route)
        if decision.verdict is Verdict.REJECT:
            reason = "saturated_forwarded" if forwarded else "no_peer_with_room"
            if not serving:
                return self.reject(ctx, now, "model_elsewhere_full")
            return self._queue_or_reject(ctx, route, location, now, reason, share)
        slot: SpillSlot | None = None
        if decision.verdict is Verdict.SPILL:
            # This request counts as active: it is one, wherever it goes.
            slot = self.spill.acquire(
                self.model_active(route.model) + 1, "saturated", route.model
            )
            if slot is None:
                return self._queue_or_reject(ctx, route, location, now, "spill_budget", share)
            self.spills[(decision.region, "saturated")] += 1
        else:
            self.forwards[decision.region] += 1
            if not serving:
                ctx.route_reason = "model_elsewhere"  # for the access log
        self._to_peer(ctx, decision.region, location, slot, route)
        return CONTINUE

    def _queue_or_reject(
        self,
        ctx: RequestContext,
        route: RouteInput,
        location: Location | None,
        now: float,
        reason: str,
        share: FairCheck | None = None,
    ) -> Outcome:
        serving = self.chooser.serving(route.model)
        queued = self._counted(self.chooser.queue_backend(route, now))
        if queued is None and share is not None and self.tracker.healthy(serving):
            verdict = share(ctx, now)
            if isinstance(verdict, LocalReply):
                self.outcomes[(self.region, "", "rejected", ctx.model_label)] += 1
                return verdict
            if verdict and self.config.routing.max_fair_wait_ms > 0:
                return WAIT_FOR_SLOT  # below its fair share: it waits here for a slot
            if verdict:  # below its fair share: it waits on a backend, others are held
                queued = self._counted(self.chooser.backend(
                    route, self.tracker.healthy(serving), now, "fair_share"
                ))
        if queued is not None:
            return self._serve_local(ctx, queued, location, now, route)
        return self.reject(ctx, now, reason)

    def affinity_key(self, request: ChatCompletionRequest) -> str:
        """The key that decides ``request``'s backend (:func:`affinity_key`)."""
        return self.chooser.route_input(request).affinity_key

    def _counted(self, choice: BackendChoice | None) -> BackendChoice | None:
        """``choice``, counted in :attr:`choices` by its reason."""
        if choice is not None:
            self.choices[choice.reason] += 1
        return choice

    def _serve_local(
        self, ctx: RequestContext, choice: BackendChoice, location: Location | None, now: float,
        route: RouteInput,
    ) -> Outcome:
        name = choice.backend
        ctx.backend = self.backends[name]
        ctx.region = self.region
        self.tracker.started(name, now)
        self.active_by_model[route.model] += 1
        # Made and then initialised, not by calling the class (as endpoints.new_context makes
        # a RequestContext): a class's call with keywords passes them to a Python __init__
        # through a dict built for them (no vectorcall for it on 3.11).
        observer = ctx.observer = _new_observation(Observation)
        # GapTimer(self.itl), its two slots set here: the class's call ran its Python
        # __init__ from C (a frame of its own), a request.
        gaps = _new_gap_timer(GapTimer)
        gaps.hist = self.itl
        gaps.last = None
        _init_observation(
            observer, self, self.region, name, True, False, time.perf_counter(), location,
            self.deadline_s if ctx.stream_requested else None, choice.reason, route=route,
            gaps=gaps,
        )
        return CONTINUE

    def unroute(self, ctx: RequestContext) -> Observation | None:
        """Undo :meth:`route` for a request that will not go (its backend turned out full
        region-wide): its record, without counting an outcome; returns that record."""
        observer, ctx.observer = ctx.observer, None
        if not isinstance(observer, Observation):
            return None
        observer.done = True
        self._uncount(observer)
        if observer.local:
            self.tracker.unstarted(observer.backend)
        else:
            self.peer_routed[observer.region] -= 1
            if observer.slot is not None:
                self.spill.release(observer.slot)
        ctx.backend = None
        return observer

    def _to_peer(
        self, ctx: RequestContext, peer: str, location: Location | None, slot: SpillSlot | None,
        route: RouteInput | None = None,
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
            self.peer_routed_by_model[_model_of(observer)] += 1  # moved: active already
            observer.region, observer.backend, observer.local = peer, backend.name, False
            observer.spill = observer.spill or slot is not None
            observer.slot = slot
        else:
            ctx.observer = observer = Observation(
                self, peer, backend.name, False, slot is not None, time.perf_counter(), location,
                slot=slot, route=route, gaps=GapTimer(self.itl),
            )
            model = _model_of(observer)
            self.active_by_model[model] += 1
            self.peer_routed_by_model[model] += 1

    def down_retry_after_s(self, now: float, pool: frozenset[str] | None = None) -> int:
        """``Retry-After`` when no backend (of ``pool``, the request's model's; None: any) is
        healthy: until the first ejected one is tried again, else (down by its scrapes) the
        scrape interval; whole seconds, 1 to 10."""
        until = [
            t
            for name, t in (*self._down_until.items(), *self._ejected_until.items())
            if t > now and (pool is None or name in pool)
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
        self.outcomes[(self.region, "", "rejected", ctx.model_label)] += 1
        serving = self.serving(ctx)
        # The backends are the model's pool: with another model served fine, "region R is
        # at capacity" alone read as the whole region down. A listed name only (the label).
        model = f" for model {ctx.model_label!r}" if ctx.model_label else ""
        if serving != frozenset() and not self.tracker.healthy(serving):
            reason = "no_healthy_backend"
            self.rejections[(reason, ctx.model_label)] += 1
            ctx.route_reason = reason
            # Its model's backends: another model's ejected backend says nothing of them.
            retry = self.down_retry_after_s(now, serving)
            return error_reply(
                503,
                f"No backend of region {self.region}{model} is answering and no other region"
                f" can take this request; retry after {retry} s.",
                "server_error",
                code=error_codes.NO_HEALTHY_BACKEND,
                headers=(("retry-after", str(retry)),),
                outcome="rejected",
            )
        retry = self.tracker.retry_after_s(now, serving or None)
        self.rejections[(reason, ctx.model_label)] += 1
        ctx.route_reason = reason  # for the access log
        said = (
            f"Region {self.region} does not serve this request's model and"
            if reason == "model_elsewhere_full"
            else f"Region {self.region} is at capacity{model} and"
        )
        return error_reply(
            429,
            f"{said} {REJECTION_REASONS[reason]}; retry after {retry} s.",
            "rate_limit_error",
            code=error_codes.REGION_SATURATED,
            headers=(("retry-after", str(retry)),),
            outcome="rejected",
        )

    # --- observer callbacks (first_token and finished are Observation's own) ----------
    def claim_switch(self, obs: Observation, ctx: RequestContext) -> bool:
        """A late first token: claim a peer and a spill slot for :meth:`switch`, or refuse."""
        if obs.switched or not obs.local:
            return False
        target = self._switch_target(ctx, obs.route)
        if target is None:
            return False
        # The model's active requests already count this one (it is in flight locally).
        model = _model_of(obs)
        slot = self.spill.acquire(self.model_active(model), "first_token_deadline", model)
        if slot is None:
            return False
        obs.claim = (target, slot)
        return True

    def _switch_target(self, ctx: RequestContext, route: RouteInput | None) -> str | None:
        forwarded = self.peer_authenticated(ctx) and FORWARDED_HEADER in ctx.headers
        if route is None and ctx.request is not None:
            route = self.chooser.route_input(ctx.request)
        if forwarded or route is None:
            return None
        location = ctx.location if isinstance(ctx.location, Location) else None
        return self.chooser.switch_target(route.model, location, self.clock(), self.sent_since())

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
        route = obs.route
        if route is None and ctx.request is not None:
            route = self.chooser.route_input(ctx.request)
        if not obs.local or route is None:
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
        serving = self.chooser.serving(route.model)
        while True:
            candidates = [n for n in self.tracker.available(now, serving) if n not in refused]
            choice = self._counted(
                self.chooser.backend(route, candidates, now, "failover") if candidates else None
            )
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
        would be refused untried; a warning says it failed (one per 10 s, with a count)."""
        backend = self.backends[name]
        if not backend.healthy:
            return
        if self.tracker.healthy() in ([], [name]):
            # Not ejected, but said: a 502 with no line would leave an operator to guess which
            # of the upstream's deadlines or errors it was.
            more = self._kept.report(name, self.clock())
            if more is not None:
                log.warning(
                    "upstream %s (%s) failed a request (%s): %s; kept in rotation, the "
                    "region's last%s", name, backend.url, cause, describe_error(exc), more,
                )
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

    # --- status and metrics ------------------------------------------------------------
    def status(self, *, unavailable: bool = False) -> EdgeStatus:
        """``GET /v1/edge/status`` (:func:`firstbyte.router.routing_status.edge_status`);
        ``unavailable``: the region's shared state does not answer, or its start-up warmup
        holds requests (unhealthy)."""
        from .routing_status import edge_status

        return edge_status(self, unavailable=unavailable)

    def model_names(self, *, peers: bool = False) -> list[str]:
        """The models this region serves (``GET /v1/models``); with ``peers``, also those
        its peers with fresh status serve."""
        return self.chooser.model_names(self.clock(), peers=peers)

    def render_metrics(self) -> str:
        from .routing_metrics import render

        return render(self)


def _model_of(obs: Observation) -> str:
    return obs.route.model if obs.route is not None else ""


def _decrement(counts: Counter[str], key: str) -> None:
    """One less of ``key``; a key at zero is dropped (the counter holds live entries only)."""
    left = counts.get(key, 0) - 1
    if left > 0:
        counts[key] = left
    else:
        counts.pop(key, None)
