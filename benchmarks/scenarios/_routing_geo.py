"""The routing benchmark's geography experiment: nearest region vs one central region.

Clients in Tokyo, London, New York, Sydney and São Paulo and three regions (us-east-1,
eu-central-1, ap-northeast-1), each in its own network namespace behind the WAN emulator
(the ``world`` geography profile of :mod:`benchmarks.wan.geo` plus São Paulo; the shared
:class:`benchmarks.world.World` that ``firstbyte demo`` and ``bench transports`` use). Each
region is a router with an ``h100-7b`` sim. Every client streams prewarmed SSE over HTTP/2:

- **nearest**: the SDK is given all three regions (us-east-1 listed first) and chooses as it
  does for applications: ``prewarm()`` probes each region's round trip and streams from the
  fastest (``timings.region`` says which served);
- **central**: the SDK is given us-east-1 only.

Compared per client and overall: TTFT P50/P99 against the 500 ms latency budget. Needs root
and /dev/net/tun; without them the experiment is skipped and says why (under ``CI=true`` that
is an error, as :func:`benchmarks.world.choose_mode` decides).

Not measured here: a client entering at the wrong region and being forwarded or hinted
(``x-firstbyte-better-region``). The world's routers have no peers or GeoIP database, and
peering them over TLS would need the router's peer client to trust the run's CA (it verifies
with certifi only); ``tests/router/test_multiregion.py`` covers forwarding on loopback.
"""


from __future__ import annotations

import asyncio
import math
import sys
from collections.abc import Sequence
from typing import Any

import msgspec

from benchmarks.stats import percentile, summarize
from benchmarks.wan.geo import BUILTIN, Profile, Site, profile_from_dict
from benchmarks.world import World, choose_mode
from client_sdk.budget import LatencyBudget
from client_sdk.timings import Timings

__all__ = ["CENTRAL", "NOT_MEASURED", "geography", "profile"]

CENTRAL = "region-us-east"
CELL = "sse/2/warm"
SIM_PROFILE = "h100-7b"
MAX_TOKENS = 8
MODES = ("nearest", "central")

NOT_MEASURED = (
    "not measured: a client entering at the wrong region being forwarded or hinted "
    "(x-firstbyte-better-region); the emulated routers have no peers or GeoIP database "
    "(the router's peer client verifies TLS with certifi only, not the run's CA)"
)


def profile() -> Profile:
    """The ``world`` profile (3 regions, 4 clients) plus a client in São Paulo."""
    data = dict(BUILTIN["world"])
    data["client"] = [*data["client"],
                      {"name": "client-sao-paulo", "city": "Sao Paulo", "last_mile": "fiber"}]
    return profile_from_dict(data, "routing-world")


def _log(message: str) -> None:
    print(f"routing: {message}", file=sys.stderr, flush=True)


async def geography(quick: bool, *, force_loopback: bool = False) -> dict[str, Any]:
    """Run both modes for every client; ``{"skipped": why}`` when the emulator cannot run."""
    mode, why = choose_mode(force_loopback)  # WorldError under CI=true without the emulator
    if mode == "loopback":
        _log(f"geography experiment SKIPPED: it needs the WAN emulator ({why})")
        return {"skipped": f"needs the WAN emulator (root and /dev/net/tun): {why}"}
    prof = profile()
    sites = {s.name: s for s in prof.sites}
    clients = [s for s in prof.sites if s.role == "client"]
    regions = [s for s in prof.sites if s.role == "region"]
    # us-east-1 first: the SDK's own probe, not the list order, has to find the nearest.
    ordered = sorted((r.name for r in regions), key=lambda name: name != CENTRAL)
    repeat = 8 if quick else 40
    samples: dict[tuple[str, str], list[Timings]] = {}
    errors: dict[tuple[str, str], list[str]] = {}
    async with World(regions=[r.name for r in regions], clients=[c.name for c in clients],
                     emulator=prof.emulator(), sim_profile=SIM_PROFILE, log=_log) as world:
        for how in MODES:
            _log(f"geography: {len(clients)} clients, {how} region, {repeat} prewarmed "
                 "SSE/HTTP/2 requests each")

            async def one(client: Site, how: str = how) -> None:
                target: str | list[str] = ordered if how == "nearest" else CENTRAL
                lines = await world.run_client(client.name, target, [CELL], repeat=repeat,
                                               max_tokens=MAX_TOKENS, time_limit_s=120.0)
                for line in lines:
                    key = (client.name, how)
                    if "timings" in line:
                        samples.setdefault(key, []).append(
                            msgspec.convert(line["timings"], Timings))
                    else:
                        errors.setdefault(key, []).append(str(line["error"]))

            # Clients at once (as the demo runs them): waiting on round trips, they share the
            # 2 cores well; run one by one, the quick run would take 3x as long.
            await asyncio.gather(*(one(client) for client in clients))
    return _results(prof, sites, clients, regions, samples, errors, repeat)


