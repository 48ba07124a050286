"""What a report shows for the results it is given: the headline in words and the figures.

Chosen by the shape of the data, not by a list of scenarios: runs with a transport/state
``cell`` per client get a TTFT dot plot and CDF small multiples; runs with budget lines get
stacked budget bars; runs measured at several ``concurrency`` levels get the router-overhead
panel with its A/A band; per-client routing rows get a client -> region dot plot; runs with
one throughput number each get bars. Each function maps a results dict to strings (HTML or
SVG), so it is tested without a browser.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from firstbyte.benchmarks import svg
from firstbyte.benchmarks.stats import percentile
from firstbyte.client_sdk.budget import PHASE_MEANING, LatencyBudget

__all__ = [
    "MIN_TAIL_SAMPLES", "TAIL_COLUMNS", "Figure", "cell_name", "figures", "headline", "runs_of",
    "tail_withheld",
]

MIN_TAIL_SAMPLES = 20
"""Fewer requests than this in a cell and its P95/P99 are not shown (they would be the worst
of a handful); the tables and plots then show the P50 and say why."""

HTTP = {"1.1": "h1.1", "2": "h2", "3": "h3"}
TRANSPORT = {"sse": "SSE", "websocket": "WS", "longpoll": "poll"}
STATE = {"cold": "cold", "0rtt": "0-RTT", "warm": "warm"}
STATE_COLOURS = {"cold": "#d62728", "0rtt": "#9467bd", "warm": "#1f77b4"}
FAMILY_COLOURS = {
    "sse/2": "#1f77b4", "sse/1.1": "#17becf", "sse/3": "#2ca02c", "websocket/1.1": "#ff7f0e",
    "longpoll/2": "#8c564b", "longpoll/1.1": "#e377c2", "longpoll/3": "#7f7f7f",
}
PHASE_COLOURS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860")
TARGET_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd")
MAX_LINES = 6


class Figure(NamedTuple):
    """One figure of the page: a heading, the legend (HTML), the panels (SVG) and a caption."""

    key: str
    title: str
    legend: str
    panels: list[str]
    caption: str


def runs_of(results: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    runs = results.get("runs")
    return [r for r in runs if isinstance(r, Mapping)] if isinstance(runs, list) else []


def cell_name(cell: str, *, with_state: bool = True) -> str:
    """``sse/3/0rtt`` -> ``SSE h3 0-RTT``."""
    transport, http, state = cell.split("/")
    name = f"{TRANSPORT.get(transport, transport)} {HTTP.get(http, http)}"
    return f"{name} {STATE.get(state, state)}" if with_state else name


def _group(run: Mapping[str, Any]) -> str | None:
    """The client (or place) a cell run belongs to: ``client-tokyo`` -> ``tokyo``."""
    name = run.get("client") or run.get("place")
    return str(name).removeprefix("client-") if name else None


def _cell_runs(results: Mapping[str, Any]) -> dict[str, dict[str, Mapping[str, Any]]]:
    """group -> cell -> run, for runs that carry a ``cell`` ``transport/http/state``."""
    out: dict[str, dict[str, Mapping[str, Any]]] = {}
    for run in runs_of(results):
        cell, group = run.get("cell"), _group(run)
        if isinstance(cell, str) and cell.count("/") == 2 and group:
            out.setdefault(group, {})[cell] = run
    return out


def _num(run: Mapping[str, Any] | None, key: str) -> float | None:
    value = None if run is None else run.get(key)
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _p50(cells: Mapping[str, Mapping[str, Any]], cell: str) -> float | None:
    return _num(cells.get(cell), "p50_ttft_ms")


def _tail_ok(run: Mapping[str, Any]) -> bool:
    return int(run.get("completed") or 0) >= MIN_TAIL_SAMPLES


TAIL_COLUMNS = frozenset({"p95_ttft_ms", "p99_ttft_ms", "p99_itl_ms"})
"""The runs tables' tail columns: left blank (``n<20``) for a run of too few requests."""


