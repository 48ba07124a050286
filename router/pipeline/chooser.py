"""Which region, backend and model a request goes to (sans-IO, the clock passed in).

:class:`RouteChooser` is Envoy's ``chooseHost()`` for this router: its answers are a function
of the request's routing inputs (:class:`RouteInput`: the model, a plain parameter every
endpoint passes, the affinity key, the warm prefix, the prompt's size), what is known of the
region's backends (:class:`~firstbyte.router.backpressure.LoadTracker`,
:class:`~firstbyte.router.models.ModelMap`, the warmup scheduler), of the peers
(:class:`~firstbyte.router.peers.PeerTable`, plus the requests sent to each since its last
status) and ``now``. It touches no socket and reads no clock; the only state it changes is the
affinity policy's memory of keys. :class:`~firstbyte.router.multiregion.RegionRouting` applies
its decisions (counters, spill slots, the request's context and observation) and runs the
services that feed it (peer polls, scrapes and warmup, model lists).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from enum import Enum
from types import MappingProxyType

import msgspec

from firstbyte.protocol.edge import ModelStatus, prefix_hash
from firstbyte.protocol.openai import ChatCompletionRequest, message_text

from ..backpressure import LoadTracker
from ..geo import GeoPoint, Location
from ..models import ModelMap
from ..peers import PeerTable
from ..warmup import WarmPrefix, WarmupScheduler
from .affinity import AffinityPolicy, BackendChoice, affinity_key
from .region import RegionCandidate, RegionDecision, RegionModel, Verdict, choose_region

__all__ = [
    "CHARS_PER_TOKEN", "ModelMissing", "Room", "RouteChooser", "RouteDecision", "RouteInput",
]

CHARS_PER_TOKEN = 4.0

_NO_ESTIMATES: Mapping[str, float] = MappingProxyType({})
"""The ``expected_ms`` of a decision with no estimate (read-only: shared by decisions)."""

Room = tuple[frozenset[str], frozenset[str] | None, list[str], int]
"""A request's room at one moment: the backends serving its model (:meth:`RouteChooser.serving`),
its fair pool (:meth:`~firstbyte.router.state.RouterState.fair_pool`), those serving it with
room, in configuration order (:meth:`~firstbyte.router.backpressure.LoadTracker.available`),
and their capacity (:meth:`~firstbyte.router.backpressure.LoadTracker.capacity`).
Worked out once for a placement at its ``now`` (:meth:`~firstbyte.router.state.RouterState.room`):
the fair gate, the region's choice and the backend's then read it instead of scanning the
backends each (a tuple, not a class: made once a request). It is used only for the very set
it was worked out for (``is``): a model map changed since makes it the caller's scan again."""


# A msgspec Struct, not a frozen dataclass: made once or twice a request, and a frozen
# dataclass's __init__ is a Python call setting each field through object.__setattr__.
class RouteInput(msgspec.Struct, frozen=True):
    """What of a request decides where it goes."""

    model: str
    affinity_key: str
    """Decides its backend among those serving ``model`` (:func:`affinity_key` for chat)."""
    prefix: WarmPrefix | None = None
    """The warm prefix its prompt starts with."""
    prompt_tokens: int = 0


class ModelMissing(Enum):
    """No backend here and no peer with fresh status serves (or may serve) the model."""

    NOT_FOUND = "model_not_found"
    """Nobody serves it: 404."""
    UNKNOWN_YET = "model_unknown_yet"
    """A peer that served it went quiet (its status is older than its TTL): 503."""


class RouteDecision(msgspec.Struct, frozen=True):  # a Struct, as RouteInput
    """The region verdict for a request, and the local backends serving its model."""

    region: RegionDecision
    serving: frozenset[str]


