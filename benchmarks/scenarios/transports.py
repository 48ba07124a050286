"""SSE, WebSocket and long-poll x HTTP/1.1, 2, 3 x cold, prewarmed, 0-RTT, across geographies.

The router (with an ``instant`` sim behind it, so server time is small and known from
``Server-Timing``) runs in a region host in us-east-1; the SDK runs in client hosts at several
distances from it, each in its own network namespace behind the WAN emulator, so every TCP,
TLS and QUIC handshake pays real round trips. Certificates are made for each run (trustme).
Per cell (transport / HTTP version / connection state) and geography it reports
``vllm bench serve``'s metrics and every network phase of the SDK's ``Timings``, the measured
round trips against theory (:mod:`firstbyte.benchmarks.scenarios._rtt_theory`), and two targets:
prewarmed TTFT <= 1.05 x (RTT + server TTFT), and HTTP/3 0-RTT cold TTFT <= 0.55 x cold
HTTP/2 TTFT at ~150 ms. Without root or /dev/net/tun it runs on loopback and says what that
cannot show; under ``CI=true`` that is an error instead.
"""

from __future__ import annotations

import asyncio
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from firstbyte.benchmarks.scenarios import _rtt_theory as theory
from firstbyte.benchmarks.stats import percentile, summarize
from firstbyte.benchmarks.wan import Emulator, Host, LinkParams
from firstbyte.benchmarks.wan.delayline import NS_PER_MS
from firstbyte.benchmarks.wan.emulator import CLIENT_CONGESTION_CONTROL
from firstbyte.benchmarks.wan.geo import last_miles, region_rtt_ms
from firstbyte.benchmarks.world import LOOPBACK_LIMITS, World, WorldError, choose_mode
from firstbyte.client_sdk.timings import Timings

__all__ = ["GEOGRAPHIES", "Geography", "cells", "run", "run_transports"]

REGION_AWS = "us-east-1"
REGION_HOST = "region-us-east"
MAX_TOKENS = 8
PROTOCOL = {"1.1": "HTTP/1.1", "2": "HTTP/2", "3": "HTTP/3"}


@dataclass(frozen=True)
class Geography:
    """A client host: where it is (AWS region of the shared RTT table + last mile), or at
    0 ms (``client_aws`` None: the baseline that measures local CPU cost)."""

    name: str
    description: str
    client_aws: str | None
    last_mile: str | None = None
    loss_pct: float = 0.0

    @property
    def rtt_ms(self) -> float:
        if self.client_aws is None:
            return 0.0
        extra = last_miles()[self.last_mile].rtt_ms if self.last_mile else 0.0
        return region_rtt_ms(self.client_aws, REGION_AWS) + extra

    @property
    def checked(self) -> bool:
        """Round trips are checked against theory on long, loss-free paths only: at a few ms
        the local CPU cost is as large as a round trip, and loss adds retransmissions."""
        return self.rtt_ms >= 50.0 and self.loss_pct == 0.0

    @property
    def host(self) -> str:
        return f"client-{self.name}"


GEOGRAPHIES: dict[str, Geography] = {
    g.name: g
    for g in [
        Geography("local", "next to the router, 0 ms (local CPU baseline)", None),
        Geography("same-city", "N. Virginia on fiber", "us-east-1", "fiber"),
        Geography("transatlantic", "Dublin on fiber", "eu-west-1", "fiber"),
        Geography("transpacific", "Tokyo on fiber", "ap-northeast-1", "fiber"),
        Geography("lossy-long", "Sydney on 4G, 2% loss each way", "ap-southeast-2", "4g", 2.0),
    ]
}
QUICK_GEOGRAPHIES = ("local", "transatlantic", "transpacific")
"""Two long RTTs: the round trips are also measured as the slope between them."""
CDF_GEOGRAPHY = "transpacific"