def tail_withheld(run: Mapping[str, Any], key: str) -> bool:
    """Is ``run``'s ``key`` a tail of too few requests to mean anything (the tables' ``n<20``)?"""
    return key in TAIL_COLUMNS and "completed" in run and not _tail_ok(run)


def _budget(results: Mapping[str, Any]) -> tuple[float, float]:
    for run in runs_of(results):
        total = _num(run, "budget_total_ms")
        if total:
            return total, _num(run, "budget_safety_ms") or total * 0.15
    return LatencyBudget().total_ms, LatencyBudget().safety_ms


# -- headline --------------------------------------------------------------------------------


def headline(results: Mapping[str, Any]) -> list[str]:
    """The answer in a few sentences, most useful first."""
    out: list[str] = []
    summary = results.get("summary") if isinstance(results.get("summary"), Mapping) else {}
    assert isinstance(summary, Mapping)
    if summary.get("mode") == "loopback":
        out.append("LOOPBACK MODE: everything ran on 127.0.0.1, so these numbers show CPU "
                   "cost only, not distances or round trips.")
    out += _cells_headline(results)
    out += _overhead_headline(results, summary)
    out += _summary_headline(results.get("scenario"), summary)
    if results.get("quick"):
        out.append("This was a quick run (--quick): few requests per condition, for checking "
                   "that everything works; tails (P95/P99) are not shown where a cell has "
                   f"fewer than {MIN_TAIL_SAMPLES} requests.")
    if not out and results.get("description"):
        out.append(str(results["description"]).split(". ")[0].rstrip(".") + ".")
    return out


def _cells_headline(results: Mapping[str, Any]) -> list[str]:
    groups = _cell_runs(results)
    out: list[str] = []
    saved: dict[str, tuple[float, float]] = {}
    for g, c in groups.items():
        cold_p50, warm_p50 = _p50(c, "sse/2/cold"), _p50(c, "sse/2/warm")
        if cold_p50 is not None and warm_p50 is not None:
            saved[g] = (cold_p50, warm_p50)
    if saved:
        best = max(saved, key=lambda g: saved[g][0] - saved[g][1])
        cold, warm = saved[best]
        others = [f"{c - w:.0f} ms for {g}" for g, (c, w) in saved.items() if g != best]
        text = (f"Prewarming saved {cold - warm:.0f} ms of time to first token for {best} "
                f"(SSE over HTTP/2: {cold:.0f} ms on a new connection, {warm:.0f} ms prewarmed)")
        out.append(text + (f"; {', '.join(others)}." if others else "."))
    pairs = {g: (_p50(c, "sse/3/0rtt"), _p50(c, "sse/2/cold")) for g, c in groups.items()}
    ratios = {g: a / b for g, (a, b) in pairs.items() if a is not None and b}
    if ratios:
        far = max(groups, key=lambda g: _num(next(iter(groups[g].values())), "rtt_ms") or 0)
        far = far if far in ratios else next(iter(ratios))
        low, high = min(ratios.values()), max(ratios.values())
        spread = f" ({low:.2f}x to {high:.2f}x across clients)" if len(ratios) > 1 else ""
        # On loopback a handshake costs nothing to save, and 0-RTT may come out slower.
        verb = "cut a cold start to" if ratios[far] < 1 else "did not cut a cold start:"
        out.append(f"HTTP/3 0-RTT {verb} {ratios[far]:.2f}x of HTTP/2's time to "
                   f"first token for {far}{spread}.")
    total, _ = _budget(results)
    fits = {}
    for g, cells in groups.items():
        lines = (cells.get("sse/2/warm") or {}).get("budget_lines_ms")
        if isinstance(lines, Mapping) and lines:
            fits[g] = sum(float(v) for v in lines.values())
    if fits:
        worst = max(fits, key=lambda g: fits[g])
        over = [g for g, v in fits.items() if v > total]
        if not over:
            out.append(f"Every client's prewarmed request fits the {total:.0f} ms budget "
                       f"(the slowest, {worst}, used {fits[worst]:.0f} ms of it on average).")
        else:
            out.append(f"Prewarmed requests from {', '.join(over)} do not fit the {total:.0f} ms "
                       "budget on average.")
    return out


