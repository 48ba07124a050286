"""Keep-warm pings read the router's ``/healthz``: a region whose router refuses (``503``
``draining``, ``state_unavailable``, ``warming``, ``unhealthy``; ``429``) is set aside as a
refused request would set it, so the next request goes to another region without a refused
attempt first. A ``draining`` answer (or a probe's) first replaces its connection with a new
one, asked at once: only if that one says ``draining`` too is the region set aside.

With real ``firstbyte sim`` and ``firstbyte router`` processes (two regions, one drained by
SIGTERM; the routers' ``/metrics`` count the requests that reached them, refused ones too: a
WebSocket request refused on an open socket has no access line of its own), and with the SDK's
test protocol server, whose ``/healthz`` answer a test sets (``Retry-After``, a ``200`` after a
refusal, ``draining`` once or twice, one region). Behind a balancer:
``test_drain_behind_balancer.py``.
"""

from __future__ import annotations

import asyncio
import signal
import ssl
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from firstbyte.benchmarks.ports import free_port
from firstbyte.client_sdk.client import AsyncClient
from tests.client_sdk.conftest import ROUTER_KEY
from tests.client_sdk.protocol_server import RunningServer, running_protocol_server
from tests.client_sdk.test_client import MESSAGES
from tests.client_sdk.test_slow_head import sim_process
from tests.client_sdk.test_stream_lost import start_router
from tests.waits import until

INTERVAL_S = 0.3
"""The keep-warm period in these tests (15 s by default)."""
TRANSPORTS = [("sse", "1.1"), ("sse", "2"), ("sse", "3"), ("longpoll", "2"),
              ("websocket", "1.1")]


def primary(client: AsyncClient) -> str:
    region = client.regions.choose(time.monotonic())
    assert region is not None
    return region.name


async def requests_counted(port: int, ca_file: str) -> dict[str, float]:
    """The router's ``firstbyte_router_requests_total`` samples: {labels: count}."""
    async with httpx.AsyncClient(verify=ssl.create_default_context(cafile=ca_file)) as client:
        text = (await client.get(f"https://localhost:{port}/metrics",
                                 headers={"authorization": f"Bearer {ROUTER_KEY}"})).text
    samples = [line.rsplit(" ", 1) for line in text.splitlines()
               if line.startswith("firstbyte_router_requests_total{")]
    return {name.removeprefix("firstbyte_router_requests_total"): float(value)
            for name, value in samples}


@asynccontextmanager
async def regions(
    tmp_path: Path, tls_files: tuple[str, str, str], sim: str, names: list[str],
    region_of: dict[str, str] | None = None,
) -> AsyncIterator[dict[str, tuple[asyncio.subprocess.Process, int]]]:
    """A ``firstbyte router`` process per name in front of ``sim``, each the router of region
    ``region_of[name]`` (default: its name; several processes may serve one region, as behind
    a balancer): {name: (process, port)}. On SIGTERM each stays draining (listening,
    ``/healthz`` 503) for 5 s."""
    ca_file, cert_file, key_file = tls_files
    started: dict[str, tuple[asyncio.subprocess.Process, int]] = {}
    ports: set[int] = set()

    async def start(name: str) -> None:
        port = free_port(udp=True)
        while port in ports:  # the others' are chosen but may not be bound yet
            port = free_port(udp=True)
        ports.add(port)
        config = tmp_path / f"{name}.toml"
        region = (region_of or {}).get(name, name)
        config.write_text(
            f'region = "{region}"\n[[upstreams]]\nurl = "{sim}"\n'
            f'[listen]\nport = {port}\ncertfile = "{cert_file}"\nkeyfile = "{key_file}"\n'
            f'drain_grace_s = 5\n[auth]\napi_keys = ["{ROUTER_KEY}"]\n'
        )
        started[name] = (await start_router(config, port, ca_file), port)

    try:
        # Side by side: each start is mostly a process importing the router on its own core.
        # Every start ends (up or failed) before a failure is raised, so none is left behind.
        done = await asyncio.gather(*(start(name) for name in names), return_exceptions=True)
        for failed in done:
            if isinstance(failed, BaseException):
                raise failed
        yield {name: started[name] for name in names}
    finally:
        for process, _ in started.values():
            if process.returncode is None:
                # Not SIGTERM: each would stay draining for its 5 s grace, one after the
                # other, and nothing after the block looks at how they end.
                process.kill()
            await process.wait()


