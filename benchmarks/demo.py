"""``firstbyte demo``: an emulated world on this machine, the SDK through every transport,
cold and warm, and the latency budget of what it measured.

It brings up three regions (us-east-1, eu-central-1, ap-northeast-1: a router with a simulated
inference server each) and clients in Tokyo, London, New York and Sydney, each in its own
network namespace behind the WAN emulator, with round trips from the shared AWS RTT table plus
each client's last mile (the ``world`` geography profile). Every client streams completions
from its nearest region over SSE (HTTP/2 and HTTP/3, 0-RTT too), WebSocket and long-poll, on
new (cold) and prewarmed connections. Then it prints the TTFT of each, the latency budget of a
prewarmed request per client (each phase against its share of 500 ms, with the 15% safety
share; :mod:`firstbyte.client_sdk.budget`) and where the report is (``--out``, default
``./firstbyte-report``: ``report.html``, one self-contained page with the answer, figures,
tables and the run's conditions, beside ``summary.md`` and ``results.json``).

The default run takes :data:`REPEAT` requests per client and cell, enough for a P95 to mean
something (about a minute and a half here); ``--quick`` takes one and its report says so.

Without root or /dev/net/tun (or with ``--loopback``) everything runs on 127.0.0.1 and the
demo says so, and what that cannot show. Progress goes to stderr; Ctrl-C or an error tears
everything down (processes, namespaces).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from firstbyte.benchmarks.conditions import CpuWatch, run_conditions
from firstbyte.benchmarks.report import write_report
from firstbyte.benchmarks.stats import percentile, summarize
from firstbyte.benchmarks.wan.geo import Profile, load_profile
from firstbyte.benchmarks.world import LOOPBACK_LIMITS, World, WorldError, choose_mode
from firstbyte.cli import CLIError
from firstbyte.client_sdk.budget import LatencyBudget
from firstbyte.client_sdk.timings import Timings

__all__ = ["add_arguments", "run"]

CELLS = [
    "sse/2/cold", "sse/2/warm", "sse/3/cold", "sse/3/0rtt", "sse/3/warm",
    "websocket/1.1/cold", "websocket/1.1/warm", "longpoll/2/cold", "longpoll/2/warm",
]
CELL_NAMES = {
    "sse/2/cold": "SSE h2 cold", "sse/2/warm": "SSE h2 warm", "sse/3/cold": "SSE h3 cold",
    "sse/3/0rtt": "SSE h3 0-RTT", "sse/3/warm": "SSE h3 warm", "websocket/1.1/cold": "WS cold",
    "websocket/1.1/warm": "WS warm", "longpoll/2/cold": "poll cold", "longpoll/2/warm": "poll warm",
}
QUICK_CLIENTS = ("client-tokyo", "client-london")
SIM_PROFILE = "h100-7b"
MAX_TOKENS = 8
PROTOCOL = {"1.1": "HTTP/1.1", "2": "HTTP/2", "3": "HTTP/3"}
REPEAT = 20
"""Requests per client and cell by default: the report shows a P95 from 20 samples on."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Bring up an emulated world on this machine (three regions, clients on four "
        "continents, through the WAN emulator), stream completions through every transport "
        "cold and warm, print the latency budget, and write report.html (the answer, figures, "
        "tables, run conditions; opens offline). Needs root "
        "and /dev/net/tun for the emulator; without them it runs on loopback and says what "
        "that cannot show."
    )
    parser.add_argument("--out", metavar="DIR", default="firstbyte-report",
                        help="where to write report.html, summary.md and results.json "
                             "(default: ./firstbyte-report)")
    parser.add_argument("--quick", action="store_true",
                        help="two clients, one request per cell (a few seconds; for CI; "
                             "medians only)")
    parser.add_argument("--loopback", action="store_true",
                        help="run on 127.0.0.1 without the emulator (no distances: CPU only)")
    parser.add_argument("--repeat", type=int, default=None, metavar="N",
                        help=f"requests per transport and state (default {REPEAT}, --quick 1)")
    parser.add_argument("--screenshot", metavar="PNG", default=None,
                        help="also save a full-page PNG of report.html (headless Chromium)")


def _log(message: str) -> None:
    print(f"demo: {message}", file=sys.stderr, flush=True)


def _nearest(profile: Profile) -> dict[str, tuple[str, float]]:
    """Client host -> (nearest region host, RTT ms), by the profile's round trips."""
    sites = {s.name: s for s in profile.sites}
    regions = [s for s in profile.sites if s.role == "region"]
    out = {}
    for client in (s for s in profile.sites if s.role == "client"):
        best = min(regions, key=lambda r: profile.rtt_ms(client, r))
        out[client.name] = (best.name, profile.rtt_ms(client, sites[best.name]))
    return out