def _overhead_headline(results: Mapping[str, Any], summary: Mapping[str, Any]) -> list[str]:
    added = _overhead(results)
    if not added:
        return []
    top = max(c for c, _ in added)
    parts = []
    for (c, target), (p50, p99) in added.items():
        if c == top and target.startswith("router/"):
            parts.append(f"{target.removeprefix('router/')} {p50:+.1f} ms at P50, "
                         f"{p99:+.1f} ms at P99")
    aa = summary.get(f"c{top}_direct_aa_added_p99_ttft_ms")
    floor = (f" The A/A noise floor (the direct path measured twice) was {abs(aa):.1f} ms at "
             "P99." if isinstance(aa, int | float) else "")
    return [f"At {top} concurrent streams the router added to time to first token: "
            + "; ".join(parts) + "." + floor]


def _summary_headline(scenario: Any, summary: Mapping[str, Any]) -> list[str]:
    out: list[str] = []
    near, central = summary.get("geo_p50_ttft_ms_nearest"), summary.get("geo_p50_ttft_ms_central")
    if isinstance(near, int | float) and isinstance(central, int | float):
        chose = " (the SDK picked the nearest region for every client)" if summary.get(
            "geo_sdk_chose_nearest") else ""
        out.append(f"Sending each client to its nearest region: P50 time to first token "
                   f"{near:.0f} ms, against {central:.0f} ms when every client uses us-east-1"
                   f"{chose}.")
    fb, nofb = summary.get("p99_ttft_ms_with_fallback"), summary.get(
        "p99_ttft_ms_without_fallback")
    if isinstance(fb, int | float) and isinstance(nofb, int | float):
        out.append(f"Under twice a region's capacity, spilling to a peer region kept P99 TTFT at "
                   f"{fb:.0f} ms with {summary.get('failed_with_fallback')} failures (without "
                   f"it: {nofb:.0f} ms, {summary.get('failed_without_fallback')} failures).")
    ratio = summary.get("core_vs_openai_ratio")
    if isinstance(ratio, int | float):
        target = summary.get("target_ratio", 10.0)
        met = "met" if ratio >= target else "NOT met"
        out.append(f"firstbyte's SSE decoder delivered {ratio:.1f}x as many chunks per second "
                   f"as the openai SDK's Stream (target {target:g}x: {met}).")
    client = summary.get("client_events_per_s")
    if isinstance(client, int | float) and scenario == "decode":
        goal = summary.get("client_target_events_per_s", 200_000)
        met = "met" if client >= goal else "NOT met"
        out.append(f"The whole client (AsyncClient.stream() over loopback) delivered "
                   f"{client:,.0f} events/s, {summary.get('client_vs_core_ratio', 0):.2f}x the "
                   f"core parser's rate in the same run (target {goal:,}: {met}).")
    best = summary.get("best chunks per CPU-second")
    if isinstance(best, int | float):
        met = "met" if summary.get("meets target") else "NOT met"
        out.append(f"The sim streams {best:,.0f} chunks per CPU-second on its best server "
                   f"({summary.get('best server')}; target "
                   f"{summary.get('target chunks per CPU-second'):,}: {met}).")
    error = summary.get("max_abs_median_error_ms_at_150", summary.get("emulator_max_abs_error_ms"))
    if isinstance(error, int | float) and scenario == "wan":
        out.append(f"The emulator's measured round trips are within {error:.2f} ms of the "
                   "configured ones.")
    return out


# -- figures ---------------------------------------------------------------------------------


def figures(results: Mapping[str, Any]) -> list[Figure]:
    """Every figure the data supports, in reading order."""
    out = [*_ttft_dots(results), *_cdfs(results), *_budget_bars(results),
           *_overhead_figure(results), *_routing_dots(results), *_throughput_bars(results)]
    return [f for f in out if f.panels]


def _rtt_marker(rtt: float | None) -> list[svg.Marker]:
    return [svg.Marker(rtt, f"RTT {rtt:.0f}", "#555")] if rtt else []


