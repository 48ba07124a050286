"""The shared Prometheus text renderer, byte for byte."""

from __future__ import annotations

from firstbyte.router.hosting.prometheus import Histogram, labels, render_counter, render_gauge
from firstbyte.router.metrics import START_BUCKETS_S, TTFT_BUCKETS_S, Metrics


def test_labels_escape_backslash_quote_and_newline() -> None:
    assert labels(a="x", b='q"\\\n') == 'a="x",b="q\\"\\\\\\n"'
    assert labels() == ""


def test_gauge_and_counter_lines() -> None:
    assert render_gauge("g", "A gauge.", [("", 2), (labels(k="v"), 0.5)]) == [
        "# HELP g A gauge.",
        "# TYPE g gauge",
        "g 2",
        'g{k="v"} 0.5',
    ]
    assert render_counter("c_total", "A counter.", [(labels(k="v"), 1 / 3)], ".3f") == [
        "# HELP c_total A counter.",
        "# TYPE c_total counter",
        'c_total{k="v"} 0.333',
    ]


def test_histogram_is_cumulative_with_le_last() -> None:
    hist = Histogram((0.1, 1.0))
    for value in (0.05, 0.1, 0.5, 3.0):
        hist.observe(value)
    assert hist.render("h", "A histogram.", labels(m="x"), ".2f") == [
        "# HELP h A histogram.",
        "# TYPE h histogram",
        'h_bucket{m="x",le="0.1"} 2',
        'h_bucket{m="x",le="1.0"} 3',
        'h_bucket{m="x",le="+Inf"} 4',
        'h_sum{m="x"} 3.65',
        'h_count{m="x"} 4',
    ]
    assert hist.samples("h")[-2:] == ["h_sum 3.65", "h_count 4"]


def test_the_routers_histograms_count_as_a_histogram_does() -> None:
    """Metrics.observe_start and observe_ttft update their histograms in line."""
    metrics = Metrics()
    start, ttft = Histogram(START_BUCKETS_S), Histogram(TTFT_BUCKETS_S)
    for value in (0.0001, 0.003, 0.003, 0.2, 7.0, 99.0):
        metrics.observe_start(value)
        start.observe(value)
        metrics.observe_ttft("m", value)
        ttft.observe(value)
    assert metrics.start.samples("s", sum_spec=".6f") == start.samples("s", sum_spec=".6f")
    assert metrics.ttft["m"].samples("t") == ttft.samples("t")
    assert list(metrics.ttft) == ["m"]