class RouteChooser:
    """This region's routing decisions over its sans-IO state (see the module docstring)."""

    def __init__(
        self,
        region: str,
        here_point: GeoPoint | None,
        model: RegionModel,
        tracker: LoadTracker,
        models: ModelMap,
        scheduler: WarmupScheduler,
        prefixes: Sequence[WarmPrefix],
        peer_table: PeerTable,
        peer_points: Mapping[str, GeoPoint | None],
        peer_urls: Mapping[str, str],
        policy: AffinityPolicy,
        *,
        affinity_chars: int = 256,
        max_queue_wait_ms: float = 0.0,
    ) -> None:
        self.region = region
        self.here_point = here_point
        self.model = model
        self.tracker = tracker
        self.models = models
        self.scheduler = scheduler
        self.prefixes = list(prefixes)
        self.prefix_texts = [p.text for p in self.prefixes]
        self.prefix_hashes = {p.name: prefix_hash(p.text) for p in self.prefixes}
        self.peer_table = peer_table
        self.peer_points = peer_points
        self.peer_urls = peer_urls
        self.policy = policy
        self.affinity_chars = affinity_chars
        self.max_queue_wait_ms = max_queue_wait_ms
        # This region's answers when it is alone (no peer serves the model), made once: they
        # are the same for every such request (frozen, with no estimates to hold). Two
        # attributes, not a dict by verdict: an Enum's hash is a Python call (a request).
        self._alone_local = RegionDecision(Verdict.LOCAL, region, _NO_ESTIMATES)
        self._alone_reject = RegionDecision(Verdict.REJECT, region, _NO_ESTIMATES)

    # --- a request's inputs
    def route_input(self, request: ChatCompletionRequest) -> RouteInput:
        """A chat request's routing inputs."""
        # No warm prefix configured (the default): nothing to look for, and no call for it.
        prefix = self.prefix_of(request) if self.prefixes else None
        chars = 0
        for m in request.messages:  # not sum() over a generator: each of its steps is a call
            content = m.content  # message_text inlined for a string (a call a message)
            chars += len(content if type(content) is str else message_text(m))
        key = affinity_key(request, self.prefix_texts, self.affinity_chars)
        return RouteInput(request.model, key, prefix, int(chars / CHARS_PER_TOKEN))

    def prefix_of(self, request: ChatCompletionRequest) -> WarmPrefix | None:
        """The warm prefix a chat request's leading system (or developer) message starts
        with, among those that apply to its model."""
        first = request.messages[0]
        if first.role not in ("system", "developer"):
            return None
        text = message_text(first)
        for p in self.prefixes:
            if (not p.models or request.model in p.models) and text.startswith(p.text):
                return p
        return None

    # --- candidates
    def here(
        self, now: float, among: frozenset[str] | None = None, *, draining: bool = False
    ) -> RegionCandidate:
        """This region as a candidate: over ``among`` (the backends serving the request's
        model; None: all of them)."""
        healthy = self.tracker.healthy(among)
        warm = {
            self.prefix_hashes[name]
            for backend in healthy
            for name in self.scheduler.warm(backend)
        }
        return RegionCandidate(
            self.region, self.here_point, bool(healthy) and not draining,
            self.tracker.region_saturated(now, among), self.tracker.queue_wait_ms(now, among),
            frozenset(warm), serves=among is None or bool(among),
        )

    def peers(
        self, now: float, model: str | None = None, sent_since: Mapping[str, int] | None = None
    ) -> dict[str, RegionCandidate]:
        """Peers with fresh status, as candidates; given ``model``, only those serving it,
        with their figures for it (a peer that does not say which models it serves, an older
        router, counts as serving every model with its region's figures). ``sent_since``:
        requests routed to each peer since its status (negative: more ended than started)."""
        out: dict[str, RegionCandidate] = {}
        for name, status in self.peer_table.fresh(now).items():
            healthy, saturated, in_flight, capacity, wait = (
                status.healthy, status.saturated, status.in_flight, status.capacity,
                status.queue_wait_ms,
            )
            if model is not None and status.models is not None:
                room = next((m for m in status.models if m.name == model), None)
                if room is None:
                    continue
                healthy, saturated, in_flight, capacity, wait = (
                    room.healthy, room.saturated, room.in_flight, room.capacity,
                    room.queue_wait_ms,
                )
            rtt = self.peer_table.peers[name].rtt_ms
            point = self.peer_points.get(name)
            if point is None and status.latitude is not None and status.longitude is not None:
                point = GeoPoint(status.latitude, status.longitude)
            # The status counted our requests of that moment; adjust by ours since (+ or -).
            # Ours to every model count against each: a peer looks no emptier than it is.
            ours = (sent_since or {}).get(name, 0)
            saturated = in_flight + ours >= capacity if ours else saturated
            out[name] = RegionCandidate(
                name, point, healthy, saturated, wait,
                frozenset(status.warm_prefixes), rtt.value if rtt is not None else None,
                status.public_url or self.peer_urls.get(name),
            )
        return out

    # --- decisions
    def serving(self, model: str) -> frozenset[str]:
        """The local backends a request for ``model`` may go to: those listing it; when none
        does, those whose list is not known yet (they may serve it: the only ones here that
        may). A backend whose list is unknown never takes a model another backend lists."""
        models = self.models  # ModelMap.serving inlined: asked several times a request
        return models.by_model.get(model) or models.unknown_set

    def model_label(self, model: str, now: float) -> str:
        """``model`` if a local backend or a fresh peer lists it, else ``""``: the metrics'
        ``model`` label. Its values are bounded by those lists (``MAX_MODELS`` a backend),
        never by what clients send: a backend whose list is unknown, or a peer that lists
        none, may take any model, and those requests go unlabelled."""
        if model in self.models.by_model:
            return model
        if not self.peer_table.peers:  # no peers: no fresh status to look through
            return ""
        for status in self.peer_table.fresh(now).values():
            if status.models is not None and any(m.name == model for m in status.models):
                return model
        return ""

    def region_for(
        self,
        route: RouteInput,
        location: Location | None,
        now: float,
        *,
        forwarded: bool = False,
        draining: bool = False,
        sent_since: Mapping[str, int] | None = None,
        room: Room | None = None,
    ) -> RouteDecision | ModelMissing:
        """Where ``route`` is served (:func:`choose_region` over the region and the peers
        serving its model), or why nobody can serve its model. A request a peer forwarded
        is never forwarded again. ``room``: the request's :data:`Room` at ``now``, if known."""
        known = self.models.by_model.get(route.model)  # :meth:`serving`, inlined
        serving = known or self.models.unknown_set
        peers = (
            {} if forwarded or not self.peer_table.peers  # no peers: none has fresh status
            else self.peers(now, route.model, sent_since)
        )
        if peers and not known:
            serving = frozenset()  # a peer that lists it, before backends that may not serve it
        if not serving and not peers:
            return self.missing(route.model, forwarded=forwarded)
        if not peers:
            # This region alone: choose_region's answer is LOCAL with room, else REJECT, and
            # no wait or prefill estimate can change it (none is computed: its expected_ms
            # is empty).
            # Not saturated: some backend serving is healthy (an unhealthy one is saturated).
            if draining:
                alone = self._alone_reject
            elif room is not None and room[0] is serving:
                alone = self._alone_local if room[2] else self._alone_reject
            else:
                saturated = self.tracker.region_saturated(now, serving)
                alone = self._alone_reject if saturated else self._alone_local
            return RouteDecision(alone, serving)
        prefix = route.prefix
        decision = choose_region(
            self.model, self.here(now, serving, draining=draining), peers, client=location,
            prompt_tokens=route.prompt_tokens,
            prefix=self.prefix_hashes[prefix.name] if prefix else None,
            prefix_tokens=int(len(prefix.text) / CHARS_PER_TOKEN) if prefix else 0,
            forwarded=forwarded,
        )
        return RouteDecision(decision, serving)

    def missing(self, model: str, *, forwarded: bool = False) -> ModelMissing:
        """Why ``model`` has no candidate (see :class:`ModelMissing`)."""
        if not forwarded and self._known_elsewhere(model):
            return ModelMissing.UNKNOWN_YET
        return ModelMissing.NOT_FOUND

    def _known_elsewhere(self, model: str) -> bool:
        """A peer whose last status (however old) serves ``model``, or does not say."""
        for peer in self.peer_table.peers.values():
            status = peer.status
            if status is not None and (
                status.models is None or any(m.name == model for m in status.models)
            ):
                return True
        return False

    def backend(
        self, route: RouteInput, candidates: list[str], now: float, reason: str | None = None
    ) -> BackendChoice | None:
        """The affinity policy's pick among ``candidates`` (under ``reason``, the policy's
        own when None); None if it picks nothing."""
        policy = self.policy
        loads = {}
        # A lone candidate is picked whatever its load (AffinityPolicy.choose; a negative
        # abs_threshold aside): its load, a call, is not asked (the usual case: a region of
        # one backend per model, or one with room).
        if len(candidates) > 1 or policy.abs_threshold < 0:
            load = self.tracker.load
            for n in candidates:  # a loop, not a dict comprehension: that is a call of its own
                loads[n] = load(n, now)
        choice = policy.choose(route.affinity_key, candidates, loads, now)
        if choice is None or reason is None:
            return choice
        return BackendChoice(choice.backend, reason)

    def local_backend(
        self, route: RouteInput, now: float, serving: frozenset[str] | None = None,
        room: Room | None = None,
    ) -> BackendChoice | None:
        """A backend with room serving ``route``'s model (among ``serving``, when the caller
        has them already: :attr:`RouteDecision.serving`; those with room in ``room``, the
        request's :data:`Room` at ``now``, when it was worked out for them)."""
        if serving is None:
            serving = self.serving(route.model)
        if room is not None and room[0] is serving:
            return self.backend(route, room[2], now)
        return self.backend(route, self.tracker.available(now, serving), now)

    def queue_backend(self, route: RouteInput, now: float) -> BackendChoice | None:
        """A backend serving ``route``'s model to queue on, when the expected wait there is
        within ``routing.max_queue_wait_ms``."""
        serving = self.serving(route.model)
        healthy = self.tracker.healthy(serving)
        limit = self.max_queue_wait_ms
        if not healthy or limit <= 0 or self.tracker.queue_wait_ms(now, serving) > limit:
            return None
        return self.backend(route, healthy, now, "queued")

    def switch_target(
        self, model: str, location: Location | None, now: float,
        sent_since: Mapping[str, int] | None = None,
    ) -> str | None:
        """The peer with room serving ``model`` expected to answer first (a late first
        token's new region), or None."""
        candidates = [
            c for c in self.peers(now, model, sent_since).values()
            if c.healthy and not c.saturated
        ]
        if not candidates:
            return None
        point = location.point if location is not None else None
        here = self.here(now)
        return min(
            candidates, key=lambda c: self.model.expected_ms(point, here, c, 0, None, 0)
        ).name

    # --- what the region serves
    def model_status(self, now: float, *, draining: bool = False) -> list[ModelStatus]:
        """Each model served here, with its room (over the backends serving it)."""
        out = []
        for model in self.models.models():
            among = self.models.serving(model)
            wait = self.tracker.queue_wait_ms(now, among)
            out.append(ModelStatus(
                name=model, healthy=bool(self.tracker.healthy(among)) and not draining,
                saturated=self.tracker.region_saturated(now, among),
                in_flight=self.tracker.in_flight(among), capacity=self.tracker.capacity(among),
                queue_wait_ms=wait if math.isfinite(wait) else 1e9,
            ))
        return out

    def model_names(self, now: float, *, peers: bool = False) -> list[str]:
        """The models this region serves; with ``peers``, also those its peers with fresh
        status serve."""
        names = set(self.models.models())
        if peers:
            for status in self.peer_table.fresh(now).values():
                names.update(m.name for m in status.models or ())
        return sorted(names)
