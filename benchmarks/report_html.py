"""The HTML report: one self-contained page per run (no scripts, no external resources: it
opens from disk offline, prints, and reads on a phone).

Layout, in reading order: the headline answer in words, the figures
(:mod:`firstbyte.benchmarks.report_views`), the tables, the run's conditions, then notes and
metric definitions. :func:`render_report` is one scenario, :func:`render_all` the sections of
``bench all``, :func:`render_comparison` a baseline against a new run. All are pure functions
of their inputs.
"""

from __future__ import annotations

import html
import math
from collections.abc import Mapping, Sequence
from typing import Any

from firstbyte.benchmarks.compare import Comparison, Row, Status
from firstbyte.benchmarks.report_views import (
    MIN_TAIL_SAMPLES,
    STATE,
    budget_bars,
    cell_name,
    figures,
    headline,
    runs_of,
    tail_note,
    tail_withheld,
)
from firstbyte.benchmarks.stats import METRIC_DEFINITIONS
from firstbyte.client_sdk.budget import PHASE_MEANING, BudgetReport, LatencyBudget, LineResult

__all__ = ["fmt", "render_all", "render_comparison", "render_report", "run_name"]

CSS = """
:root { color-scheme: light; }
* { box-sizing: border-box; }
body { font: 16px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; color: #222;
  margin: 0 auto; max-width: 1040px; padding: 12px 16px 40px; background: #fff; }
h1 { font-size: 1.6em; margin: .4em 0 .1em; }
h2 { font-size: 1.25em; margin: 1.6em 0 .5em; border-bottom: 1px solid #ddd; padding-bottom: 3px; }
h3 { font-size: 1.05em; margin: 1.2em 0 .4em; }
.meta { color: #555; margin: 0 0 .8em; }
.answer { background: #f4f8fc; border-left: 4px solid #1f77b4; padding: 8px 14px 8px 30px;
  margin: 0; font-size: 1.08em; }
.answer li { margin: .3em 0; }
figure { margin: 0 0 1.6em; break-inside: avoid; }
figcaption { color: #444; font-size: .92em; margin-top: .3em; }
.grid { display: grid; grid-template-columns: repeat(auto-fill, minmax(320px, 1fr));
  gap: 6px 18px; }
.wide { max-width: 720px; }
svg.chart { width: 100%; height: auto; display: block; }
ul.legend { list-style: none; padding: 0; margin: .2em 0 .5em; display: flex; flex-wrap: wrap;
  gap: 2px 16px; font-size: .9em; }
ul.legend li { display: flex; align-items: center; gap: 6px; }
.swatch { display: inline-block; width: 18px; height: 11px; border-radius: 2px; }
.swatch.rtt { border-left: 2px dashed #555; width: 2px; height: 14px; border-radius: 0; }
.swatch.budget { border-left: 2px solid #c00000; width: 2px; height: 14px; border-radius: 0; }
.swatch.band { background: #e4e4e4; }
.scroll { overflow-x: auto; margin-bottom: 1em; }
table { border-collapse: collapse; font-size: .9em; font-variant-numeric: tabular-nums; }
th, td { padding: 3px 8px; border-bottom: 1px solid #e6e6e6; text-align: right;
  vertical-align: top; }
th { background: #f6f6f6; font-weight: 600; }
th:first-child, td:first-child, td.text { text-align: left; }
td { white-space: nowrap; }
th .sub { display: block; font-weight: normal; color: #555; font-size: .9em; }
td.over { background: #fde0dc; font-weight: 600; }
td.na { color: #999; }
tr.moved td { background: #fff7e0; }
tr.regressed td { background: #fde0dc; }
dl.conditions { display: grid; grid-template-columns: max-content 1fr; gap: 2px 14px; margin: 0; }
dl.conditions dt { color: #555; }
dl.conditions dd { margin: 0; overflow-wrap: anywhere; }
.words { margin: .2em 0 .6em; }
.small { font-size: .9em; color: #444; }
code { font-size: .92em; }
nav ul { padding-left: 20px; }
@media (max-width: 600px) { body { font-size: 15px; padding: 8px 10px 30px; }
  .grid { grid-template-columns: 1fr; } }
@media print { body { max-width: none; font-size: 11pt; } .scroll { overflow: visible; }
  details > *:not(summary) { display: block; } h2 { break-after: avoid; } }
"""


