"""``firstbyte bench``: run a benchmark scenario and write its report, or compare two results.

Scenarios are discovered, not registered: every module in ``benchmarks/scenarios/`` that
defines ``run(quick: bool) -> dict`` is one, named after its module, and its docstring's first
line is its help. Discovery reads the sources without importing them, so ``--help`` works even
when one scenario's optional dependency is missing.

A scenario with options of its own also defines ``add_arguments(parser)`` (imported only then);
its options reach ``run`` as keyword arguments. A scenario whose results carry a non-empty
``failed_checks`` list failed: the report is written, each check is printed, and the exit code
is 1 (as CI needs to catch it).
"""

from __future__ import annotations

import argparse
import ast
import importlib
import os
import pkgutil
import sys
from pathlib import Path
from typing import Any

import msgspec

import firstbyte.benchmarks.scenarios
from firstbyte.benchmarks.compare import compare, load_results
from firstbyte.benchmarks.conditions import CpuWatch, run_conditions
from firstbyte.benchmarks.errors import BenchError
from firstbyte.benchmarks.report import markdown_summary, write_combined_report, write_report
from firstbyte.benchmarks.report_html import render_comparison
from firstbyte.cli import CLIError

__all__ = ["add_arguments", "discover_scenarios", "run", "run_scenario"]

_RESERVED = {"all", "compare", "screenshot"}


def discover_scenarios() -> dict[str, str]:
    """Scenario name -> one-line description, for every module that defines ``run``."""
    return {name: doc for name, (doc, _) in _scan_scenarios().items()}


def _scan_scenarios() -> dict[str, tuple[str, bool]]:
    """Scenario name -> (description, whether it defines ``add_arguments``)."""
    found: dict[str, tuple[str, bool]] = {}
    modules = pkgutil.iter_modules(firstbyte.benchmarks.scenarios.__path__)
    for info in sorted(modules, key=lambda i: i.name):
        if info.name.startswith("_") or info.ispkg or info.name in _RESERVED:
            continue
        path = Path(firstbyte.benchmarks.scenarios.__path__[0]) / f"{info.name}.py"
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (OSError, SyntaxError, ValueError):
            continue
        functions = {
            node.name
            for node in tree.body
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        }
        if "run" not in functions:
            continue
        doc = (ast.get_docstring(tree) or "").strip().splitlines()
        found[info.name] = (
            doc[0].rstrip(".") if doc else "(no description)",
            "add_arguments" in functions,
        )
    return found


