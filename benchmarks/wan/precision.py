"""The WAN emulator's precision: configured vs measured round-trip time through it.

Two emulated hosts, a configured RTT, and three probes that cross the forwarder: a UDP echo,
a TCP connect (SYN to SYN-ACK: 1 RTT) and a request/response on an open TCP connection
(1 RTT), each timed by the kernel (:mod:`firstbyte.benchmarks.wan.echo`). The error is the
median measured minus the configured RTT; it includes the echo tools' own cost. The
floor error (fastest minus configured) is the emulator's own: a busy host delays packets,
never speeds them up, so the floor stays put on hours when the median drifts.
``run(quick)`` is the ``firstbyte bench wan`` scenario: quick (CI) measures 150 ms only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from firstbyte.benchmarks.wan.emulator import Emulator, Host, PrecisionReport

# The acceptance bound: median error at 150 ms RTT.
MAX_MEDIAN_ERROR_MS = 1.0
RTT_PROBES = ("udp", "tcp-connect", "tcp-request")


def measure(
    rtt_ms: float,
    count: int = 20,
    methods: Sequence[Literal["udp", "tcp"]] = ("udp", "tcp"),
    *,
    jitter_ms: float = 0.0,
    loss_pct: float = 0.0,
) -> PrecisionReport:
    """Start a two-host emulator at ``rtt_ms``, probe it ``count`` times per method, stop it."""
    hosts = [Host("precision-client", "192.0.2.200"), Host("precision-server", "198.51.100.200")]
    with Emulator(
        hosts,
        {("precision-client", "precision-server"): rtt_ms},
        jitter_ms=jitter_ms,
        loss_pct=loss_pct,
    ) as wan:
        return wan.precision(
            [("precision-client", "precision-server")], count=count, methods=methods
        )


def run(quick: bool) -> dict[str, Any]:
    """Results in the shape :mod:`firstbyte.benchmarks.report` writes (``runs`` = one row per
    probe)."""
    rtts = [150.0] if quick else [10.0, 50.0, 150.0, 300.0]
    count = 10 if quick else 100
    runs: list[dict[str, Any]] = []
    summary: dict[str, Any] = {}
    forwarder: dict[str, Any] = {}
    for rtt in rtts:
        report = measure(rtt, count)
        forwarder[f"rtt_{rtt:g}ms"] = report.forwarder
        for p in report.pairs:
            runs.append(
                {
                    "label": f"{p.method} @ {p.configured_rtt_ms:g} ms",
                    "method": p.method,
                    "configured_rtt_ms": p.configured_rtt_ms,
                    "median_rtt_ms": round(p.median_ms, 3),
                    "p90_rtt_ms": round(p.p90_ms, 3),
                    "median_error_ms": round(p.error_ms, 3),
                    "min_rtt_ms": round(p.min_ms, 3),
                    "floor_error_ms": round(p.floor_error_ms, 3),
                    "samples": p.samples,
                    "lost": p.lost,
                }
            )
            summary[f"median_error_ms_{p.method}_{rtt:g}"] = round(p.error_ms, 3)
    at150 = [r for r in runs if r["configured_rtt_ms"] == 150.0 and r["method"] in RTT_PROBES]
    summary["max_abs_median_error_ms_at_150"] = max(abs(r["median_error_ms"]) for r in at150)
    summary["within_bound"] = summary["max_abs_median_error_ms_at_150"] <= MAX_MEDIAN_ERROR_MS
    summary["max_abs_floor_error_ms_at_150"] = max(abs(r["floor_error_ms"]) for r in at150)
    return {
        "scenario": "wan",
        "description": (
            "Precision of the packet-level WAN emulator: two hosts in network namespaces, "
            "a configured RTT, measured by UDP echo, TCP connect (1 RTT) and a TCP "
            f"request/response (1 RTT), {count} samples each."
        ),
        "summary": summary,
        "runs": runs,
        "forwarder": forwarder,
        "notes": [
            f"bound: median error <= {MAX_MEDIAN_ERROR_MS} ms at 150 ms RTT (every probe)",
            "arrivals are kernel receive timestamps; the echo server's hold is subtracted",
            "probes run SCHED_FIFO (below the forwarder) to measure the emulator, not the host",
            "error = median measured - configured; includes the probes' own Python overhead",
            "floor error = fastest measured - configured: the emulator's own, host noise aside",
            "forwarder lateness = time a packet was written minus its scheduled release",
        ],
    }
