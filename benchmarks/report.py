"""Benchmark reports: one JSON file, a Markdown summary and one self-contained HTML page
(``report.html``: the answer in words, figures, tables, run conditions), for any scenario.

A scenario's ``run(quick) -> dict`` returns results shaped like this (every key optional
except ``scenario``)::

    {
      "scenario": "router_overhead",
      "description": "one paragraph: what was measured and how",
      "quick": true,
      "summary": {"added_p50_ttft_ms_c100": 0.4, ...},   # headline numbers
      "runs": [                                           # one per condition measured
        {"label": "direct c=1", "transport": "sse", "protocol": "HTTP/1.1",
         "geography": "us-east-1", **benchmarks.stats.summarize(...)},
      ],
      "notes": ["anything a reader must know to trust the numbers"],
    }

:func:`write_report` adds the metric definitions, the date, the host and the run's
conditions (:mod:`firstbyte.benchmarks.conditions`), and writes ``results.json``,
``summary.md`` and ``report.html`` (:mod:`firstbyte.benchmarks.report_html`; the figures it
draws depend on what the runs carry: ``cell`` per client, ``ttfts_ms``, ``budget_lines_ms``,
``concurrency``).
"""

from __future__ import annotations

import datetime as dt
import os
import platform
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec

from firstbyte.benchmarks.conditions import run_conditions
from firstbyte.benchmarks.report_html import fmt as _fmt
from firstbyte.benchmarks.report_html import render_all, render_report
from firstbyte.benchmarks.report_html import run_name as _run_name
from firstbyte.benchmarks.report_views import tail_withheld
from firstbyte.benchmarks.stats import METRIC_DEFINITIONS

__all__ = ["markdown_summary", "write_combined_report", "write_json", "write_report"]

# Columns of the runs table: result key -> header. Only columns some run has are shown.
_RUN_COLUMNS: dict[str, str] = {
    "completed": "ok",
    "failed": "failed",
    "p50_ttft_ms": "TTFT p50 ms",
    "p95_ttft_ms": "TTFT p95 ms",
    "p99_ttft_ms": "TTFT p99 ms",
    "p99_itl_ms": "ITL p99 ms",
    "mean_tpot_ms": "TPOT mean ms",
    "p50_e2el_ms": "E2EL p50 ms",
    "p50_connect_ms": "connect p50 ms",
    "p50_first_byte_ms": "first byte p50 ms",
    "request_throughput": "req/s",
    "goodput_fraction": "goodput",
}
_LABEL_KEYS = ("label", "transport", "protocol", "geography")  # named by run_name
_META_KEYS = {"scenario", "description", "quick", "date", "host", "metric_definitions", "notes"}


def write_json(data: Mapping[str, Any], path: Path) -> Path:
    """Indented JSON; NaN and infinities become ``null`` so any JSON reader accepts the file."""
    path.write_bytes(msgspec.json.format(msgspec.json.encode(data), indent=2) + b"\n")
    return path


def write_report(results: Mapping[str, Any], out_dir: str | os.PathLike[str]) -> dict[str, Path]:
    """Write ``results.json``, ``summary.md`` and ``report.html`` into ``out_dir`` (created if
    needed); return name -> path (``json``, ``markdown``, ``html``).

    The JSON is the results plus ``metric_definitions``, ``date``, ``host`` and ``conditions``
    (unless the results carry their own, measured over the run: see
    :class:`~firstbyte.benchmarks.conditions.CpuWatch`).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    full = dict(results)
    full.setdefault("date", dt.datetime.now(dt.UTC).isoformat(timespec="seconds"))
    full.setdefault(
        "host",
        {
            "python": platform.python_version(),
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
        },
    )
    full.setdefault("conditions", run_conditions())
    full["metric_definitions"] = dict(METRIC_DEFINITIONS)
    paths = {"json": write_json(full, out / "results.json")}
    # What the page shows is what the JSON says (NaN already turned into null).
    decoded = msgspec.json.decode(paths["json"].read_bytes())
    paths["html"] = out / "report.html"
    paths["html"].write_text(render_report(decoded), encoding="utf-8")
    paths["markdown"] = out / "summary.md"
    paths["markdown"].write_text(markdown_summary(full, html="report.html"))
    return paths


def write_combined_report(combined: Mapping[str, Any], out_dir: Path) -> dict[str, Path]:
    """``bench all``: the combined ``results.json`` and one ``report.html`` with a section
    per scenario."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": write_json(combined, out_dir / "results.json")}
    paths["html"] = out_dir / "report.html"
    paths["html"].write_text(render_all(msgspec.json.decode(paths["json"].read_bytes())),
                             encoding="utf-8")
    return paths


