"""The SDK's periodic re-probe across real regions: it leaves a region that got slow and comes
back when it recovers, moving its warm primary and standby, without a failed or cold request.

Three real routers (``benchmarks.cluster.running_regions``) behind the TLS edge proxies of
``test_regions_live`` (a per-direction delay that can be changed while running), re-probed
every 0.3 s while requests keep running.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import pytest

from firstbyte.benchmarks.cluster import RegionSpec, running_regions
from firstbyte.client_sdk.client import AsyncClient
from firstbyte.client_sdk.timings import Timings
from tests.client_sdk.test_regions_live import FAST, edges, sdk, stream_once, until

INTERVAL_S = 0.3


def primary(client: AsyncClient) -> str | None:
    region = client.regions.choose(time.monotonic())
    return None if region is None else region.name


def standby(client: AsyncClient) -> str | None:
    region = client.regions.standby(time.monotonic())
    return None if region is None else region.name


@contextlib.asynccontextmanager
async def requests_meanwhile(client: AsyncClient) -> AsyncIterator[list[Timings | BaseException]]:
    """Sequential requests in the background for the whole block; every outcome is kept."""
    outcomes: list[Timings | BaseException] = []

    async def loop() -> None:
        while True:
            try:
                outcomes.append(await stream_once(client))
            except Exception as exc:  # a failed request is what the test looks for
                outcomes.append(exc)
            await asyncio.sleep(0.05)

    task = asyncio.create_task(loop())
    try:
        yield outcomes
    finally:
        task.cancel()
        # A lost cancel (test_cancel.py) would keep the loop running: fail, do not hang.
        done, _ = await asyncio.wait([task], timeout=10.0)
        assert done, "the request loop ran on after its cancel"


@pytest.mark.parametrize("transport", ["sse", "websocket"])
async def test_reprobe_leaves_a_slow_region_and_comes_back_after_it_recovers(
    tls_files: tuple[str, str, str], transport: str
) -> None:
    ca_file, cert, key = tls_files
    specs = [RegionSpec("near", 0.0, 0.0, **FAST), RegionSpec("mid", 0.0, 1.0, **FAST),
             RegionSpec("far", 0.0, 2.0, **FAST)]
    async with running_regions(specs) as regions, \
            edges(regions, (cert, key), {"mid": 0.05, "far": 0.1}) as proxies, \
            sdk(proxies, ["near", "mid", "far"], ca_file, transport=transport,
                reprobe_interval_s=INTERVAL_S) as client:
        # Each probe counts fully (no EWMA): a recovered region then goes from let go (no
        # connection) straight to primary, the case where its connection must be opened
        # before requests are sent there. The EWMA path is in test_reprobe_units.
        # So one probe decides, and the regions' RTTs (~0, 100 and 200 ms) are far enough
        # apart that only a probe stalled by ~90 ms (this process descheduled under a loaded
        # suite) could reorder them; 20 and 40 ms delays once read a switch too many.
        client.regions.alpha = 1.0
        await client.prewarm()
        assert (primary(client), standby(client)) == ("near", "mid")
        await until(lambda: proxies["far"].open == 0)
        async with requests_meanwhile(client) as outcomes:
            # Re-probes run (RTTs keep being measured) but nothing moves: near stays best.
            accepted = {name: proxies[name].accepted for name in ("near", "mid")}
            far_accepted = proxies["far"].accepted
            await asyncio.sleep(4 * INTERVAL_S)
            # far (let go) costs a connection per probe (a handshake each at 200 ms RTT).
            await until(lambda: proxies["far"].accepted >= far_accepted + 2, timeout_s=5.0)
            assert client.regions.switches == 0
            # The kept regions are probed on their warm connections.
            assert {name: proxies[name].accepted for name in ("near", "mid")} == accepted
            assert (primary(client), standby(client)) == ("near", "mid")

            proxies["near"].delay_s = 0.15  # near is now the farthest: ~300 ms RTT
            await until(lambda: primary(client) == "mid", timeout_s=10.0)
            # far (200 ms) is now second best: it becomes the warm standby, near is let go.
            await until(lambda: standby(client) == "far", timeout_s=10.0)
            assert proxies["far"].open >= 1
            before = len(outcomes)
            await until(lambda: any(isinstance(o, Timings) and o.region == "mid"
                                    for o in outcomes[before:]), timeout_s=5.0)

            await until(lambda: proxies["near"].open == 0)  # let go
            accepted = proxies["near"].accepted
            proxies["near"].delay_s = 0.0  # recovered
            await until(lambda: primary(client) == "near", timeout_s=10.0)
            # Straight from no connection to primary; the probe's connection (WebSocket: and
            # the socket opened for requests) were opened before any request went there.
            assert proxies["near"].accepted - accepted == (2 if transport == "websocket" else 1)
            await until(lambda: standby(client) == "mid", timeout_s=10.0)
            before = len(outcomes)
            await until(lambda: any(isinstance(o, Timings) and o.region == "near"
                                    for o in outcomes[before:]), timeout_s=5.0)
        assert client.regions.switches == 2  # away and back, no flapping between
        await until(lambda: proxies["far"].open == 0)  # neither primary nor standby again
    failed = [o for o in outcomes if not isinstance(o, Timings)]
    assert not failed, failed
    served = [o for o in outcomes if isinstance(o, Timings)]
    assert {t.region for t in served} >= {"near", "mid"}
    # Every request rode a connection opened before it was sent there: no handshake, no resume.
    assert all(t.warm and t.resumes == 0 for t in served), [
        (t.region, t.warm, t.resumes) for t in served if not (t.warm and t.resumes == 0)]


async def test_reprobe_interval_none_never_reprobes(tls_files: tuple[str, str, str]) -> None:
    ca_file, cert, key = tls_files
    specs = [RegionSpec("near", 0.0, 0.0, **FAST), RegionSpec("mid", 0.0, 1.0, **FAST)]
    async with running_regions(specs) as regions, \
            edges(regions, (cert, key), {"mid": 0.02}) as proxies, \
            sdk(proxies, ["near", "mid"], ca_file, reprobe_interval_s=None) as client:
        await client.prewarm()
        assert primary(client) == "near"
        accepted = {name: p.accepted for name, p in proxies.items()}
        proxies["near"].delay_s = 0.06
        await asyncio.sleep(1.0)
        assert primary(client) == "near"
        assert {name: p.accepted for name, p in proxies.items()} == accepted
        assert (await stream_once(client)).region == "near"
