"""Summary statistics of a benchmark run, with ``vllm bench serve``'s result field names.

:func:`summarize` turns per-request :class:`~firstbyte.client_sdk.timings.Timings` into one flat
dict: ``completed``, ``failed``, ``duration``, ``request_throughput``, ``output_throughput``,
``mean_/median_/std_/p50_/p90_/p95_/p99_`` + ``ttft_ms``, ``tpot_ms``, ``itl_ms``,
``e2el_ms``, the same for our network phases (``p50_first_byte_ms``, ``p99_connect_ms``, ...),
``goodput`` against an :class:`SLO`, the mean of each latency budget line, and the raw
TTFTs (``ttfts_ms``) that the CDF plot needs. Definitions are in :data:`METRIC_DEFINITIONS`,
which every report repeats.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import msgspec

from firstbyte.client_sdk.budget import LatencyBudget
from firstbyte.client_sdk.timings import Timings

__all__ = [
    "METRIC_DEFINITIONS",
    "PERCENTILES",
    "PHASES",
    "SLO",
    "describe",
    "percentile",
    "summarize",
]

PERCENTILES: tuple[int, ...] = (50, 90, 95, 99)

METRIC_DEFINITIONS: dict[str, str] = {
    "TTFT": "time to first token: request start to the first content chunk",
    "ITL": "inter-token latency: the gap between successive content chunks",
    "TPOT": "time per output token: (E2EL - TTFT) / (output tokens - 1)",
    "E2EL": "end-to-end latency: request start to the last content chunk",
    "first_byte": "request start to the first byte of the response",
    "connect": "DNS + TCP connect + TLS handshake, or DNS + QUIC handshake (0 on a warm "
    "connection)",
    "request_sent": "request start to the request fully written",
    "render": "request start to the first token handed to and rendered by the application",
    "goodput": "completed requests per second that met every SLO of the run",
    "percentiles": "linear interpolation between closest ranks (numpy's default); "
    "std is the population standard deviation",
    "request start": "the moment the application asked for the completion, before any "
    "connection work",
}

# Network phases reported besides the vLLM metrics: name -> how to read it from Timings.
PHASES: dict[str, Callable[[Timings], float | None]] = {
    "dns": lambda t: t.dns_ms,
    "tcp_connect": lambda t: t.tcp_connect_ms,
    "tls_handshake": lambda t: t.tls_handshake_ms,
    "quic_handshake": lambda t: t.quic_handshake_ms,
    "connect": lambda t: t.connect_ms,
    "pool_wait": lambda t: t.pool_wait_ms,
    "request_sent": lambda t: t.request_sent_ms,
    "first_byte": lambda t: t.first_byte_ms,
    "render": lambda t: t.render_ms,
}


class SLO(msgspec.Struct, frozen=True, omit_defaults=True):
    """Service level objectives; a request counts toward goodput when it meets all that are set."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    def met_by(self, timings: Timings) -> bool:
        checks = (
            (self.ttft_ms, timings.ttft_ms),
            (self.tpot_ms, timings.tpot_ms),
            (self.e2el_ms, timings.e2el_ms),
        )
        for limit, value in checks:
            if limit is None:
                continue
            if value is None or value > limit:
                return False
        return True


def percentile(values: Sequence[float], p: float) -> float:
    """The ``p``-th percentile (0-100) with linear interpolation; NaN for no values."""
    if not values:
        return math.nan
    if not 0 <= p <= 100:
        raise ValueError(f"percentile must be within 0..100, not {p}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def describe(values: Sequence[float], name: str, *, full: bool = True) -> dict[str, float]:
    """``mean_NAME_ms``, ``pXX_NAME_ms`` (and, if ``full``, ``median_`` and ``std_``).

    With no values every field is 0.0, as ``vllm bench serve`` reports an empty series.
    """
    out: dict[str, float] = {}
    n = len(values)
    mean = math.fsum(values) / n if n else 0.0
    out[f"mean_{name}_ms"] = mean
    if full:
        out[f"median_{name}_ms"] = percentile(values, 50) if n else 0.0
        variance = math.fsum((v - mean) ** 2 for v in values) / n if n else 0.0
        out[f"std_{name}_ms"] = math.sqrt(variance)
    for p in PERCENTILES:
        out[f"p{p}_{name}_ms"] = percentile(values, p) if n else 0.0
    return out


def _present(values: Iterable[float | None]) -> list[float]:
    return [v for v in values if v is not None]


def summarize(
    timings: Sequence[Timings],
    *,
    duration_s: float,
    failed: int = 0,
    slo: SLO | None = None,
    input_tokens: int = 0,
    budget: LatencyBudget | None = None,
) -> dict[str, Any]:
    """Summarise completed requests (``timings``) of a run that took ``duration_s`` seconds.

    ``failed`` counts requests that did not complete; they are in neither the latencies nor
    the goodput. Output tokens are the content chunks received (one token per chunk).
    """
    budget = budget or LatencyBudget()
    completed = len(timings)
    output_tokens = sum(t.output_chunks for t in timings)
    duration = max(duration_s, 1e-9)
    ttfts = _present(t.ttft_ms for t in timings)
    result: dict[str, Any] = {
        "completed": completed,
        "failed": failed,
        "duration": duration_s,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": completed / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
    }
    result |= describe(ttfts, "ttft")
    result |= describe(_present(t.tpot_ms for t in timings), "tpot")
    result |= describe([gap for t in timings for gap in t.inter_token_ms], "itl")
    result |= describe(_present(t.e2el_ms for t in timings), "e2el")
    for name, read in PHASES.items():
        values = _present(read(t) for t in timings)
        if values:
            result |= describe(values, name, full=False)
    slo = slo or SLO()
    good = sum(1 for t in timings if slo.met_by(t))
    result["slo"] = msgspec.to_builtins(slo)
    result["goodput"] = good / duration
    result["goodput_fraction"] = good / (completed + failed) if completed + failed else 0.0
    result["budget_total_ms"] = budget.total_ms
    result["budget_safety_ms"] = budget.safety_ms
    result["budget_lines_ms"] = _mean_budget_lines(timings, budget)
    result["ttfts_ms"] = ttfts
    return result


def _mean_budget_lines(timings: Sequence[Timings], budget: LatencyBudget) -> dict[str, float]:
    """The mean of each budget line over the requests where that phase was seen."""
    sums: dict[str, list[float]] = {line.name: [] for line in budget.lines()}
    for t in timings:
        for line in budget.check(t).lines:
            if line.measured_ms is not None:
                sums[line.name].append(line.measured_ms)
    return {name: math.fsum(v) / len(v) for name, v in sums.items() if v}
