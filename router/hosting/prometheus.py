"""Prometheus text exposition (format 0.0.4): label sets, gauges, counters and histograms.

One renderer for the router's ``/metrics`` (``firstbyte_*`` families) and the simulator's
(vLLM's ``vllm:*`` families). Renderers return lines without a trailing newline; callers
join them with ``"\\n"`` and end the document with one. Labels are passed as the text
between the braces (``labels(region="eu")`` builds it, escaped); an empty label text renders
a bare sample name. Values are formatted with a format spec: ``""`` is ``str(value)``
(``repr`` for floats, so no precision is lost); callers pass e.g. ``".6f"`` or ``"g"``.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Sequence

__all__ = ["GapTimer", "Histogram", "family", "labels", "render_counter", "render_gauge", "sample"]


def labels(**values: str) -> str:
    """``k="v",...`` with backslash, double quote and newline escaped as the format requires."""
    return ",".join(f'{key}="{_escape(value)}"' for key, value in values.items())


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def family(name: str, kind: str, help_text: str) -> list[str]:
    """The ``# HELP`` and ``# TYPE`` lines that open a metric family."""
    return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]


def sample(name: str, label_text: str, value: float, spec: str = "") -> str:
    """One sample line: ``name{labels} value`` (``name value`` without labels)."""
    if label_text:
        return f"{name}{{{label_text}}} {value:{spec}}"
    return f"{name} {value:{spec}}"


def render_gauge(
    name: str, help_text: str, samples: Iterable[tuple[str, float]], spec: str = ""
) -> list[str]:
    """A gauge family; each entry of ``samples`` is (label text, value)."""
    return family(name, "gauge", help_text) + [sample(name, lab, v, spec) for lab, v in samples]


def render_counter(
    name: str, help_text: str, samples: Iterable[tuple[str, float]], spec: str = ""
) -> list[str]:
    """A counter family (``name`` includes ``_total``); entries are (label text, value)."""
    return family(name, "counter", help_text) + [sample(name, lab, v, spec) for lab, v in samples]


class Histogram:
    """A cumulative histogram over fixed upper bounds; ``observe`` is O(log buckets)."""

    # Slots: the compiled per-chunk path (router/_chunkpath.c) observes inter-token gaps at
    # these offsets (:class:`GapTimer`).
    __slots__ = ("bounds", "count", "counts", "total")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.total = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value
        self.count += 1

    def samples(self, name: str, label_text: str = "", sum_spec: str = "") -> list[str]:
        """The ``_bucket`` (cumulative, ``le`` last among the labels), ``_sum`` and ``_count``
        lines; ``sum_spec`` formats the sum."""
        prefix = f"{label_text}," if label_text else ""
        lines: list[str] = []
        running = 0
        for bound, count in zip(self.bounds, self.counts, strict=False):
            running += count
            lines.append(f'{name}_bucket{{{prefix}le="{bound}"}} {running}')
        lines.append(f'{name}_bucket{{{prefix}le="+Inf"}} {self.count}')
        lines.append(sample(f"{name}_sum", label_text, self.total, sum_spec))
        lines.append(sample(f"{name}_count", label_text, self.count))
        return lines

    def render(
        self, name: str, help_text: str, label_text: str = "", sum_spec: str = ""
    ) -> list[str]:
        """The whole family: header lines, then :meth:`samples`."""
        return family(name, "histogram", help_text) + self.samples(name, label_text, sum_spec)


class GapTimer:
    """The gaps between one stream's successive chunks, observed into a :class:`Histogram`
    (the inter-token latency): :meth:`tick` per chunk; ``last`` is the previous chunk's
    :func:`time.perf_counter` reading (None before the first). The compiled per-chunk path
    (router/_chunkpath.c) does what :meth:`tick` does, at the slots' offsets."""

    __slots__ = ("hist", "last")

    def __init__(self, hist: Histogram) -> None:
        self.hist = hist
        self.last: float | None = None

    def tick(self, now: float) -> None:
        last, self.last = self.last, now
        if last is not None:
            # Histogram.observe inlined: this runs per relayed chunk.
            hist, value = self.hist, now - last
            hist.counts[bisect_left(hist.bounds, value)] += 1
            hist.total += value
            hist.count += 1
