"""Re-probing without sockets: the selector's switch decision (hysteresis, clock passed in) and
the pool's one scheduler that runs the re-probe (never twice at once, only while in use)."""

from __future__ import annotations

import asyncio
import ssl
import time

import pytest

from firstbyte.client_sdk.pool import ConnectionPool
from firstbyte.client_sdk.regions import Region, RegionSelector

A = Region("a", "https://a.example")
B = Region("b", "https://b.example")
C = Region("c", "https://c.example")


def selector(**kw: float) -> RegionSelector:
    # alpha=1: each observation replaces the RTT, so the margins are tested exactly.
    return RegionSelector([A, B, C], alpha=kw.pop("alpha", 1.0), **kw)


def measure(s: RegionSelector, **rtts: float) -> None:
    for name, rtt in rtts.items():
        s.observe_rtt(name, rtt)


def settle(s: RegionSelector, now: float = 0.0) -> list[str]:
    """What the client does after a probe: keep the proposal; returns the kept names."""
    chosen = s.proposal(now)
    s.keep(chosen)
    return [r.name for r in chosen]


def test_first_proposal_is_the_rtt_order() -> None:
    s = selector()
    assert [r.name for r in s.proposal(0.0)] == ["a", "b"]  # nothing measured: configured order
    measure(s, a=30.0, b=20.0, c=10.0)
    assert settle(s) == ["c", "b"]
    assert [r.name for r in s.ranked(0.0)] == ["c", "b", "a"]
    assert s.switches == 0  # a first choice is not a switch


def test_noise_does_not_move_the_primary() -> None:
    s = selector(alpha=0.3)
    measure(s, a=10.0, b=10.4, c=50.0)
    assert settle(s) == ["a", "b"]
    # Two regions within noise of each other, b measured faster half of the time.
    for i in range(50):
        measure(s, a=10.0 + (0.8 if i % 2 else 0.0), b=10.4 - (0.6 if i % 3 else 0.0), c=50.0)
        assert settle(s) == ["a", "b"]
    assert s.switches == 0
    # Without hysteresis the plain RTT order would have swapped them.
    s.observe_rtt("a", 11.5)
    assert (s.rtt_ms("b") or 0) < (s.rtt_ms("a") or 0)
    assert s.choose(0.0) == A


@pytest.mark.parametrize(("incumbent", "stays", "moves"), [
    (5.0, 3.01, 2.99),     # small RTTs: the 2 ms floor
    (100.0, 90.01, 89.99),  # large RTTs: 10 %
])
def test_switch_margin_is_max_of_2ms_and_10_percent(
    incumbent: float, stays: float, moves: float
) -> None:
    s = selector()
    measure(s, a=incumbent, b=incumbent + 50, c=incumbent + 60)
    assert settle(s) == ["a", "b"]
    s.observe_rtt("b", stays)
    assert settle(s) == ["a", "b"]
    assert not s.beats("b", "a")
    s.observe_rtt("b", moves)
    assert s.beats("b", "a")
    assert settle(s) == ["b", "a"]  # the old primary is the best of the rest: the standby
    assert s.switches == 1


def test_a_slow_primary_is_left_and_taken_back_once_it_is_clearly_faster() -> None:
    s = selector(alpha=0.3)
    measure(s, a=5.0, b=40.0, c=80.0)
    assert settle(s) == ["a", "b"]
    probes = 0
    while settle(s)[0] == "a":  # a gets slow: 125 ms per probe
        measure(s, a=125.0, b=40.0, c=80.0)
        probes += 1
    assert probes == 2  # EWMA: 41 ms, then 66 ms > 40 ms by more than 10 %
    assert s.choose(0.0) == B
    while settle(s)[1] != "c":  # the standby follows: c (80) beats a once a is clearly slower
        measure(s, a=125.0, b=40.0, c=80.0)
    recovered = 0
    while settle(s)[0] == "b":  # a recovers: back only once clearly faster than b
        measure(s, a=5.0, b=40.0, c=80.0)
        recovered += 1
        assert (s.rtt_ms("a") or 0) < 40.0 - 4.0 or settle(s)[0] == "b"
    assert recovered >= 3
    assert s.choose(0.0) == A
    assert s.switches == 2


def test_a_set_aside_primary_is_replaced_and_must_win_its_place_back() -> None:
    s = selector()
    measure(s, a=10.0, b=11.0, c=12.0)
    assert settle(s) == ["a", "b"]
    s.failed("a", now=0.0, retry_after_s=5.0)
    assert s.choose(1.0) == B  # requests skip it at once, before any re-probe
    assert settle(s, now=1.0) == ["b", "c"]
    # Back after its Retry-After, 1 ms faster than b, 2 ms faster than c: noise, both stay.
    assert s.available("a", 6.0)
    assert settle(s, now=6.0) == ["b", "c"]
    assert s.choose(6.0) == B
    s.observe_rtt("a", 8.0)  # now clearly faster than b; b is within noise of c: c stays
    assert settle(s, now=7.0) == ["a", "c"]
    assert s.switches == 2


def test_a_hint_ranks_above_the_kept_regions() -> None:
    s = selector()
    measure(s, a=10.0, b=20.0, c=90.0)
    settle(s)
    assert s.hint("c", None, now=0.0) == C
    assert [r.name for r in s.ranked(1.0)] == ["c", "a", "b"]
    assert [r.name for r in s.proposal(1.0)] == ["a", "b"]  # by RTT: what to keep warm
    assert [r.name for r in s.ranked(301.0)] == ["a", "b", "c"]


def test_keep_refuses_an_unknown_region() -> None:
    s = selector()
    with pytest.raises(KeyError):
        s.keep([Region("elsewhere", "https://evil.example")])


# -- the pool's scheduler --------------------------------------------------------------------

def pool(**kw: float) -> ConnectionPool:
    return ConnectionPool(ssl.create_default_context(), keepalive_interval_s=300.0, **kw)


async def test_a_job_never_runs_twice_at_once_and_its_errors_do_not_stop_it() -> None:
    p = pool()
    running = 0
    peak = 0
    runs = 0

    async def job() -> None:
        nonlocal running, peak, runs
        running += 1
        peak = max(peak, running)
        runs += 1
        try:
            await asyncio.sleep(0.12)  # longer than the interval
            if runs % 2:
                raise OSError("probe failed")
        finally:
            running -= 1

    p.every(0.03, job)
    p.touch()  # a request: the loop starts
    await asyncio.sleep(0.8)
    await p.aclose()
    assert peak == 1
    assert 3 <= runs <= 8, runs  # ~0.8 / 0.15 runs; the failing ones did not end the loop
    assert running == 0  # aclose cancelled the run in progress


async def test_jobs_run_only_while_the_client_is_in_use() -> None:
    p = pool(keepalive_expiry_s=0.3)
    times: list[float] = []

    async def job() -> None:
        times.append(time.monotonic())

    p.every(0.05, job)
    await asyncio.sleep(0.2)
    assert times == []  # never used: nothing runs
    p.touch()
    await asyncio.sleep(0.8)
    idle_runs = len(times)
    assert idle_runs >= 2
    assert times[-1] - times[0] < 0.6  # stopped about keepalive_expiry_s after the use
    await asyncio.sleep(0.3)
    assert len(times) == idle_runs
    p.touch()  # used again: runs again
    await asyncio.sleep(0.3)
    assert len(times) > idle_runs
    await p.aclose()


def test_every_refuses_a_non_positive_interval() -> None:
    async def job() -> None:
        return None

    with pytest.raises(ValueError, match="positive"):
        pool().every(0.0, job)