def _ttft_dots(results: Mapping[str, Any]) -> list[Figure]:
    groups = _cell_runs(results)
    if not groups:
        return []
    total, _ = _budget(results)
    budget = svg.Marker(total, f"budget {total:.0f}", "#c00000", "")
    values_all = [_num(r, "p95_ttft_ms" if _tail_ok(r) else "p50_ttft_ms") or 0.0
                  for cells in groups.values() for r in cells.values()]
    x_max = max([*values_all, total]) * 1.05
    states = [s for s in STATE if any(c.endswith("/" + s) for g in groups.values() for c in g)]
    series = [svg.Series(STATE[s], STATE_COLOURS[s]) for s in states]
    panels = []
    tails = False
    for group, cells in groups.items():
        families = list(dict.fromkeys(cell_name(c, with_state=False) for c in cells))
        values: dict[tuple[str, str], tuple[float, float | None]] = {}
        for cell, run in cells.items():
            p50 = _num(run, "p50_ttft_ms")
            if p50 is None or not run.get("completed"):
                continue
            tail = _num(run, "p95_ttft_ms") if _tail_ok(run) else None
            tails = tails or tail is not None
            values[(cell_name(cell, with_state=False), STATE.get(cell.rsplit("/", 1)[1], ""))] = (
                p50, tail)
        rtt = _num(next(iter(cells.values())), "rtt_ms")
        title = f"{group}" + (f" (RTT {rtt:.0f} ms)" if rtt else "")
        panels.append(svg.dot_plot(title, families, series, values, x_max=x_max,
                                   markers=[*_rtt_marker(rtt), budget]))
    tail_words = ("the thin bar runs from the median to P95; " if tails else
                  f"medians only: under {MIN_TAIL_SAMPLES} requests per cell, a P95 would be "
                  "the worst of a few; ")
    return [Figure(
        "ttft-dots", "Time to first token: each transport cold, 0-RTT and prewarmed",
        svg.legend(series, [("marker rtt", "round trip to the region"),
                            ("marker budget", f"{total:.0f} ms budget")]),
        panels,
        "Dot = median TTFT (request start to first content chunk); " + tail_words
        + "cold = new connection, warm = prewarmed and kept alive. The gap between a row's red "
        "and blue dots is what prewarming saves.")]


def _cdfs(results: Mapping[str, Any]) -> list[Figure]:
    groups = _cell_runs(results)
    total, _ = _budget(results)
    every = [float(v) for cells in groups.values() for r in cells.values()
             for v in r.get("ttfts_ms") or []]
    if not every:
        return []
    # One axis for every panel, to the budget or the pooled P99, whichever is later: a single
    # retransmitted request at 1.2 s would otherwise squeeze every other line to the left.
    x_max = max(percentile(every, 99), total) * 1.1
    beyond = sum(1 for v in every if v > x_max)
    families: dict[str, svg.Series] = {}
    panels = []
    for group, cells in groups.items():
        rtt = _num(next(iter(cells.values())), "rtt_ms")
        for kind, states in (("new connection", ("cold", "0rtt")), ("prewarmed", ("warm",))):
            lines = []
            for cell, run in cells.items():
                transport, http, state = cell.split("/")
                values = [float(v) for v in run.get("ttfts_ms") or []]
                if state not in states or not values:
                    continue
                family = f"{transport}/{http}"
                name = cell_name(cell, with_state=False) + (" 0-RTT" if state == "0rtt" else "")
                s = svg.Series(name, FAMILY_COLOURS.get(family, "#333"),
                               "5 3" if state == "0rtt" else "")
                families.setdefault(name, s)
                lines.append((transport, s, values))
            transports = dict.fromkeys(line[0] for line in lines)
            chunks = [lines] if len(lines) <= MAX_LINES else [
                [line for line in lines if line[0] == t] for t in transports]
            for chunk in chunks:
                if not chunk:
                    continue
                suffix = f", {TRANSPORT.get(chunk[0][0], chunk[0][0])}" if len(chunks) > 1 else ""
                n = min(len(v) for _, _, v in chunk)
                panels.append(svg.cdf_panel(
                    f"{group}: {kind}{suffix} (n={n})", [(s, v) for _, s, v in chunk],
                    x_max=x_max, markers=[*_rtt_marker(rtt),
                                          svg.Marker(total, f"budget {total:.0f}", "#c00000", "")]))
    return [Figure(
        "ttft-cdf", "TTFT distribution per client",
        svg.legend(list(families.values()), [("marker rtt", "round trip"),
                                             ("marker budget", f"{total:.0f} ms budget")]),
        panels,
        "Each line: the fraction of requests (y) whose TTFT was at most x. Steep and left is "
        "good; a long flat tail to the right is the P95-P99 the safety share is kept for."
        + (f" The axis ends at {x_max:.0f} ms; {beyond} slower request(s) of {len(every)} "
           "end their line at the right edge." if beyond else ""))]