def cells(quick: bool) -> list[str]:
    """The cells measured, SSE over HTTP/2 first (the phase plot draws each state's first)."""
    if quick:
        return [
            "sse/2/cold", "sse/2/warm", "sse/1.1/cold", "sse/3/cold", "sse/3/warm", "sse/3/0rtt",
            "websocket/1.1/cold", "websocket/1.1/warm", "longpoll/2/cold", "longpoll/2/warm",
        ]
    out = []
    for transport in ("sse", "longpoll"):
        for http in ("2", "1.1", "3"):
            out += [f"{transport}/{http}/cold", f"{transport}/{http}/warm"]
        out.append(f"{transport}/3/0rtt")
    return [*out, "websocket/1.1/cold", "websocket/1.1/warm"]


def _emulator(geos: Sequence[Geography]) -> Emulator:
    hosts = [Host(REGION_HOST, "198.51.100.10")]
    hosts += [Host(g.host, f"192.0.2.{10 + i}", CLIENT_CONGESTION_CONTROL)
              for i, g in enumerate(geos)]
    links = {}
    for g in geos:
        params = LinkParams(delay_ns=round(g.rtt_ms * NS_PER_MS / 2), loss_pct=g.loss_pct)
        links[(g.host, REGION_HOST)] = links[(REGION_HOST, g.host)] = params
    return Emulator(hosts, links=links)


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


async def run_transports(
    quick: bool, *, force_loopback: bool = False, geographies: Sequence[str] | None = None,
    repeat: int | None = None,
) -> dict[str, Any]:
    """Measure every cell in every geography; results in :mod:`firstbyte.benchmarks.report`'s
    shape."""
    mode, why = choose_mode(force_loopback)
    if mode == "loopback":
        _log(f"transports: LOOPBACK MODE ({why}). {LOOPBACK_LIMITS}")
        geos = [Geography("loopback", "client and router on 127.0.0.1", None)]
        emulator = None
    else:
        names = geographies or (QUICK_GEOGRAPHIES if quick else list(GEOGRAPHIES))
        geos = [GEOGRAPHIES[n] for n in names]
        if geos[0].client_aws is not None:
            geos.insert(0, GEOGRAPHIES["local"])  # the CPU baseline is always measured
        emulator = _emulator(geos)
    repeat = repeat or (3 if quick else 7)
    measured = cells(quick)
    samples: dict[tuple[str, str], list[Timings]] = {}
    cpu: dict[tuple[str, str], list[float]] = {}
    errors: dict[tuple[str, str], list[str]] = {}
    async with World(regions=[REGION_HOST], clients=[g.host for g in geos],
                     emulator=emulator) as world:
        for g in geos:
            _log(f"transports: {g.name} ({g.description}, RTT {g.rtt_ms:g} ms): "
                 f"{len(measured)} cells x {repeat}")
            lines = await world.run_client(
                g.host, REGION_HOST, measured, repeat=repeat, max_tokens=MAX_TOKENS,
                request_timeout_s=30.0, time_limit_s=600.0)
            for line in lines:
                key = (g.name, line["cell"])
                if "timings" in line:
                    samples.setdefault(key, []).append(msgspec.convert(line["timings"], Timings))
                    cpu.setdefault(key, []).append(line["client_cpu_ms"])
                else:
                    errors.setdefault(key, []).append(line["error"])
        precision = await world.precision(
            [(g.host, REGION_HOST) for g in geos if g.client_aws is not None and not g.loss_pct])
    return _results(quick, mode, why, geos, measured, samples, cpu, errors, precision, repeat)


