"""Results shaped like the demo's and router_overhead's, from synthetic timings (no network)."""

from __future__ import annotations

from typing import Any

from firstbyte.benchmarks.compare import compare
from firstbyte.benchmarks.demo import CELLS, PROTOCOL
from firstbyte.benchmarks.stats import summarize
from tests.benchmarks.test_report import make_timings

CLIENTS = {"client-tokyo": 9.0, "client-sydney": 116.5}
ROUND_TRIPS = {"cold": 3, "0rtt": 1, "warm": 1}


def demo_like(n: int) -> dict[str, Any]:
    """Two clients x every demo cell, ``n`` requests each; cold pays more round trips."""
    runs = []
    for client, rtt in CLIENTS.items():
        for i, cell in enumerate(CELLS):
            transport, http, state = cell.split("/")
            timings = make_timings(rtt * ROUND_TRIPS[state] / 3, n, seed=i)
            runs.append({
                "transport": transport, "protocol": PROTOCOL[http], "cell": cell,
                "geography": f"{client.removeprefix('client-')} {state}", "client": client,
                "rtt_ms": rtt, **summarize(timings, duration_s=1.0), "errors": [],
            })
    return {"scenario": "demo", "quick": n < 20, "summary": {"mode": "emulated"},
            "runs": runs, "notes": ["synthetic"], "description": "demo-shaped test data"}


def overhead_like() -> dict[str, Any]:
    runs = []
    for c, direct, router, aa in ((1, 20.0, 20.4, None), (100, 30.0, 31.0, 30.3)):
        targets = {"direct": direct, "router/hypercorn": router, "direct-aa": aa}
        for name, p50 in targets.items():
            if p50 is None:
                continue
            runs.append({"label": f"{name} c={c}", "transport": "sse", "concurrency": c,
                         "completed": 100, "p50_ttft_ms": p50, "p99_ttft_ms": p50 * 1.5})
    return {"scenario": "router_overhead", "quick": False, "runs": runs,
            "summary": {"c100_direct_aa_added_p99_ttft_ms": 0.45}}


def comparison_pair() -> tuple[dict[str, Any], dict[str, Any]]:
    base = overhead_like()
    new = overhead_like()
    new["runs"][-2]["p99_ttft_ms"] *= 1.5  # router/hypercorn c=100 got worse
    return base, new


__all__ = ["compare", "comparison_pair", "demo_like", "overhead_like"]
