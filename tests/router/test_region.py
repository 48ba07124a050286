from __future__ import annotations

from firstbyte.router.geo import GeoPoint, Location, known_regions
from firstbyte.router.pipeline.region import RegionCandidate, RegionModel, Verdict, choose_region

R = known_regions()
TOKYO = R["ap-northeast-1"].point
FRANKFURT = R["eu-central-1"].point
VIRGINIA = R["us-east-1"].point
MODEL = RegionModel(prefill_ms_per_1k_tokens=16.0, forward_overhead_ms=5.0, forward_margin_ms=20.0)


def cand(name: str, point: GeoPoint, *, wait: float = 0.0, saturated: bool = False,
         healthy: bool = True, warm: frozenset[str] = frozenset(),
         rtt: float | None = None) -> RegionCandidate:
    return RegionCandidate(name, point, healthy, saturated, wait, warm, rtt)


def at(point: GeoPoint) -> Location:
    return Location(point)


def peers(*cs: RegionCandidate) -> dict[str, RegionCandidate]:
    return {c.name: c for c in cs}


def test_nearby_client_served_locally() -> None:
    here = cand("frankfurt", FRANKFURT)
    d = choose_region(MODEL, here, peers(cand("tokyo", TOKYO), cand("virginia", VIRGINIA)),
                      client=at(GeoPoint(48.1, 11.6)))  # Munich
    assert d.verdict is Verdict.LOCAL
    assert d.region == "frankfurt"
    assert d.better_region is None


def test_far_client_forwarded_to_its_nearest_region_with_hint() -> None:
    here = cand("frankfurt", FRANKFURT)
    d = choose_region(MODEL, here, peers(cand("tokyo", TOKYO), cand("virginia", VIRGINIA)),
                      client=at(GeoPoint(35.0, 135.8)))  # Kyoto
    assert d.verdict is Verdict.FORWARD
    assert d.region == "tokyo"
    assert d.better_region == "tokyo"
    assert d.expected_ms["tokyo"] < d.expected_ms["frankfurt"]


def test_unknown_client_counts_as_local() -> None:
    here = cand("frankfurt", FRANKFURT)
    d = choose_region(MODEL, here, peers(cand("tokyo", TOKYO, rtt=1.0)), client=None)
    assert d.verdict is Verdict.LOCAL
    assert d.better_region is None


def test_queue_wait_moves_unknown_client_to_measured_peer() -> None:
    here = cand("frankfurt", FRANKFURT, wait=400.0)
    d = choose_region(MODEL, here, peers(cand("tokyo", TOKYO, rtt=3.0)), client=None)
    assert d.verdict is Verdict.FORWARD
    assert d.region == "tokyo"


def test_warm_prefix_can_beat_distance() -> None:
    # 8K-token prompt whose 7K-token prefix is warm only in Virginia (~92 ms from Frankfurt).
    here = cand("frankfurt", FRANKFURT)
    virginia = cand("virginia", VIRGINIA, warm=frozenset({"p"}))
    kwargs = {"prompt_tokens": 8000, "prefix": "p", "prefix_tokens": 7000}
    near_fra = at(GeoPoint(50.0, 8.0))
    d = choose_region(MODEL, here, peers(virginia), client=near_fra, **kwargs)  # type: ignore[arg-type]
    assert d.verdict is Verdict.LOCAL  # 112 ms prefill saved < ~160 ms RTT + margin
    d = choose_region(MODEL, here, peers(virginia), client=near_fra, prompt_tokens=40000,
                      prefix="p", prefix_tokens=39000)
    assert d.verdict is Verdict.FORWARD  # 624 ms of prefill saved


def test_saturated_region_spills_to_best_peer_or_rejects() -> None:
    here = cand("frankfurt", FRANKFURT, saturated=True)
    ps = peers(cand("tokyo", TOKYO), cand("virginia", VIRGINIA))
    d = choose_region(MODEL, here, ps, client=at(GeoPoint(50.0, 8.0)))
    assert d.verdict is Verdict.SPILL
    assert d.region == "virginia"  # nearer than Tokyo
    d = choose_region(MODEL, here, ps, client=at(GeoPoint(50.0, 8.0)), spill_slot=False)
    assert d.verdict is Verdict.REJECT
    all_full = peers(cand("tokyo", TOKYO, saturated=True), cand("virginia", VIRGINIA, healthy=False))
    d = choose_region(MODEL, here, all_full, client=None)
    assert d.verdict is Verdict.REJECT


def test_forwarded_request_never_forwarded_again() -> None:
    here = cand("frankfurt", FRANKFURT)
    d = choose_region(MODEL, here, peers(cand("tokyo", TOKYO)), client=at(TOKYO), forwarded=True)
    assert d.verdict is Verdict.LOCAL
    here = cand("frankfurt", FRANKFURT, saturated=True)
    d = choose_region(MODEL, here, peers(cand("tokyo", TOKYO)), client=at(TOKYO), forwarded=True)
    assert d.verdict is Verdict.REJECT


def test_margin_prevents_flapping_between_equal_regions() -> None:
    here = cand("a", FRANKFURT, wait=10.0)
    d = choose_region(MODEL, here, peers(cand("b", FRANKFURT)), client=at(FRANKFURT))
    assert d.verdict is Verdict.LOCAL
