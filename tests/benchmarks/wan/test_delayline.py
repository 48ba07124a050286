"""The delay line's decisions, with an injected clock: delay, jitter without reordering,
loss rate, rate limit, queue limit, unroutable pairs."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from firstbyte.benchmarks.wan.delayline import NS_PER_MS, DelayLine, LinkParams, Verdict

MS = NS_PER_MS


def test_each_direction_gets_its_own_delay() -> None:
    line = DelayLine({(0, 1): LinkParams(75 * MS), (1, 0): LinkParams(5 * MS)})
    assert line.push(b"a" * 100, 0, 1, now_ns=1_000) is Verdict.SCHEDULED
    assert line.push(b"b" * 100, 1, 0, now_ns=2_000) is Verdict.SCHEDULED
    assert line.next_deadline() == 2_000 + 5 * MS
    assert line.pop_due(2_000 + 5 * MS - 1) == []
    assert line.pop_due(2_000 + 5 * MS) == [(0, b"b" * 100, 2_000 + 5 * MS)]
    assert line.pop_due(1_000 + 75 * MS - 1) == []
    assert line.pop_due(1_000 + 75 * MS) == [(1, b"a" * 100, 1_000 + 75 * MS)]
    assert line.next_deadline() is None


def test_packets_with_equal_release_times_keep_arrival_order() -> None:
    line = DelayLine({(0, 1): LinkParams(10 * MS)})
    for i in range(50):
        line.push(bytes([i]) * 20, 0, 1, now_ns=0)
    assert [p[0] for _, p, _ in line.pop_due(10 * MS)] == list(range(50))


def test_unknown_pair_is_dropped_and_counted() -> None:
    line = DelayLine({(0, 1): LinkParams(MS)})
    assert line.push(b"x" * 40, 1, 0, now_ns=0) is None
    assert line.unroutable == 1
    assert line.in_flight() == 0


def _jittered(spacing_ns: int, n: int) -> tuple[list[int], list[int]]:
    """Push ``n`` packets ``spacing_ns`` apart through 50 +- 10 ms; (arrival order out, delays)."""
    line = DelayLine({(0, 1): LinkParams(50 * MS, jitter_ns=10 * MS)}, seed=3)
    arrivals = [i * spacing_ns for i in range(n)]
    for i, t in enumerate(arrivals):
        line.push(i.to_bytes(4, "big") * 5, 0, 1, now_ns=t)
    released = line.pop_due(10**13)
    order = [int.from_bytes(p[:4], "big") for _, p, _ in released]
    return order, [r - t for (_, _, r), t in zip(released, arrivals, strict=True)]


def test_jitter_spreads_sparse_packets_uniformly_around_the_delay() -> None:
    # Packets further apart than the jitter range are never held back by their predecessor.
    order, delays = _jittered(25 * MS, 4_000)
    assert order == list(range(4_000))
    assert min(delays) >= 40 * MS
    assert max(delays) <= 60 * MS
    assert min(delays) < 41 * MS
    assert max(delays) > 59 * MS
    assert abs(sum(delays) / len(delays) - 50 * MS) < 0.5 * MS


def test_jitter_never_reorders_dense_packets() -> None:
    # One packet every 0.1 ms with +-10 ms jitter: a FIFO path holds each packet behind the
    # one before it, so delays only ever rise to their running maximum.
    order, delays = _jittered(100_000, 5_000)
    assert order == list(range(5_000))
    assert min(delays) >= 40 * MS
    assert max(delays) <= 60 * MS


def test_loss_rate_matches_and_is_reproducible_by_seed() -> None:
    def verdicts(seed: int) -> list[Verdict | None]:
        line = DelayLine({(0, 1): LinkParams(MS, loss_pct=10.0)}, seed=seed)
        return [line.push(b"p" * 64, 0, 1, now_ns=i * 1000) for i in range(20_000)]

    first = verdicts(7)
    lost = first.count(Verdict.LOST)
    assert 1_800 <= lost <= 2_200
    assert verdicts(7) == first
    assert verdicts(8) != first


def test_zero_loss_never_drops() -> None:
    line = DelayLine({(0, 1): LinkParams(MS)})
    assert all(line.push(b"p" * 64, 0, 1, now_ns=i) is Verdict.SCHEDULED for i in range(1000))


def test_rate_limit_serialises_packets() -> None:
    # 1 Mbit/s: a 1250-byte packet takes exactly 10 ms to send.
    line = DelayLine({(0, 1): LinkParams(20 * MS, rate_bps=1e6)})
    for _ in range(5):
        line.push(b"x" * 1250, 0, 1, now_ns=0)
    releases = [r for _, _, r in line.pop_due(10**12)]
    assert releases == [20 * MS + k * 10 * MS for k in range(1, 6)]


def test_rate_limit_idle_link_sends_at_once() -> None:
    line = DelayLine({(0, 1): LinkParams(0, rate_bps=8e6)})
    line.push(b"x" * 1000, 0, 1, now_ns=0)  # 1 ms to send
    line.push(b"x" * 1000, 0, 1, now_ns=50 * MS)  # the link is idle again by then
    assert [r for _, _, r in line.pop_due(10**12)] == [MS, 51 * MS]


def test_queue_limit_drops_tail() -> None:
    # 1 Mbit/s with at most 30 ms of queue: 1250-byte packets (10 ms each) arriving at once.
    line = DelayLine({(0, 1): LinkParams(0, rate_bps=1e6, queue_limit_ns=30 * MS)})
    verdicts = [line.push(b"x" * 1250, 0, 1, now_ns=0) for _ in range(6)]
    assert verdicts == [Verdict.SCHEDULED] * 4 + [Verdict.QUEUE_FULL] * 2
    assert line.links[(0, 1)].counts[Verdict.QUEUE_FULL] == 2


@pytest.mark.parametrize(
    "kwargs",
    [
        {"delay_ns": -1},
        {"delay_ns": 0, "jitter_ns": -1},
        {"delay_ns": 0, "loss_pct": 101.0},
        {"delay_ns": 0, "rate_bps": 0.0},
        {"delay_ns": 0, "queue_limit_ns": -5},
    ],
)
def test_link_params_reject_nonsense(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="must be"):
        LinkParams(**kwargs)  # type: ignore[arg-type]


@settings(max_examples=60, deadline=None)
@given(
    gaps=st.lists(st.integers(min_value=0, max_value=5 * MS), min_size=1, max_size=200),
    sizes=st.lists(st.integers(min_value=20, max_value=1500), min_size=200, max_size=200),
    jitter_ms=st.integers(min_value=0, max_value=20),
    rate=st.sampled_from([None, 1e6, 1e8]),
)
def test_any_arrivals_leave_in_order_and_never_early(
    gaps: list[int], sizes: list[int], jitter_ms: int, rate: float | None
) -> None:
    delay = 30 * MS
    line = DelayLine(
        {(0, 1): LinkParams(delay, jitter_ns=jitter_ms * MS, rate_bps=rate, queue_limit_ns=10**15)}
    )
    now = 0
    arrivals = []
    for i, gap in enumerate(gaps):
        now += gap
        arrivals.append(now)
        line.push(i.to_bytes(2, "big") + b"\0" * sizes[i], 0, 1, now_ns=now)
    out = line.pop_due(10**15)
    assert [int.from_bytes(p[:2], "big") for _, p, _ in out] == list(range(len(gaps)))
    for (_, _, release), arrival in zip(out, arrivals, strict=True):
        assert release >= arrival + delay - jitter_ms * MS