def _ttfts(timings: Sequence[Timings]) -> list[float]:
    return [t.ttft_ms for t in timings if t.ttft_ms is not None]


def _results(
    prof: Profile, sites: dict[str, Site], clients: Sequence[Site], regions: Sequence[Site],
    samples: dict[tuple[str, str], list[Timings]], errors: dict[tuple[str, str], list[str]],
    repeat: int,
) -> dict[str, Any]:
    budget_ms = LatencyBudget().total_ms
    aws = {r.name: r.aws for r in regions}
    runs: list[dict[str, Any]] = []
    rows: list[dict[str, Any]] = []
    overall: dict[str, list[float]] = {how: [] for how in MODES}
    for client in clients:
        place = client.name.removeprefix("client-")
        nearest = min(regions, key=lambda r: prof.rtt_ms(client, r))
        row: dict[str, Any] = {
            "client": place,
            "last_mile": client.last_mile.name if client.last_mile else None,
            "nearest_region": aws[nearest.name],
            "rtt_nearest_ms": round(prof.rtt_ms(client, nearest), 1),
            "rtt_central_ms": round(prof.rtt_ms(client, sites[CENTRAL]), 1),
        }
        for how in MODES:
            got = samples.get((client.name, how), [])
            ttfts = _ttfts(got)
            overall[how] += ttfts
            served: dict[str, int] = {}
            for t in got:
                name = aws.get(t.region or "", t.region or "?")
                served[name] = served.get(name, 0) + 1
            failed = len(errors.get((client.name, how), []))
            row[f"p50_ttft_ms_{how}"] = round(percentile(ttfts, 50), 1) if ttfts else None
            row[f"p99_ttft_ms_{how}"] = round(percentile(ttfts, 99), 1) if ttfts else None
            row[f"served_by_{how}"] = ",".join(f"{k}:{v}" for k, v in sorted(served.items()))
            row[f"failed_{how}"] = failed
            run = {
                "label": f"{place} {how}",
                "transport": "sse",
                "protocol": "HTTP/2",
                "geography": f"{place} {how}",
                "client": place,
                "mode": how,
                "served_by": served,
                **summarize(got, duration_s=math.fsum(t.e2el_ms or 0 for t in got) / 1000,
                            failed=failed),
                "errors": errors.get((client.name, how), [])[:3],
            }
            if how == "central":
                run["budget_lines_ms"] = {}  # phases.png: one bar per client (nearest)
            runs.append(run)
        row["chose_nearest"] = all(
            t.region == nearest.name for t in samples.get((client.name, "nearest"), []))
        rows.append(row)
    summary: dict[str, Any] = {}
    for how in MODES:
        values = overall[how]
        p99 = percentile(values, 99) if values else math.nan
        summary[f"geo_p50_ttft_ms_{how}"] = round(percentile(values, 50), 1) if values else None
        summary[f"geo_p99_ttft_ms_{how}"] = round(p99, 1) if values else None
        summary[f"geo_within_{budget_ms:.0f}ms_{how}"] = (
            round(sum(1 for v in values if v <= budget_ms) / len(values), 3) if values else 0.0)
        summary[f"geo_p99_within_budget_{how}"] = bool(values) and p99 <= budget_ms
        summary[f"geo_failed_{how}"] = sum(r[f"failed_{how}"] for r in rows)
    summary["geo_sdk_chose_nearest"] = all(r["chose_nearest"] for r in rows)
    return {
        "clients": rows,
        "runs": runs,
        "summary": summary,
        "repeat": repeat,
        "budget_ms": budget_ms,
        "description": (
            f"{len(clients)} clients x 3 regions through the WAN emulator (AWS RTT table + "
            f"last mile); {repeat} prewarmed SSE/HTTP/2 requests of {MAX_TOKENS} tokens per "
            f"client and mode; {SIM_PROFILE} sims"),
    }
