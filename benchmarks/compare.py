"""Compare two benchmark result files and flag tail-latency regressions.

Tracked metrics are the P95 and P99 latencies (keys ``p95_*_ms`` and ``p99_*_ms``, also with a
prefix such as ``added_p99_ttft_ms``) of every run and of the headline ``summary`` of every
scenario. A metric *regresses* when the new value
exceeds the baseline by more than ``threshold`` (a fraction: 0.10 is 10%) and by more than
``min_delta_ms`` (an absolute noise floor, 0 unless asked for).

A result file holds either one scenario (``{"scenario": ..., "runs": [...]}``, as written by
``firstbyte bench SCENARIO``) or several (``{"scenarios": {name: results}}``, as written by
``firstbyte bench all``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from enum import StrEnum
from typing import Any

import msgspec

__all__ = ["Comparison", "Row", "Status", "compare", "load_results", "tracked_metrics"]

_TRACKED = re.compile(r"(^|_)p(95|99)_[a-z0-9_]+_ms$")
_LABEL_KEYS = ("label", "transport", "protocol", "geography")


class Status(StrEnum):
    OK = "ok"
    REGRESSED = "REGRESSED"
    IMPROVED = "improved"
    NEW = "new"
    MISSING = "missing"


class Row(msgspec.Struct, frozen=True):
    metric: str
    baseline: float | None
    new: float | None
    change: float | None
    """(new - baseline) / |baseline|, or None when either side is absent or the baseline is 0."""
    status: Status


class Comparison(msgspec.Struct, frozen=True):
    threshold: float
    min_delta_ms: float
    rows: list[Row]
    skipped: list[str] = msgspec.field(default_factory=list)
    """Scenarios in only one of the two files (not compared)."""

    @property
    def regressions(self) -> list[Row]:
        return [row for row in self.rows if row.status is Status.REGRESSED]

    @property
    def compared(self) -> list[Row]:
        """The metrics in both files (regressed, improved or within the threshold)."""
        return [row for row in self.rows if row.status not in (Status.NEW, Status.MISSING)]

    @property
    def ok(self) -> bool:
        """Nothing regressed, and something was compared: two files that share no metric
        (a loopback run against emulated geographies) vouch for nothing."""
        return bool(self.compared) and not self.regressions

    def nothing_compared(self) -> str:
        """Why no metric was compared (the verdict when :attr:`compared` is empty)."""
        only_base = sum(1 for row in self.rows if row.status is Status.MISSING)
        only_new = sum(1 for row in self.rows if row.status is Status.NEW)
        if not self.rows:
            return "no tracked P95/P99 metrics in common"
        return (f"no tracked P95/P99 metric is in both files ({only_base} only in the baseline,"
                f" {only_new} only in the new run): nothing was compared; compare runs of the"
                " same mode and labels (loopback against loopback, emulated against emulated)")

    def render(self, *, all_rows: bool = True) -> str:
        """A plain-text table and a one-line verdict; without ``all_rows`` only the metrics
        that did not stay within the threshold (regressed, improved, new, missing)."""
        header = ("metric", "baseline", "new", "change", "status")
        shown = [row for row in self.rows if all_rows or row.status is not Status.OK]
        body = [
            (
                row.metric,
                _num(row.baseline),
                _num(row.new),
                "-" if row.change is None else f"{row.change * 100:+.1f}%",
                row.status.value,
            )
            for row in shown
        ]
        widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]
        lines = []
        for r in [header, *body]:
            cells = [r[0].ljust(widths[0])] + [r[i].rjust(widths[i]) for i in (1, 2, 3)]
            lines.append("  ".join([*cells, r[4]]).rstrip())
        lines.insert(1, "  ".join("-" * w for w in widths))
        n = len(self.regressions)
        limit = f"{self.threshold * 100:.0f}%"
        if self.min_delta_ms:
            limit += f" and {self.min_delta_ms:g} ms"
        verdict = (
            f"{n} tracked P95/P99 metric(s) regressed by more than {limit}"
            if n
            else f"no tracked P95/P99 metric regressed by more than {limit}"
        )
        if not self.compared:
            verdict = self.nothing_compared()
        if self.skipped:
            verdict += f"; not in both files: {', '.join(self.skipped)}"
        hidden = len(self.rows) - len(shown)
        if hidden:
            verdict += f" ({hidden} within the threshold not shown; --all shows them)"
        return "\n".join([*lines, "", verdict])


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def load_results(data: bytes) -> dict[str, Any]:
    """Decode a result file; raises ``ValueError`` with a readable reason when it is not one."""
    try:
        decoded = msgspec.json.decode(data)
    except msgspec.DecodeError as exc:
        raise ValueError(f"not valid JSON ({exc})") from None
    if not isinstance(decoded, dict) or not ("scenario" in decoded or "scenarios" in decoded):
        raise ValueError("not a firstbyte benchmark result (no 'scenario' or 'scenarios' key)")
    return decoded


def tracked_metrics(results: Mapping[str, Any]) -> dict[str, float]:
    """Every tracked P95/P99 latency, keyed ``scenario/run/metric`` (``summary`` for headlines)."""
    out: dict[str, float] = {}
    scenarios = results.get("scenarios")
    if isinstance(scenarios, Mapping):
        for name, sub in scenarios.items():
            if isinstance(sub, Mapping):
                out |= _scenario_metrics(str(name), sub)
    else:
        out |= _scenario_metrics(str(results.get("scenario", "")), results)
    return out


def _scenario_metrics(scenario: str, results: Mapping[str, Any]) -> dict[str, float]:
    out: dict[str, float] = {}
    sections: list[tuple[str, Any]] = [("summary", results.get("summary"))]
    runs = results.get("runs")
    if isinstance(runs, list):
        for i, run in enumerate(runs):
            if isinstance(run, Mapping):
                parts = [str(run[k]) for k in _LABEL_KEYS if run.get(k)]
                sections.append((" ".join(dict.fromkeys(parts)) or f"run{i}", run))
    for section, values in sections:
        if not isinstance(values, Mapping):
            continue
        for key, value in values.items():
            is_number = isinstance(value, int | float) and not isinstance(value, bool)
            if is_number and _TRACKED.search(key):
                out[f"{scenario}/{section}/{key}"] = float(value)
    return out


def compare(
    baseline: Mapping[str, Any],
    new: Mapping[str, Any],
    *,
    threshold: float = 0.10,
    min_delta_ms: float = 0.0,
) -> Comparison:
    """Compare every tracked metric of ``new`` against ``baseline``."""
    if not threshold > 0:
        raise ValueError(f"threshold must be a positive fraction (0.10 = 10%), not {threshold}")
    if not min_delta_ms >= 0:  # also nan, which would turn the gate off
        raise ValueError(f"min_delta_ms must be 0 or more, not {min_delta_ms}")
    base, current = tracked_metrics(baseline), tracked_metrics(new)
    # Only scenarios both files ran: one scenario's result against a combined baseline
    # compares that scenario, not "missing" for all the others.
    in_base = {key.split("/", 1)[0] for key in base}
    in_new = {key.split("/", 1)[0] for key in current}
    common = in_base & in_new
    base = {k: v for k, v in base.items() if k.split("/", 1)[0] in common}
    current = {k: v for k, v in current.items() if k.split("/", 1)[0] in common}
    rows: list[Row] = []
    for metric in sorted(base.keys() | current.keys()):
        b, n = base.get(metric), current.get(metric)
        if b is None:
            rows.append(Row(metric, None, n, None, Status.NEW))
            continue
        if n is None:
            rows.append(Row(metric, b, None, None, Status.MISSING))
            continue
        # Relative to the baseline's size: an added latency may be negative (the router
        # faster than direct), and -2.7 to -2.6 ms is 3.7% worse, not a regression.
        change = (n - b) / abs(b) if b != 0 else None
        status = Status.OK
        if n - b > min_delta_ms and (change is None or change > threshold):
            status = Status.REGRESSED
        elif change is not None and change < -threshold:
            status = Status.IMPROVED
        rows.append(Row(metric, b, n, change, status))
    return Comparison(
        threshold=threshold,
        min_delta_ms=min_delta_ms,
        rows=rows,
        skipped=sorted((in_base | in_new) - common),
    )
