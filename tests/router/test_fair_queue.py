"""The fair queue's core, exactly: who waits counts in its flow's demand at once, and a slot
that frees goes to the waiter of the flow furthest below its share (keys by weight, then
subjects inside the key), before any new arrival (clock passed in, no sockets)."""

from __future__ import annotations

from firstbyte.router.fair_queue import FairQueue
from firstbyte.router.fair_share import ASK_WINDOW_S, FairShare
from firstbyte.router.tenancy import ALONE, KeyLimiter, KeyPolicy, Tenants

A, B = b"key-a", b"key-b"


def _one(_: str) -> float:
    return 1.0


def test_a_waiting_request_counts_in_its_flows_demand_at_once() -> None:
    flows: FairShare[str] = FairShare()
    for _ in range(10):
        flows.started("abuser")
    assert flows.demands(0.0) == {"abuser": 10.0}
    flows.wait("light")
    assert flows.demands(0.0) == {"abuser": 10.0, "light": 1.0}
    assert flows.active()
    # The abuser, at the whole budget of 10 with a light flow waiting, is over its share (9).
    over = flows.decide("abuser", 10, 0.0, weight_of=_one, contended=True)
    assert (over.admit, over.share) == (False, 9.0)
    # ... and so it is even when uncontended: the waiting flow is below its share.
    assert not flows.decide("abuser", 10, 0.0, weight_of=_one, contended=False).admit
    # The light flow's next request counts the one waiting ahead of it: within its share.
    light = flows.decide("light", 10, 0.0, weight_of=_one, contended=True)
    assert (light.admit, light.in_flight, light.share) == (True, 1, 2.0)
    flows.unwait("light")
    assert flows.demands(0.0) == {"abuser": 10.0}
    flows.unwait("light")  # once too often: nothing goes negative
    assert flows.waiting("light") == 0


def test_the_first_request_of_a_light_subject_is_admitted_at_a_full_region() -> None:
    # One key, one abusive subject holding the whole region of 100: a light subject's very
    # first request is below its share (1 of 100), the abuser's next one is not.
    tenants = Tenants(KeyLimiter())
    for _ in range(100):
        tenants.hold(A, "abuser")
    subjects = tenants.subjects_of(A)
    first = subjects.decide("user-1", 100.0, 0.0, weight_of=_one, contended=True)
    assert (first.admit, first.share) == (True, 1.0)
    tenants.wait(A, "user-1", lambda: None)
    assert not subjects.decide("abuser", 100.0, 0.0, weight_of=_one, contended=True).admit
    assert tenants.keys.waiting(A) == 1


def test_a_freed_slot_goes_to_the_key_furthest_below_its_share_by_weight() -> None:
    queue: FairQueue[str] = FairQueue()
    queue.push(A, "", "a1")
    queue.push(B, "", "b1")
    queue.push(A, "", "a2")
    in_flight = {A: 4.0, B: 6.0}
    weight = {A: 1.0, B: 2.0}  # usage per weight: A 4, B 3: B is further below
    usage = {k: in_flight[k] / weight[k] for k in in_flight}
    first = queue.pop(usage.__getitem__, lambda k, s: 0.0)
    assert first is not None
    assert first.item == "b1"
    assert (len(queue), queue.handed, queue.busy()) == (2, 1, True)
    # Equal usage: the longest waiting goes first; inside a flow, first come first served.
    second = queue.pop(lambda k: 1.0, lambda k, s: 0.0)
    third = queue.pop(lambda k: 1.0, lambda k, s: 0.0)
    assert (second and second.item, third and third.item) == ("a1", "a2")
    assert queue.pop(lambda k: 1.0, lambda k, s: 0.0) is None
    assert queue.handed == 3
    for _ in range(3):
        queue.taken()
    assert not queue.busy()
    queue.taken()
    assert queue.handed == 0


def test_inside_a_key_the_subject_with_fewest_in_flight_goes_first() -> None:
    queue: FairQueue[str] = FairQueue()
    abuser = queue.push(A, "abuser", "x")
    queue.push(A, "user-1", "u1")
    queue.push(A, "user-2", "u2")
    held = {"abuser": 80.0, "user-1": 1.0, "user-2": 0.0}
    got = queue.pop(lambda k: 0.0, lambda k, s: held[s])
    assert got is not None
    assert got.item == "u2"
    assert queue.remove(abuser)
    assert not queue.remove(abuser)
    assert not queue.remove(got)  # handed already: not in the queue
    got = queue.pop(lambda k: 0.0, lambda k, s: held[s])
    assert got is not None
    assert got.item == "u1"
    assert len(queue) == 0
    assert queue.pop(lambda k: 0.0, lambda k, s: 0.0) is None


