"""Routing under load on loopback: prefix affinity vs round-robin, spills, 429, late first token."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx

from firstbyte.benchmarks.cluster import RegionHandle, RegionSpec, running_regions, wait_for_peers
from firstbyte.client_sdk.client import AsyncClient
from firstbyte.client_sdk.errors import RateLimitError
from tests.waits import until

SYSTEM = "You are a meticulous assistant for a travel company; answer briefly and kindly. " * 100


def history_body(user: int, turns: list[tuple[str, str]], question: str, **kw: Any) -> dict[str, Any]:
    messages: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]
    for q, a in turns:
        messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    messages.append({"role": "user", "content": question})
    return {"model": "sim", "messages": messages, "max_tokens": kw.get("max_tokens", 24),
            "user": f"user-{user}"}


async def conversations(url: str, users: int, turns: int) -> tuple[float, dict[str, int]]:
    """Each user has its own growing history; returns (cache-hit ratio, requests per backend)."""
    histories: dict[int, list[tuple[str, str]]] = {u: [] for u in range(users)}
    prompt = cached = 0
    async with httpx.AsyncClient(timeout=60) as client:
        for turn in range(turns):
            async def one(u: int, turn: int = turn) -> tuple[int, int]:
                question = f"User {u} here, trip plan {turn}: what should I pack for day {turn}? " * 3
                r = await client.post(f"{url}/v1/chat/completions",
                                      json=history_body(u, histories[u], question))
                assert r.status_code == 200, r.text
                data = r.json()
                histories[u].append((question, data["choices"][0]["message"]["content"]))
                usage = data["usage"]
                return usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]
            for p, c in await asyncio.gather(*(one(u) for u in range(users))):
                prompt += p
                cached += c
    return cached / prompt, {}


async def affinity_run(policy: str) -> tuple[float, dict[str, int]]:
    spec = RegionSpec("tokyo", 35.68, 139.69, backends=4,
                      config={"routing": {"backend_policy": policy}})
    async with running_regions([spec], warm_prefixes=[{"name": "sys", "text": SYSTEM}]) as regions:
        ratio, _ = await conversations(regions["tokyo"].url, users=50, turns=4)
        tracker = regions["tokyo"].state.routing.tracker
        return ratio, {n: b.requests for n, b in tracker.backends.items()}


async def test_prefix_affinity_beats_round_robin_and_stays_balanced() -> None:
    prefix_ratio, prefix_load = await affinity_run("prefix")
    rr_ratio, _ = await affinity_run("round_robin")
    assert prefix_ratio > rr_ratio
    assert prefix_ratio >= 0.9
    total = sum(prefix_load.values())
    assert total == 200
    assert max(prefix_load.values()) / total <= 0.40, prefix_load
    assert max(prefix_load.values()) / min(prefix_load.values()) <= 1.5, prefix_load


def three_regions(tokyo: dict[str, Any], others: dict[str, Any] | None = None) -> list[RegionSpec]:
    others = others or {}
    return [
        RegionSpec("tokyo", 35.68, 139.69, **tokyo),
        RegionSpec("frankfurt", 50.11, 8.68, **others),
        RegionSpec("virginia", 39.04, -77.49, **others),
    ]


def in_flight(regions: dict[str, RegionHandle]) -> dict[str, int]:
    """Requests each region's router has sent to its backends and not seen end."""
    return {name: sum(b.in_flight for b in handle.state.routing.tracker.backends.values())
            for name, handle in regions.items()}


BUSY_TOKENS = 3000
"""A stream that keeps a slot busy for ~30 s on the h100-7b profile (10 ms a token), sent
with ``ignore_eos``: the sim would otherwise stop at the prompt's natural end, 8-256 tokens
(one of these ended after ~1 s, before a slow machine's waits were over)."""


