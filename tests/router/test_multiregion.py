"""Three regions on loopback (a router and sims each), a real GeoIP database, real sockets.

Client "addresses" come via X-Forwarded-For from 127.0.0.1, a trusted proxy (real
connections all come from 127.0.0.1)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from firstbyte.benchmarks.cluster import RegionHandle, RegionSpec, running_regions, wait_for_peers
from firstbyte.router.upstream_metrics import parse_backend_metrics
from tests.router.geo_fixtures import (
    FRANKFURT_CLIENT,
    TOKYO_CLIENT,
    UNKNOWN_CLIENT,
    VIRGINIA_CLIENT,
    write_city_mmdb,
)
from tests.router.logs import access_records

API_KEY = "sk-multiregion-0001"
AUTH = {"authorization": f"Bearer {API_KEY}"}
SYSTEM = "You are the support assistant of a company that builds latency-aware routers. " * 150
WARM = [{"name": "support", "text": SYSTEM}]


def specs(**per_region: dict[str, Any]) -> list[RegionSpec]:
    base = [
        RegionSpec("tokyo", 35.68, 139.69),
        RegionSpec("frankfurt", 50.11, 8.68),
        RegionSpec("virginia", 39.04, -77.49),
    ]
    for spec in base:
        for key, value in per_region.get(spec.name, {}).items():
            setattr(spec, key, value)
    return base


@contextlib.asynccontextmanager
async def cluster(
    tmp_path: Path, warm: list[dict[str, Any]] | None = None, **per_region: dict[str, Any]
) -> AsyncIterator[dict[str, RegionHandle]]:
    mmdb = write_city_mmdb(tmp_path / "cities.mmdb")
    async with running_regions(
        specs(**per_region), api_keys=[API_KEY], warm_prefixes=WARM if warm is None else warm,
        geo_database=str(mmdb),
    ) as regions:
        await wait_for_peers(regions)
        yield regions


def chat(user: str, *, system: str = SYSTEM, max_tokens: int = 4, stream: bool = False) -> dict[str, Any]:
    return {
        "model": "sim",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        "max_tokens": max_tokens,
        "stream": stream,
    }


async def post(client: httpx.AsyncClient, region: RegionHandle, body: dict[str, Any],
               xff: str | None = None) -> httpx.Response:
    headers = dict(AUTH)
    if xff is not None:
        headers["x-forwarded-for"] = xff
    return await client.post(f"{region.url}/v1/chat/completions", json=body, headers=headers)


async def test_client_served_by_its_region_via_trusted_proxy(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="firstbyte.access")
    async with cluster(tmp_path) as regions, httpx.AsyncClient(timeout=30) as client:
        frankfurt = regions["frankfurt"]
        r = await post(client, frankfurt, chat("hello from Tokyo"), xff=TOKYO_CLIENT)
        assert r.status_code == 200, r.text
        assert r.headers["x-firstbyte-region"] == "tokyo"
        assert r.headers["x-firstbyte-better-region"] == "tokyo"
        assert r.headers["x-firstbyte-better-region-url"] == regions["tokyo"].url
        assert r.json()["choices"][0]["message"]["content"]
        r = await post(client, frankfurt, chat("hello from Frankfurt"), xff=FRANKFURT_CLIENT)
        assert r.headers["x-firstbyte-region"] == "frankfurt"
        assert "x-firstbyte-better-region" not in r.headers
        r = await post(client, regions["tokyo"], chat("hello from Virginia"), xff=VIRGINIA_CLIENT)
        assert r.headers["x-firstbyte-region"] == "virginia"
        # Unknown address: local to the region it reached.
        r = await post(client, frankfurt, chat("hello from nowhere"), xff=UNKNOWN_CLIENT)
        assert r.headers["x-firstbyte-region"] == "frankfurt"
        # Streaming through the forward: SSE with ids, tokens, [DONE].
        r = await post(client, frankfurt, chat("stream me", stream=True, max_tokens=8), xff=TOKYO_CLIENT)
        assert r.status_code == 200
        assert r.headers["x-firstbyte-region"] == "tokyo"
        assert r.text.rstrip().endswith("data: [DONE]")
        assert r.text.count('"content"') >= 8
        # The peer served it as a forwarded request (never forwarded again).
        metrics = (await client.get(f"{frankfurt.url}/metrics", headers=AUTH)).text
        assert 'firstbyte_route_forwards_total{to="tokyo"} 2' in metrics
    # One JSON access-log line per request, without secrets or addresses.
    records = access_records(caplog)
    forwarded = [r for r in records if r["entry_region"] == "frankfurt" and r["region"] == "tokyo"]
    assert len(forwarded) == 2
    assert forwarded[0]["client_city"] == "Tokyo"
    assert forwarded[0]["outcome"] == "ok"
    assert all(API_KEY not in r.getMessage() and TOKYO_CLIENT not in r.getMessage()
               for r in caplog.records)


async def test_spoofed_forwarded_for_from_untrusted_peer_changes_nothing(tmp_path: Path) -> None:
    untrusted = {"config": {"geo": {"trusted_proxies": []}}}
    async with cluster(tmp_path, frankfurt=untrusted) as regions, httpx.AsyncClient(timeout=30) as client:
        frankfurt = regions["frankfurt"]
        r = await post(client, frankfurt, chat("I claim to be in Tokyo"), xff=TOKYO_CLIENT)
        assert r.status_code == 200
        assert r.headers["x-firstbyte-region"] == "frankfurt"
        assert "x-firstbyte-better-region" not in r.headers
        # A client cannot fake the router-to-router marker either.
        headers = {**AUTH, "x-firstbyte-forwarded": "tokyo", "x-firstbyte-peer-key": "wrong-key-000000"}
        r = await client.post(f"{regions['tokyo'].url}/v1/chat/completions", headers={**headers, "x-forwarded-for": FRANKFURT_CLIENT}, json=chat("x"))
        assert r.headers["x-firstbyte-region"] == "frankfurt"  # still routed by location


async def sim_prefix_queries(client: httpx.AsyncClient, url: str) -> float:
    metrics = parse_backend_metrics((await client.get(f"{url}/metrics")).text)
    assert metrics.prefix_queries is not None
    return metrics.prefix_queries


async def test_backends_warm_before_first_request_and_after_restart(tmp_path: Path) -> None:
    async with cluster(tmp_path) as regions, httpx.AsyncClient(timeout=30) as client:
        # No user request has been sent: the sims' prefix caches were still queried (warmup).
        for region in regions.values():
            for sim in region.sims:
                assert await sim_prefix_queries(client, sim.url) > 0
            status = (await client.get(f"{region.url}/v1/edge/status", headers=AUTH)).json()
            assert all(states == {"support": "warm"} for states in status["warm"].values())
        tokyo = regions["tokyo"]
        r = await post(client, tokyo, chat("How do I reset my router?"), xff=TOKYO_CLIENT)
        usage = r.json()["usage"]
        system_tokens = len(SYSTEM) // 4
        assert usage["prompt_tokens_details"]["cached_tokens"] >= system_tokens - 32
        # A backend restarts (empty cache, counters back at 0, down for a moment).
        sim = tokyo.sims[0]
        await sim.restart(down_s=0.6)  # longer than a scrape interval (0.25 s)
        routing = tokyo.state.routing
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 15
        scheduler = routing.scheduler
        while scheduler.restarts_total["tokyo-0"] < 1 or scheduler.warm("tokyo-0") != ["support"]:
            assert loop.time() < deadline, (scheduler.registry(), scheduler.restarts_total)
            await asyncio.sleep(0.05)
        # The fresh sim has the system prompt cached again (asked directly).
        direct = await client.post(f"{sim.url}/v1/chat/completions", json=chat("Another question"))
        assert direct.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= system_tokens - 32
        metrics = (await client.get(f"{tokyo.url}/metrics", headers=AUTH)).text
        assert 'firstbyte_backend_restarts_total{backend="tokyo-0"} 1' in metrics
        assert 'firstbyte_warm_state{backend="tokyo-0",prefix="support"} 1' in metrics
