"""The HTML report as a pure function of the results: the answer in words first, the figures
the data calls for, tails only where there are enough samples, the budget in words, and
nothing that needs the network."""

from __future__ import annotations

import re

from firstbyte.benchmarks import svg
from firstbyte.benchmarks.report_html import render_all, render_comparison, render_report
from firstbyte.benchmarks.report_views import MAX_LINES, headline
from tests.benchmarks.reports_data import compare, comparison_pair, demo_like, overhead_like


def test_the_answer_comes_first_in_words() -> None:
    page = render_report(demo_like(20))
    answer = page.index("The answer")
    assert answer < page.index("<h2>Figures") < page.index("<h2>Tables")
    assert page.index("<h2>Tables") < page.index("<h2>Run conditions")
    words = headline(demo_like(20))
    assert words[0].startswith("Prewarming saved ")
    assert "for sydney" in words[0]  # the farthest client saves the most
    assert words[1].startswith("HTTP/3 0-RTT cut a cold start to ")
    assert "Every client's prewarmed request fits the 500 ms budget" in words[2]


def test_a_0rtt_start_slower_than_http2s_is_not_said_to_cut() -> None:
    """On loopback a handshake has nothing to save: 1.30x was headlined as a cut."""
    slow = demo_like(20)
    for run in slow["runs"]:
        if run["cell"] == "sse/3/0rtt":
            run["p50_ttft_ms"] *= 10
    words = headline(slow)
    assert words[1].startswith("HTTP/3 0-RTT did not cut a cold start: "), words[1]


def test_figures_chosen_for_the_data() -> None:
    page = render_report(demo_like(20))
    for figure in ("ttft-dots", "ttft-cdf", "budget"):
        assert f'data-figure="{figure}"' in page
    assert 'data-figure="overhead"' not in page
    # small multiples: two panels (new connection, prewarmed) per client, few lines each
    assert page.count('class="chart cdf"') == 2 * 2
    for panel in re.findall(r'<svg class="chart cdf".*?</svg>', page):
        assert panel.count("<polyline") <= MAX_LINES
    # the round trip and the budget are marked on every CDF panel
    assert page.count(">RTT 116<") >= 3
    overhead = render_report(overhead_like())
    assert 'data-figure="overhead"' in overhead
    assert "A/A band" in overhead
    assert "hypercorn +1.0 ms at P50" in overhead


def test_tails_only_with_twenty_samples() -> None:
    few = render_report(demo_like(5))
    assert "medians only: under 20 requests per cell" in few
    assert "n&lt;20" in few  # the runs table leaves P95/P99 blank and says why
    assert "This was a quick run (--quick)" in few
    enough = render_report(demo_like(20))
    assert "from the median to P95" in enough
    assert "n&lt;20" not in enough
    assert "P50 / P95 ms" in enough


def test_budget_table_names_phases_and_explains_an_overrun_in_words() -> None:
    page = render_report(demo_like(20))
    for meaning in ("connect + send", "round trip to first byte", "prefill + first token"):
        assert meaning in page
    assert "network: 30 ms, 6%" in page
    # at Sydney's 116 ms RTT phases overrun their allowances, yet the request fits 500 ms
    assert re.search(r"<b>sydney warm</b>: [a-z +]+ at \d{3}% of its allowance(, [a-z +]+ at "
                     r"\d+%)*, yet the request fits: \d+ of 500 ms", page)
    assert '<td class="over">' in page


def test_page_is_self_contained() -> None:
    for page in (render_report(demo_like(20)), render_report(overhead_like()),
                 render_all({"scenarios": {"demo": demo_like(3), "overhead": overhead_like()}})):
        assert "<script" not in page
        assert "<link" not in page
        assert "url(" not in page
        refs = re.findall(r'(?:src|href)="([^"#][^"]*)"', page)
        assert refs == [], refs
        # the only URL is the SVG namespace, which is a name, not a resource
        assert set(re.findall(r"https?://[^\s\"<]+", page)) <= {"http://www.w3.org/2000/svg"}


def test_bench_all_has_a_section_per_scenario_and_their_answers_first() -> None:
    page = render_all({"scenarios": {"demo": demo_like(3), "router_overhead": overhead_like()}})
    assert page.index("The answers") < page.index('<section id="demo">')
    assert page.index('<section id="demo">') < page.index('<section id="router_overhead">')
    assert '<a href="#router_overhead">' in page


def test_comparison_lists_what_moved_first_with_the_noise_floor() -> None:
    base, new = comparison_pair()
    page = render_comparison(compare(base, new, min_delta_ms=2.0), "base.json", "new.json")
    assert page.index("Moved beyond the threshold") < page.index("router/hypercorn c=100")
    assert page.index("router/hypercorn c=100") < page.index("Within the threshold")
    # baseline, new, change, noise floor (max of 10% of 46.5 and 2 ms)
    assert "<td>46.5</td><td>69.8</td><td>+50.0%</td><td>4.65</td><td>REGRESSED</td>" in page
    assert "1 tracked P95/P99 latency regressed by more than 10% and 2 ms." in page


def test_svg_is_deterministic_and_scales() -> None:
    args = ("t", ["a", "b"], [svg.Series("x", "#000")], {("a", "x"): (1.0, 2.0)})
    one, two = svg.dot_plot(*args), svg.dot_plot(*args)
    assert one == two
    assert one.startswith('<svg class="chart dots" viewBox="0 0 ')
    assert "width=" not in one.split(">", 1)[0]  # sized by the page, not fixed pixels
    assert svg.nice_ticks(523) == [0, 200, 400, 600]
    assert svg.nice_ticks(0) == [0.0, 1.0]