def _e(value: Any) -> str:
    return html.escape(str(value))


def fmt(value: Any) -> str:
    """A number for a table: 2 decimals below 10, one above, thousands separated."""
    if value is None:
        return "-"
    if isinstance(value, bool) or not isinstance(value, float):
        return str(value)
    if math.isnan(value):
        return "-"
    if value != 0 and abs(value) < 10:
        return f"{value:.3g}" if abs(value) < 0.01 else f"{value:.2f}"
    return f"{value:,.1f}"


def _page(title: str, body: str) -> str:
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            f"<title>{_e(title)}</title><style>{CSS}</style></head><body>\n{body}\n"
            "</body></html>\n")


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], *, classes: Sequence[str] = (),
           raw: bool = False) -> str:
    """A table; cells and headers are escaped unless ``raw`` (then they are trusted HTML:
    ``<td>`` elements, and header contents)."""
    head = "".join(f"<th>{h if raw else _e(h)}</th>" for h in header)
    body = []
    for i, row in enumerate(rows):
        cls = f' class="{classes[i]}"' if i < len(classes) and classes[i] else ""
        cells = "".join(row) if raw else "".join(f"<td>{_e(c)}</td>" for c in row)
        body.append(f"<tr{cls}>{cells}</tr>")
    return (f'<div class="scroll"><table><thead><tr>{head}</tr></thead>'
            f"<tbody>{''.join(body)}</tbody></table></div>")


# -- tables ----------------------------------------------------------------------------------


def _heat(value: float, total: float) -> str:
    """A background from green (fast) to red (at or over the budget)."""
    hue = 120 * (1 - min(max(value / total, 0.0), 1.0))
    return f"background:hsl({hue:.0f},70%,86%)"


def _ttft_table(results: Mapping[str, Any]) -> str:
    """Client x transport rows, cold / 0-RTT / warm columns side by side (P50, P95 if n>=20)."""
    groups: dict[str, dict[str, Mapping[str, Any]]] = {}
    for run in runs_of(results):
        cell, group = run.get("cell"), run.get("client") or run.get("place")
        if isinstance(cell, str) and cell.count("/") == 2 and group:
            groups.setdefault(str(group).removeprefix("client-"), {})[cell] = run
    if not groups:
        return ""
    total = next((float(r["budget_total_ms"]) for r in runs_of(results)
                  if isinstance(r.get("budget_total_ms"), int | float)), 500.0)
    states = [s for s in STATE if any(c.endswith("/" + s) for g in groups.values() for c in g)]
    rows = []
    for group, cells in groups.items():
        families = dict.fromkeys(c.rsplit("/", 1)[0] for c in cells)
        for i, family in enumerate(families):
            first = f'<td class="text">{_e(group) if i == 0 else ""}</td>'
            tds = [first, f'<td class="text">{_e(cell_name(family + "/cold", with_state=False))}'
                   "</td>"]
            for state in states:
                got = cells.get(f"{family}/{state}")
                p50 = got.get("p50_ttft_ms") if got else None
                if not isinstance(p50, int | float) or not got or not got.get("completed"):
                    tds.append('<td class="na">-</td>')
                    continue
                text, shade = f"{p50:.0f}", float(p50)
                p95 = got.get("p95_ttft_ms")
                if int(got.get("completed") or 0) >= MIN_TAIL_SAMPLES and isinstance(
                        p95, int | float):
                    text, shade = text + f' <span class="small">/ {p95:.0f}</span>', float(p95)
                tds.append(f'<td style="{_heat(shade, total)}">{text}</td>')
            rows.append(tds)
    tails = any(int(r.get("completed") or 0) >= MIN_TAIL_SAMPLES for g in groups.values()
                for r in g.values())
    what = "P50 / P95 ms" if tails else "P50 ms"
    header = ["client", "transport", *(f"{STATE[s]} {_e(what)}" for s in states)]
    note = ("Colour: green is fast, red is at the budget "
            f"({total:.0f} ms) or over; coloured by P95 where shown.")
    return (f"<h3>Time to first token ({what})</h3>" + _table(header, rows, raw=True)
            + f'<p class="small">{_e(note)}</p>')


