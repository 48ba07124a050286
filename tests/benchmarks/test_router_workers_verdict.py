"""``bench router_workers`` reads each Redis-vs-memory figure with its A/A: a run whose own
noise is larger than the target says so instead of calling the target met or not."""

from __future__ import annotations

import pytest

from firstbyte.benchmarks.scenarios.router_workers import _verdict


@pytest.mark.parametrize(("value", "aa", "limit", "ratio", "expected"), [
    (5.0, -3.0, 10.0, False, "met"),  # within, in a run that resolves 10 ms
    (-50.0, 134.3, 10.0, False, "inconclusive"),  # "within", but noise alone made +134
    (16.0, -276.7, 30.0, False, "inconclusive"),  # past 30 ms by less than the noise
    (225.1, -101.3, 10.0, False, "NOT MET"),  # past it by more than the noise
    (277.3, 134.3, 10.0, False, "NOT MET"),
    (1.15, 1.03, 1.15, True, "met"),
    (1.26, 1.08, 1.15, True, "NOT MET"),
    (1.10, 0.80, 1.15, True, "inconclusive"),  # the A/A strayed by 20%
    (1.30, 0.80, 1.15, True, "inconclusive"),
])
def test_a_figure_is_judged_against_its_limit_and_its_aa(
    value: float, aa: float, limit: float, ratio: bool, expected: str
) -> None:
    assert _verdict(value, aa, limit, ratio) == expected
