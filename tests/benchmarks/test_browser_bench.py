"""``firstbyte bench browser``: the cell syntax, and (netns) the CI-quick run through the WAN
emulator: Chromium in a client namespace against the router, the same cells as the Python
SDK, with the round trips the report explains (the SDK's theory: a browser's start is a CORS
simple request, so a cold page pays no preflight), and what prewarm on intent saves; and a
long conversation's next message on the h100-7b sim, compressed and not."""

from __future__ import annotations

import msgspec
import pytest

from firstbyte.benchmarks.scenarios._browser_runner import HISTORY_TOKENS, parse_cell
from firstbyte.benchmarks.scenarios.browser import (
    HISTORY_CELLS,
    cells,
    first_message,
    next_message,
    sdk_cell,
)
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
    for bad in ("sse/2/cold", "websocket/1.1/0rtt", "longpoll/4/cold", "sse-fetch/2",
                "websocket/1.1/history-7b"):
        with pytest.raises(ValueError, match="expected TRANSPORT/HTTP/MODE"):
            parse_cell(bad)
    for cell in HISTORY_CELLS:
        assert parse_cell(cell)[:2] == ("sse-fetch", "2")


def test_the_next_message_sentence_says_the_ratios() -> None:
    rows = [{"geography": "transpacific", "rtt_ms": 151.0, "cell": cell, "browser_ttft_ms": ttft,
             "body_bytes": size}
            for cell, ttft, size in zip(HISTORY_CELLS, (160.0, 176.0, 320.0),
                                        (160, 8000, 26000), strict=True)]
    got = next_message(rows)
    assert got["history_over_short_pct"] == 10.0
    assert got["uncompressed_over_short_pct"] == 100.0
    assert got["answer"].startswith("An 8K-token conversation's next message at transpacific "
                                    "(151 ms RTT)")
    assert "176 ms, +10% over a short prompt on a warm page (160 ms); uncompressed 320 ms, " \
        "+100%." in got["answer"]


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

    # A long conversation's next message: every cell measured at 151 ms, the history as long
    # as it says, warmed (its prefix cached), compressed under the initial window (~14.5 KB)
    # by default and not with compressRequests: false. Not their timing: the full run's.
    history = {row["cell"]: row for row in results["long_history"]}
    assert set(history) == set(HISTORY_CELLS)
    for row in history.values():
        assert row["geography"] == "transpacific", row
        assert row["failed"] == 0, row
        assert row["requests"] >= 1, row
        assert row["browser_ttft_ms"] is not None, row
        assert row["warm"] is True, row
        assert row["preflights"] == 0, row
    for cell in ("sse-fetch/2/history-7b", "sse-fetch/2/history-7b-uncompressed"):
        assert HISTORY_TOKENS <= history[cell]["prompt_tokens"] <= HISTORY_TOKENS + 100
        assert history[cell]["cached_tokens"] >= HISTORY_TOKENS - 32  # whole 16-token blocks
    gzipped = history["sse-fetch/2/history-7b"]["body_bytes"]
    plain = history["sse-fetch/2/history-7b-uncompressed"]["body_bytes"]
    assert plain > 20_000, plain
    assert gzipped < min(12_000, plain / 2.5), (gzipped, plain)
    # What compression is for, in round trips (a physical bound, not a timing): the emulated
    # client runs CUBIC and the connection idled while the user typed, so the uncompressed
    # body's second flight waits a round trip (the router's `queue`, its head to its whole
    # body), and the gzipped one, inside the initial window, arrives with its head.
    rtt = history["sse-fetch/2/history-7b"]["rtt_ms"]
    plain_queue = history["sse-fetch/2/history-7b-uncompressed"]["server_timing_ms"]["queue"]
    gzipped_queue = history["sse-fetch/2/history-7b"]["server_timing_ms"]["queue"]
    assert plain_queue >= 0.9 * rtt, (plain_queue, rtt)
    assert gzipped_queue < 0.5 * rtt, (gzipped_queue, rtt)
    said = next_message(results["long_history"])
    assert said["history_ttft_ms"] is not None
    assert said["short_ttft_ms"] is not None
    assert said["answer"] in results["description"]