def _budget_table(results: Mapping[str, Any]) -> str:
    bars = budget_bars(results)
    if not bars:
        return ""
    run = next(r for r in runs_of(results) if r.get("budget_lines_ms"))
    budget = LatencyBudget(total_ms=float(run.get("budget_total_ms") or 500.0))
    lines = budget.lines()
    header = ["request", *(f"{_e(PHASE_MEANING.get(line.name, line.name))}<span class=\"sub\">"
                           f"{_e(line.name)}: {line.allowance_ms:.0f} ms, "
                           f"{line.allowance_ms / budget.total_ms:.0%}</span>" for line in lines),
              f"total<span class=\"sub\">of {budget.total_ms:.0f} ms</span>", "verdict"]
    rows, words = [], []
    for name, measured in bars.items():
        report = BudgetReport(total_ms=budget.total_ms, safety_ms=budget.safety_ms, lines=[
            LineResult(line.name, line.category, line.allowance_ms, measured.get(line.name))
            for line in lines])
        tds = [f'<td class="text">{_e(name)}</td>']
        for line in report.lines:
            if line.measured_ms is None:
                tds.append('<td class="na">not seen</td>')
                continue
            used = f" ({(line.used_fraction or 0) * 100:.0f}%)"
            cls = ' class="over"' if line.overran else ""
            tds.append(f"<td{cls}>{line.measured_ms:.1f}{used}</td>")
        tds.append(f"<td>{report.measured_ms:.1f}</td>")
        verdict = "within budget" if report.within_budget else "OVER BUDGET"
        tds.append(f'<td class="text">{verdict}</td>')
        rows.append(tds)
        if report.overruns or not report.within_budget:
            over = ", ".join(f"{PHASE_MEANING.get(n, n)} at {(line.used_fraction or 0):.0%}"
                             for line in report.lines if line.overran for n in [line.name])
            fits = (f"yet the request fits: {report.measured_ms:.0f} of {budget.total_ms:.0f} ms"
                    + (f", {report.safety_used_ms:.0f} ms of it from the safety share"
                       if report.safety_used_ms > 0 else ", the safety share untouched")
                    if report.within_budget else
                    f"and the request is OVER BUDGET: {report.measured_ms:.0f} ms")
            words.append(f"<li><b>{_e(name)}</b>: {_e(over)} of its allowance, {_e(fits)}.</li>")
    safety = (f"The remaining {budget.safety_ms:.0f} ms ({budget.safety_share:.0%}) is the "
              "safety share, kept for the P95-P99 tail and never allotted to a phase. A phase "
              "over its allowance (red) is not a failure while the request as a whole fits "
              "the budget: the other phases' unused time, then the safety share, absorb it.")
    return ("<h3>Latency budget per request (mean ms, and the share of each phase's allowance "
            "used)</h3>" + _table(header, rows, raw=True)
            + f'<p class="small">{_e(safety)}</p>'
            + (f'<ul class="words">{"".join(words)}</ul>' if words else ""))


_RUN_COLUMNS: dict[str, str] = {
    "completed": "ok", "failed": "failed", "p50_ttft_ms": "TTFT P50", "p95_ttft_ms": "TTFT P95",
    "p99_ttft_ms": "TTFT P99", "p99_itl_ms": "ITL P99", "mean_tpot_ms": "TPOT mean",
    "p50_e2el_ms": "E2EL P50", "p50_connect_ms": "connect P50",
    "p50_first_byte_ms": "first byte P50", "request_throughput": "req/s",
    "goodput_fraction": "goodput",
}
_LABEL_KEYS = ("label", "transport", "protocol", "geography")