@pytest.mark.slow
@pytest.mark.parametrize(("transport", "http"), TRANSPORTS)
async def test_a_draining_region_gets_no_request_after_a_keep_warm_ping(
    tmp_path: Path, tls_files: tuple[str, str, str], transport: str, http: str
) -> None:
    ca_file = tls_files[0]
    async with AsyncExitStack() as stack:
        sim = await stack.enter_async_context(sim_process())
        routers = await stack.enter_async_context(
            regions(tmp_path, tls_files, sim, ["first", "second"]))
        client = await stack.enter_async_context(AsyncClient(
            {name: f"https://localhost:{port}/v1" for name, (_, port) in routers.items()},
            ROUTER_KEY, ca_file=ca_file, transport=transport,  # type: ignore[arg-type]
            http=http,  # type: ignore[arg-type]
            keepalive_interval_s=INTERVAL_S,
            # Not due within the test: only keep-warm can see the drain. (Over WebSocket
            # it keeps the HTTP connection whose /healthz keep-warm asks: pongs say nothing.)
            reprobe_interval_s=600,
        ))
        await client.prewarm()
        draining = primary(client)
        other = next(name for name in routers if name != draining)
        process, port = routers[draining]
        process.send_signal(signal.SIGTERM)
        async with httpx.AsyncClient(verify=ssl.create_default_context(cafile=ca_file)) as direct:
            for _ in range(100):
                if (await direct.get(f"https://localhost:{port}/healthz")).status_code == 503:
                    break
                await asyncio.sleep(0.02)
            else:
                raise AssertionError("the router did not start draining")
        await asyncio.sleep(3 * INTERVAL_S)  # a keep-warm ping or more has asked it
        async with client.stream(model="sim-instant", messages=MESSAGES,
                                 max_tokens=3) as stream:
            text = "".join([delta.text async for delta in stream])
        assert len(text.split()) == 3
        assert stream.timings.region == other
        # No attempt on the draining router first (it would count one, outcome "draining").
        assert await requests_counted(port, ca_file) == {}
        served = await requests_counted(routers[other][1], ca_file)
        assert any('outcome="ok"' in labels for labels in served), served


@asynccontextmanager
async def two_servers(
    tls_files: tuple[str, str, str], **options: Any
) -> AsyncIterator[tuple[AsyncClient, dict[str, RunningServer]]]:
    """Protocol servers ``a`` and ``b`` and a client of both, prewarmed with ``a`` primary."""
    _, cert_file, key_file = tls_files
    with running_protocol_server(cert_file, key_file) as a, \
            running_protocol_server(cert_file, key_file) as b:
        async with AsyncClient({"a": a.base_url, "b": b.base_url}, "k", ca_file=tls_files[0],
                               reprobe_interval_s=None, **options) as client:
            client.regions.alpha = 1.0
            await client.prewarm()
            client.regions.keep([client.regions.regions[0], client.regions.regions[1]])
            assert primary(client) == "a"
            yield client, {"a": a, "b": b}


async def test_keep_warm_honours_retry_after_and_a_200_does_not_end_it(
    tls_files: tuple[str, str, str]
) -> None:
    async with two_servers(tls_files, keepalive_interval_s=0.1) as (client, servers):
        a = servers["a"].app
        a.health = (429, "30")
        await until(lambda: not client.regions.available("a", time.monotonic()),
                    what="a set aside")
        # The router's Retry-After, not the 1 s backoff of a refusal without one.
        assert client.regions.aside_s("a", time.monotonic()) > 25
        a.health = (200, None)
        await asyncio.sleep(0.5)  # keep-warm pings answered 200 meanwhile
        assert client.regions.aside_s("a", time.monotonic()) > 25
        b = servers["b"].app
        posted = {"a": len(a.requests), "b": len(b.requests)}
        async with client.stream(model="m", messages=MESSAGES) as stream:
            assert "".join([d.text async for d in stream])
        assert [r for r in a.requests[posted["a"]:] if r[0] == "POST"] == []
        assert [r for r in b.requests[posted["b"]:] if r[0] == "POST"] == [
            ("POST", "/v1/chat/completions")]


async def test_a_request_failure_is_not_undone_by_a_keep_warm_200(
    tls_files: tuple[str, str, str]
) -> None:
    async with two_servers(tls_files, keepalive_interval_s=0.1, retries=0) as (client, servers):
        # A 429 from region a (its /healthz still says 200: say, the key's limit there): the
        # request goes to b, which has already refused its one busy-1 request.
        servers["b"].app.refused["busy-1"] = 1
        async with client.stream(model="busy-1", messages=MESSAGES) as stream:
            assert "".join([d.text async for d in stream])
        assert servers["a"].app.refused == {"busy-1": 1}
        aside = client.regions.aside_s("a", time.monotonic())
        assert aside > 0.5  # Retry-After: 1
        await asyncio.sleep(0.35)  # keep-warm pings of a answered 200 meanwhile
        assert client.regions.aside_s("a", time.monotonic()) > aside - 0.45


