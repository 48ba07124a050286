"""Benchmark reports: one JSON file, a Markdown summary and PNG plots, for any scenario.

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

:func:`write_report` adds the metric definitions, the date and the host, and writes
``results.json``, ``summary.md``, ``ttft_cdf.png`` (when runs carry ``ttfts_ms``) and
``phases.png`` (when runs carry ``budget_lines_ms``; one stacked bar per geography, or per
run label without one, against the latency budget with its safety share).
"""

from __future__ import annotations

import datetime as dt
import math
import os
import platform
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec

from firstbyte.benchmarks.stats import METRIC_DEFINITIONS

__all__ = ["markdown_summary", "write_report"]

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
_LABEL_KEYS = ("label", "transport", "protocol", "geography")
_META_KEYS = {"scenario", "description", "quick", "date", "host", "metric_definitions", "notes"}
_PHASE_COLOURS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860")


def write_report(results: Mapping[str, Any], out_dir: str | os.PathLike[str]) -> dict[str, Path]:
    """Write the report files into ``out_dir`` (created if needed); return name -> path.

    The JSON is the results plus ``metric_definitions``, ``date`` and ``host``; NaN and
    infinities become ``null`` so any JSON reader accepts the file.
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
    full["metric_definitions"] = dict(METRIC_DEFINITIONS)
    paths: dict[str, Path] = {}
    paths["json"] = out / "results.json"
    paths["json"].write_bytes(msgspec.json.format(msgspec.json.encode(full), indent=2) + b"\n")
    runs = _runs(full)
    if any(run.get("ttfts_ms") for run in runs):
        paths["ttft_cdf"] = _plot_ttft_cdf(runs, out / "ttft_cdf.png")
    if any(run.get("budget_lines_ms") for run in runs):
        paths["phases"] = _plot_phases(runs, out / "phases.png")
    paths["markdown"] = out / "summary.md"
    images = {k: p.name for k, p in paths.items() if p.suffix == ".png"}
    paths["markdown"].write_text(markdown_summary(full, images=images))
    return paths


def markdown_summary(results: Mapping[str, Any], *, images: Mapping[str, str] | None = None) -> str:
    """The report as Markdown: headline numbers, a runs table, notes and metric definitions."""
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
    for name, file in (images or {}).items():
        lines += [f"![{name}]({file})", ""]
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


def _run_name(run: Mapping[str, Any]) -> str:
    parts = [str(run[key]) for key in _LABEL_KEYS if run.get(key)]
    if not parts:  # no label: the row's first text field names it (e.g. "server")
        parts = [next((v for v in run.values() if isinstance(v, str)), "run")]
    return " ".join(dict.fromkeys(parts))


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
        cells = [_run_name(run), *(_fmt(run.get(key)) for key in columns)]
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool) or not isinstance(value, float):
        return str(value)
    if math.isnan(value):
        return "-"
    if value != 0 and abs(value) < 10:
        return f"{value:.3g}" if abs(value) < 0.01 else f"{value:.2f}"
    return f"{value:,.1f}"


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers and CI
    import matplotlib.pyplot as plt

    return plt


def _plot_ttft_cdf(runs: Sequence[Mapping[str, Any]], path: Path) -> Path:
    """One empirical CDF of TTFT per run (labelled by transport and protocol)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    try:
        for run in runs:
            values = sorted(v for v in run.get("ttfts_ms") or [] if v is not None)
            if not values:
                continue
            fractions = [(i + 1) / len(values) for i in range(len(values))]
            ax.step(values, fractions, where="post", label=_run_name(run))
        ax.set_xlabel("TTFT (ms): request start to first content chunk")
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.01)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small", loc="lower right")
        ax.set_title("TTFT CDF per transport and protocol")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)
    return path


def _plot_phases(runs: Sequence[Mapping[str, Any]], path: Path) -> Path:
    """Stacked mean budget lines per geography (or run), with the budget and its safety share."""
    plt = _pyplot()
    bars: dict[str, Mapping[str, float]] = {}
    total_ms, safety_ms = 500.0, 75.0
    for run in runs:
        lines = run.get("budget_lines_ms")
        if not isinstance(lines, Mapping) or not lines:
            continue
        name = str(run.get("geography") or _run_name(run))
        bars.setdefault(name, lines)
        total_ms = float(run.get("budget_total_ms") or total_ms)
        safety_ms = float(run.get("budget_safety_ms") or safety_ms)
    phase_names = list(dict.fromkeys(name for lines in bars.values() for name in lines))
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(bars) + 3), 5))
    try:
        xs = list(range(len(bars)))
        bottoms = [0.0] * len(bars)
        for i, phase in enumerate(phase_names):
            heights = [float(lines.get(phase, 0.0)) for lines in bars.values()]
            ax.bar(
                xs,
                heights,
                bottom=bottoms,
                label=phase,
                color=_PHASE_COLOURS[i % len(_PHASE_COLOURS)],
                zorder=2,
            )
            bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
        ax.axhspan(
            total_ms - safety_ms,
            total_ms,
            color="#cccccc",
            alpha=0.6,
            zorder=1,
            label=f"safety share ({safety_ms:.0f} ms)",
        )
        ax.axhline(
            total_ms, color="#c00000", linewidth=1.5, zorder=3, label=f"budget {total_ms:.0f} ms"
        )
        ax.set_xticks(xs, list(bars), rotation=20, ha="right")
        ax.set_ylabel("mean ms per phase")
        ax.set_ylim(0, max([total_ms * 1.1, *(b * 1.05 for b in bottoms)]))
        ax.set_title("Where the latency budget goes")
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
        fig.tight_layout()
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)
    return path
