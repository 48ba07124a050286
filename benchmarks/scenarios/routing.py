"""Routing across regions: nearest vs central region, fallback under load, prefix placement, warmup.

Five experiments. The first through the WAN emulator
(:mod:`firstbyte.benchmarks.scenarios._routing_geo`),
the others on loopback (routers and sims of the ``h100-7b`` profile, in this process):

0. **Geography.** Clients in Tokyo, London, New York, Sydney and São Paulo; regions us-east-1,
   eu-central-1 and ap-northeast-1. Prewarmed SSE over HTTP/2 from the nearest region (the
   SDK's own RTT probe picks it among all three) vs from us-east-1 for everyone. Compared:
   TTFT P50/P99 per client and overall against the 500 ms budget. And the *wrong door*:
   peered routers with GeoIP, the SDK entering through us-east-1 with no probe; the first
   request is forwarded and hinted, the following ones go to the nearest region directly.
   Skipped (and said so)
   without root and /dev/net/tun; an error under ``CI=true``.
1. **Fallback.** Region ``tokyo`` has 2 backends of ``max_num_seqs`` 4 (capacity 8 streams).
   Closed-loop clients keep 16 streams going at it (2x its capacity). *Without fallback* the
   router admits everything and the backends queue it; *with fallback* the router caps each
   backend at its capacity and spills the rest to ``frankfurt`` (same capacity) within the
   spill budget. Compared: P50/P99 TTFT and failed requests. Target: P99 TTFT with fallback
   <= 500 ms and zero failures.
2. **Placement.** One region of 4 backends; 50 users share a 2,000-token system prompt and
   each has its own growing history (4 turns). Prefix-aware routing (affinity on the first
   user message, bounded loads) vs round-robin. Compared: prefix-cache hit ratio
   (cached / prompt tokens, from each response's ``usage``), TTFT, and backend balance.
   Target: hit ratio >= 90% and max/min backend load <= 1.5.
3. **Warm vs cold prefix.** One region of 2 backends just started (fresh sims, empty caches),
   with the shared ~3,700-token support prompt as a ``warm_prefixes`` entry (the router
   warms it before serving) and without; users arrive every 20 ms and each sends its first
   request. Compared: TTFT P50/P99, cached tokens, requests that missed the prefix.
4. **Two models.** ``model-a`` in every region (tokyo, frankfurt, virginia), ``model-b`` only in
   tokyo; each sim serves only its names (another is vLLM's 404, so a misrouted request is
   an error) and the routers learn them from the sims' ``/v1/models``. Clients entering
   through frankfurt get ``model-b`` from tokyo. Compared: B's TTFT through frankfurt vs
   directly from tokyo (the same path minus the forward), A's TTFT through frankfurt alone vs
   with B's traffic beside it, and misrouted requests (target: 0).

On loopback the hop to a peer costs ~1 ms; across real regions it costs their RTT (e.g.
Tokyo-Frankfurt ~223 ms), which a spilled request adds to its TTFT.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import httpx

from firstbyte.benchmarks.cluster import RegionSpec, running_regions, wait_for_peers
from firstbyte.benchmarks.scenarios._routing_geo import geography
from firstbyte.benchmarks.stats import percentile
from firstbyte.benchmarks.world import LOOPBACK_LIMITS, WorldError
from firstbyte.protocol import paths
from firstbyte.protocol.headers import REGION_HEADER
from firstbyte.protocol.sse import DONE, SSEDecoder

__all__ = ["main", "run"]

PROFILE = "h100-7b"
SEQS_PER_BACKEND = 4
SYSTEM = ("You are the concierge of a travel company. Be brief, precise and friendly. " * 200)[
    :8000
]  # ~2,000 tokens at ~4 characters per token
SUPPORT_SYSTEM = ("You are the support assistant of an online bookshop. Quote order numbers, "
                  "never guess delivery dates, and hand refunds to a human. " * 100)[:12000]
# ~3,700 tokens (the sim's tokenizer); its uncached prefill is ~58 ms in h100-7b
ARRIVAL_GAP_S = 0.02  # a new user every 20 ms (50/s) for the warm vs cold experiment


async def _stream(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> dict[str, Any]:
    """One streamed request: TTFT (ms), serving region, usage; ``ok`` False on any failure."""
    start = time.perf_counter()
    ttft: float | None = None
    usage: dict[str, Any] = {}
    try:
        async with client.stream("POST", url + paths.CHAT_COMPLETIONS, json=body) as r:
            region = r.headers.get(REGION_HEADER, "")
            if r.status_code != 200:
                await r.aread()
                return {"ok": False, "status": r.status_code, "region": region}
            decoder = SSEDecoder()
            done = False
            async for raw in r.aiter_raw():
                for event in decoder.receive_data(raw):
                    if event.data == DONE:
                        done = True
                        continue
                    if '"error"' in event.data[:20]:
                        return {"ok": False, "status": 200, "region": region}
                    if ttft is None and '"content":"' in event.data:
                        ttft = (time.perf_counter() - start) * 1000
                    if '"usage":{' in event.data:
                        import json

                        usage = json.loads(event.data).get("usage") or {}
    except httpx.HTTPError:
        return {"ok": False, "status": 0, "region": ""}
    return {"ok": done and ttft is not None, "ttft_ms": ttft, "region": region, "usage": usage}


async def _closed_loop(url: str, workers: int, total: int, max_tokens: int) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    counter = iter(range(total))
    limits = httpx.Limits(max_connections=workers, max_keepalive_connections=workers)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:

        async def worker() -> None:
            for i in counter:
                body = {"model": "sim", "stream": True, "max_tokens": max_tokens,
                        "messages": [{"role": "user", "content": f"request {i}: plan my day"}]}
                results.append(await _stream(client, url, body))

        await asyncio.gather(*(worker() for _ in range(workers)))
    return results


def _summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    ttfts = [r["ttft_ms"] for r in results if r["ok"]]
    regions: dict[str, int] = {}
    for r in results:
        if r["ok"]:
            regions[r["region"]] = regions.get(r["region"], 0) + 1
    statuses: dict[str, int] = {}
    for r in results:
        if not r["ok"]:
            statuses[str(r["status"])] = statuses.get(str(r["status"]), 0) + 1
    return {
        "failures_by_status": statuses,
        "completed": len(ttfts),
        "failed": sum(1 for r in results if not r["ok"]),
        "p50_ttft_ms": round(percentile(ttfts, 50), 1),
        "p99_ttft_ms": round(percentile(ttfts, 99), 1),
        "served_by": regions,
    }


async def _fallback(quick: bool) -> dict[str, Any]:
    total = 96 if quick else 400
    workers = 2 * 2 * SEQS_PER_BACKEND  # 2x the region's capacity
    max_tokens = 24
    sim = {"profile": PROFILE, "max_num_seqs": SEQS_PER_BACKEND}
    # Without fallback: no peers, the router admits everything, the backends queue.
    queueing = RegionSpec(
        "tokyo", 35.68, 139.69, sim=sim, upstream={"max_in_flight": 1024},
        config={"routing": {"backend_max_waiting": 1024}},
    )
    async with running_regions([queueing]) as regions:
        without = _summary(await _closed_loop(regions["tokyo"].url, workers, total, max_tokens))
    # With fallback: each backend capped at its capacity; overflow spills to Frankfurt. Half
    # the load must leave, so the spill budget is 60% of active requests (default 20%).
    capped = {"max_in_flight": SEQS_PER_BACKEND}
    routing = {"spill_budget_ratio": 0.6, "max_queue_wait_ms": 300.0}
    specs = [
        RegionSpec("tokyo", 35.68, 139.69, sim=sim, upstream=capped,
                   config={"routing": routing}),
        RegionSpec("frankfurt", 50.11, 8.68, sim=sim, upstream=capped),
    ]
    async with running_regions(specs) as regions:
        await wait_for_peers(regions)
        with_fb = _summary(await _closed_loop(regions["tokyo"].url, workers, total, max_tokens))
    return {"without_fallback": without, "with_fallback": with_fb, "workers": workers,
            "requests": total, "max_tokens": max_tokens}


async def _conversations(url: str, users: int, turns: int) -> dict[str, Any]:
    rng = random.Random(7)
    histories: dict[int, list[dict[str, str]]] = {u: [] for u in range(users)}
    results: list[dict[str, Any]] = []
    limits = httpx.Limits(max_connections=users, max_keepalive_connections=users)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        for turn in range(turns):

            async def one(u: int, turn: int = turn) -> None:
                question = (f"I am traveller {u}. For leg {turn} of my trip, which of these "
                            f"{rng.randint(3, 9)} museums opens earliest? ") * 4
                messages = [{"role": "system", "content": SYSTEM}, *histories[u],
                            {"role": "user", "content": question}]
                body = {"model": "sim", "stream": True, "max_tokens": 24, "messages": messages,
                        "stream_options": {"include_usage": True}}
                r = await _stream(client, url, body)
                results.append(r)
                histories[u] += [{"role": "user", "content": question},
                                 {"role": "assistant", "content": f"Answer {turn} for {u}."}]

            await asyncio.gather(*(one(u) for u in range(users)))
    prompt = sum(r["usage"].get("prompt_tokens", 0) for r in results if r["ok"])
    cached = sum(
        (r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        for r in results if r["ok"]
    )
    out = _summary(results)
    out["cache_hit_ratio"] = round(cached / prompt, 4) if prompt else 0.0
    return out


async def _placement(quick: bool) -> dict[str, Any]:
    users, turns = 50, (3 if quick else 4)
    out: dict[str, Any] = {"users": users, "turns": turns}
    for policy in ("prefix", "round_robin"):
        spec = RegionSpec("tokyo", 35.68, 139.69, backends=4, sim={"profile": PROFILE},
                          config={"routing": {"backend_policy": policy}})
        warm = [{"name": "concierge", "text": SYSTEM}]
        async with running_regions([spec], warm_prefixes=warm) as regions:
            result = await _conversations(regions["tokyo"].url, users, turns)
            routing = regions["tokyo"].state.routing
            loads = {n: b.requests for n, b in routing.tracker.backends.items()}
            result["choices"] = dict(routing.choices)
        result["backend_requests"] = loads
        result["max_min_load"] = round(max(loads.values()) / max(1, min(loads.values())), 3)
        result["max_share"] = round(max(loads.values()) / max(1, sum(loads.values())), 3)
        out[policy] = result
    return out


async def _first_requests(url: str, users: int, system: str) -> list[dict[str, Any]]:
    """Each user's first request (shared system prompt + their own question), one user
    arriving every ``ARRIVAL_GAP_S`` (open loop, so a slow answer does not delay the next)."""
    limits = httpx.Limits(max_connections=users, max_keepalive_connections=users)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        # In rotation once ready, as a load balancer would put it: a router with warm
        # prefixes answers /healthz 200 only after warming them (503 "warming" before; its
        # start-up, ~0.1 s here, and requests arriving meanwhile are held until then).
        (await client.get(f"{url}/healthz")).raise_for_status()

        async def one(u: int) -> dict[str, Any]:
            await asyncio.sleep(u * ARRIVAL_GAP_S)
            messages = [{"role": "system", "content": system},
                        {"role": "user", "content": f"Customer {u} here: where is order {u}?"}]
            body = {"model": "sim", "stream": True, "max_tokens": 8, "messages": messages,
                    "stream_options": {"include_usage": True}}
            return await _stream(client, url, body)

        return list(await asyncio.gather(*(one(u) for u in range(users))))


async def _warm_vs_cold(quick: bool) -> dict[str, Any]:
    """Users' first requests right after a region (2 backends, fresh sims) starts: with the
    support prompt as a warm prefix (warmed before the router takes requests) and without.
    Rounds alternate the two conditions, each round a fresh region."""
    rounds, users = (3, 12) if quick else (8, 16)
    spec = RegionSpec("tokyo", 35.68, 139.69, sim={"profile": PROFILE})
    # Unmeasured: this process's first-use costs (imports, first connections) are no one's.
    async with running_regions([spec]) as regions:
        await _first_requests(regions["tokyo"].url, 2, "Say hello.")
    results: dict[str, list[dict[str, Any]]] = {"warm": [], "cold": []}
    for _ in range(rounds):
        for condition in ("warm", "cold"):
            warm = [{"name": "support", "text": SUPPORT_SYSTEM}] if condition == "warm" else []
            async with running_regions([spec], warm_prefixes=warm) as regions:
                results[condition] += await _first_requests(
                    regions["tokyo"].url, users, SUPPORT_SYSTEM)
    out: dict[str, Any] = {"rounds": rounds, "users_per_round": users,
                           "arrival_gap_ms": ARRIVAL_GAP_S * 1000, "backends": spec.backends}
    for condition, got in results.items():
        done = [r for r in got if r["ok"]]
        cached = [(r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                  for r in done]
        prompt = [r["usage"].get("prompt_tokens", 0) for r in done]
        # A request that found under half its prompt cached paid for the system prompt.
        missed = [c < n / 2 for c, n in zip(cached, prompt, strict=True)]
        miss_ttfts = [r["ttft_ms"] for r, m in zip(done, missed, strict=True) if m]
        row = _summary(got)
        row["mean_prompt_tokens"] = round(sum(prompt) / len(prompt), 1) if prompt else 0.0
        row["mean_cached_tokens"] = round(sum(cached) / len(cached), 1) if cached else 0.0
        row["p50_cached_tokens"] = round(percentile(cached, 50), 1) if cached else 0.0
        row["prefix_misses"] = sum(missed)
        row["p50_ttft_ms_prefix_misses"] = (
            round(percentile(miss_ttfts, 50), 1) if miss_ttfts else None)
        out[condition] = row
    return out


MODEL_A, MODEL_B = "model-a", "model-b"


async def _model_phase(
    url: str, model: str, total: int, workers: int, tag: str
) -> list[dict[str, Any]]:
    """``total`` streamed requests for ``model`` at ``url``, ``workers`` at a time."""
    results: list[dict[str, Any]] = []
    counter = iter(range(total))
    limits = httpx.Limits(max_connections=workers, max_keepalive_connections=workers)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:

        async def worker() -> None:
            for i in counter:
                body = {"model": model, "stream": True, "max_tokens": 8,
                        "messages": [{"role": "user", "content": f"{tag} {i}: plan my day"}]}
                results.append(await _stream(client, url, body))

        await asyncio.gather(*(worker() for _ in range(workers)))
    return results


async def _two_models(quick: bool) -> dict[str, Any]:
    """Model A everywhere, model B in tokyo only (see the module docstring, experiment 4)."""
    total, workers = (24, 4) if quick else (200, 4)
    only_a = {"profile": PROFILE, "served_model_names": [MODEL_A]}
    both = {"profile": PROFILE, "served_model_names": [MODEL_A, MODEL_B]}
    specs = [
        RegionSpec("tokyo", 35.68, 139.69, sim=both),
        RegionSpec("frankfurt", 50.11, 8.68, sim=only_a),
        RegionSpec("virginia", 39.04, -77.49, sim=only_a),
    ]
    async with running_regions(specs) as regions:
        await wait_for_peers(regions)
        tokyo, frankfurt = regions["tokyo"].url, regions["frankfurt"].url
        await _model_phase(frankfurt, MODEL_B, workers, workers, "warm-up")  # unmeasured
        phases = {
            "b_direct_tokyo": await _model_phase(tokyo, MODEL_B, total, workers, "b-direct"),
            "b_via_frankfurt": await _model_phase(frankfurt, MODEL_B, total, workers, "b-fwd"),
            "a_frankfurt_alone": await _model_phase(frankfurt, MODEL_A, total, workers, "a"),
        }
        mixed = await asyncio.gather(
            _model_phase(frankfurt, MODEL_A, total, workers // 2, "a-mixed"),
            _model_phase(frankfurt, MODEL_B, total, workers // 2, "b-mixed"),
        )
        phases["a_frankfurt_with_b"], phases["b_via_frankfurt_with_a"] = mixed
    expected = {"b_direct_tokyo": "tokyo", "b_via_frankfurt": "tokyo",
                "a_frankfurt_alone": "frankfurt", "a_frankfurt_with_b": "frankfurt",
                "b_via_frankfurt_with_a": "tokyo"}
    rows = []
    for name, results in phases.items():
        summary = _summary(results)
        # A misroute is a request served by a region (or backend) without its model: the
        # sims refuse it (404), or it was served by another region than the one that has it.
        misrouted = summary["failed"] + sum(
            r["ok"] and r["region"] != expected[name] for r in results)
        # Names outside the report's request columns, so its table shows every one of them.
        rows.append({
            "label": name, "requests": len(results), "errors": summary["failed"],
            "misrouted": misrouted, "ttft_ms_p50": summary["p50_ttft_ms"],
            "ttft_ms_p99": summary["p99_ttft_ms"],
            "served_by": " ".join(f"{k}:{v}" for k, v in sorted(summary["served_by"].items())),
        })
    by = {row["label"]: row for row in rows}
    return {
        "requests_per_phase": total, "workers": workers, "rows": rows,
        "misrouted": sum(row["misrouted"] for row in rows),
        "p50_ttft_ms_b_via_frankfurt": by["b_via_frankfurt"]["ttft_ms_p50"],
        "p50_ttft_ms_b_direct_tokyo": by["b_direct_tokyo"]["ttft_ms_p50"],
        "p50_ttft_ms_a_alone": by["a_frankfurt_alone"]["ttft_ms_p50"],
        "p50_ttft_ms_a_with_b": by["a_frankfurt_with_b"]["ttft_ms_p50"],
    }


def run(quick: bool) -> dict[str, Any]:
    """Every experiment; ``summary`` holds the compared numbers and whether targets are met.

    The geography experiment needs the WAN emulator; without it, it is skipped (``geography``
    says why) and the others run; under ``CI=true`` that is a :class:`CLIError` instead.
    """
    from firstbyte.cli import CLIError

    try:
        geo = asyncio.run(geography(quick))
    except WorldError as exc:
        raise CLIError(str(exc)) from None
    fallback = asyncio.run(_fallback(quick))
    placement = asyncio.run(_placement(quick))
    prefix_warmup = asyncio.run(_warm_vs_cold(quick))
    two_models = asyncio.run(_two_models(quick))
    fb, nofb = fallback["with_fallback"], fallback["without_fallback"]
    prefix, rr = placement["prefix"], placement["round_robin"]
    summary = {
        "p99_ttft_ms_with_fallback": fb["p99_ttft_ms"],
        "p99_ttft_ms_without_fallback": nofb["p99_ttft_ms"],
        "failed_with_fallback": fb["failed"],
        "failed_without_fallback": nofb["failed"],
        "fallback_target_met": fb["p99_ttft_ms"] <= 500 and fb["failed"] == 0,
        "cache_hit_ratio_prefix": prefix["cache_hit_ratio"],
        "cache_hit_ratio_round_robin": rr["cache_hit_ratio"],
        "max_min_load_prefix": prefix["max_min_load"],
        "p50_ttft_ms_prefix": prefix["p50_ttft_ms"],
        "p50_ttft_ms_round_robin": rr["p50_ttft_ms"],
        "placement_target_met": prefix["cache_hit_ratio"] >= 0.9
        and prefix["max_min_load"] <= 1.5,
    }
    warm, cold = prefix_warmup["warm"], prefix_warmup["cold"]
    summary |= {
        "p50_ttft_ms_first_request_warm_prefix": warm["p50_ttft_ms"],
        "p99_ttft_ms_first_request_warm_prefix": warm["p99_ttft_ms"],
        "p50_ttft_ms_first_request_cold_prefix": cold["p50_ttft_ms"],
        "p99_ttft_ms_first_request_cold_prefix": cold["p99_ttft_ms"],
        "mean_cached_tokens_warm_prefix": warm["mean_cached_tokens"],
        "mean_cached_tokens_cold_prefix": cold["mean_cached_tokens"],
        "prefix_misses_warm": warm["prefix_misses"],
        "prefix_misses_cold": cold["prefix_misses"],
        "misrouted_two_models": two_models["misrouted"],
        "p50_ttft_ms_model_b_via_frankfurt": two_models["p50_ttft_ms_b_via_frankfurt"],
        "p50_ttft_ms_model_b_direct_tokyo": two_models["p50_ttft_ms_b_direct_tokyo"],
        "p50_ttft_ms_model_a_alone": two_models["p50_ttft_ms_a_alone"],
        "p50_ttft_ms_model_a_with_b": two_models["p50_ttft_ms_a_with_b"],
        "model_b_forward_added_p50_ms": round(
            two_models["p50_ttft_ms_b_via_frankfurt"] - two_models["p50_ttft_ms_b_direct_tokyo"], 1
        ),
        "two_models_target_met": two_models["misrouted"] == 0,
    }
    if "skipped" in geo:
        summary["geography"] = "SKIPPED: " + geo["skipped"]
    else:
        summary |= geo["summary"]
    notes = [
        "the geography experiment runs in network namespaces behind the WAN emulator: one "
        "process per region (router + h100-7b sim) and per client (the SDK); all the other "
        "experiments run on loopback in this process",
        "geography: 'nearest' gives the SDK all three regions (us-east-1 first) and it picks "
        "by its own RTT probe at prewarm(); 'central' gives it us-east-1 only; the five "
        "clients run at once, sharing this machine's 2 CPUs",
        "warm vs cold prefix: each round starts a fresh region (fresh sims, empty caches) and "
        "sends users once the router's /healthz says ok; a router with warm prefixes says "
        "'warming' (503) until they are warm (~0.1 s here) and holds requests arriving "
        "meanwhile, so none is served cold",
    ]
    if "skipped" not in geo:
        notes.append(
            "geography, wrong door: a second world whose routers are peered (peer key, GeoIP "
            "database of the clients' cities, the run's CA for peer TLS); the SDK is given all "
            "three regions without an RTT probe and enters through us-east-1; wrong_door shows "
            "per client the first request (forwarded? hint?) and the following ones")
    if "skipped" in geo:
        notes.insert(0, f"geography experiment SKIPPED: {geo['skipped']}. {LOOPBACK_LIMITS}")
    return {
        "scenario": "routing",
        "description": __doc__.strip().splitlines()[0] if __doc__ else "routing",
        "summary": summary,
        "runs": geo.get("runs", []),
        "geography": {k: v for k, v in geo.items() if k not in ("runs", "summary")},
        "geography_clients": geo.get("clients", []),
        "wrong_door": geo.get("wrong_door", []),
        "fallback": fallback,
        "placement": placement,
        "prefix_warmup": prefix_warmup,
        "two_models": {k: v for k, v in two_models.items() if k != "rows"},
        "two_models_rows": two_models["rows"],
        # Names outside the report's request columns, so its table shows every one of them.
        "prefix_warmup_rows": [
            {"condition": c, "ttft_ms_p50": prefix_warmup[c]["p50_ttft_ms"],
             "ttft_ms_p99": prefix_warmup[c]["p99_ttft_ms"],
             "requests": prefix_warmup[c]["completed"] + prefix_warmup[c]["failed"],
             "errors": prefix_warmup[c]["failed"],
             **{k: prefix_warmup[c][k] for k in ("mean_prompt_tokens", "mean_cached_tokens",
                                                 "prefix_misses", "p50_ttft_ms_prefix_misses")}}
            for c in ("warm", "cold")
        ],
        "notes": [*notes,
            "loopback experiments: routers, sims and clients share one process and this "
            "machine's 2 noisy CPUs",
            "loopback: a spilled request pays ~1 ms for the peer hop here, the inter-region "
            "RTT in a real deployment",
            "fallback run uses spill_budget_ratio 0.6: at 2x capacity half the requests must "
            "leave the region, more than the default 20% budget allows; and "
            "max_queue_wait_ms 300: when neither region has a free slot for a moment, a "
            "request queues locally if the expected wait is under 300 ms instead of a 429",
            "TTFT: request start to the first content chunk (as vllm bench serve)",
            "two models: tokyo's sims serve model-a and model-b, the others model-a only "
            "(each sim 404s any other name, as vLLM); the routers are given no model lists "
            "and learn them from /v1/models; 'b_via_frankfurt' pays the frankfurt->tokyo hop "
            "over 'b_direct_tokyo': a second router on the same CPUs here (the difference is "
            "model_b_forward_added_p50_ms), plus the inter-region RTT in a deployment; the "
            "mixed phases run A and B at once through frankfurt, half the workers each",
        ],
    }


def main() -> None:
    import json
    import sys

    print(json.dumps(run(quick="--quick" in sys.argv)["summary"], indent=2))


if __name__ == "__main__":
    main()