def test_tenants_hand_only_free_slots_not_yet_handed_and_wake_the_fairest() -> None:
    limiter = KeyLimiter()
    limiter.configure(KeyPolicy(weight=1.0), {B: KeyPolicy(weight=3.0)})
    tenants = Tenants(limiter)
    for _ in range(3):
        tenants.hold(A, None)
    for _ in range(6):
        tenants.hold(B, None)  # usage by weight: A 3, B 2
    woke: list[str] = []
    wa = tenants.wait(A, None, lambda: woke.append("a"))
    wb = tenants.wait(B, None, lambda: woke.append("b"))
    assert tenants.keys.waiting(A) == tenants.keys.waiting(B) == 1
    assert tenants.hand_slots(0) == 0
    assert woke == []
    assert tenants.hand_slots(1) == 1
    assert woke == ["b"]
    # One slot free, already handed to B's waiter (not taken yet): A's waiter stays.
    assert tenants.hand_slots(1) == 0
    assert woke == ["b"]
    assert tenants.stop_waiting(wb)  # it takes its slot
    assert tenants.keys.waiting(B) == 0
    assert tenants.queue.handed == 0
    assert not tenants.stop_waiting(wa)  # it gives up
    assert tenants.keys.waiting(A) == 0
    assert not tenants.queue.busy()
    assert tenants.hand_slots(5) == 0


def test_a_waiting_subject_alone_in_a_full_region_is_a_full_region() -> None:
    # Only one subject of one key asks: nothing to share, the caller refuses it as full.
    tenants = Tenants(KeyLimiter())
    for _ in range(4):
        tenants.hold(A, "only")
    tenants.wait(A, "only", lambda: None)

    class Ctx:
        owner, subject = A, "only"

    refused = tenants.fair_refusal(Ctx(), 4.0, 0.0, 1)  # type: ignore[arg-type]
    assert refused is ALONE


def test_a_flow_that_waited_keeps_asking_while_it_comes_back() -> None:
    flows: FairShare[str] = FairShare()
    flows.wait("light", 10.0)  # alone: it held 0 and waited for 1
    flows.unwait("light")
    flows.started("light", 10.0)
    # While in flight its demand is its one request, not one more (one client) ...
    assert flows.demands(10.5) == {"light": 1.0}
    flows.finished("light")
    # ... and between its requests it still asks for it (its client is coming back) ...
    assert flows.demands(11.0) == {"light": 1.0}
    # ... renewed each time it starts one, forgotten once it is quiet for the window.
    flows.started("light", 11.5)
    flows.finished("light")
    assert flows.demands(11.5 + ASK_WINDOW_S - 0.01) == {"light": 1.0}
    assert flows.demands(11.5 + ASK_WINDOW_S) == {}
    flows.forget_asks(11.5 + ASK_WINDOW_S)
    assert not flows.active()


def test_a_flow_that_waited_keeps_its_peak_demand_for_the_window() -> None:
    # A key of 8 clients held 5 when its 6th request had to wait: for the ask window its
    # demand is at least 6, so an over-share key is not given the slots its lulls free.
    flows: FairShare[str] = FairShare()
    for _ in range(5):
        flows.started("light")
    for _ in range(34):
        flows.started("heavy")
    flows.wait("light", 0.0)
    flows.unwait("light")
    flows.started("light", 0.1)
    for _ in range(3):
        flows.finished("light")  # a lull: it holds 3
    assert flows.demands(1.0) == {"light": 6.0, "heavy": 34.0}
    assert flows.demands(1.0, "light") == {"light": 6.0, "heavy": 34.0}
    # 37 of 40 held, 3 free: the heavy key is at its share (34 = 40 - 6), refused even so.
    heavy = flows.decide("heavy", 40, 1.0, weight_of=_one, contended=False)
    assert (heavy.admit, heavy.share) == (False, 34.0)
    assert flows.decide("light", 40, 1.0, weight_of=_one, contended=False).admit
    # Past the window (and no wait since), the lull's slots are anyone's.
    assert flows.demands(0.1 + ASK_WINDOW_S) == {"light": 3.0, "heavy": 34.0}
    assert flows.decide("heavy", 40, 0.1 + ASK_WINDOW_S, weight_of=_one, contended=False).admit


def test_what_a_flow_that_waited_keeps_still_leaves_room_for_others_at_once() -> None:
    flows: FairShare[str] = FairShare()
    for _ in range(2):
        flows.started("light")
    flows.wait("light", 0.0)  # it held 2 and waited for a 3rd: it keeps 3
    flows.unwait("light")
    flows.finished("light")
    flows.finished("light")  # a lull: it holds 0, keeps 3
    for _ in range(6):
        flows.started("heavy")
    # 10 slots: 6 held, 3 kept, 1 free: the heavy flow takes it (room for every demand) ...
    took = flows.decide("heavy", 10, 1.0, weight_of=_one, contended=True)
    assert (took.admit, took.share) == (True, 7.0)
    flows.started("heavy")
    # ... but not the kept ones: 7 held and 3 kept fill the 10.
    kept = flows.decide("heavy", 10, 1.0, weight_of=_one, contended=True)
    assert (kept.admit, kept.share) == (False, 7.0)
