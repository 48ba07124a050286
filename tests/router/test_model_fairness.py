"""Fairness and the spill budget per model, over real sockets on loopback: a key flooding a
model served by a small pool does not lower another key's share of another model's backends,
and one model's spills do not use up the spill budget another model needs."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import Counter
from typing import Any

import httpx

from firstbyte.benchmarks.cluster import RegionSpec, running_regions, wait_for_peers
from firstbyte.router.sim.server import sim_server
from tests.router.conftest import API_KEY, OTHER_KEY, RouterFactory, auth


def chat(model: str, text: str, max_tokens: int) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": text}],
            "stream": True, "max_tokens": max_tokens, "seed": 3}


def _code(response: httpx.Response) -> str:
    error: dict[str, str] = json.loads(response.content)["error"]
    return error["code"]


async def test_a_key_flooding_one_model_does_not_lower_anothers_share_of_its_backends(
    start_router: RouterFactory,
) -> None:
    """Model A on a backend of 4 slots, model B on another of 1. Key X runs 8 closed loops
    on B, key Y 4 on A. Shared over the region's 5 slots, X's demand (B's slot and one more
    asked) cut Y's share to 3: Y got ``key_over_fair_share`` while A had room for it. Per
    model pool, Y alone asks for A's backend: every one of its streams is served, and X,
    alone on B's full backend, is refused as a key alone in a full region is
    (``region_saturated``), not as over a share Y's traffic on A took from it."""
    async with (
        sim_server("h100-7b", served_model_names=["model-a"]) as sim_a,
        sim_server("h100-7b", served_model_names=["model-b"]) as sim_b,
        start_router(
            [sim_a.url, sim_b.url], tls=False,
            upstreams=[{"url": sim_a.url, "max_in_flight": 4},
                       {"url": sim_b.url, "max_in_flight": 1}],
            auth={"api_keys": [API_KEY, OTHER_KEY]},
        ) as router,
    ):
        url = router.base_url + "/v1/chat/completions"
        answers: dict[str, list[httpx.Response]] = {"x": [], "y": []}
        deadline = time.monotonic() + 3.0
        limits = httpx.Limits(max_connections=16, max_keepalive_connections=16)
        async with httpx.AsyncClient(limits=limits, timeout=60) as client:

            async def loop(who: str, key: str, model: str, i: int) -> None:
                n = 0
                # Bounded in count and time: at most 200 requests a loop, for 3 s.
                while time.monotonic() < deadline and n < 200:
                    answer = await client.post(url, json=chat(model, f"{who} {i} {n}", 12),
                                               headers=auth(key))
                    answers[who].append(answer)
                    n += 1
                    if answer.status_code == 429:
                        await asyncio.sleep(0.05)  # greedy: not waiting out Retry-After

            await asyncio.gather(
                *(loop("x", OTHER_KEY, "model-b", i) for i in range(8)),
                *(loop("y", API_KEY, "model-a", i) for i in range(4)),
            )
        state = router.app.state
        # Shares kept per pool: one per model here, bounded by the backends' lists.
        names = [backend.name for backend in state.pool.backends]
        assert set(state.pools) <= {frozenset({names[0]}), frozenset({names[1]})}
        state.tick(state.clock() + 3.0)  # past the ask window: nothing held, nothing kept
        assert state.pools == {}
    ys, xs = answers["y"], answers["x"]
    refused_y = Counter(_code(a) for a in ys if a.status_code != 200)
    assert refused_y == Counter(), refused_y  # no key_over_fair_share, no 429 for A
    assert len(ys) >= 6, len(ys)  # A's streams went on for the whole run
    assert all(a.text.endswith("data: [DONE]\n\n") for a in ys)
    statuses_x = Counter(a.status_code for a in xs)
    assert set(statuses_x) <= {200, 429}, statuses_x
    assert statuses_x[429] > 0, statuses_x  # X's excess on B is still refused
    codes_x = Counter(_code(a) for a in xs if a.status_code == 429)
    assert set(codes_x) == {"region_saturated"}, codes_x
    assert all(int(a.headers["retry-after"]) >= 1 for a in xs if a.status_code == 429)
    assert statuses_x[200] >= 1  # B's slot served X all along (a misroute would be a 404)


async def test_one_models_spills_do_not_use_up_another_models_spill_budget() -> None:
    """Tokyo has 2 slots for models A and B, and a spill budget of 1 (ratio 0, minimum 1);
    Frankfurt has room. B and A take a slot each; B spills once (its budget used up), and
    A's next stream still spills to Frankfurt on A's own budget (one
    budget per region refused it: 429 ``region_saturated``, reason ``spill_budget``).
    B's next is refused on B's budget, as before."""
    stall = {"profile": "h100-7b", "faults": ["stall:after=2,ms=4000"],
             "served_model_names": ["model-a", "model-b"]}
    specs = [
        RegionSpec("tokyo", 35.68, 139.69, backends=1, sim=stall,
                   upstream={"max_in_flight": 2},
                   config={"routing": {"spill_budget_ratio": 0.0,
                                       "spill_min_concurrency": 1}}),
        RegionSpec("frankfurt", 50.11, 8.68, backends=1, sim=stall,
                   upstream={"max_in_flight": 64}),
    ]
    async with running_regions(specs) as regions:
        await wait_for_peers(regions)
        url = regions["tokyo"].url + "/v1/chat/completions"
        async with (
            httpx.AsyncClient(timeout=30) as client,
            contextlib.AsyncExitStack() as held,
        ):

            async def open_stream(model: str, i: int) -> httpx.Response:
                """Start a stream and keep it open (it stalls after two tokens)."""
                return await held.enter_async_context(
                    client.stream("POST", url, json=chat(model, f"{model} {i}", 8))
                )

            b_local = await open_stream("model-b", 1)
            a_local = await open_stream("model-a", 1)  # Tokyo is full for both models now
            b_spilled = await open_stream("model-b", 2)
            a_spilled = await open_stream("model-a", 2)
            b_refused = await open_stream("model-b", 3)
            got = [(r.status_code, r.headers.get("x-firstbyte-region"))
                   for r in (b_local, b_spilled, a_local, a_spilled)]
            assert got == [(200, "tokyo"), (200, "frankfurt"), (200, "tokyo"),
                           (200, "frankfurt")], got
            assert b_refused.status_code == 429
            body = json.loads(await b_refused.aread())
            assert body["error"]["code"] == "region_saturated"
            assert "spilled to other regions is used up" in body["error"]["message"]
            routing = regions["tokyo"].state.routing
            assert routing.spill.spilling_by_model == {"model-a": 1, "model-b": 1}
            assert routing.rejections == {("spill_budget", "model-b"): 1}
            for r in (b_local, b_spilled, a_local, a_spilled):
                assert (await r.aread()).endswith(b"data: [DONE]\n\n")
        assert routing.spill.spilling == 0
        assert not routing.active_by_model  # every count given back
