"""The routing benchmark's geography experiment: nearest region, one central region, wrong door.

Clients in Tokyo, London, New York, Sydney and São Paulo and three regions (us-east-1,
eu-central-1, ap-northeast-1), each in its own network namespace behind the WAN emulator
(the ``world`` geography profile of :mod:`firstbyte.benchmarks.wan.geo` plus São Paulo; the shared
:class:`firstbyte.benchmarks.world.World` that ``firstbyte demo`` and ``bench transports`` use).
Each region is a router with an ``h100-7b`` sim. Every client streams prewarmed SSE over HTTP/2:

- **nearest**: the SDK is given all three regions (us-east-1 listed first) and chooses as it
  does for applications: ``prewarm()`` probes each region's round trip and streams from the
  fastest (``timings.region`` says which served);
- **central**: the SDK is given us-east-1 only; the routers are not peered, so us-east-1
  serves everyone;
- **wrong door**: a second world whose routers are one deployment (peers, a peer key, each
  router's location and a GeoIP database placing every client;
  :class:`firstbyte.benchmarks.world.Peering`).
  The SDK is given all three regions but no probe decides (``--no-probe``): it enters through
  us-east-1 on a warm connection. For a client nearer another region, us-east-1 forwards the
  first request there (``x-firstbyte-region`` names the region that served) and answers with
  ``x-firstbyte-better-region`` (+ ``-url``); the SDK prefers and prewarms that region, so the
  following requests go there directly. Reported per client: the first request's TTFT and
  who served it, the hint, the P50 of the following requests and who served them, and the
  first request's extra cost over the nearest mode's P50.

Compared per client and overall: TTFT P50/P99 against the 500 ms latency budget. Needs root
and /dev/net/tun; without them the experiment is skipped and says why (under ``CI=true`` that
is an error, as :func:`firstbyte.benchmarks.world.choose_mode` decides).
"""


from __future__ import annotations

import asyncio
import math
import sys
from collections.abc import Sequence
from typing import Any

import msgspec

from firstbyte.benchmarks.stats import percentile, summarize
from firstbyte.benchmarks.wan import geo as wan_geo
from firstbyte.benchmarks.wan.geo import BUILTIN, Place, Profile, Site, profile_from_dict
from firstbyte.benchmarks.world import Peering, World, choose_mode
from firstbyte.client_sdk.budget import LatencyBudget
from firstbyte.client_sdk.timings import Timings

__all__ = ["CENTRAL", "geography", "locations", "profile"]

CENTRAL = "region-us-east"
CELL = "sse/2/warm"
SIM_PROFILE = "h100-7b"
MAX_TOKENS = 8
MODES = ("nearest", "central")
WRONG_DOOR = "wrong-door"


def _profile_data() -> dict[str, Any]:
    data = dict(BUILTIN["world"])
    data["client"] = [*data["client"],
                      {"name": "client-sao-paulo", "city": "Sao Paulo", "last_mile": "fiber"}]
    return data


def profile() -> Profile:
    """The ``world`` profile (3 regions, 4 clients) plus a client in São Paulo."""
    return profile_from_dict(_profile_data(), "routing-world")


def locations(prof: Profile) -> dict[str, Place]:
    """Where each host of :func:`profile` is: a client at its city, a region at its AWS
    region's location (what the peered routers and their GeoIP database are told)."""
    cities = {c["name"]: wan_geo.cities()[c["city"].lower()] for c in _profile_data()["client"]}
    return {s.name: cities[s.name] if s.role == "client" else wan_geo.regions()[s.aws]
            for s in prof.sites}


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
    # us-east-1 first: the SDK's own probe, not the list order, has to find the nearest (and
    # in the wrong-door mode, where no probe decides, us-east-1 is the door).
    ordered = sorted((r.name for r in regions), key=lambda name: name != CENTRAL)
    repeat = 8 if quick else 40
    samples: dict[tuple[str, str], list[Timings]] = {}
    errors: dict[tuple[str, str], list[str]] = {}
    firsts: dict[tuple[str, str], Timings] = {}
    """Each client's first request (rep 0) per mode: the one through the wrong door."""

    async def run_mode(world: World, how: str) -> None:
        _log(f"geography: {len(clients)} clients, {how}, {repeat} prewarmed SSE/HTTP/2 "
             "requests each")

        async def one(client: Site) -> None:
            target: str | list[str] = CENTRAL if how == "central" else ordered
            lines = await world.run_client(client.name, target, [CELL], repeat=repeat,
                                           max_tokens=MAX_TOKENS, time_limit_s=120.0,
                                           probe=how != WRONG_DOOR)
            key = (client.name, how)
            for line in lines:
                if "timings" in line:
                    timings = msgspec.convert(line["timings"], Timings)
                    samples.setdefault(key, []).append(timings)
                    if line["rep"] == 0:
                        firsts[key] = timings
                else:
                    errors.setdefault(key, []).append(f"rep {line['rep']}: {line['error']}")

        # Clients at once (as the demo runs them): waiting on round trips, they share the
        # 2 cores well; run one by one, the quick run would take 3x as long.
        await asyncio.gather(*(one(client) for client in clients))

    def world(peering: Peering | None) -> World:
        return World(regions=[r.name for r in regions], clients=[c.name for c in clients],
                     emulator=prof.emulator(), sim_profile=SIM_PROFILE, log=_log,
                     peering=peering)

    # Unpeered routers: "central" must be served by us-east-1 itself, never forwarded.
    async with world(None) as unpeered:
        for how in MODES:
            await run_mode(unpeered, how)
    # One deployment: peers, GeoIP, forwarding and better-region hints.
    async with world(Peering(locations(prof))) as peered:
        await run_mode(peered, WRONG_DOOR)
    result = _results(prof, sites, clients, regions, samples, errors, repeat)
    _wrong_door(result, prof, clients, regions, samples, errors, firsts)
    return result


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
                run["budget_lines_ms"] = {}  # budget bars: one per client (nearest)
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
            f"client and mode (nearest, central, wrong door); {SIM_PROFILE} sims"),
    }