def markdown_summary(results: Mapping[str, Any], *, html: str | None = None) -> str:
    """The report as Markdown: headline numbers, a runs table, notes and metric definitions;
    ``html`` names the page with the figures."""
    lines = [f"# Benchmark: {results.get('scenario', 'unnamed')}", ""]
    if results.get("description"):
        lines += [str(results["description"]), ""]
    meta = [f"date {results['date']}"] if results.get("date") else []
    meta.append("quick run" if results.get("quick") else "full run")
    host = results.get("host")
    if isinstance(host, Mapping):
        meta.append(f"Python {host.get('python')} on {host.get('cpus')} CPUs")
    lines += ["_" + ", ".join(meta) + "_", ""]
    summary = results.get("summary")
    if not isinstance(summary, Mapping):
        # A scenario with its own layout: its top-level scalars are its headline numbers.
        summary = {
            key: value
            for key, value in results.items()
            if key not in _META_KEYS and isinstance(value, int | float | str | bool)
        }
    if summary:
        lines += ["| result | value |", "|---|---:|"]
        lines += [f"| {key} | {_fmt(value)} |" for key, value in summary.items()]
        lines.append("")
    failed = results.get("failed_checks")
    if isinstance(failed, Sequence) and not isinstance(failed, str) and failed:
        lines += ["**Failed checks:**", ""] + [f"- {check}" for check in failed] + [""]
    runs = _runs(results)
    if runs:
        lines += [*_runs_table(runs), ""]
    for key, value in results.items():
        if key in _META_KEYS or key == "runs" or not isinstance(value, list):
            continue
        rows = [row for row in value if isinstance(row, Mapping)]
        if rows:
            lines += [f"{key}:", "", *_runs_table(rows), ""]
    if html:
        lines += [f"Figures, tables and run conditions: [{html}]({html})", ""]
    notes = results.get("notes")
    if isinstance(notes, Sequence) and not isinstance(notes, str) and notes:
        lines += ["Notes:", ""] + [f"- {note}" for note in notes] + [""]
    definitions = results.get("metric_definitions") or METRIC_DEFINITIONS
    lines += ["Metric definitions (same as `vllm bench serve`):", ""]
    lines += [f"- **{name}**: {text}" for name, text in definitions.items()]
    return "\n".join(lines) + "\n"


def _runs(results: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    runs = results.get("runs")
    if not isinstance(runs, Sequence):
        return []
    return [run for run in runs if isinstance(run, Mapping)]




def _runs_table(runs: Sequence[Mapping[str, Any]]) -> list[str]:
    columns = [key for key in _RUN_COLUMNS if any(key in run for run in runs)]
    names = dict(_RUN_COLUMNS)
    if not columns:
        # Not a request-level benchmark: show every scalar the runs report.
        columns = [
            key
            for key in dict.fromkeys(k for run in runs for k in run)
            if key not in _LABEL_KEYS
            and all(isinstance(run.get(key), int | float | str | None) for run in runs)
        ][:12]
        names = {key: key for key in columns}
    header = ["run", *(names[key] for key in columns)]
    rows = ["| " + " | ".join(header) + " |", "|---" + "|---:" * len(columns) + "|"]
    for run in runs:
        cells = [_run_name(run), *("n<20" if tail_withheld(run, key) else _fmt(run.get(key))
                                   for key in columns)]
        rows.append("| " + " | ".join(cells) + " |")
    return rows