def run_name(run: Mapping[str, Any]) -> str:
    """A run's row name: its label, transport, protocol and geography, without repeats."""
    parts = [str(run[key]) for key in _LABEL_KEYS if run.get(key)]
    if not parts:
        parts = [next((str(v) for v in run.values() if isinstance(v, str)), "run")]
    return " ".join(dict.fromkeys(parts))


def _rows_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """Request-level runs get the standard columns (tails blank under the sample minimum);
    other rows every scalar column (up to 12)."""
    columns = [k for k in _RUN_COLUMNS if any(k in r for r in rows)]
    names = dict(_RUN_COLUMNS)
    if not columns:
        columns = [k for k in dict.fromkeys(k for r in rows for k in r)
                   if k not in _LABEL_KEYS
                   and all(isinstance(r.get(k), int | float | str | None) for r in rows)][:12]
        names = {k: k for k in columns}
    body = []
    for r in rows:
        cells = [f'<td class="text">{_e(run_name(r))}</td>']
        for k in columns:
            if tail_withheld(r, k):
                cells.append(f'<td class="na" title="fewer than {MIN_TAIL_SAMPLES} requests">'
                             "n&lt;20</td>")
            else:
                text = ' class="text"' if isinstance(r.get(k), str) else ""
                cells.append(f"<td{text}>{_e(fmt(r.get(k)))}</td>")
        body.append(cells)
    ms = any(k.endswith("_ms") for k in columns)
    header = ["run", *(_e(names[k]) + (" ms" if k.endswith("_ms") and ms and names is _RUN_COLUMNS
                                         else "") for k in columns)]
    return _table(header, body, raw=True)


_META_KEYS = {"scenario", "description", "quick", "date", "host", "metric_definitions", "notes",
              "conditions"}


def _tables(results: Mapping[str, Any]) -> str:
    parts = [_ttft_table(results), _budget_table(results)]
    summary = results.get("summary")
    if not isinstance(summary, Mapping):
        summary = {k: v for k, v in results.items()
                   if k not in _META_KEYS and isinstance(v, int | float | str | bool)}
    if summary:
        parts.append("<h3>Headline numbers</h3>" + _table(
            ["result", "value"], [[str(k), fmt(v)] for k, v in summary.items()]))
    runs = runs_of(results)
    if runs:
        note = tail_note(runs)
        parts.append(f"<details><summary><b>Every run ({len(runs)})</b></summary>"
                     + _rows_table(runs)
                     + (f'<p class="small">{_e(note)}</p>' if note else "") + "</details>")
    for key, value in results.items():
        if key in _META_KEYS or key == "runs" or not isinstance(value, list):
            continue
        rows = [row for row in value if isinstance(row, Mapping)]
        if rows:
            parts.append(f"<h3>{_e(key.replace('_', ' '))}</h3>" + _rows_table(rows))
    return "".join(p for p in parts if p)


# -- sections --------------------------------------------------------------------------------


def _figures(results: Mapping[str, Any]) -> str:
    out = []
    for fig in figures(results):
        grid = "grid" if len(fig.panels) > 1 else "wide"
        out.append(f'<figure id="fig-{fig.key}" data-figure="{fig.key}"><h3>{_e(fig.title)}</h3>'
                   f'{fig.legend}<div class="{grid}">{"".join(fig.panels)}</div>'
                   f"<figcaption>{_e(fig.caption)}</figcaption></figure>")
    return "".join(out)


