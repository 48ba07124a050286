"""The pure chooser: region, backend and model from the request, the known load and ``now``
(no sockets, no clock: every ``now`` is passed in)."""

from __future__ import annotations

from firstbyte.protocol.edge import EdgeStatus, ModelStatus
from firstbyte.router.backpressure import BackendLoad, LoadTracker
from firstbyte.router.geo import GeoPoint
from firstbyte.router.models import ModelMap
from firstbyte.router.peers import PeerTable
from firstbyte.router.pipeline.affinity import AffinityPolicy
from firstbyte.router.pipeline.chooser import ModelMissing, RouteChooser, RouteDecision, RouteInput
from firstbyte.router.pipeline.region import RegionModel, Verdict
from firstbyte.router.warmup import WarmupScheduler

FRANKFURT = GeoPoint(50.11, 8.68)
TOKYO = GeoPoint(35.68, 139.69)


def room(name: str, *, saturated: bool = False, in_flight: int = 0) -> ModelStatus:
    return ModelStatus(name=name, healthy=True, saturated=saturated, in_flight=in_flight,
                       capacity=8, queue_wait_ms=0.0)


def peer_status(region: str, models: list[ModelStatus] | None) -> EdgeStatus:
    return EdgeStatus(region=region, healthy=True, saturated=False, in_flight=0, capacity=16,
                      queue_wait_ms=0.0, latitude=TOKYO.lat, longitude=TOKYO.lon, models=models)


def chooser(lists: dict[str, list[str]], peers: dict[str, list[ModelStatus] | None]) -> RouteChooser:
    names = list(lists)
    table = PeerTable([(p, f"http://{p}.invalid") for p in peers], ttl_s=5.0)
    for name, models in peers.items():
        table.observe(name, peer_status(name, models), now=0.0, rtt_ms=200.0)
    return RouteChooser(
        "frankfurt", FRANKFURT, RegionModel(),
        LoadTracker([BackendLoad(n, max_in_flight=4) for n in names]), ModelMap(lists),
        WarmupScheduler([]), [], table, dict.fromkeys(peers), {},
        AffinityPolicy(dict.fromkeys(names, 1.0)),
    )


def test_a_model_served_here_stays_on_the_backends_serving_it() -> None:
    c = chooser({"a0": ["A"], "a1": ["A"], "b0": ["B"]}, {"tokyo": [room("A"), room("C")]})
    decision = c.region_for(RouteInput("B", "k1"), None, now=1.0)
    assert isinstance(decision, RouteDecision)
    assert decision.region.verdict is Verdict.LOCAL
    assert decision.serving == {"b0"}
    assert {c.local_backend(RouteInput("B", f"k{i}"), 1.0).backend for i in range(20)} == {"b0"}  # type: ignore[union-attr]
    assert {c.local_backend(RouteInput("A", f"k{i}"), 1.0).backend for i in range(20)} == {"a0", "a1"}  # type: ignore[union-attr]


def test_a_model_served_only_by_a_peer_is_forwarded_there_without_a_hint() -> None:
    c = chooser({"a0": ["A"]}, {"tokyo": [room("A"), room("C")], "virginia": [room("A")]})
    decision = c.region_for(RouteInput("C", "k"), None, now=1.0)
    assert isinstance(decision, RouteDecision)
    assert (decision.region.verdict, decision.region.region) == (Verdict.FORWARD, "tokyo")
    assert decision.region.better_region is None
    assert decision.serving == frozenset()
    # Full there for C (whatever its region-wide figures say): refused, not sent.
    c = chooser({"a0": ["A"]}, {"tokyo": [room("A"), room("C", saturated=True)]})
    decision = c.region_for(RouteInput("C", "k"), None, now=1.0)
    assert isinstance(decision, RouteDecision)
    assert decision.region.verdict is Verdict.REJECT
    # Our own requests sent since its status count against its room for C.
    c = chooser({"a0": ["A"]}, {"tokyo": [room("C", in_flight=6)]})
    decision = c.region_for(RouteInput("C", "k"), None, now=1.0, sent_since={"tokyo": 2})
    assert isinstance(decision, RouteDecision)
    assert decision.region.verdict is Verdict.REJECT


def test_a_model_served_nowhere_is_not_found_unless_it_may_yet_be() -> None:
    c = chooser({"a0": ["A"]}, {"tokyo": [room("C")]})
    assert c.region_for(RouteInput("Z", "k"), None, now=1.0) is ModelMissing.NOT_FOUND
    # The peer that has C went quiet (status older than its TTL): come back later, not 404.
    assert c.region_for(RouteInput("C", "k"), None, now=60.0) is ModelMissing.UNKNOWN_YET
    # A request forwarded to us is never forwarded again: here, C is not served.
    assert c.region_for(RouteInput("C", "k"), None, now=1.0, forwarded=True) is (
        ModelMissing.NOT_FOUND
    )
    # A backend whose list is unknown takes no model another backend (or a peer) lists;
    # one nobody lists, it may serve.
    c = chooser({"a0": ["A"], "new": []}, {"tokyo": [room("C")]})
    assert c.models.unknown() == ["new"]
    for model, serving in (("A", {"a0"}), ("C", set()), ("Z", {"new"})):
        decision = c.region_for(RouteInput(model, "k"), None, now=1.0)
        assert isinstance(decision, RouteDecision)
        assert decision.serving == serving, model