def _results(
    quick: bool, mode: str, why: str | None, geos: Sequence[Geography], measured: Sequence[str],
    samples: dict[tuple[str, str], list[Timings]], cpu: dict[tuple[str, str], list[float]],
    errors: dict[tuple[str, str], list[str]], precision: Any, repeat: int,
) -> dict[str, Any]:
    runs: list[dict[str, Any]] = []
    trips: list[dict[str, Any]] = []
    targets: list[dict[str, Any]] = []
    for g in geos:
        for cell in measured:
            transport, http, state = cell.split("/")
            got = samples.get((g.name, cell), [])
            run = {
                "transport": transport,
                "protocol": PROTOCOL[http] + (" 0-RTT" if state == "0rtt" else ""),
                "geography": f"{g.name} {state}",
                "cell": cell,
                "state": state,
                "place": g.name,
                "rtt_ms": g.rtt_ms,
                **summarize(got, duration_s=math.fsum(t.e2el_ms or 0 for t in got) / 1000,
                            failed=len(errors.get((g.name, cell), []))),
                "client_cpu_ms_p50": percentile(cpu.get((g.name, cell), []), 50),
                "zero_rtt_accepted": sum(1 for t in got if t.zero_rtt),
                "errors": errors.get((g.name, cell), [])[:3],
            }
            run["ttft_samples_ms"] = run["ttfts_ms"]
            if g.name not in (CDF_GEOGRAPHY, "loopback"):
                run["ttfts_ms"] = []  # the CDF plot: one line per cell at ~150 ms only
            runs.append(run)
            if mode == "loopback" or g.client_aws is None:
                continue
            base = samples.get(("local", cell), [])
            row = {"geography": g.name, "cell": cell, "checked": g.checked}
            pair = _slope_partner(g, geos)
            other = None if pair is None else (samples.get((pair.name, cell), []), pair.rtt_ms)
            row |= theory.round_trips(got, base, g.rtt_ms, theory.theory_first_byte(
                transport, http, state), theory.theory_ttft(transport, http, state), other)
            trips.append(row)
            if state == "warm" and g.checked:
                result = theory.prewarmed_target(got, base, g.rtt_ms)
                if result is not None:
                    targets.append({"target": "prewarmed TTFT <= 1.05 x (RTT + server TTFT)",
                                    "geography": g.name, "cell": cell, **result})
        zero = samples.get((g.name, "sse/3/0rtt"), [])
        cold = samples.get((g.name, "sse/2/cold"), [])
        if mode == "emulated" and g.name == CDF_GEOGRAPHY:
            result = theory.zero_rtt_target(zero, cold)
            if result is not None:
                targets.append({"target": "HTTP/3 0-RTT TTFT <= 0.55 x cold HTTP/2 TTFT",
                                "geography": g.name, "cell": "sse/3/0rtt vs sse/2/cold",
                                **result})
    return {
        "scenario": "transports",
        "description": _description(mode, geos, repeat),
        "summary": _summary(mode, runs, trips, targets, precision),
        "runs": runs,
        "round_trips": trips,
        "targets": targets,
        "emulator_precision": [] if precision is None else precision.to_dict()["pairs"],
        "notes": _notes(mode, why),
    }


def _slope_partner(g: Geography, geos: Sequence[Geography]) -> Geography | None:
    """The other checked geography whose RTT is furthest from ``g``'s, for the slope counts
    (None: ``g`` is not checked or has no partner)."""
    if not g.checked:
        return None
    others = [o for o in geos if o.checked and o.rtt_ms != g.rtt_ms]
    return max(others, key=lambda o: abs(o.rtt_ms - g.rtt_ms), default=None)


def _description(mode: str, geos: Sequence[Geography], repeat: int) -> str:
    where = ", ".join(f"{g.name} {g.rtt_ms:g} ms" + (f" ({g.loss_pct:g}% loss)" if g.loss_pct
                                                   else "") for g in geos)
    how = ("router + instant sim in a region namespace (us-east-1), the SDK in client "
           "namespaces behind the WAN emulator" if mode == "emulated" else
           "LOOPBACK MODE: router, sim and SDK on 127.0.0.1")
    return (f"Transports (SSE, WebSocket, long-poll) x HTTP/1.1, 2, 3 x cold, prewarmed, "
            f"0-RTT; {how}; geographies: {where}; {repeat} requests per cell, "
            f"{MAX_TOKENS} tokens each, TLS 1.3 with a per-run CA.")


