"""The router's own metrics, rendered as Prometheus text on ``GET /metrics``.

Plain counters and one histogram, updated in the event loop (no locks needed). The
multi-region stages add their own families with :meth:`Metrics.add_gauge_source`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping

from .hosting.prometheus import Histogram, labels, render_counter, render_gauge
from .observability.usage import UsageMeter
from .pipeline.context import LocalReply

__all__ = ["SUM_SPEC", "TTFT_BUCKETS_S", "Metrics"]

TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# The router's histogram sums are printed with microsecond precision.
SUM_SPEC = ".6f"


class Metrics:
    """Requests by endpoint and outcome, requests the router refused by reason, in-flight
    streams, time to first token."""

    def __init__(self) -> None:
        self.requests: Counter[tuple[str, str]] = Counter()
        self.rejected: Counter[str] = Counter()
        self.in_flight = 0
        self.ttft = Histogram(TTFT_BUCKETS_S)
        self.sse_events: Counter[str] = Counter()
        """Events sent to SSE readers, by path: ``direct`` (written from the upstream's data
        callback, :mod:`.hosting.body_writer`) or ``send`` (by the reader's task through ASGI
        ``send``); added once per response (:func:`.readers.sse_events`'s ``tally``)."""
        self.usage = UsageMeter()
        """Completions and tokens per key label (:mod:`.observability.usage`)."""
        self._gauges: list[tuple[str, str, Callable[[], float]]] = []
        self._counters: list[tuple[str, str, str, Callable[[], Mapping[str, int]]]] = []
        self._sections: list[Callable[[], list[str]]] = []

    def count(self, endpoint: str, outcome: str) -> None:
        self.requests[(endpoint, outcome)] += 1

    def count_reply(self, endpoint: str, reply: LocalReply) -> None:
        """Count a local answer; a 429 also counts as a rejection under its error code."""
        self.requests[(endpoint, reply.outcome)] += 1
        if reply.status == 429:
            self.rejected[reply.code or "rejected"] += 1

    def add_counter_source(
        self, name: str, help_text: str, label: str, read: Callable[[], Mapping[str, int]]
    ) -> None:
        """Expose ``read()`` (label value -> count) as a counter family at scrape time."""
        self._counters.append((name, help_text, label, read))

    def add_gauge_source(self, name: str, help_text: str, read: Callable[[], float]) -> None:
        """Expose ``read()`` as a gauge called ``name`` at scrape time."""
        self._gauges.append((name, help_text, read))

    def add_section(self, render: Callable[[], list[str]]) -> None:
        """Append ``render()``'s lines (whole families) to every scrape."""
        self._sections.append(render)

    def render(self) -> str:
        requests = [
            (labels(endpoint=endpoint, outcome=outcome), value)
            for (endpoint, outcome), value in sorted(self.requests.items())
        ]
        lines = [
            *render_counter(
                "firstbyte_router_requests_total", "Requests by endpoint and outcome.", requests
            ),
            *render_counter(
                "firstbyte_router_rejected_total",
                "Requests the router refused with 429, by reason (the error code).",
                [(labels(reason=reason), n) for reason, n in sorted(self.rejected.items())],
            ),
            *render_gauge(
                "firstbyte_router_in_flight", "Upstream requests in flight.", [("", self.in_flight)]
            ),
            *self.ttft.render(
                "firstbyte_router_ttft_seconds",
                "Request arrival to first content chunk.",
                sum_spec=SUM_SPEC,
            ),
            *render_counter(
                "firstbyte_router_sse_events_total",
                "Events sent to SSE readers by path: direct (from the upstream's data callback)"
                " or send (the reader's task); counted as each response ends.",
                [(labels(path=path), n) for path, n in sorted(self.sse_events.items())],
            ),
        ]
        for name, help_text, read in self._gauges:
            lines += render_gauge(name, help_text, [("", read())])
        for name, help_text, label, counts in self._counters:
            samples = [(labels(**{label: k}), n) for k, n in sorted(counts().items())]
            lines += render_counter(name, help_text, samples)
        lines += self.usage.render()
        for section in self._sections:
            lines += section()
        return "\n".join(lines) + "\n"