def test_a_peer_that_does_not_list_models_counts_as_serving_every_model() -> None:
    c = chooser({"a0": ["A"]}, {"tokyo": None})
    decision = c.region_for(RouteInput("anything", "k"), None, now=1.0)
    assert isinstance(decision, RouteDecision)
    assert (decision.region.verdict, decision.region.region) == (Verdict.FORWARD, "tokyo")


def test_each_models_room_is_over_the_backends_serving_it() -> None:
    c = chooser({"a0": ["A"], "a1": ["A", "B"]}, {"tokyo": [room("C")]})
    c.tracker.started("a0", 0.0)
    status = {m.name: m for m in c.model_status(1.0)}
    assert (status["A"].capacity, status["A"].in_flight) == (8, 1)
    assert (status["B"].capacity, status["B"].in_flight) == (4, 0)
    for _ in range(4):
        c.tracker.started("a1", 0.0)
    assert c.model_status(1.0)[1].saturated is True  # B: its one backend is full
    assert c.model_status(1.0)[0].saturated is False  # A: a0 has room
    assert c.model_names(1.0) == ["A", "B"]
    assert c.model_names(1.0, peers=True) == ["A", "B", "C"]


def test_who_serves_a_model_follows_every_list_change() -> None:
    # Asked several times a request, so kept; a list learned, changed or kept over a reload
    # is seen by the next request, and a name no backend lists is kept nowhere.
    c = chooser({"a0": ["A"], "new": []}, {})
    assert c.serving("B") == {"new"}
    assert c.models.learned("new", ["B"], now=1.0)
    assert (c.serving("A"), c.serving("B"), c.models.unknown_set) == ({"a0"}, {"new"}, set())
    assert c.models.learned("new", ["A"], now=2.0)
    assert (c.serving("A"), c.serving("B")) == ({"a0", "new"}, frozenset())
    c.models.keep("new", None)  # a reload keeps a list not asked yet
    assert (c.serving("A"), c.serving("B")) == ({"a0"}, {"new"})
    for i in range(100):
        c.serving(f"junk-{i}")
    assert set(c.models.by_model) == {"A"}


def test_a_region_without_peers_serves_while_it_has_room_and_refuses_when_full() -> None:
    c = chooser({"a0": ["A"], "b0": ["B"]}, {})
    decision = c.region_for(RouteInput("A", "k"), None, now=1.0)
    assert isinstance(decision, RouteDecision)
    assert (decision.region.verdict, decision.serving) == (Verdict.LOCAL, {"a0"})
    for _ in range(4):
        c.tracker.started("a0", 1.0)
    full = c.region_for(RouteInput("A", "k"), None, now=1.0)
    assert isinstance(full, RouteDecision)
    assert full.region.verdict is Verdict.REJECT  # full for A, though b0 has room
    assert c.region_for(RouteInput("A", "k"), None, now=1.0, draining=True).region.verdict is (  # type: ignore[union-attr]
        Verdict.REJECT
    )
    c.tracker.set_health("b0", False)
    gone = c.region_for(RouteInput("B", "k"), None, now=1.0)
    assert isinstance(gone, RouteDecision)
    assert gone.region.verdict is Verdict.REJECT


def test_a_room_is_read_only_for_the_backends_it_was_worked_out_for() -> None:
    # A placement's room (RouterState.room) stands in for a scan of the backends, but only
    # for the very set it was made for: for another (a model map changed since) the chooser
    # scans them as without one.
    c = chooser({"a0": ["A"], "a1": ["A"], "b0": ["B"]}, {})
    serving = c.serving("A")
    full: tuple[frozenset[str], frozenset[str] | None, list[str], int] = (serving, serving, [], 8)
    decision = c.region_for(RouteInput("A", "k"), None, now=1.0, room=full)
    assert decision.region.verdict is Verdict.REJECT  # type: ignore[union-attr]
    assert c.local_backend(RouteInput("A", "k"), 1.0, serving, full) is None
    only_a1 = (serving, serving, ["a1"], 8)
    assert c.local_backend(RouteInput("A", "k"), 1.0, serving, only_a1).backend == "a1"  # type: ignore[union-attr]
    other = (frozenset(sorted(serving)), serving, [], 8)  # equal, not the same: not its room
    decision = c.region_for(RouteInput("A", "k"), None, now=1.0, room=other)
    assert decision.region.verdict is Verdict.LOCAL  # type: ignore[union-attr]
    assert c.local_backend(RouteInput("A", "k"), 1.0, serving, other) is not None
