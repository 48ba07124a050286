"""The fair-share core: weighted max-min water-filling, exactly, and the admission decision
over flows in flight and flows refused recently (clock passed in)."""

from __future__ import annotations

import random

import pytest

from firstbyte.router.fair_share import ASK_WINDOW_S, FairShare, water_fill


def _one(_: str) -> float:
    return 1.0


def test_water_fill_gives_light_flows_their_demand_and_splits_the_rest() -> None:
    # 1:1:8 asking for 12 of 10: the two light flows are met, the heavy one gets the rest.
    assert water_fill(10, {"a": 1, "b": 1, "c": 8}) == {"a": 1, "b": 1, "c": 8}
    assert water_fill(6, {"a": 1, "b": 1, "c": 8}) == {"a": 1, "b": 1, "c": 4}
    assert water_fill(6, {"a": 4, "b": 4, "c": 16}) == {"a": 2, "b": 2, "c": 2}
    assert water_fill(9, {"a": 2, "b": 4, "c": 16}) == {"a": 2, "b": 3.5, "c": 3.5}


def test_water_fill_honours_weights() -> None:
    assert water_fill(8, {"a": 10, "b": 10, "c": 10}, {"c": 2.0}) == {"a": 2, "b": 2, "c": 4}
    # A weighted flow that asks for little leaves the rest to the others, by weight.
    assert water_fill(8, {"a": 10, "b": 10, "c": 1}, {"a": 3.0}) == {
        "a": pytest.approx(5.25), "b": pytest.approx(1.75), "c": 1,
    }


def test_water_fill_never_exceeds_the_budget_or_a_demand() -> None:
    assert water_fill(0, {"a": 3}) == {"a": 0}
    assert water_fill(100, {"a": 3, "b": 0}) == {"a": 3, "b": 0}
    assert water_fill(5, {}) == {}


def test_a_flow_below_its_share_is_admitted_and_one_at_it_is_not() -> None:
    flows: FairShare[str] = FairShare()
    for _ in range(8):
        flows.started("heavy")
    light = flows.decide("light", 8, 0.0, weight_of=_one, contended=True)
    assert (light.admit, light.in_flight, light.share, light.flows) == (True, 0, 1.0, 2)
    flows.started("light")
    # The heavy flow now asks for a ninth of a budget of 8 it shares with light's 1.
    heavy = flows.decide("heavy", 8, 0.0, weight_of=_one, contended=True)
    assert (heavy.admit, heavy.in_flight, heavy.share) == (False, 8, 7.0)


def test_uncontended_over_share_is_admitted_unless_another_flow_is_starved() -> None:
    flows: FairShare[str] = FairShare()
    for _ in range(4):
        flows.started("heavy")
    # Budget 4, nobody else asking: the slot is free, take it (work-conserving).
    assert flows.decide("heavy", 4, 0.0, weight_of=_one, contended=False).admit
    flows.asked("light", 1.0)  # light was refused at 1.0: it asks for one more
    assert not flows.decide("heavy", 4, 1.5, weight_of=_one, contended=False).admit
    # Once its ask is older than the window, the heavy flow may take a free slot again.
    assert flows.decide("heavy", 4, 1.0 + ASK_WINDOW_S, weight_of=_one, contended=False).admit
    # ... and the refusal is forgotten by housekeeping.
    flows.forget_asks(1.0 + ASK_WINDOW_S)
    assert flows.demands(1.5) == {"heavy": 4.0}


def test_weights_shift_the_share() -> None:
    flows: FairShare[str] = FairShare()
    for name, n in (("a", 3), ("b", 3), ("c", 3)):
        for _ in range(n):
            flows.started(name)
    weights = {"a": 1.0, "b": 1.0, "c": 2.0}
    # Budget 8 at 1:1:2: a and b hold 2 each, c 4; with 3 each, c is below its share.
    assert flows.decide("c", 8, 0.0, weight_of=weights.__getitem__, contended=True).admit
    assert not flows.decide("a", 8, 0.0, weight_of=weights.__getitem__, contended=True).admit


def test_finished_flows_are_forgotten() -> None:
    flows: FairShare[str] = FairShare()
    flows.started("a")
    flows.started("a")
    flows.finished("a")
    assert flows.in_flight("a") == 1
    assert flows.total() == 1
    flows.finished("a")
    assert len(flows) == 0
    assert not flows.active()
    flows.finished("a")  # a second end of the same flow changes nothing
    assert flows.total() == 0


def test_with_room_for_every_demand_a_flow_may_take_what_the_others_do_not_ask() -> None:
    flows: FairShare[str] = FairShare()
    for _ in range(3):
        flows.started("a")
    decision = flows.decide("b", 10, 0.0, weight_of=_one, contended=True)
    assert (decision.admit, decision.share, decision.flows) == (True, 7.0, 2)
    flows.asked("c", 0.0)  # c asks for one more: one less left for b
    assert flows.decide("b", 10, 0.0, weight_of=_one, contended=True).share == 6.0
    # An expired ask no longer counts, even before housekeeping drops it.
    assert flows.decide("b", 5, ASK_WINDOW_S, weight_of=_one, contended=True).share == 2.0


def test_room_for_one_more_is_what_decide_admits_without_working_out_shares() -> None:
    """``has_room``: the tenancy gate's shortcut. Wherever it says yes, ``decide`` admits
    every flow, whatever its weight; once anyone asks, waits or keeps a demand, it says no
    (the shares then have to be worked out)."""
    rnd = random.Random(7)
    for _ in range(500):
        share: FairShare[str] = FairShare()
        for flow in rnd.sample("abcdef", rnd.randint(0, 6)):
            for _ in range(rnd.randint(1, 5)):
                share.started(flow, 0.0)
        budget = float(rnd.randint(1, 30))
        weights = {flow: rnd.choice((0.5, 1.0, 3.0)) for flow in "abcdefg"}
        room = share.has_room(budget)
        assert room == (share.total() + 1 <= budget)
        if room:
            for flow in "abcdefg":
                assert share.decide(flow, budget, 1.0, weight_of=weights.__getitem__,
                                    contended=True).admit
    quiet: FairShare[str] = FairShare()
    quiet.started("a", 0.0)
    assert quiet.has_room(2.0)
    asked: FairShare[str] = FairShare()
    asked.asked("b", 0.0)
    waited: FairShare[str] = FairShare()
    waited.wait("b", 0.0)
    assert not asked.has_room(100.0)
    assert not waited.has_room(100.0)


def test_room_for_a_flow_is_has_room_and_what_the_others_leave_it() -> None:
    """``room_for``: ``has_room`` and the flow's share (the budget less the other flows' in
    flight) in one call; None exactly where ``has_room`` says no."""
    rnd = random.Random(11)
    for _ in range(500):
        share: FairShare[str] = FairShare()
        for flow in rnd.sample("abcdef", rnd.randint(0, 6)):
            for _ in range(rnd.randint(1, 5)):
                share.started(flow, 0.0)
        if rnd.random() < 0.2:
            share.asked(rnd.choice("abcdef"), 0.0)
        budget = float(rnd.randint(1, 30))
        for flow in "abcdefg":
            room = share.room_for(flow, budget)
            if share.has_room(budget):
                assert room == budget - (share.total() - share.in_flight(flow))
            else:
                assert room is None
