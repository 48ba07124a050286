"""Read an inference server's Prometheus ``/metrics`` into the few numbers routing needs.

Sans-IO: :func:`parse_backend_metrics` takes the exposition text. vLLM names first
(``vllm:num_requests_running``, ``vllm:num_requests_waiting``, ``vllm:gpu_cache_usage_perc``,
``vllm:prefix_cache_queries_total``, ``vllm:prefix_cache_hits_total``), SGLang's as a fallback
(``sglang:num_running_reqs``, ``sglang:num_queue_reqs``, ``sglang:token_usage``). Values with
several label sets (one per model) are summed; the cache usage takes the maximum.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["BackendMetrics", "parse_backend_metrics", "parse_prometheus_text"]


@dataclass(frozen=True, slots=True)
class BackendMetrics:
    running: float | None = None
    waiting: float | None = None
    cache_usage: float | None = None
    """KV cache usage, 0..1."""
    prefix_queries: float | None = None
    """Prefix-cache queries (tokens) since the server started: a counter."""
    prefix_hits: float | None = None

    def counters(self) -> tuple[float, ...]:
        """The monotonic counters present; one going backwards means the server restarted."""
        return tuple(v for v in (self.prefix_queries, self.prefix_hits) if v is not None)


def parse_prometheus_text(text: str) -> dict[str, float]:
    """Sum of each metric's samples by name (labels dropped); malformed lines are skipped."""
    out: dict[str, float] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if "{" in line:
            name, _, rest = line.partition("{")
            _, _, rest = rest.rpartition("}")
        else:
            name, _, rest = line.partition(" ")
        fields = rest.split()
        if not fields:
            continue
        try:
            value = float(fields[0])
        except ValueError:
            continue
        if math.isnan(value):
            continue
        name = name.strip()
        out[name] = (
            max(out[name], value)
            if name.endswith("_perc") and name in out
            else (out.get(name, 0.0) + value)
        )
    return out


_NAMES: dict[str, tuple[str, ...]] = {
    "running": ("vllm:num_requests_running", "sglang:num_running_reqs"),
    "waiting": ("vllm:num_requests_waiting", "sglang:num_queue_reqs"),
    "cache_usage": (
        "vllm:gpu_cache_usage_perc",
        "vllm:kv_cache_usage_perc",
        "sglang:token_usage",
    ),
    "prefix_queries": ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"),
    "prefix_hits": ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"),
}


def parse_backend_metrics(text: str) -> BackendMetrics:
    """The routing-relevant numbers of one ``/metrics`` scrape (``None`` where absent)."""
    samples = parse_prometheus_text(text)
    found: dict[str, float | None] = {}
    for field, names in _NAMES.items():
        found[field] = next((samples[n] for n in names if n in samples), None)
    return BackendMetrics(**found)