def _conditions(results: Mapping[str, Any]) -> str:
    items: list[tuple[str, str]] = []
    if results.get("date"):
        items.append(("date", str(results["date"])))
    items.append(("run", "quick (--quick: few requests, a check that it works)"
                  if results.get("quick") else "full"))
    summary = results.get("summary") if isinstance(results.get("summary"), Mapping) else {}
    assert isinstance(summary, Mapping)
    if summary.get("mode"):
        items.append(("network", "emulated WAN (network namespaces + the userspace delay line)"
                      if summary["mode"] == "emulated" else "loopback (no distances)"))
    error = summary.get("emulator_max_abs_error_ms")
    if isinstance(error, int | float):
        items.append(("emulator precision", f"every measured RTT within {error:.2f} ms of "
                                            "the configured one"))
    conditions = results.get("conditions")
    if isinstance(conditions, Mapping):
        for key in ("machine", "os", "python", "commit", "command"):
            if conditions.get(key):
                items.append((key, str(conditions[key])))
        share = conditions.get("foreign_cpu_share")
        if isinstance(share, int | float):
            items.append(("foreign CPU", f"{share:.0%} of the machine's CPU was used by other "
                                         "processes during the run"))
    else:
        host = results.get("host")
        if isinstance(host, Mapping):
            items.append(("machine", f"{host.get('machine')}, {host.get('cpus')} CPUs, Python "
                                     f"{host.get('python')}"))
    body = "".join(f"<dt>{_e(k)}</dt><dd>{_e(v)}</dd>" for k, v in items)
    return f'<dl class="conditions">{body}</dl>'


def _notes(results: Mapping[str, Any]) -> str:
    out = ""
    if results.get("description"):
        out += f"<p>{_e(results['description'])}</p>"
    notes = results.get("notes")
    if isinstance(notes, Sequence) and not isinstance(notes, str) and notes:
        out += "<ul>" + "".join(f"<li>{_e(n)}</li>" for n in notes) + "</ul>"
    definitions = results.get("metric_definitions") or METRIC_DEFINITIONS
    if isinstance(definitions, Mapping):
        out += ("<p>Metric definitions (the same as <code>vllm bench serve</code>):</p><ul>"
                + "".join(f"<li><b>{_e(k)}</b>: {_e(v)}</li>" for k, v in definitions.items())
                + "</ul>")
    return out


def _section(results: Mapping[str, Any], level: int) -> str:
    h = f"h{level}"
    answer = "".join(f"<li>{_e(s)}</li>" for s in headline(results))
    figs = _figures(results)
    return (f'<{h}>The answer</{h}><ul class="answer" data-headline>{answer}</ul>'
            + (f"<{h}>Figures</{h}>{figs}" if figs else "")
            + f"<{h}>Tables</{h}>{_tables(results)}"
            + f"<{h}>Run conditions</{h}>{_conditions(results)}"
            + f"<{h}>Notes and definitions</{h}>{_notes(results)}")


def _title(results: Mapping[str, Any]) -> str:
    name = str(results.get("scenario", "benchmark"))
    return "firstbyte demo" if name == "demo" else f"firstbyte bench {name}"


def render_report(results: Mapping[str, Any]) -> str:
    """One scenario's (or the demo's) page."""
    title = _title(results)
    meta = ("quick run" if results.get("quick") else "full run") + (
        f", {results['date']}" if results.get("date") else "")
    return _page(title, f"<h1>{_e(title)}</h1><p class=\"meta\">{_e(meta)}</p>"
                 + _section(results, 2))


def render_all(combined: Mapping[str, Any]) -> str:
    """``bench all``: every scenario's answer first, then one section per scenario."""
    scenarios = combined.get("scenarios")
    scenarios = scenarios if isinstance(scenarios, Mapping) else {}
    nav = []
    sections = []
    for name, results in scenarios.items():
        if not isinstance(results, Mapping):
            continue
        first = headline(results)[:1]
        nav.append(f'<li><a href="#{_e(name)}">{_e(name)}</a>'
                   + (f": {_e(first[0])}" if first else "") + "</li>")
        sections.append(f'<section id="{_e(name)}"><h2>{_e(name)}</h2>'
                        + _section(results, 3) + "</section>")
    quick = "quick run" if combined.get("quick") else "full run"
    skipped = combined.get("skipped")
    not_run = "".join(f"<li>{_e(name)}: {_e(str(why))}</li>" for name, why in skipped.items()
                      ) if isinstance(skipped, Mapping) else ""
    return _page("firstbyte bench all",
                 f"<h1>firstbyte bench all</h1><p class=\"meta\">{quick}, {len(sections)} "
                 f"scenarios</p>"
                 + (f"<h2>Not run here</h2><ul>{not_run}</ul>" if not_run else "")
                 + f"<h2>The answers</h2><nav><ul class=\"answer\" data-headline>"
                 f"{''.join(nav)}</ul></nav>" + "".join(sections))


