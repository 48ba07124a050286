"""The sim's Prometheus metrics, named as vLLM names them, rendered in the text format.

vLLM (v1 engine) exports, among others: gauges ``vllm:num_requests_running``,
``vllm:num_requests_waiting``, ``vllm:gpu_cache_usage_perc`` (renamed
``vllm:kv_cache_usage_perc`` in newer releases; both are exported here), counters
``vllm:prefix_cache_queries`` / ``vllm:prefix_cache_hits`` (in tokens, exposed with the
``_total`` suffix as prometheus_client does), ``vllm:prompt_tokens``,
``vllm:generation_tokens``, ``vllm:request_success`` (by ``finished_reason``), and histograms
``vllm:time_to_first_token_seconds``, ``vllm:inter_token_latency_seconds`` (older releases:
``vllm:time_per_output_token_seconds``, also exported) and ``vllm:e2e_request_latency_seconds``.
Every sample carries the ``model_name`` label, as in vLLM.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence

__all__ = ["ITL_BUCKETS", "TTFT_BUCKETS", "Histogram", "render_counter", "render_gauge"]

# vLLM's bucket boundaries (seconds) for these histograms.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
E2E_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


class Histogram:
    """A cumulative Prometheus histogram; ``observe`` is O(log buckets)."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.total = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value
        self.count += 1

    def render(self, name: str, help_text: str, labels: str) -> str:
        lines = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        running = 0
        for bound, count in zip(self.bounds, self.counts, strict=False):
            running += count
            lines.append(f'{name}_bucket{{{labels},le="{bound}"}} {running}')
        lines.append(f'{name}_bucket{{{labels},le="+Inf"}} {self.count}')
        lines.append(f"{name}_sum{{{labels}}} {self.total!r}")
        lines.append(f"{name}_count{{{labels}}} {self.count}")
        return "\n".join(lines) + "\n"


def render_gauge(name: str, help_text: str, labels: str, value: float) -> str:
    return f"# HELP {name} {help_text}\n# TYPE {name} gauge\n{name}{{{labels}}} {value!r}\n"


def render_counter(
    name: str, help_text: str, labels: str, values: Sequence[tuple[str, float]]
) -> str:
    """A counter family; each entry is (extra labels, value). ``name`` is without ``_total``."""
    lines = [f"# HELP {name}_total {help_text}", f"# TYPE {name}_total counter"]
    for extra, value in values:
        all_labels = f"{labels},{extra}" if extra else labels
        lines.append(f"{name}_total{{{all_labels}}} {float(value)!r}")
    return "\n".join(lines) + "\n"