def _add_output_options(parser: argparse.ArgumentParser, default_out: str) -> None:
    parser.add_argument(
        "--quick", action="store_true", help="a short run (as CI does): fewer requests, less load"
    )
    parser.add_argument(
        "--out",
        metavar="DIR",
        default=default_out,
        help=f"where to write results.json, summary.md and report.html (default: {default_out})",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print the results JSON on stdout instead of the Markdown summary",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    scanned = _scan_scenarios()
    scenarios = {name: doc for name, (doc, _) in scanned.items()}
    listing = "\n".join(f"  {name:<18} {doc}" for name, doc in scenarios.items()) or "  (none yet)"
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = (
        f"scenarios:\n{listing}\n"
        "  all                every scenario above, one combined results.json\n\n"
        "compare:\n  firstbyte bench compare BASELINE.json NEW.json [--threshold 0.10]"
        " [--min-delta-ms MS] [--all] [--out DIR]\n\n"
        "screenshot:\n  firstbyte bench screenshot REPORT.html OUT.png [--width 1000]"
    )
    sub = parser.add_subparsers(dest="scenario", metavar="SCENARIO", required=True)
    for name, doc in scenarios.items():
        scenario = sub.add_parser(name, help=doc, description=doc + ".")
        _add_output_options(scenario, f"bench-results/{name}")
        if scanned[name][1]:
            _add_scenario_options(scenario, name)
    every = sub.add_parser("all", help="run every scenario", description="Run every scenario.")
    _add_output_options(every, "bench-results/all")
    cmp = sub.add_parser(
        "compare",
        help="compare two result files; exit 1 when a P95/P99 latency regressed",
        description=(
            "Compare two results.json files. Exit 1 when a tracked P95/P99 latency metric "
            "regressed by more than the threshold, 2 when the files share no tracked metric "
            "(nothing was compared), 0 otherwise."
        ),
    )
    cmp.add_argument("baseline", metavar="BASELINE.json", help="the reference results.json")
    cmp.add_argument("new", metavar="NEW.json", help="the results.json to check against it")
    cmp.add_argument(
        "--threshold",
        type=float,
        default=0.10,
        help="allowed relative increase, as a fraction (default 0.10 = 10%%)",
    )
    cmp.add_argument(
        "--all", action="store_true", help="list every tracked metric, not only the changed ones"
    )
    cmp.add_argument(
        "--out",
        metavar="DIR",
        default="bench-results/compare",
        help="where to write report.html (default: bench-results/compare)",
    )
    cmp.add_argument(
        "--min-delta-ms",
        type=float,
        default=0.0,
        help="also require an absolute increase above this many ms (noise floor; default 0)",
    )
    _add_screenshot(sub)


def _add_screenshot(sub: Any) -> None:
    shot = sub.add_parser(
        "screenshot",
        help="render a report.html in headless Chromium and save a PNG of the whole page",
        description=(
            "Open REPORT.html in headless Chromium (the system's chromium, Debian package "
            "'chromium'), fail on console errors or failed loads, and save a full-page PNG."
        ),
    )
    shot.add_argument("report", metavar="REPORT.html")
    shot.add_argument("png", metavar="OUT.png")
    shot.add_argument("--width", type=int, default=1000,
                      help="viewport width in CSS pixels (default 1000; 400 for a phone)")


def _add_scenario_options(parser: argparse.ArgumentParser, name: str) -> None:
    """The scenario's own options; their names are remembered so only they reach its ``run``."""
    before = {action.dest for action in parser._actions}
    module = importlib.import_module(f"firstbyte.benchmarks.scenarios.{name}")
    module.add_arguments(parser)
    added = [action.dest for action in parser._actions if action.dest not in before]
    parser.set_defaults(scenario_options=added)


def failed_checks(results: dict[str, Any]) -> list[str]:
    """The checks a scenario's run failed (its ``failed_checks``), empty when it passed."""
    checks = results.get("failed_checks")
    return [str(check) for check in checks] if isinstance(checks, list) else []


def run_scenario(name: str, quick: bool, **options: Any) -> dict[str, Any]:
    """Import and run one scenario; its results carry ``scenario``, ``quick`` and the run's
    ``conditions`` (with the share of CPU other processes used meanwhile). A part it started
    that failed (:class:`~firstbyte.benchmarks.errors.BenchError`) is a :class:`CLIError`."""
    scenarios = discover_scenarios()
    if name not in scenarios:
        known = ", ".join(scenarios) or "none"
        raise CLIError(f"unknown scenario {name!r} (available: {known})")
    module = importlib.import_module(f"firstbyte.benchmarks.scenarios.{name}")
    cpu = CpuWatch()
    try:
        results = module.run(quick, **options)
    except BenchError as exc:  # a part it started failed: one line, not a traceback
        raise CLIError(f"{name}: {exc}") from None
    if not isinstance(results, dict):
        raise CLIError(f"scenario {name!r} returned {type(results).__name__}, not a dict")
    results.setdefault("scenario", name)
    results["quick"] = quick
    # The scenario's own conditions (what it ran) and the run's (machine, commit, foreign CPU).
    results["conditions"] = {**results.get("conditions", {}), **run_conditions(cpu)}
    return dict(results)


def _run_compare(args: argparse.Namespace) -> int:
    loaded = []
    for path in (args.baseline, args.new):
        try:
            loaded.append(load_results(Path(path).read_bytes()))
        except OSError as exc:
            raise CLIError(f"cannot read {path}: {exc.strerror or exc}") from None
        except ValueError as exc:
            raise CLIError(f"{path}: {exc}") from None
    try:
        result = compare(
            loaded[0], loaded[1], threshold=args.threshold, min_delta_ms=args.min_delta_ms
        )
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    out = _out_dir(args.out)  # before the table: a bad --out says so first
    print(result.render(all_rows=args.all))
    page = out / "report.html"
    try:
        page.write_text(render_comparison(result, args.baseline, args.new), encoding="utf-8")
    except OSError as exc:  # exit 2, never 1: 1 says a metric regressed
        raise CLIError(f"cannot write {page}: {exc.strerror or exc}") from None
    print(f"bench: wrote {page}", file=sys.stderr)
    if not result.compared:
        raise CLIError(f"{args.new} against {args.baseline}: {result.nothing_compared()}")
    return 0 if result.ok else 1


def _out_dir(path: str) -> Path:
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise CLIError(f"--out {out} exists and is not a directory")
    try:  # now, not after a run of minutes
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CLIError(f"cannot create --out {out}: {exc.strerror or exc}") from None
    probe = out / f".firstbyte-write-check-{os.getpid()}"
    try:  # a folder that exists but takes no file (read-only, immutable, another owner's)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise CLIError(f"cannot write in --out {out}: {exc.strerror or exc}") from None
    return out


def _run_screenshot(args: argparse.Namespace) -> int:
    from firstbyte.benchmarks.browser import BrowserError, screenshot

    if not 200 <= args.width <= 4000:
        raise CLIError("--width must be within 200..4000")
    try:
        page = screenshot(Path(args.report), Path(args.png), width=args.width)
    except BrowserError as exc:
        raise CLIError(str(exc)) from None
    print(f"bench: wrote {args.png} ({page.width}x{page.height} CSS px)", file=sys.stderr)
    return 0


def run(args: argparse.Namespace) -> int:
    if args.scenario == "compare":
        return _run_compare(args)
    if args.scenario == "screenshot":
        return _run_screenshot(args)
    out = _out_dir(args.out)
    failed: list[str] = []
    if args.scenario == "all":
        combined: dict[str, Any] = {"scenario": "all", "quick": args.quick, "scenarios": {},
                                    "skipped": {}}
        for name in discover_scenarios():
            print(f"bench: running {name}", file=sys.stderr)
            try:
                results = run_scenario(name, args.quick)
            except CLIError as exc:
                # One scenario this machine cannot run (the WAN emulator's precision needs
                # root) does not cost the others' combined report, nor the run an exit 0.
                print(f"bench: skipped {name}: {exc}", file=sys.stderr)
                combined["skipped"][name] = str(exc)
                failed.append(f"{name}: not run: {exc}")
                continue
            failed += [f"{name}: {check}" for check in failed_checks(results)]
            written = write_report(results, out / name)
            # The written file has the metric definitions, date and host added.
            combined["scenarios"][name] = msgspec.json.decode(written["json"].read_bytes())
        paths = write_combined_report(combined, out)
        if args.json:
            sys.stdout.write(paths["json"].read_text())
        else:
            for name, results in combined["scenarios"].items():
                print(markdown_summary(results))
                print(f"(full report: {out / name / 'report.html'})\n")
        print(f"bench: wrote {paths['json']}, {paths['html']}", file=sys.stderr)
        return _verdict(failed)
    options = {dest: getattr(args, dest) for dest in getattr(args, "scenario_options", [])}
    results = run_scenario(args.scenario, args.quick, **options)
    written = write_report(results, out)
    if args.json:
        sys.stdout.write(written["json"].read_text())
    else:
        sys.stdout.write(written["markdown"].read_text())
    print("bench: wrote " + ", ".join(str(p) for p in written.values()), file=sys.stderr)
    return _verdict(failed_checks(results))


def _verdict(failed: list[str]) -> int:
    """Exit code 1 and one line per failed check, 0 when none failed."""
    for check in failed:
        print(f"bench: check failed: {check}", file=sys.stderr)
    return 1 if failed else 0
