"""The router's own metrics, rendered as Prometheus text on ``GET /metrics``.

Plain counters and one histogram, updated in the event loop (no locks needed). The
multi-region stages add their own families with :meth:`Metrics.add_gauge_source`.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Callable

__all__ = ["TTFT_BUCKETS_S", "Histogram", "Metrics"]

TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Histogram:
    """A cumulative Prometheus histogram over fixed buckets (seconds)."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.total = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1

    def render(self, name: str) -> list[str]:
        lines: list[str] = []
        running = 0
        for bound, count in zip(self.buckets, self.counts, strict=False):
            running += count
            lines.append(f'{name}_bucket{{le="{bound}"}} {running}')
        lines.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        lines.append(f"{name}_sum {self.total:.6f}")
        lines.append(f"{name}_count {self.count}")
        return lines


class Metrics:
    """Requests by endpoint and outcome, in-flight streams, time to first token."""

    def __init__(self) -> None:
        self.requests: Counter[tuple[str, str]] = Counter()
        self.in_flight = 0
        self.ttft = Histogram(TTFT_BUCKETS_S)
        self._gauges: list[tuple[str, str, Callable[[], float]]] = []

    def count(self, endpoint: str, outcome: str) -> None:
        self.requests[(endpoint, outcome)] += 1

    def add_gauge_source(self, name: str, help_text: str, read: Callable[[], float]) -> None:
        """Expose ``read()`` as a gauge called ``name`` at scrape time."""
        self._gauges.append((name, help_text, read))

    def render(self) -> str:
        lines = [
            "# HELP firstbyte_router_requests_total Requests by endpoint and outcome.",
            "# TYPE firstbyte_router_requests_total counter",
        ]
        for (endpoint, outcome), value in sorted(self.requests.items()):
            lines.append(
                f'firstbyte_router_requests_total{{endpoint="{endpoint}",outcome="{outcome}"}}'
                f" {value}"
            )
        lines += [
            "# HELP firstbyte_router_in_flight Upstream requests in flight.",
            "# TYPE firstbyte_router_in_flight gauge",
            f"firstbyte_router_in_flight {self.in_flight}",
            "# HELP firstbyte_router_ttft_seconds Request arrival to first content chunk.",
            "# TYPE firstbyte_router_ttft_seconds histogram",
            *self.ttft.render("firstbyte_router_ttft_seconds"),
        ]
        for name, help_text, read in self._gauges:
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge", f"{name} {read()}"]
        return "\n".join(lines) + "\n"