def run(args: argparse.Namespace) -> int:
    if args.repeat is not None and not 1 <= args.repeat <= 50:
        raise CLIError("--repeat must be within 1..50")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise CLIError(f"--out {out} exists and is not a directory")
    try:  # now, not after the run: a path that cannot be written is a user error
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CLIError(f"cannot create --out {out}: {exc.strerror}") from None
    try:
        mode, why = choose_mode(args.loopback)
    except WorldError as exc:
        raise CLIError(f"{exc} (use --loopback to run without it)") from None
    try:
        code = asyncio.run(_demo(args, mode, why, out))
        if args.screenshot:
            _screenshot(out / "report.html", Path(args.screenshot))
        return code
    except WorldError as exc:
        raise CLIError(str(exc)) from None
    except KeyboardInterrupt:
        _log("interrupted; every process and namespace of the demo has been removed")
        return 130


def _screenshot(report: Path, png: Path) -> None:
    from firstbyte.benchmarks.browser import BrowserError, screenshot

    try:
        screenshot(report, png)
    except BrowserError as exc:
        raise CLIError(f"--screenshot: {exc}") from None
    print(f"screenshot: {png}")


async def _demo(args: argparse.Namespace, mode: str, why: str | None, out: Path) -> int:
    profile = load_profile("world")
    nearest = _nearest(profile)
    clients = list(QUICK_CLIENTS) if args.quick else list(nearest)
    # Every region runs, also in --quick: the world is three regions, whoever talks to them.
    regions = [s.name for s in profile.sites if s.role == "region"]
    repeat = args.repeat or (1 if args.quick else REPEAT)
    cpu = CpuWatch()
    emulator = None
    if mode == "emulated":
        emulator = profile.emulator()
        _log("emulated world: network namespaces + the WAN emulator's delay line")
    else:
        _log(f"LOOPBACK MODE ({why}). {LOOPBACK_LIMITS}")
    samples: dict[tuple[str, str], list[Timings]] = {}
    errors: dict[tuple[str, str], list[str]] = {}
    async with World(regions=regions, clients=clients, emulator=emulator,
                     sim_profile=SIM_PROFILE, log=_log) as world:
        _log(f"streaming from {len(clients)} clients, {len(CELLS)} transport/state cells, "
             f"{repeat} request(s) each")

        async def one(client: str) -> None:
            lines = await world.run_client(client, nearest[client][0], CELLS, repeat=repeat,
                                           max_tokens=MAX_TOKENS, time_limit_s=300.0)
            for line in lines:
                key = (client, line["cell"])
                if "timings" in line:
                    samples.setdefault(key, []).append(msgspec.convert(line["timings"], Timings))
                else:
                    errors.setdefault(key, []).append(line["error"])
            _log(f"{client} done")

        await asyncio.gather(*(one(c) for c in clients))
        rtts = {c: (world.rtt_ms(c, nearest[c][0])) for c in clients}
        if mode == "emulated":
            _log("measuring the emulator's precision (configured vs measured RTT)")
        precision = await world.precision([(c, nearest[c][0]) for c in clients], count=5)
    results = _results(mode, why, profile, clients, nearest, rtts, samples, errors, repeat)
    results["quick"] = bool(args.quick)
    results["conditions"] = run_conditions(cpu)
    if precision is not None:
        results["emulator_precision"] = precision.to_dict()["pairs"]
        results["summary"]["emulator_max_abs_error_ms"] = round(precision.max_abs_error_ms, 3)
    _print(mode, clients, nearest, rtts, samples, errors)
    if precision is not None:
        print(f"\nemulator precision: every measured RTT within {precision.max_abs_error_ms:.2f} ms"
              " of the configured one (median of 5 UDP and 5 TCP probes per client)")
    written = write_report(results, out)
    print(f"\nreport: {written['html']}  (also {written['markdown'].name} and "
          f"{written['json'].name} in {out})")

    failed = sum(len(v) for v in errors.values())
    if failed:
        print(f"{failed} request(s) failed; see {written['json']}", file=sys.stderr)
    return 0 if not failed else 1