# -- comparison ------------------------------------------------------------------------------


def _noise_floor(row: Row, comparison: Comparison) -> float | None:
    if row.baseline is None:
        return None
    return max(row.baseline * comparison.threshold, comparison.min_delta_ms)


def render_comparison(comparison: Comparison, baseline: str, new: str) -> str:
    """Baseline against a new run: the metrics that moved beyond the threshold first (both
    values, the change and the noise floor), then the ones that stayed within it."""
    moved = [r for r in comparison.rows if r.status is not Status.OK]
    moved.sort(key=lambda r: (r.status is not Status.REGRESSED, -abs(r.change or 0)))
    still = [r for r in comparison.rows if r.status is Status.OK]
    n = len(comparison.regressions)
    limit = f"{comparison.threshold:.0%}" + (
        f" and {comparison.min_delta_ms:g} ms" if comparison.min_delta_ms else "")
    words = [f"{n} tracked P95/P99 latenc{'y' if n == 1 else 'ies'} regressed by more than "
             f"{limit}." if n else f"No tracked P95/P99 latency regressed by more than {limit}."]
    improved = sum(1 for r in comparison.rows if r.status is Status.IMPROVED)
    if improved:
        words.append(f"{improved} improved by more than {comparison.threshold:.0%}.")
    if not comparison.compared:
        reason = comparison.nothing_compared()
        words = [f"Nothing was compared: {reason[0].lower()}{reason[1:]}."]
    if comparison.skipped:
        words.append(f"In only one of the files (not compared): {', '.join(comparison.skipped)}.")
    words.append(f"{len(still)} metric(s) stayed within the threshold.")

    def rows(selected: Sequence[Row]) -> tuple[list[list[str]], list[str]]:
        body, classes = [], []
        for r in selected:
            floor = _noise_floor(r, comparison)
            body.append([r.metric, fmt(r.baseline), fmt(r.new),
                         "-" if r.change is None else f"{r.change * 100:+.1f}%",
                         "-" if floor is None else f"{floor:.2f}", r.status.value])
            classes.append("regressed" if r.status is Status.REGRESSED else
                           "moved" if r.status is not Status.OK else "")
        return body, classes

    header = ["metric (scenario/run/metric)", "baseline ms", "new ms", "change",
              "noise floor ms", "status"]
    moved_rows, moved_classes = rows(moved)
    still_rows, _ = rows(still)
    body = (f"<h1>firstbyte bench compare</h1><p class=\"meta\">baseline {_e(baseline)}<br>"
            f"new {_e(new)}</p><h2>The answer</h2><ul class=\"answer\" data-headline>"
            + "".join(f"<li>{_e(w)}</li>" for w in words) + "</ul>"
            + "<h2>Moved beyond the threshold</h2>"
            + (_table(header, moved_rows, classes=moved_classes) if moved_rows else
               "<p>None.</p>")
            + f"<h2>Within the threshold ({len(still_rows)})</h2>"
            + (f"<details><summary>show</summary>{_table(header, still_rows)}</details>"
               if still_rows else "<p>None.</p>")
            + "<h2>How to read it</h2><p>Tracked metrics are every P95 and P99 latency of "
            "every run and headline. The noise floor of a metric is the larger of the "
            f"threshold ({comparison.threshold:.0%} of the baseline) and the absolute floor "
            f"(--min-delta-ms, {comparison.min_delta_ms:g} ms): a change smaller than it is "
            "not called a regression.</p>")
    return _page("firstbyte bench compare", body)