def budget_bars(results: Mapping[str, Any]) -> dict[str, Mapping[str, float]]:
    """Bar name (geography, or run label) -> mean ms per budget line, first run per name."""
    bars: dict[str, Mapping[str, float]] = {}
    for run in runs_of(results):
        lines = run.get("budget_lines_ms")
        if isinstance(lines, Mapping) and lines:
            name = str(run.get("geography") or run.get("label") or "run")
            for key, label in STATE.items():
                name = name.replace(f" {key}", f" {label}")
            bars.setdefault(name, {str(k): float(v) for k, v in lines.items()})
    return bars


def phase_label(name: str, total: float) -> str:
    allowance = {line.name: line.allowance_ms for line in LatencyBudget(total_ms=total).lines()}
    share = f", {allowance[name] / total:.0%}" if name in allowance else ""
    return f"{PHASE_MEANING.get(name, name)} ({name}{share})"


def _budget_bars(results: Mapping[str, Any]) -> list[Figure]:
    bars = budget_bars(results)
    if not bars:
        return []
    total, safety = _budget(results)
    phases = list(dict.fromkeys(p for lines in bars.values() for p in lines))
    segments = [svg.Series(phase_label(p, total), PHASE_COLOURS[i % len(PHASE_COLOURS)])
                for i, p in enumerate(phases)]
    values = {row: {phase_label(p, total): v for p, v in lines.items()}
              for row, lines in bars.items()}
    panel = svg.stacked_bars(
        "Mean time per phase of a request", list(bars), segments, values,
        limit=svg.Marker(total, f"budget {total:.0f} ms", "#c00000", ""),
        band=(total - safety, total),
        label_width=max(90, 8 * max(len(r) for r in bars) + 8))
    return [Figure(
        "budget", f"Where the {total:.0f} ms budget goes",
        svg.legend(segments, [("band", f"safety share ({safety:.0f} ms, {safety / total:.0%}): "
                                       "kept for the P95-P99 tail")]),
        [panel],
        "Each bar lays a request's phases end to end (means over the requests of that row). "
        "A bar past the grey band eats into the safety share; past the red line it is over "
        "budget.")]


def _overhead(results: Mapping[str, Any]) -> dict[tuple[int, str], tuple[float, float]]:
    """(concurrency, target) -> added (P50, P99) TTFT over the direct path, plain runs only."""
    base: dict[int, Mapping[str, Any]] = {}
    rows: list[tuple[int, str, Mapping[str, Any]]] = []
    for run in runs_of(results):
        c, label = run.get("concurrency"), str(run.get("label", ""))
        if not isinstance(c, int) or "(" in label:
            continue
        target = label.rsplit(" c=", 1)[0]
        if target == "direct":
            base[c] = run
        else:
            rows.append((c, target, run))
    out = {}
    for c, target, run in rows:
        direct = base.get(c)
        got = [_num(run, k) for k in ("p50_ttft_ms", "p99_ttft_ms")]
        ref = [_num(direct, k) for k in ("p50_ttft_ms", "p99_ttft_ms")]
        if None not in got and None not in ref:
            out[(c, target)] = (got[0] - ref[0], got[1] - ref[1])  # type: ignore[operator]
    return out