async def cancelled(tasks: list[asyncio.Task[Any]]) -> None:
    """Cancel requests still running (their clients go: the routers cancel upstream)."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def slow_body(i: int, max_tokens: int = 40, stream: bool = False) -> dict[str, Any]:
    return {"model": "sim", "max_tokens": max_tokens, "stream": stream,
            "ignore_eos": max_tokens >= BUSY_TOKENS,
            "messages": [{"role": "user", "content": f"request {i}: tell me a long story"}]}


async def test_saturated_region_spills_to_peers_and_nothing_fails() -> None:
    # Tokyo: 2 backends x 2 in flight. 10 concurrent requests need the peers for 6 of them;
    # a spill budget of 60% of active requests allows that (the default 20% would 429 some).
    tokyo = {"sim": {"profile": "h100-7b"}, "upstream": {"max_in_flight": 2},
             "config": {"routing": {"spill_budget_ratio": 0.6}}}
    async with running_regions(three_regions(tokyo, {"sim": {"profile": "h100-7b"}})) as regions:
        await wait_for_peers(regions)
        url = regions["tokyo"].url
        async with httpx.AsyncClient(timeout=60) as client:
            replies = await asyncio.gather(
                *(client.post(f"{url}/v1/chat/completions", json=slow_body(i)) for i in range(10))
            )
        assert [r.status_code for r in replies] == [200] * 10
        served = [r.headers["x-firstbyte-region"] for r in replies]
        assert served.count("tokyo") == 4
        assert served.count("frankfurt") + served.count("virginia") == 6
        assert all(r.json()["choices"][0]["message"]["content"] for r in replies)
        metrics = regions["tokyo"].state.routing.spills
        assert sum(n for (_, reason), n in metrics.items() if reason == "saturated") == 6


async def test_all_regions_saturated_answer_429_with_retry_after() -> None:
    one = {"backends": 1, "sim": {"profile": "h100-7b"}, "upstream": {"max_in_flight": 1}}
    async with running_regions(three_regions(one, one)) as regions:
        await wait_for_peers(regions)
        url = regions["tokyo"].url
        async with httpx.AsyncClient(timeout=60) as client:
            replies = await asyncio.gather(
                *(client.post(f"{url}/v1/chat/completions", json=slow_body(i, 60)) for i in range(8))
            )
            codes = sorted(r.status_code for r in replies)
            assert codes.count(200) == 3  # one local, one spilled to each peer
            assert codes.count(429) == 5
            for r in replies:
                if r.status_code == 429:
                    assert int(r.headers["retry-after"]) >= 1
                    error = r.json()["error"]
                    assert error["type"] == "rate_limit_error"
                    assert error["code"] == "region_saturated"
                    assert r.headers["x-firstbyte-region"] == "tokyo"
            # The SDK surfaces the Retry-After it must honour, asked while every region is full.
            # On a loaded machine the regions may not stay full for the ask (a peer poll fails,
            # a stream ends early): that attempt proves nothing, and is made again.
            full = {"tokyo": 1, "frankfurt": 1, "virginia": 1}
            broken: list[object] = []
            for _ in range(3):
                raised, held, ended = await ask_sdk_while_full(regions, client, url, full)
                if held:
                    break
                broken.append((in_flight(regions), ended))
            else:
                raise AssertionError(f"the regions did not stay full for the ask: {broken}")
            assert raised is not None
            assert raised.retry_after is not None
            assert raised.retry_after >= 1


async def ask_sdk_while_full(
    regions: dict[str, RegionHandle], client: httpx.AsyncClient, url: str,
    full: dict[str, int],
) -> tuple[RateLimitError | None, bool, list[str]]:
    """With every region idle, start one long stream per slot (one local, one spilled to
    each peer), wait until every router counts its own and Tokyo has heard so from its peers,
    then ask through the SDK (no retries). Returns what it raised, whether every region was
    still full after the ask, and how any busy stream ended early. The routers' counts are
    waited on, not fixed times a slow machine outruns."""
    idle = dict.fromkeys(full, 0)
    await until(lambda: in_flight(regions) == idle, 10, "every region idle")
    await wait_for_peers(regions)
    busy = [asyncio.create_task(client.post(f"{url}/v1/chat/completions",
                                            json=slow_body(i, BUSY_TOKENS)))
            for i in range(sum(full.values()))]
    try:
        await until(lambda: in_flight(regions) == full, 10, "every region full")
        await wait_for_peers(regions)
        raised = None
        async with AsyncClient(f"{url}/v1", http="1.1", retries=0) as sdk:
            try:
                async with sdk.stream(model="sim",
                                      messages=[{"role": "user", "content": "hi"}]) as s:
                    async for _ in s:
                        pass
            except RateLimitError as exc:
                raised = exc
        held = in_flight(regions) == full
        ended = [f"{t.result().status_code} {t.result().text[:200]}" if not t.exception()
                 else repr(t.exception()) for t in busy if t.done()]
        return raised, held, ended
    finally:
        await cancelled(busy)


async def test_stalled_backend_spills_within_first_token_deadline() -> None:
    tokyo = {"backends": 1, "sim": {"faults": ["stall:after=0"]},
             "config": {"routing": {"first_token_deadline_ms": 400}}}
    async with running_regions(three_regions(tokyo)) as regions:
        await wait_for_peers(regions)
        url = regions["tokyo"].url
        async with httpx.AsyncClient(timeout=30) as client:
            start = time.perf_counter()
            first_token = None
            text = ""
            async with client.stream("POST", f"{url}/v1/chat/completions",
                                     json=slow_body(1, 12, stream=True)) as r:
                assert r.status_code == 200
                # The head waited for the first token, so it names the region that served.
                assert r.headers["x-firstbyte-region"] in {"frankfurt", "virginia"}
                async for chunk in r.aiter_text():
                    if first_token is None and '"content"' in chunk:
                        first_token = time.perf_counter() - start
                    text += chunk
        assert first_token is not None
        assert 0.3 < first_token < 2.5  # after the 400 ms deadline, not after a timeout
        assert text.rstrip().endswith("data: [DONE]")
        assert '"error"' not in text
        assert text.count('"role"') <= 1  # the switch added no second preamble
        spills = regions["tokyo"].state.routing.spills
        assert sum(n for (_, reason), n in spills.items() if reason == "first_token_deadline") == 1


async def test_sdk_fails_over_on_429_and_sets_the_region_aside_for_retry_after() -> None:
    one = {"backends": 1, "sim": {"profile": "h100-7b"}, "upstream": {"max_in_flight": 1}}
    # Two unconnected regions: Tokyo cannot spill, so a full Tokyo answers 429.
    async with running_regions([RegionSpec("tokyo", 35.68, 139.69, **one)]) as tokyo, \
            running_regions([RegionSpec("frankfurt", 50.11, 8.68, backends=1)]) as frankfurt:
        t_url, f_url = tokyo["tokyo"].url + "/v1", frankfurt["frankfurt"].url + "/v1"
        async with httpx.AsyncClient(timeout=60) as client:
            busy = asyncio.create_task(
                client.post(f"{tokyo['tokyo'].url}/v1/chat/completions", json=slow_body(0, BUSY_TOKENS)))
            await until(lambda: in_flight(tokyo) == {"tokyo": 1}, 10, "Tokyo full")
            async with AsyncClient([t_url, f_url], http="1.1") as sdk:
                asked_at = time.monotonic()  # Tokyo's 429 came after this
                async with sdk.stream(model="sim",
                                      messages=[{"role": "user", "content": "hi"}]) as s:
                    text = "".join([d.text async for d in s])
                assert text
                # Retry-After >= 1 s from the 429: set aside past asked_at + 0.9 however long
                # the stream from Frankfurt took (on a slow machine, more than the second)
                assert not sdk.regions.available(t_url, asked_at + 0.9)
                assert sdk.regions.available(f_url, time.monotonic())
            assert in_flight(tokyo) == {"tokyo": 1}  # still full: its 429 was right
            await cancelled([busy])
