"""Round trips in theory vs measured, and the transport targets: pure functions over Timings.

Theory, in round trips (RTT) from request start to the first byte of the response:

==========================  ===  =====================================================
cold HTTP/1.1 or HTTP/2      3   TCP handshake, TLS 1.3 handshake, the request
cold HTTP/3                  2   QUIC handshake (transport + TLS together), the request
HTTP/3 0-RTT (resumed)       1   the request rides in the first flight as early data
cold WebSocket               4   TCP, TLS, the HTTP upgrade, the request message
prewarmed / kept warm        1   the request on the open connection
==========================  ===  =====================================================

The first token comes on that same first response on every transport: SSE and WebSocket
stream it, and long-poll's ``POST /v1/streams?wait=S`` answers with the first batch of events
(so cold long-poll is TCP + TLS + 1 = 3 on HTTP/1.1 and HTTP/2, warm 1). A measured count
is ``(first_byte - server time) / RTT`` where server time is the
``Server-Timing`` total; the *corrected* count also subtracts the same cell's median local
cost measured at 0 ms RTT in the same run (client and server CPU: TLS and QUIC crypto, Python),
so CPU is reported apart from round trips. The *slope* is the count between two long RTTs
(the change in first byte over the change in RTT), which no fixed local cost enters: on a
virtual machine a process woken after a long idle runs slower than one kept busy at 0 ms (the
client's CPU for a cold HTTP/3 request read 38 ms at 151 ms RTT and 12 ms at 0 ms), so the
local cost measured at 0 ms understates it at a long RTT, and both long RTTs pay it alike.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from firstbyte.benchmarks.stats import percentile
from firstbyte.client_sdk.timings import Timings

__all__ = [
    "PREWARMED_FACTOR",
    "TOLERANCE",
    "ZERO_RTT_FACTOR",
    "prewarmed_target",
    "round_trips",
    "server_ms",
    "theory_first_byte",
    "theory_ttft",
    "zero_rtt_target",
]

TOLERANCE = 0.10
"""Measured round trips must be within 10% of theory."""
PREWARMED_FACTOR = 1.05
"""Prewarmed TTFT at RTT R must be <= 1.05 x (R + server TTFT)."""
ZERO_RTT_FACTOR = 0.55
"""HTTP/3 0-RTT cold TTFT must be <= 0.55 x cold HTTP/2 TTFT."""


def theory_first_byte(transport: str, http: str, mode: str) -> int:
    """Round trips from request start to the first response byte (see the module table)."""
    if mode in ("warm", "0rtt"):
        return 1
    if transport == "websocket":
        return 4
    return 2 if http == "3" else 3


def theory_ttft(transport: str, http: str, mode: str) -> int:
    """Round trips from request start to the first token: the first response carries it on
    every transport (long-poll's POST waits for the first batch), so the same as first byte."""
    return theory_first_byte(transport, http, mode)


def server_ms(t: Timings) -> float:
    """The router's own account of its time (queue, route, upstream), 0 without the header."""
    return math.fsum(t.server_timing.values())


def _median(values: Sequence[float]) -> float | None:
    return percentile(values, 50) if values else None


def round_trips(
    samples: Sequence[Timings], baseline: Sequence[Timings], rtt_ms: float, theory_fb: int,
    theory_tt: int, other: tuple[Sequence[Timings], float] | None = None,
) -> dict[str, Any]:
    """Measured round trips of one cell at ``rtt_ms`` against theory.

    ``baseline`` is the same cell measured at 0 ms RTT (its local cost is subtracted for the
    corrected counts; empty: nothing subtracted). ``other`` is the same cell at another long
    RTT (its samples and RTT), for the slope counts. Medians over the samples.
    """
    fb = [(t.first_byte_ms, server_ms(t)) for t in samples if t.first_byte_ms is not None]
    tt = [(t.first_token_ms, server_ms(t)) for t in samples if t.first_token_ms is not None]
    cpu_fb = _median([t.first_byte_ms - server_ms(t) for t in baseline
                      if t.first_byte_ms is not None]) or 0.0
    cpu_tt = _median([t.first_token_ms - server_ms(t) for t in baseline
                      if t.first_token_ms is not None]) or 0.0
    out: dict[str, Any] = {
        "rtt_ms": rtt_ms,
        "theory_first_byte_rtts": theory_fb,
        "theory_ttft_rtts": theory_tt,
        "local_first_byte_ms": round(cpu_fb, 2),
        "local_ttft_ms": round(cpu_tt, 2),
    }
    if rtt_ms <= 0 or not fb or not tt:
        return out
    raw_fb = _median([(v - s) / rtt_ms for v, s in fb])
    raw_tt = _median([(v - s) / rtt_ms for v, s in tt])
    cor_fb = _median([(v - s - cpu_fb) / rtt_ms for v, s in fb])
    cor_tt = _median([(v - s - cpu_tt) / rtt_ms for v, s in tt])
    assert raw_fb is not None
    assert raw_tt is not None
    assert cor_fb is not None
    assert cor_tt is not None
    out |= {
        "first_byte_rtts_raw": round(raw_fb, 3),
        "first_byte_rtts": round(cor_fb, 3),
        "ttft_rtts_raw": round(raw_tt, 3),
        "ttft_rtts": round(cor_tt, 3),
    }
    slope_fb = slope_tt = None
    if other is not None and other[0] and other[1] > 0 and other[1] != rtt_ms:
        other_samples, other_rtt = other
        slope_fb = _slope(fb, other_samples, "first_byte_ms", rtt_ms, other_rtt)
        slope_tt = _slope(tt, other_samples, "first_token_ms", rtt_ms, other_rtt)
        if slope_fb is not None:
            out["first_byte_rtts_slope"] = round(slope_fb, 3)
        if slope_tt is not None:
            out["ttft_rtts_slope"] = round(slope_tt, 3)
    out["first_byte_within_10pct"] = _within(theory_fb, cor_fb, raw_fb, slope_fb)
    out["ttft_within_10pct"] = _within(theory_tt, cor_tt, raw_tt, slope_tt)
    return out


def _slope(
    here: Sequence[tuple[float, float]], other: Sequence[Timings], field: str, rtt_ms: float,
    other_rtt_ms: float,
) -> float | None:
    """Round trips as the change of the median (time - server time) between two RTTs over
    the change of RTT: any cost the same at both cancels."""
    there = [(v, server_ms(t)) for t in other if (v := getattr(t, field)) is not None]
    a = _median([v - s for v, s in here])
    b = _median([v - s for v, s in there])
    if a is None or b is None:
        return None
    return (a - b) / (rtt_ms - other_rtt_ms)


def _within(theory: int, *counts: float | None) -> bool:
    """Whether the measured counts match ``theory`` within :data:`TOLERANCE`. The true count
    lies within the band they span: the raw one has all local cost still in; the corrected
    one less the cost measured at 0 ms, which a burst of load during those few samples
    overstates, and which a process woken after a long idle exceeds; the slope (when
    measured) has no fixed cost in it. It matches when that band, widened by the tolerance,
    holds ``theory``. An extra or a missing round trip moves every count past it."""
    known = [c for c in counts if c is not None]
    low, high = min(known), max(known)
    return low - TOLERANCE * theory <= theory <= high + TOLERANCE * theory


def prewarmed_target(
    samples: Sequence[Timings], baseline: Sequence[Timings], rtt_ms: float
) -> dict[str, Any] | None:
    """Prewarmed TTFT (median) against ``1.05 x (RTT + server TTFT)``.

    Server TTFT is the ``Server-Timing`` total when the transport carries it (SSE, long-poll),
    else (WebSocket: no per-request headers) the same cell's median TTFT at 0 ms RTT.
    """
    ttft = _median([t.first_token_ms for t in samples if t.first_token_ms is not None])
    if ttft is None:
        return None
    server = _median([server_ms(t) for t in samples if t.server_timing])
    source = "Server-Timing"
    if server is None:
        server = _median([t.first_token_ms for t in baseline if t.first_token_ms is not None])
        source = "TTFT at 0 ms RTT"
    if server is None:
        return None
    limit = PREWARMED_FACTOR * (rtt_ms + server)
    return {
        "ttft_ms": round(ttft, 2),
        "server_ttft_ms": round(server, 2),
        "server_ttft_from": source,
        "limit_ms": round(limit, 2),
        "met": ttft <= limit,
    }


def zero_rtt_target(
    zero_rtt: Sequence[Timings], cold_h2: Sequence[Timings]
) -> dict[str, Any] | None:
    """Median 0-RTT TTFT over median cold HTTP/2 TTFT, against 0.55."""
    a = _median([t.first_token_ms for t in zero_rtt if t.first_token_ms is not None])
    b = _median([t.first_token_ms for t in cold_h2 if t.first_token_ms is not None])
    if a is None or b is None or b <= 0:
        return None
    accepted = sum(1 for t in zero_rtt if t.zero_rtt)
    return {
        "zero_rtt_ttft_ms": round(a, 2),
        "cold_h2_ttft_ms": round(b, 2),
        "ratio": round(a / b, 3),
        "limit_ratio": ZERO_RTT_FACTOR,
        "early_data_accepted": f"{accepted}/{len(zero_rtt)}",
        "met": a / b <= ZERO_RTT_FACTOR,
    }