def _wrong_door(
    result: dict[str, Any], prof: Profile, clients: Sequence[Site], regions: Sequence[Site],
    samples: dict[tuple[str, str], list[Timings]], errors: dict[tuple[str, str], list[str]],
    firsts: dict[tuple[str, str], Timings],
) -> None:
    """Add the wrong-door mode to ``result``: a row per client (``wrong_door``), a run per
    client, and summary numbers; the nearest mode's P50 is the yardstick."""
    aws = {r.name: r.aws for r in regions}
    nearest_p50 = {row["client"]: row["p50_ttft_ms_nearest"] for row in result["clients"]}
    rows: list[dict[str, Any]] = []
    after_all: list[float] = []
    for client in clients:
        place = client.name.removeprefix("client-")
        key = (client.name, WRONG_DOOR)
        nearest = min(regions, key=lambda r: prof.rtt_ms(client, r))
        got = samples.get(key, [])
        first = firsts.get(key)
        after = [t for t in got if t is not first]
        after_ttfts = _ttfts(after)
        after_all += after_ttfts
        served: dict[str, int] = {}
        for t in after:
            name = aws.get(t.region or "", t.region or "?")
            served[name] = served.get(name, 0) + 1
        first_ttft = first.ttft_ms if first is not None else None
        p50_after = percentile(after_ttfts, 50) if after_ttfts else None
        base = nearest_p50.get(place)
        hint = first.better_region if first is not None else None
        failed = len(errors.get(key, []))
        upstream = first.server_timing.get("upstream-headers") if first is not None else None
        # At most 12 columns (the report's table shows no more); the nearest region is in
        # the clients table, and "moved" says whether the following requests went there.
        rows.append({
            "client": place,
            "first_ttft_ms": round(first_ttft, 1) if first_ttft is not None else None,
            # x-firstbyte-region of the first request: us-east-1 itself, or where it forwarded
            "first_served_by": aws.get(first.region or "", first.region) if first else None,
            "forwarded": first is not None and first.region != CENTRAL,
            # us-east-1's upstream request to response head: to its sim, or across to the peer
            # (a new connection to the peer adds its TCP and TLS round trips here)
            "first_upstream_headers_ms": round(upstream, 1) if upstream is not None else None,
            "hinted_to": aws.get(hint, hint) if hint else None,
            "p50_ttft_ms_after": round(p50_after, 1) if p50_after is not None else None,
            "served_after": ",".join(f"{k}:{v}" for k, v in sorted(served.items())),
            "moved": bool(after) and all(t.region == nearest.name for t in after),
            "first_extra_ms": (round(first_ttft - base, 1)
                               if first_ttft is not None and base is not None else None),
            "after_extra_ms": (round(p50_after - base, 1)
                               if p50_after is not None and base is not None else None),
            "failed_requests": failed,  # not "failed": the report would take this for a run
        })
        result["runs"].append({
            "label": f"{place} wrong door",
            "transport": "sse",
            "protocol": "HTTP/2",
            "geography": f"{place} wrong door",
            "client": place,
            "mode": WRONG_DOOR,
            "served_by": served,
            **summarize(got, duration_s=math.fsum(t.e2el_ms or 0 for t in got) / 1000,
                        failed=failed),
            "errors": errors.get(key, [])[:3],
            "budget_lines_ms": {},  # budget bars: one per client (nearest)
        })
    forwarded = [r for r in rows if r["forwarded"]]
    result["wrong_door"] = rows
    result["summary"] |= {
        "geo_wrong_door_failed": sum(r["failed_requests"] for r in rows),
        "geo_wrong_door_forwarded": len(forwarded),
        "geo_wrong_door_hinted": sum(1 for r in rows if r["hinted_to"]),
        "geo_wrong_door_moved_to_nearest": all(r["moved"] for r in rows),
        "geo_p50_ttft_ms_wrong_door_after": (
            round(percentile(after_all, 50), 1) if after_all else None),
        "geo_wrong_door_mean_first_extra_ms_forwarded": (
            round(math.fsum(r["first_extra_ms"] for r in forwarded) / len(forwarded), 1)
            if forwarded and all(r["first_extra_ms"] is not None for r in forwarded) else None),
    }
