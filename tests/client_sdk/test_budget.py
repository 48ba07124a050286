from __future__ import annotations

import math

import msgspec
import pytest

from firstbyte.client_sdk.budget import BudgetReport, LatencyBudget
from firstbyte.client_sdk.timings import Timings


def warm_fast() -> Timings:
    return Timings(
        warm=True,
        request_sent_ms=1.0,
        first_byte_ms=40.0,
        first_token_ms=150.0,
        inter_token_ms=[18.0, 19.0, 20.0, 21.0, 17.0, 50.0],
        render_ms=155.0,
        last_token_ms=300.0,
        output_chunks=7,
    )


def test_default_is_the_conversational_split() -> None:
    budget = LatencyBudget()
    assert budget.total_ms == 500
    assert budget.safety_ms == pytest.approx(75.0)
    allowances = {line.name: line.allowance_ms for line in budget.lines()}
    assert allowances == pytest.approx(
        {"network": 30, "first_byte": 75, "first_token": 170, "next_tokens": 100, "render": 50}
    )
    assert budget.per_token_ms == pytest.approx(20.0)
    categories = budget.categories()
    assert categories == pytest.approx({"prefill": 100, "decode": 200, "io": 125, "safety": 75})
    # B_total = B_prefill + B_decode + B_io + B_safety
    assert math.fsum(categories.values()) == pytest.approx(budget.total_ms)
    assert math.fsum(a for a in allowances.values()) + budget.safety_ms == pytest.approx(500)


def test_scaling_keeps_shares() -> None:
    budget = LatencyBudget(total_ms=1000)
    assert budget.safety_ms == pytest.approx(150.0)
    assert math.fsum(budget.categories().values()) == pytest.approx(1000)
    assert budget.lines()[0].allowance_ms == pytest.approx(60.0)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"total_ms": 0},
        {"total_ms": -5},
        {"total_ms": float("nan")},
        {"safety_share": 0.30},
        {"render_share": -0.1, "network_share": 0.26},
        {"next_tokens": 0},
    ],
)
def test_invalid_budgets_are_rejected(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):  # noqa: PT011 - each case has its own message
        LatencyBudget(**kwargs)  # type: ignore[arg-type]


def test_fast_warm_request_is_within_budget() -> None:
    report = LatencyBudget().check(warm_fast())
    assert report.overruns == []
    assert report.within_budget
    measured = {line.name: line.measured_ms for line in report.lines}
    assert measured == pytest.approx(
        {"network": 1, "first_byte": 39, "first_token": 110, "next_tokens": 95, "render": 5}
    )
    assert report.safety_used_ms == 0


def test_cold_transpacific_connection_overruns_network_and_first_byte() -> None:
    # 150 ms RTT, TCP + TLS 1.3: 300 ms of handshakes before the request is even sent.
    timings = msgspec.structs.replace(
        warm_fast(),
        warm=False,
        dns_ms=10.0,
        tcp_connect_ms=150.0,
        tls_handshake_ms=150.0,
        request_sent_ms=311.0,
        first_byte_ms=470.0,
        first_token_ms=580.0,
        render_ms=585.0,
    )
    report = LatencyBudget().check(timings)
    assert report.overruns == ["network", "first_byte"]
    assert not report.within_budget
    assert report.safety_used_ms > report.safety_ms


def test_overrun_absorbed_by_safety_share_is_reported_but_within_budget() -> None:
    timings = msgspec.structs.replace(warm_fast(), first_token_ms=260.0, render_ms=265.0)
    report = LatencyBudget().check(timings)
    assert report.overruns == ["first_token"]
    assert report.within_budget
    assert report.safety_used_ms == 0  # the other lines were under their allowance


def test_missing_phases_are_not_seen_not_overruns() -> None:
    report = LatencyBudget().check(Timings(request_sent_ms=5.0, first_byte_ms=30.0))
    by_name = {line.name: line for line in report.lines}
    assert by_name["first_token"].measured_ms is None
    assert by_name["next_tokens"].measured_ms is None
    assert by_name["render"].measured_ms is None
    assert report.overruns == []
    assert "not seen" in report.render()


def test_short_answer_shrinks_next_tokens_allowance() -> None:
    timings = msgspec.structs.replace(warm_fast(), inter_token_ms=[30.0, 30.0])
    report = LatencyBudget().check(timings)
    line = next(line for line in report.lines if line.name == "next_tokens")
    assert line.allowance_ms == pytest.approx(40.0)
    assert line.measured_ms == pytest.approx(60.0)
    assert report.overruns == ["next_tokens"]


def test_network_falls_back_to_connect_phases_without_send_event() -> None:
    timings = Timings(dns_ms=2.0, tcp_connect_ms=3.0, pool_wait_ms=1.0, first_byte_ms=20.0)
    report = LatencyBudget().check(timings)
    assert report.lines[0].measured_ms == pytest.approx(6.0)
    assert report.lines[1].measured_ms == pytest.approx(14.0)


def test_render_table_names_each_phase_and_the_safety_share() -> None:
    timings = msgspec.structs.replace(warm_fast(), request_sent_ms=45.0)
    text = LatencyBudget().check(timings).render()
    lines = text.splitlines()
    assert lines[0].split()[:4] == ["phase", "what", "it", "is"]
    for name in ("network", "first_byte", "first_token", "next_tokens", "render"):
        assert any(row.startswith(name) for row in lines)
    network_row = next(row for row in lines if row.startswith("network"))
    assert "OVER" in network_row
    assert "30.0" in network_row
    assert "45.0" in network_row
    assert any(row.startswith("safety") and "75.0" in row and "15%" in row for row in lines)
    total = next(row for row in lines if row.startswith("total"))
    assert "500.0" in total
    # each phase is named by what it is, with its share of the budget
    assert "connect + send" in network_row
    assert " 6% " in network_row
    # over its allowance, yet the request fits: the table says so in words
    assert lines[-1].startswith("connect + send (network) took 45.0 ms, 150% of its 30 ms")
    assert "but the request as a whole fits the 500 ms budget" in lines[-1]


def test_a_render_of_microseconds_shows_as_such_not_as_zero() -> None:
    timings = msgspec.structs.replace(warm_fast(), render_ms=150.013)
    rows = LatencyBudget().check(timings).render().splitlines()
    render_row = next(row for row in rows if row.startswith("render"))
    assert render_row.split()[-2] == "0.01"  # measured ms, then the share used


def test_report_round_trips_as_json() -> None:
    report = LatencyBudget().check(warm_fast())
    data = msgspec.json.encode(report)
    assert msgspec.json.decode(data, type=BudgetReport) == report
    budget = msgspec.json.decode(msgspec.json.encode(LatencyBudget()), type=LatencyBudget)
    assert budget == LatencyBudget()