def _summary(
    mode: str, runs: Sequence[dict[str, Any]], trips: Sequence[dict[str, Any]],
    targets: Sequence[dict[str, Any]], precision: Any,
) -> dict[str, Any]:
    out: dict[str, Any] = {"mode": mode}
    for run in runs:
        if run["place"] in (CDF_GEOGRAPHY, "loopback") and run["transport"] == "sse":
            out[f"p50_ttft_ms {run['place']} {run['cell']}"] = round(run["p50_ttft_ms"], 1)
    if mode == "loopback":
        out["round_trips_vs_theory"] = "not measurable on loopback"
        out["targets"] = "not measurable on loopback"
        return out
    checked = [row for row in trips if row["checked"] and "first_byte_rtts" in row]
    ok = [row for row in checked if row["first_byte_within_10pct"] and row["ttft_within_10pct"]]
    out["round_trip_cells_checked"] = len(checked)
    out["round_trip_cells_within_10pct"] = len(ok)
    out["round_trips_match_theory"] = "met" if checked and len(ok) == len(checked) else "NOT MET"
    # Per geography: a fixed local cost (client and server CPU, a few ms) is a larger share
    # of a short round trip, so the 5% margin is tighter the nearer the client.
    for place in dict.fromkeys(t["geography"] for t in targets):
        here = [t for t in targets if t["geography"] == place and t["target"].startswith("pre")]
        one_rtt = [t for t in here if not t["cell"].startswith("longpoll")]
        polls = [t for t in here if t["cell"].startswith("longpoll")]
        out[f"target_prewarmed_sse_websocket {place}"] = _verdict(one_rtt)
        out[f"target_prewarmed_longpoll {place}"] = _verdict(polls)
    zero = [t for t in targets if t["target"].startswith("HTTP/3 0-RTT")]
    out["target_0rtt"] = _verdict(zero)
    if zero:
        out["target_0rtt_ratio"] = zero[0]["ratio"]
    if precision is not None:
        out["emulator_max_abs_error_ms"] = round(precision.max_abs_error_ms, 3)
        out["emulator_max_abs_floor_error_ms"] = round(precision.max_abs_floor_error_ms, 3)
    return out


def _verdict(rows: Sequence[dict[str, Any]]) -> str:
    if not rows:
        return "not measured"
    met = sum(1 for r in rows if r["met"])
    return f"met ({met}/{len(rows)})" if met == len(rows) else f"NOT MET ({met}/{len(rows)})"


def _notes(mode: str, why: str | None) -> list[str]:
    notes = [
        "Theory (round trips to the first byte): cold TCP+TLS 1.3 (HTTP/1.1, HTTP/2) 3, cold "
        "QUIC (HTTP/3) 2, HTTP/3 0-RTT 1, cold WebSocket 4 (TCP, TLS, upgrade, request), "
        "prewarmed 1; long-poll's first token comes in the answer to its POST "
        "(POST /v1/streams?wait=S), so it costs the same.",
        "first_byte_rtts = median (first_byte - Server-Timing total - local cost) / RTT, where "
        "local cost is the same cell's median at 0 ms RTT in this run (client and server CPU, "
        "reported apart from round trips); first_byte_rtts_raw subtracts only Server-Timing; "
        "first_byte_rtts_slope is the change of that median between the two checked RTTs over "
        "the change of RTT (no fixed local cost in it). A cell matches theory when the band "
        "these counts span, widened by 10%, holds it.",
        "Round trips are checked (within 10%) on long loss-free paths; on short paths the local "
        "CPU cost is as large as a round trip, and loss adds retransmissions.",
        "Budget bars: one per geography and connection state: SSE over HTTP/2 for cold and "
        "warm, SSE over HTTP/3 for 0-RTT. TTFT CDFs: every cell at ~150 ms (transpacific).",
        "server TTFT for the prewarmed target: Server-Timing total (queue, route, upstream) "
        "when the transport has response headers, else the cell's TTFT at 0 ms RTT. Long-poll "
        "needs 1 round trip too (its POST waits for the first batch); at short RTTs the local "
        "cost of a few ms (client and server CPU) is itself near the 5% margin.",
    ]
    if mode == "loopback":
        notes.insert(0, f"{LOOPBACK_LIMITS} Why loopback: {why}.")
    return notes


def run(quick: bool) -> dict[str, Any]:
    """The ``firstbyte bench transports`` scenario."""
    from firstbyte.cli import CLIError

    try:
        return asyncio.run(run_transports(quick))
    except WorldError as exc:
        raise CLIError(str(exc)) from None
