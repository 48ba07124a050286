"""The SDK across real regions: RTT probe, warm standby failover, better-region hints.

Every region is a real router (``benchmarks.cluster``: routers peered with each other, simulated
backends) behind an :class:`EdgeProxy`: a TLS-terminating TCP proxy, as a region's load
balancer would be, which can add a delay each way (a farther region) and can be killed (a
region that goes away). The SDK talks real TLS (a ``trustme`` CA) to the proxies.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from firstbyte.benchmarks.cluster import (
    MODEL,
    RegionHandle,
    RegionSpec,
    running_regions,
    wait_for_peers,
)
from firstbyte.client_sdk.client import AsyncClient
from firstbyte.client_sdk.timings import Timings
from tests.router.geo_fixtures import TOKYO_CLIENT, write_city_mmdb
from tests.waits import until

MESSAGES = [{"role": "user", "content": "Tell me about latency."}]
FAST = {"backends": 1, "sim": {"profile": "instant"}}


class EdgeProxy:
    """TLS in front, plain TCP to the router behind; ``delay_s`` is added in each direction."""

    def __init__(self, target_port: int, cert: tuple[str, str], delay_s: float = 0.0) -> None:
        self.target_port = target_port
        self.delay_s = delay_s
        self.accepted = 0
        """Client connections accepted (TLS handshakes the SDK paid for)."""
        self.open = 0
        self.port = 0
        self._ssl = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self._ssl.load_cert_chain(*cert)
        self._ssl.set_alpn_protocols(["h2", "http/1.1"])  # hypercorn speaks h2c behind us
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def url(self) -> str:
        return f"https://localhost:{self.port}/v1"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0, ssl=self._ssl)
        self.port = self._server.sockets[0].getsockname()[1]

    async def kill(self) -> None:
        """The region is gone: refuse new connections and reset the open ones."""
        if self._server is not None:
            self._server.close()
            self._server = None
        for writer in list(self._writers):
            writer.transport.abort()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        self.open += 1
        self._writers.add(writer)
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.transport.abort()
            self.open -= 1
            return
        self._writers.add(up_writer)
        pumps = [asyncio.ensure_future(self._pump(reader, up_writer)),
                 asyncio.ensure_future(self._pump(up_reader, writer))]
        for task in pumps:
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        try:
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in pumps:
                task.cancel()
            for w in (writer, up_writer):
                w.transport.abort()
                self._writers.discard(w)
            self.open -= 1

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        # Reader and writer decoupled by a queue, so a delay shifts every chunk by delay_s
        # without slowing the byte rate (as distance does), and order is kept.
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def write() -> None:
            while True:
                due, data = await queue.get()
                if not data:
                    return
                if due > loop.time():
                    await asyncio.sleep(due - loop.time())
                dst.write(data)
                await dst.drain()

        writer = asyncio.ensure_future(write())
        try:
            while True:
                data = await src.read(65536)
                queue.put_nowait((loop.time() + self.delay_s, data))
                if not data:
                    break
            await writer
        finally:
            writer.cancel()
            with contextlib.suppress(asyncio.CancelledError, OSError):
                await writer


@contextlib.asynccontextmanager
async def edges(
    regions: dict[str, RegionHandle], cert: tuple[str, str], delays: dict[str, float],
) -> AsyncIterator[dict[str, EdgeProxy]]:
    proxies = {name: EdgeProxy(h.endpoints.port, cert, delays.get(name, 0.0))
               for name, h in regions.items()}
    try:
        for proxy in proxies.values():
            await proxy.start()
        yield proxies
    finally:
        for proxy in proxies.values():
            await proxy.kill()


async def stream_once(client: AsyncClient, max_tokens: int = 4) -> Timings:
    async with client.stream(model="sim", messages=MESSAGES, max_tokens=max_tokens) as s:
        text = "".join([d.text async for d in s])
    assert text
    return s.timings


def sdk(proxies: dict[str, EdgeProxy], names: list[str], ca_file: str, **kw: Any) -> AsyncClient:
    # keep-warm pings would add bytes and connections at random moments; not needed here.
    return AsyncClient({n: proxies[n].url for n in names}, ca_file=ca_file,
                       keepalive_interval_s=300.0, **kw)


@pytest.mark.parametrize("http", ["1.1", "2"])
async def test_probe_picks_the_fastest_region_and_keeps_a_warm_standby(
    tls_files: tuple[str, str, str], http: str
) -> None:
    ca_file, cert, key = tls_files
    specs = [RegionSpec("far", 0.0, 0.0, **FAST), RegionSpec("near", 0.0, 1.0, **FAST),
             RegionSpec("mid", 0.0, 2.0, **FAST)]
    # Configured worst first: only the measurement can put "near" first.
    async with running_regions(specs) as regions, \
            edges(regions, (cert, key), {"far": 0.08, "mid": 0.04}) as proxies, \
            sdk(proxies, ["far", "mid", "near"], ca_file, http=http) as client:
        await client.prewarm()
        rtt = {name: client.regions.rtt_ms(name) for name in ("far", "mid", "near")}
        assert rtt["near"] is not None
        assert rtt["mid"] is not None
        assert rtt["far"] is not None
        assert rtt["near"] < rtt["mid"] < rtt["far"], rtt
        assert rtt["far"] > 150.0  # 2 x 80 ms of delay is inside the measurement
        now = time.monotonic()
        assert client.regions.choose(now).name == "near"  # type: ignore[union-attr]
        assert client.regions.standby(now).name == "mid"  # type: ignore[union-attr]
        assert [client.regions.label(n) for n in ("far", "mid", "near")] == [
            "far", "mid", "near"]  # the routers' own names, from /v1/edge/status
        # Only the primary and the standby stay connected.
        await until(lambda: proxies["far"].open == 0)
        assert proxies["near"].open == 1
        assert proxies["mid"].open == 1
        timings = await stream_once(client)
        assert timings.region == "near"
        assert timings.warm
        assert proxies["near"].accepted == 1  # the probe's connection served the request


async def test_failover_after_a_429_goes_to_the_warm_standby_without_a_handshake(
    tls_files: tuple[str, str, str],
) -> None:
    ca_file, cert, key = tls_files
    # Two unconnected regions: a full "primary" cannot spill, so it answers 429.
    busy = {"backends": 1, "sim": {"profile": "h100-7b"}, "upstream": {"max_in_flight": 1}}
    async with running_regions([RegionSpec("primary", 0.0, 0.0, **busy)]) as one, \
            running_regions([RegionSpec("standby", 0.0, 1.0, **FAST)]) as two:
        regions = {**one, **two}
        async with edges(regions, (cert, key), {"standby": 0.03}) as proxies, \
                sdk(proxies, ["standby", "primary"], ca_file) as client:
            await client.prewarm()
            assert client.regions.choose(time.monotonic()).name == "primary"  # type: ignore[union-attr]
            async with httpx.AsyncClient(timeout=60) as direct:
                hog = asyncio.create_task(direct.post(
                    f"{regions['primary'].url}/v1/chat/completions",
                    json={"model": "sim", "max_tokens": 100, "messages": MESSAGES}))
                await until(lambda: regions["primary"].state.routing.active() >= 1)
                timings = await stream_once(client)
                # Set aside for its Retry-After (>= 1 s), so the next request skips it.
                assert not client.regions.available("primary", time.monotonic())
                assert (await hog).status_code == 200
        assert timings.region == "standby"
        assert timings.warm, timings  # the 429 and the retry both rode open connections
        assert timings.tcp_connect_ms is None
        assert timings.tls_handshake_ms is None
        assert proxies["standby"].accepted == 1  # the prewarmed standby connection, no other


@pytest.mark.parametrize("http", ["1.1", "2"])
async def test_failover_when_the_primary_dies_costs_no_handshake(
    tls_files: tuple[str, str, str], http: str
) -> None:
    ca_file, cert, key = tls_files
    specs = [RegionSpec("primary", 0.0, 0.0, **FAST), RegionSpec("standby", 0.0, 1.0, **FAST)]
    async with running_regions(specs) as regions, \
            edges(regions, (cert, key), {"standby": 0.03}) as proxies, \
            sdk(proxies, ["standby", "primary"], ca_file, http=http,
                resume_backoff_s=1.0) as client:
        await client.prewarm()
        assert (await stream_once(client)).region == "primary"
        await proxies["primary"].kill()
        timings = await stream_once(client)
        assert timings.region == "standby"
        assert timings.warm, timings
        assert proxies["standby"].accepted == 1
        again = await stream_once(client)  # the dead region is set aside: straight to standby
        assert again.region == "standby"
        assert again.warm
        assert again.resumes == 0
        # The dead primary's pooled connection (HTTP/2 sends on it before noticing) cost no
        # backoff (1 s here): the failover took about as long as a plain request to the standby.
        assert timings.first_byte_ms is not None
        assert again.first_byte_ms is not None
        assert timings.first_byte_ms < again.first_byte_ms + 500, (timings, again)


@contextlib.asynccontextmanager
async def geo_cluster(tmp_path: Path) -> AsyncIterator[dict[str, RegionHandle]]:
    mmdb = write_city_mmdb(tmp_path / "cities.mmdb")
    specs = [RegionSpec("tokyo", 35.68, 139.69, **FAST),
             RegionSpec("frankfurt", 50.11, 8.68, **FAST),
             RegionSpec("virginia", 39.04, -77.49, **FAST)]
    async with running_regions(specs, geo_database=str(mmdb)) as regions:
        await wait_for_peers(regions)
        yield regions


@pytest.mark.parametrize("transport", ["sse", "websocket"])
async def test_a_better_region_hint_moves_later_requests_there(
    tls_files: tuple[str, str, str], tmp_path: Path, transport: str
) -> None:
    # SSE carries the hint in response headers, WebSocket on the stream's "start" message.
    ca_file, cert, key = tls_files
    async with geo_cluster(tmp_path) as regions, \
            edges(regions, (cert, key), {"virginia": 0.02, "tokyo": 0.04}) as proxies, \
            sdk(proxies, ["tokyo", "virginia", "frankfurt"], ca_file,
                transport=transport) as client:
        # The client is in Tokyo (a load balancer would add this header for it).
        client.headers["x-forwarded-for"] = TOKYO_CLIENT
        await client.prewarm()
        assert client.regions.choose(time.monotonic()).name == "frankfurt"  # type: ignore[union-attr]
        await until(lambda: proxies["tokyo"].open == 0)  # neither primary nor standby
        first = await stream_once(client)
        # Frankfurt forwarded to Tokyo and said so; the hint's URL is the router's own
        # (plain, behind the proxy): the SDK matched the region by name, not by that URL.
        assert first.region == "tokyo"
        assert first.better_region == "tokyo"
        assert first.better_region_url == regions["tokyo"].url
        assert client.regions.choose(time.monotonic()).name == "tokyo"  # type: ignore[union-attr]
        await until(lambda: proxies["tokyo"].accepted == 2 and proxies["tokyo"].open == 1)
        await until(lambda: not client._background)
        second = await stream_once(client)
        assert second.region == "tokyo"
        assert second.better_region is None  # served directly, not via Frankfurt
        assert second.warm  # the hint prewarmed Tokyo
        assert proxies["tokyo"].accepted == 2


async def test_a_hint_naming_an_unconfigured_region_is_ignored(
    tls_files: tuple[str, str, str], tmp_path: Path
) -> None:
    ca_file, cert, key = tls_files
    async with geo_cluster(tmp_path) as regions, \
            edges(regions, (cert, key), {"virginia": 0.02}) as proxies, \
            sdk(proxies, ["frankfurt", "virginia"], ca_file) as client:
        client.headers["x-forwarded-for"] = TOKYO_CLIENT
        # No prewarm: the routers' names are unknown, so the hint makes the SDK probe to
        # learn them; Tokyo is none of them and stays out.
        first = await stream_once(client)
        assert first.better_region == "tokyo"
        await until(lambda: not client.regions.unlabelled())
        await until(lambda: not client._background)
        assert [r.name for r in client.regions.regions] == ["frankfurt", "virginia"]
        assert all(r.url != first.better_region_url for r in client.regions.regions)
        now = time.monotonic()
        assert client.regions.choose(now).name == "frankfurt"  # type: ignore[union-attr]
        hosts = {(o.host, o.port) for o, _ in client.pool._sessions}
        assert hosts == {("localhost", proxies["frankfurt"].port),
                         ("localhost", proxies["virginia"].port)}
        second = await stream_once(client)
        assert second.better_region == "tokyo"  # still via Frankfurt
        assert proxies["tokyo"].accepted == 0


@pytest.mark.parametrize(("transport", "http"), [("sse", "1.1"), ("sse", "2"), ("sse", "3"),
                                               ("websocket", "1.1"), ("longpoll", "3")])
async def test_probe_over_every_http_version_against_a_tls_router(
    tls_files: tuple[str, str, str], transport: str, http: str
) -> None:
    from tests.client_sdk.conftest import ROUTER_KEY, start_stack

    async with start_stack(tls_files, models=[MODEL]) as stack:
        # One router under two names (the certificate covers both): two "regions".
        other = f"https://127.0.0.1:{stack.port}/v1"
        async with AsyncClient({"a": stack.base_url, "b": other}, ROUTER_KEY,
                               ca_file=stack.ca_file, http=http,
                               transport=transport) as client:  # type: ignore[arg-type]
            rtts = await client.probe_regions(samples=2)
            assert set(rtts) == {"a", "b"}
            assert all(v is not None and 0 < v < 1000 for v in rtts.values()), rtts
            assert client.regions.label("a") == client.regions.label("b") == "sdk-test"
            await client.prewarm()
            timings = await stream_once(client)
            assert timings.warm
            assert timings.transport == transport
            if transport != "websocket":
                assert timings.http_version == f"HTTP/{http}"


def test_sync_client_probes_a_server_without_edge_status(server: Any, ca_file: str) -> None:
    from firstbyte.client_sdk.sync import Client
    from tests.client_sdk.protocol_server import expected_text

    other = f"https://127.0.0.1:{server.port}/v1"
    with Client([server.base_url, other], "test-key", ca_file=ca_file) as client:
        rtts = client.probe_regions(samples=2)
        assert set(rtts) == {server.base_url, other}
        assert all(v is not None for v in rtts.values())
        client.prewarm()
        with client.stream(model="m", messages=MESSAGES, max_tokens=5) as stream:
            assert "".join(d.text for d in stream) == expected_text(5)
        assert stream.timings.warm


async def test_regions_discovered_from_one_routers_edge_status() -> None:
    from firstbyte.client_sdk.region_probe import discover_regions

    specs = [RegionSpec("tokyo", 35.68, 139.69, **FAST), RegionSpec("frankfurt", 50.11, 8.68, **FAST)]
    async with running_regions(specs) as regions:
        await wait_for_peers(regions)
        found = await discover_regions(regions["frankfurt"].url + "/v1")
        assert found == {"frankfurt": regions["frankfurt"].url + "/v1",
                         "tokyo": regions["tokyo"].url + "/v1"}
        async with AsyncClient(found) as client:
            await client.prewarm()
            assert {client.regions.label(n) for n in found} == {"tokyo", "frankfurt"}
            timings = await stream_once(client)
            assert timings.region in found
            assert timings.warm


def test_discovery_from_a_server_without_edge_status_is_an_error(server: Any, ca_file: str) -> None:
    from firstbyte.client_sdk.errors import APIError
    from firstbyte.client_sdk.region_probe import discover_regions

    with pytest.raises(APIError):
        asyncio.run(discover_regions(server.base_url, ca_file=ca_file))