def _overhead_figure(results: Mapping[str, Any]) -> list[Figure]:
    added = _overhead(results)
    if not added:
        return []
    levels = sorted({c for c, _ in added} | {c for c, _ in added})
    targets = [t for t in dict.fromkeys(t for _, t in added) if t != "direct-aa"]
    series = [svg.Series(t, TARGET_COLOURS[i % len(TARGET_COLOURS)])
              for i, t in enumerate(targets)]
    panels = []
    for i, metric in enumerate(("P50", "P99")):
        band = [abs(added[(c, "direct-aa")][i]) if (c, "direct-aa") in added else None
                for c in levels]
        lines = [(s, [added[(c, s.name)][i] if (c, s.name) in added else None for c in levels])
                 for s in series]
        panels.append(svg.line_panel(
            f"added {metric} TTFT", [f"{c} stream{'s' if c > 1 else ''}" for c in levels],
            lines, band=band, band_label="A/A: the direct path measured twice",
            unit="ms added vs direct"))
    return [Figure(
        "overhead", "What the router adds to time to first token, by concurrency",
        svg.legend(series, [("band", "A/A band: the direct path against itself (noise)")]),
        panels,
        "Each point: the router's TTFT percentile minus the direct path's, same workload, "
        "alternating phases. Inside the grey band the difference is within the noise of "
        "measuring the same path twice.")]


def _routing_dots(results: Mapping[str, Any]) -> list[Figure]:
    rows = [r for r in results.get("geography_clients") or [] if isinstance(r, Mapping)]
    if not rows:
        return []
    modes = [m for m in ("nearest", "central") if any(f"p50_ttft_ms_{m}" in r for r in rows)]
    colours = {"nearest": "#2ca02c", "central": "#d62728"}
    series = [svg.Series(m, colours[m]) for m in modes]
    values = {(str(r["client"]), m): (float(r[f"p50_ttft_ms_{m}"]), None)
              for r in rows for m in modes if isinstance(r.get(f"p50_ttft_ms_{m}"), int | float)}
    total, _ = _budget(results)
    panel = svg.dot_plot("P50 TTFT per client", [str(r["client"]) for r in rows], series,
                         values, markers=[svg.Marker(total, f"budget {total:.0f}", "#c00000", "")])
    return [Figure("routing", "Nearest region vs one central region",
                   svg.legend(series), [panel],
                   "nearest: the SDK picks a region by its own RTT probe; central: every client "
                   "uses us-east-1.")]


_THROUGHPUT = {"events_per_s": "events per second", "chunks_per_cpu_s": "chunks per CPU-second"}


def _throughput_bars(results: Mapping[str, Any]) -> list[Figure]:
    runs = runs_of(results)
    for key, unit in _THROUGHPUT.items():
        got = {str(r.get("label")): float(r[key]) for r in runs
               if isinstance(r.get(key), int | float)}
        if not got:
            continue
        target = results.get("target_chunks_per_cpu_s") if key == "chunks_per_cpu_s" else None
        s = svg.Series(unit, "#4c72b0")
        panel = svg.stacked_bars(
            unit, list(got), [s], {name: {unit: v} for name, v in got.items()},
            limit=svg.Marker(float(target), f"target {target:,}", "#c00000", "")
            if isinstance(target, int | float) else None,
            unit=unit, label_width=max(90, 7 * max(len(n) for n in got) + 8))
        return [Figure("throughput", f"Throughput: {unit}", "", [panel],
                       "Longer is better; one bar per pipeline or server.")]
    return []


def tail_note(runs: Sequence[Mapping[str, Any]]) -> str | None:
    """Why some P95/P99 cells are blank, or None when every run has enough samples."""
    small = [r for r in runs if "p95_ttft_ms" in r and not _tail_ok(r)]
    if not small:
        return None
    fewest = min(int(r.get("completed") or 0) for r in small)
    return (f"P95/P99 are left blank for runs with fewer than {MIN_TAIL_SAMPLES} requests "
            f"(here as few as {fewest}): such a 'P99' is just the slowest of a handful.")
