"""The router's own metrics, rendered as Prometheus text on ``GET /metrics``.

Plain counters and one histogram per model, updated in the event loop (no locks needed).
The multi-region stages add their own families with :meth:`Metrics.add_gauge_source`.

The request, refusal and TTFT families carry a ``model`` label: the request's
:attr:`~firstbyte.router.pipeline.context.RequestContext.model_label`, ``""`` for a request
refused before routing knew its model (no key, a bad body, a model nobody lists).
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter
from collections.abc import Callable, Mapping

from .hosting.prometheus import Histogram, family, labels, render_counter, render_gauge
from .observability.usage import UsageMeter
from .pipeline.context import LocalReply

__all__ = ["START_BUCKETS_S", "SUM_SPEC", "TTFT_BUCKETS_S", "Metrics"]

TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
START_BUCKETS_S = (
    0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5,
)
"""Finer than TTFT's at the low end: the router's own time is milliseconds, and a benchmark
compares two routers' by it (``bench router_workers``)."""
# The router's histogram sums are printed with microsecond precision.
SUM_SPEC = ".6f"


class Metrics:
    """Requests by endpoint, outcome and model, requests the router refused by reason and
    model, in-flight streams, time to first token by model."""

    def __init__(self) -> None:
        self.requests: Counter[tuple[str, str, str]] = Counter()
        self.rejected: Counter[tuple[str, str]] = Counter()
        self.in_flight = 0
        self.ttft: dict[str, Histogram] = {}
        """Time to first token by model label: one histogram each, made on its first use."""
        self.start = Histogram(START_BUCKETS_S)
        """Request arrival to its request written to the upstream (:meth:`observe_start`)."""
        self.sse_events: Counter[str] = Counter()
        """Events sent to SSE readers, by path: ``direct`` (written from the upstream's data
        callback, :mod:`.hosting.body_writer`) or ``send`` (by the reader's task through ASGI
        ``send``); added once per response (:class:`.readers.SSEEvents`' ``tally``)."""
        self.relay_reads: Counter[str] = Counter()
        """Upstream reads of streamed answers, by path: ``fast`` (one whole event past the
        first content, cut and appended without the relay's actions) or ``full``; added once
        per request (:meth:`.pipeline.relay.Relay.feed`)."""
        self.usage = UsageMeter()
        """Completions and tokens per key label (:mod:`.observability.usage`)."""
        self._gauges: list[tuple[str, str, Callable[[], float]]] = []
        self._counters: list[tuple[str, str, str, Callable[[], Mapping[str, int]]]] = []
        self._sections: list[Callable[[], list[str]]] = []

    def count(self, endpoint: str, outcome: str, model: str = "") -> None:
        self.requests[(endpoint, outcome, model)] += 1

    def count_reply(self, endpoint: str, reply: LocalReply, model: str = "") -> None:
        """Count a local answer; a 429 also counts as a rejection under its error code."""
        self.requests[(endpoint, reply.outcome, model)] += 1
        if reply.status == 429:
            self.rejected[(reply.code or "rejected", model)] += 1

    def observe_ttft(self, model: str, seconds: float) -> None:
        """A first token ``seconds`` after its request arrived; ``model`` is its label."""
        hist = self.ttft.get(model)
        if hist is None:  # once a model: the label is bounded by the models listed
            hist = self.ttft[model] = Histogram(TTFT_BUCKETS_S)
        # Histogram.observe in line (as GapTimer.tick has it): a call less a request.
        hist.counts[bisect_left(hist.bounds, seconds)] += 1
        hist.total += seconds
        hist.count += 1

    def observe_start(self, seconds: float) -> None:
        """A stream's request written to its upstream ``seconds`` after it arrived: the
        router's own time (admission, routing, shared state, the pool) before the upstream
        can work on it, without the upstream's queue that TTFT also holds."""
        hist = self.start  # Histogram.observe in line, as above
        hist.counts[bisect_left(hist.bounds, seconds)] += 1
        hist.total += seconds
        hist.count += 1

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
            (labels(endpoint=endpoint, outcome=outcome, model=model), value)
            for (endpoint, outcome, model), value in sorted(self.requests.items())
        ]
        lines = [
            *render_counter(
                "firstbyte_router_requests_total",
                "Requests by endpoint, outcome and model.",
                requests,
            ),
            *render_counter(
                "firstbyte_router_rejected_total",
                "Requests the router refused with 429, by reason (the error code) and model.",
                [
                    (labels(reason=reason, model=model), n)
                    for (reason, model), n in sorted(self.rejected.items())
                ],
            ),
            *render_gauge(
                "firstbyte_router_in_flight", "Upstream requests in flight.", [("", self.in_flight)]
            ),
            *family(
                "firstbyte_router_ttft_seconds",
                "histogram",
                "Request arrival to first content chunk, by model.",
            ),
        ]
        for model, hist in sorted(self.ttft.items()):
            lines += hist.samples(
                "firstbyte_router_ttft_seconds", labels(model=model), SUM_SPEC
            )
        lines += self.start.render(
            "firstbyte_router_start_seconds",
            "Request arrival to its request written to the upstream (streams over HTTP/1.1):"
            " the router's own time before the upstream can work on it.",
            sum_spec=SUM_SPEC,
        )
        lines += render_counter(
            "firstbyte_router_sse_events_total",
            "Events sent to SSE readers by path: direct (from the upstream's data callback)"
            " or send (the reader's task); counted as each response ends.",
            [(labels(path=path), n) for path, n in sorted(self.sse_events.items())],
        )
        lines += render_counter(
            "firstbyte_router_relay_reads_total",
            "Upstream reads of streamed answers by path: compiled (whole chunks of whole events"
            " after the first content, in C), fast (one whole event, in Python) or full (the"
            " relay's actions); counted as each request ends.",
            [(labels(path=path), n) for path, n in sorted(self.relay_reads.items())],
        )
        for name, help_text, read in self._gauges:
            lines += render_gauge(name, help_text, [("", read())])
        for name, help_text, label, counts in self._counters:
            samples = [(labels(**{label: k}), n) for k, n in sorted(counts().items())]
            lines += render_counter(name, help_text, samples)
        lines += self.usage.render()
        for section in self._sections:
            lines += section()
        return "\n".join(lines) + "\n"