def _median_request(timings: Sequence[Timings]) -> Timings | None:
    ranked = sorted((t for t in timings if t.first_token_ms is not None),
                    key=lambda t: t.first_token_ms or 0.0)
    return ranked[(len(ranked) - 1) // 2] if ranked else None


def _p50(timings: Sequence[Timings]) -> float | None:
    values = [t.first_token_ms for t in timings if t.first_token_ms is not None]
    return percentile(values, 50) if values else None


def _print(
    mode: str, clients: Sequence[str], nearest: dict[str, tuple[str, float]],
    rtts: dict[str, float], samples: dict[tuple[str, str], list[Timings]],
    errors: dict[tuple[str, str], list[str]],
) -> None:
    title = ("an emulated world (network namespaces, WAN emulator)" if mode == "emulated"
             else "LOOPBACK MODE: everything on 127.0.0.1, no distances")
    print(f"firstbyte demo: {title}\n")
    print(f"  {'client':<18}{'nearest region':<22}{'RTT':>9}")
    for c in clients:
        print(f"  {c:<18}{nearest[c][0]:<22}{rtts[c]:>7.1f}ms")
    print("\nTTFT p50 in ms (request start to first token), cold = new connection, "
          "warm = prewarmed:")
    print("  " + f"{'client':<18}" + "".join(f"{CELL_NAMES[c]:>14}" for c in CELLS))
    for c in clients:
        cells = []
        for cell in CELLS:
            value = _p50(samples.get((c, cell), []))
            cells.append("failed" if value is None and errors.get((c, cell)) else
                         "-" if value is None else f"{value:.1f}")
        print("  " + f"{c:<18}" + "".join(f"{v:>14}" for v in cells))
    budget = LatencyBudget()
    print(f"\nLatency budget: {budget.total_ms:.0f} ms end to end, {budget.safety_ms:.0f} ms "
          "(15%) kept as the safety share for the P95-P99 tail.")
    for c in clients:
        warm = _median_request(samples.get((c, "sse/2/warm"), []))
        cold = _median_request(samples.get((c, "sse/2/cold"), []))
        if warm is None:
            continue
        print(f"\n{c} -> {nearest[c][0]} (RTT {rtts[c]:.1f} ms), prewarmed SSE over HTTP/2:")
        print("  " + budget.check(warm).render().replace("\n", "\n  "))
        if cold is not None and cold.first_token_ms is not None and warm.first_token_ms:
            print(f"  the same request on a new connection: TTFT {cold.first_token_ms:.1f} ms "
                  f"(network {cold.request_sent_ms or 0:.1f} ms before the request was sent); "
                  f"prewarming saved {cold.first_token_ms - warm.first_token_ms:.1f} ms")
    if mode == "loopback":
        print(f"\n{LOOPBACK_LIMITS}")


def _results(
    mode: str, why: str | None, profile: Profile, clients: Sequence[str],
    nearest: dict[str, tuple[str, float]], rtts: dict[str, float],
    samples: dict[tuple[str, str], list[Timings]], errors: dict[tuple[str, str], list[str]],
    repeat: int,
) -> dict[str, Any]:
    runs = []
    summary: dict[str, Any] = {"mode": mode}
    for c in clients:
        place = c.removeprefix("client-")
        for cell in CELLS:
            transport, http, state = cell.split("/")
            got = samples.get((c, cell), [])
            runs.append({
                "transport": transport,
                "protocol": PROTOCOL[http] + (" 0-RTT" if state == "0rtt" else ""),
                "geography": f"{place} {state}",
                "cell": cell,
                "client": c,
                "region": nearest[c][0],
                "rtt_ms": rtts[c],
                **summarize(got, duration_s=sum(t.e2el_ms or 0 for t in got) / 1000,
                            failed=len(errors.get((c, cell), []))),
                "errors": errors.get((c, cell), [])[:3],
            })
        for cell in ("sse/2/cold", "sse/2/warm"):
            value = _p50(samples.get((c, cell), []))
            summary[f"p50_ttft_ms {place} {cell}"] = None if value is None else round(value, 1)
        warm = _median_request(samples.get((c, "sse/2/warm"), []))
        if warm is not None:
            summary[f"within_500ms_budget {place} warm"] = LatencyBudget().check(warm).within_budget
    hosts = {row["name"]: row for row in profile.describe()}
    description = (
        f"firstbyte demo ({'emulated world' if mode == 'emulated' else 'LOOPBACK MODE'}): "
        f"regions {', '.join(s.name for s in profile.sites if s.role == 'region')} (router + "
        f"{SIM_PROFILE} sim each); clients "
        + ", ".join(f"{c} ({hosts[c]['last_mile']}, {rtts[c]:.1f} ms to {nearest[c][0]})"
                    for c in clients)
        + f"; {repeat} request(s) of {MAX_TOKENS} tokens per transport and state."
    )
    notes = ["Budget bars: one per client and state (SSE over HTTP/2 cold and warm, SSE over "
             "HTTP/3 for 0-RTT) against the 500 ms budget and its 15% safety share.",
             "RTTs: AWS inter-region table (cloudping.co) plus each client's last mile, with "
             "the last mile's loss and bandwidth (see benchmarks/wan/data/SOURCES.md)."]
    if mode == "loopback":
        notes.insert(0, f"{LOOPBACK_LIMITS} Why loopback: {why}.")
    return {"scenario": "demo", "description": description, "summary": summary,
            "runs": runs, "notes": notes}
