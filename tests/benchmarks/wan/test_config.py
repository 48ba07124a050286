"""Emulator configuration without namespaces: what each link gets, and clear errors early
(before any root-only step)."""

from __future__ import annotations

import pytest

from firstbyte.benchmarks.wan import Emulator, Host, LinkParams, PairPrecision, PrecisionReport
from firstbyte.benchmarks.wan.delayline import NS_PER_MS
from firstbyte.benchmarks.wan.forwarder import ForwarderConfig

A, B, C = Host("a", "192.0.2.1"), Host("b", "198.51.100.1"), Host("c", "203.0.113.1")


def test_rtt_is_split_evenly_and_applies_both_ways() -> None:
    wan = Emulator(
        [A, B, C],
        {("b", "a"): 150.0},
        default_rtt_ms=4.0,
        jitter_ms=2.0,
        loss_pct=1.5,
        rate_mbit=20.0,
    )
    ab, ba = wan.link_params[("a", "b")], wan.link_params[("b", "a")]
    assert ab.delay_ns == ba.delay_ns == 75 * NS_PER_MS
    assert ab.jitter_ns == 2 * NS_PER_MS
    assert ab.loss_pct == 1.5
    assert ab.rate_bps == 20e6
    assert wan.configured_rtt_ms("a", "b") == 150.0
    assert wan.configured_rtt_ms("a", "c") == 4.0
    assert len(wan.link_params) == 6


def test_links_override_single_directions() -> None:
    slow_up = LinkParams(delay_ns=40 * NS_PER_MS, rate_bps=1e6)
    wan = Emulator([A, B], {("a", "b"): 20.0}, links={("a", "b"): slow_up})
    assert wan.link_params[("a", "b")] is slow_up
    assert wan.link_params[("b", "a")].delay_ns == 10 * NS_PER_MS
    assert wan.configured_rtt_ms("a", "b") == 50.0


@pytest.mark.parametrize(
    ("hosts", "kwargs", "message"),
    [
        ([A, Host("b", "10.0.0.1")], {}, "outside the emulated prefixes"),
        ([A, Host("b", "198.51.100.300")], {}, "not an IPv4 address"),
        ([A, Host("B_host", "198.51.100.2")], {}, "host name 'B_host'"),
        ([A, Host("a", "198.51.100.2")], {}, "duplicate host names"),
        ([A, Host("b", "192.0.2.1")], {}, "duplicate host addresses"),
        ([A], {}, "at least two hosts"),
        ([A, B], {"rtt_ms": {("a", "z"): 10.0}}, "not among"),
        ([A, B], {"rtt_ms": {("a", "b"): -1.0}}, "must be >= 0"),
        ([A, B], {"links": {("a", "a"): LinkParams(0)}}, "not a pair of distinct hosts"),
        ([A, B], {"loss_pct": 150.0}, "loss_pct"),
    ],
)
def test_bad_configuration_fails_before_anything_starts(
    hosts: list[Host], kwargs: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        Emulator(hosts, **kwargs)  # type: ignore[arg-type]


def test_forwarder_config_round_trips_through_json() -> None:
    config = ForwarderConfig(
        tuns=["t0", "t1"],
        ips=["192.0.2.1", "198.51.100.1"],
        links={(0, 1): LinkParams(5, 1, 0.5, 1e6, 7), (1, 0): LinkParams(9)},
        seed=42,
    )
    assert ForwarderConfig.from_json(config.to_json()) == config


def test_precision_report_renders_and_serialises() -> None:
    report = PrecisionReport(
        [
            PairPrecision("a", "b", "udp", 150.0, 20, 0, 150.3, 150.5, 0.3, 150.1, 0.1),
            PairPrecision("a", "b", "tcp-connect", 150.0, 20, 0, 149.2, 150.1, -0.8, 148.6, -1.4),
        ],
        {"lateness_us": {"samples": 80, "p50": 6.0, "p90": 20.0, "p99": 90.0, "max": 120.0}},
    )
    assert report.max_abs_error_ms == 0.8
    data = report.to_dict()
    assert data["max_abs_error_ms"] == 0.8
    assert report.max_abs_floor_error_ms == data["max_abs_floor_error_ms"] == pytest.approx(1.4)
    assert data["pairs"][1]["method"] == "tcp-connect"
    text = report.render()
    assert "a -> b" in text
    assert "+0.30ms" in text
    assert "148.60ms" in text  # the fastest round trip, beside the median
    assert "-0.80ms" in text
    assert "p99 90 us" in text
