"""``firstbyte bench browser``: the cell syntax, and (netns) the CI-quick run through the WAN
emulator: Chromium in a client namespace against the router, the same cells as the Python
SDK, with the round trips the report explains (the SDK's theory: a browser's start is a CORS
simple request, so a cold page pays no preflight), and what prewarm on intent saves."""

from __future__ import annotations

import msgspec
import pytest

from firstbyte.benchmarks.scenarios._browser_runner import parse_cell
from firstbyte.benchmarks.scenarios.browser import cells, first_message, sdk_cell
from tests.benchmarks.conftest import QuickRuns


def test_every_browser_cell_has_an_sdk_cell() -> None:
    for quick in (True, False):
        for cell in cells(quick):
            parse_cell(cell)
            mode = cell.split("/")[2]
            assert sdk_cell(cell).split("/")[1:] == [cell.split("/")[1],
                                                     "warm" if mode == "intent" else mode]
    assert sdk_cell("eventsource/2/cold") == "sse/2/cold"
    assert sdk_cell("sse-fetch/2/intent") == "sse/2/warm"  # the SDK's prewarm
    for bad in ("sse/2/cold", "websocket/1.1/0rtt", "longpoll/4/cold", "sse-fetch/2"):
        with pytest.raises(ValueError, match="expected TRANSPORT/HTTP/MODE"):
            parse_cell(bad)


@pytest.mark.netns
def test_quick_run_compares_browser_and_sdk_round_trips(quick_runs: QuickRuns) -> None:
    code, stdout, stderr, _ = quick_runs.result("browser")
    assert code == 0, stderr[-3000:]
    results = msgspec.json.decode(stdout)
    assert results["summary"]["mode"] == "emulated"
    rows = {(r["geography"], r["cell"]): r for r in results["browser_vs_sdk"]}
    assert {cell for _, cell in rows} == set(cells(quick=True))
    for row in rows.values():
        assert row["browser_ttft_ms"] is not None, row
        assert row["sdk_ttft_ms"] is not None, row
        assert row["paint_after_token_ms"] >= 0, row  # painted after the token arrived
    far = {cell: r for (place, cell), r in rows.items() if place == "transpacific"}
    # A browser's start is a CORS simple request: no preflight, cold, prewarmed or warm.
    for cell in ("sse-fetch/2/cold", "sse-fetch/2/intent", "sse-fetch/2/warm"):
        assert far[cell]["preflights"] == 0, far[cell]
    assert far["websocket/1.1/cold"]["preflights"] == 0  # WebSocket has no CORS preflight
    # Round trips to the first byte over HTTP/2: the SDK's theory plus the preflights. Raw
    # counts (only Server-Timing subtracted) include the local cost, so they bound from above
    # loosely; from below physics bounds them: a cold page cannot skip the preflight's trip.
    for cell, slack in (("sse-fetch/2/cold", 1.0), ("sse-fetch/2/intent", 0.5),
                        ("sse-fetch/2/warm", 0.5)):
        row = far[cell]
        expected = row["theory_first_byte_rtts"] + row["preflights"]
        assert expected - 0.1 <= row["browser_first_byte_rtts_raw"] <= expected + slack, row
        theory = row["theory_first_byte_rtts"]
        assert theory - 0.1 <= row["sdk_first_byte_rtts_raw"] <= theory + slack, row
    # A warm page's WebSocket stream goes on the open socket: one round trip, as the SDK's
    # (0.5 RTT below the cold handshakes' four is far apart; the local cost is not).
    ws = far["websocket/1.1/warm"]
    assert ws["browser_ttft_ms"] < ws["sdk_ttft_ms"] + 0.5 * ws["rtt_ms"], ws
    assert far["sse-fetch/3/cold"]["browser_http"] == "HTTP/3"
    assert results["summary"]["chromium_http3"] == "negotiated"

    # The report's first line answers what the first message costs and what prewarm saves.
    headline = first_message(results["browser_vs_sdk"])
    assert results["description"].startswith(headline["answer"])
    assert headline["geography"] == "transpacific"
    # An intent-prewarmed page's first message goes on the open connection: at least a
    # round trip (the handshakes' two, physically) faster than the cold page's, and its
    # round trips to the first byte are a warm request's one.
    assert headline["prewarm_saves_ms"] >= far["sse-fetch/2/cold"]["rtt_ms"], headline
    intent = far["sse-fetch/2/intent"]
    assert intent["theory_first_byte_rtts"] == 1