async def test_a_refusing_region_is_asked_again_when_its_retry_after_ends(
    tls_files: tuple[str, str, str]
) -> None:
    # Keep-warm far apart: only the re-check after Retry-After asks again.
    async with two_servers(tls_files, keepalive_interval_s=60) as (client, servers):
        a = servers["a"].app
        a.health = (503, "1")
        await client.pool.ping()  # what the keep-warm loop runs every interval
        assert not client.regions.available("a", time.monotonic())
        # Still refusing: set aside again at each re-check. Between a Retry-After's end and
        # the re-check's answer the region is back for that one round trip (a Retry-After
        # says when it may be asked again), so a gap as long as a loaded machine's round
        # trip is allowed, never one as long as a keep-warm interval.
        deadline = time.monotonic() + 2.5
        back_since: float | None = None
        longest_back = 0.0
        while (now := time.monotonic()) < deadline:
            if client.regions.available("a", now):
                back_since = now if back_since is None else back_since
                longest_back = max(longest_back, now - back_since)
            else:
                back_since = None
            await asyncio.sleep(0.01)
        assert longest_back < 0.3, f"back for {longest_back:.2f} s while still refusing"
        a.health = (200, None)
        # Back once the last Retry-After ends (the re-check's 200 keeps it back).
        await until(lambda: client.regions.available("a", time.monotonic()), timeout_s=2.0)
        await asyncio.sleep(1.2)
        assert client.regions.available("a", time.monotonic())


async def test_one_region_refusing_keep_warm_still_gets_the_requests(
    tls_files: tuple[str, str, str]
) -> None:
    _, cert_file, key_file = tls_files
    with running_protocol_server(cert_file, key_file) as only:
        async with AsyncClient(only.base_url, "k", ca_file=tls_files[0],
                               keepalive_interval_s=0.1) as client:
            await client.prewarm()
            only.app.health = (503, "30")
            await asyncio.sleep(0.4)
            posted = len(only.app.requests)
            async with client.stream(model="m", messages=MESSAGES) as stream:
                assert "".join([d.text async for d in stream])
            assert ("POST", "/v1/chat/completions") in only.app.requests[posted:]


def healthz_connections(server: RunningServer, since: int) -> list[tuple[str, int] | None]:
    """The connection each ``/healthz`` after request ``since`` came on, in order."""
    app = server.app
    return [peer for (_, path), peer in zip(app.requests[since:], app.peers[since:], strict=True)
            if path == "/healthz"]


@pytest.mark.parametrize("http", ["1.1", "2", "3"])
@pytest.mark.parametrize("draining", [1, 2])
async def test_a_draining_keep_warm_answer_rewarms_a_new_connection(
    tls_files: tuple[str, str, str], http: str, draining: int
) -> None:
    """The router process behind the kept connection to ``a`` drains (``/healthz`` 503
    ``draining``): that connection is dropped and a new one asked at once. Another process
    answers it (one ``draining``): ``a`` stays in use and the next request rides the new
    connection. It drains too (two): ``a`` is set aside, as before."""
    async with two_servers(tls_files, http=http, keepalive_interval_s=60) as (client, servers):
        a = servers["a"]
        since = len(a.app.requests)
        a.app.health_draining = draining
        await client.pool.ping()  # what the keep-warm loop runs every interval
        kept, fresh = healthz_connections(a, since)
        assert kept != fresh
        if draining == 2:
            assert not client.regions.available("a", time.monotonic())
            return
        assert client.regions.available("a", time.monotonic())
        since = len(a.app.requests)
        async with client.stream(model="m", messages=MESSAGES) as stream:
            assert "".join([d.text async for d in stream])
        assert stream.timings.warm
        assert a.app.requests[since:] == [("POST", "/v1/chat/completions")]
        assert a.app.peers[since:] == [fresh]


@pytest.mark.parametrize("http", ["1.1", "2", "3"])
async def test_a_probe_answered_draining_measures_again_on_a_new_connection(
    tls_files: tuple[str, str, str], http: str
) -> None:
    """A re-probe whose ``/healthz`` says ``draining`` probes again on a new connection; the
    region's other process answers it, so the region stays in use."""
    async with two_servers(tls_files, http=http, keepalive_interval_s=60) as (client, servers):
        a = servers["a"]
        since = len(a.app.requests)
        a.app.health_draining = 1
        rtts = await client.probe_regions()
        connections = healthz_connections(a, since)
        assert len(connections) == 4  # the draining answer, then the probe's three samples
        assert connections[0] != connections[1] == connections[3]
        assert rtts["a"] is not None
        assert client.regions.available("a", time.monotonic())
