"""One router process of a region drains behind the region's balancer (a rolling deploy): the
SDK's next request, keep-warm ping or probe on its kept-alive connection to that process is
answered ``503 draining``, and the SDK goes on through a new connection, which the balancer
gives the region's other process, instead of setting the whole region aside for another.

Real processes: ``firstbyte sim``, two ``firstbyte router`` processes of region ``east``
behind a real HAProxy (TCP mode, ``balance first``, health checks on ``/healthz``: every
connection goes to ``east-a`` while it is up), and the router of region ``west``. ``east-a``
gets SIGTERM while the SDK holds a connection to it; HAProxy takes it out of rotation at its
next health check (the routers' ``/healthz`` says 503 from the drain's start), and the tests
wait for that before the SDK's next move. The routers' ``/metrics`` count the requests that
reached each (refused ones too).
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from firstbyte.client_sdk.client import AsyncClient
from tests.client_sdk.conftest import ROUTER_KEY
from tests.client_sdk.test_client import MESSAGES
from tests.client_sdk.test_keepwarm_health import regions, requests_counted
from tests.client_sdk.test_slow_head import sim_process
from tests.haproxy import Balancer, running_haproxy

pytestmark = pytest.mark.slow

TOKENS = 6
STALL_MS = 2000
"""With a stream in flight on the HTTP/2 connection, the sim holds every stream this long
after its second token: the first stream is still running on ``east-a`` when it drains."""


@dataclass
class Deployment:
    routers: dict[str, tuple[asyncio.subprocess.Process, int]]
    """``east-a``, ``east-b``, ``west``: (process, port)."""
    balancer: Balancer
    ca_file: str

    @property
    def urls(self) -> dict[str, str]:
        """The SDK's regions: ``east`` through the balancer, ``west`` its router."""
        return {"east": f"https://localhost:{self.balancer.port}/v1",
                "west": f"https://localhost:{self.routers['west'][1]}/v1"}

    async def drain_east_a(self) -> None:
        """SIGTERM ``east-a``; return once HAProxy has taken it out of rotation."""
        self.routers["east-a"][0].send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while (await self.balancer.servers())["east/a"]["status"] != "DOWN":
            assert time.monotonic() < deadline, self.balancer.log.read_text()
            await asyncio.sleep(0.02)

    async def sessions(self, server: str) -> int:
        """Connections HAProxy has given ``server`` (``a`` or ``b``) so far."""
        return int((await self.balancer.servers())[f"east/{server}"]["stot"])

    async def counted(self, name: str) -> dict[str, float]:
        """The requests router ``name`` counted, by labels (its ``/metrics``)."""
        return await requests_counted(self.routers[name][1], self.ca_file)


@asynccontextmanager
async def deployment(
    tmp_path: Path, tls_files: tuple[str, str, str], *faults: str
) -> AsyncIterator[Deployment]:
    async with AsyncExitStack() as stack:
        sim = await stack.enter_async_context(sim_process(*faults))
        routers = await stack.enter_async_context(regions(
            tmp_path, tls_files, sim, ["east-a", "east-b", "west"],
            region_of={"east-a": "east", "east-b": "east"}))
        backend = (
            "backend east\n    balance first\n    option httpchk GET /healthz\n"
            "    default-server check check-ssl verify none inter 100ms fall 1 rise 1\n"
            f"    server a 127.0.0.1:{routers['east-a'][1]}\n"
            f"    server b 127.0.0.1:{routers['east-b'][1]}\n"
        )
        balancer = await stack.enter_async_context(
            running_haproxy(backend, tmp_path, "east", default_backend="east"))
        yield Deployment(routers, balancer, tls_files[0])


def outcomes(counted: dict[str, float]) -> dict[str, float]:
    """Requests counted by outcome (``ok``, ``draining``, ...; a long-poll's polls and a
    WebSocket's stream are counted too)."""
    out: dict[str, float] = {}
    for labels, count in counted.items():
        outcome = labels.split('outcome="', 1)[1].split('"', 1)[0]
        out[outcome] = out.get(outcome, 0) + count
    return out


@pytest.mark.parametrize(("transport", "http"), [
    ("sse", "1.1"), ("sse", "2"), ("longpoll", "1.1"), ("websocket", "1.1"),
])
async def test_a_request_refused_by_a_draining_router_goes_to_its_region_sibling(
    tmp_path: Path, tls_files: tuple[str, str, str], transport: str, http: str
) -> None:
    """The kept-alive connection to ``east-a`` carries the next request into its drain (over
    HTTP/2 a stream still runs on it, so the router's GOAWAY waits for that stream to end):
    the request is served by ``east-b`` through a new connection, every token once, and
    ``west`` never sees it. The stream running on ``east-a`` ends whole."""
    busy = http == "2"
    async with AsyncExitStack() as stack:
        d = await stack.enter_async_context(deployment(
            tmp_path, tls_files, *([f"stall:after=2,ms={STALL_MS}"] if busy else [])))
        client = await stack.enter_async_context(AsyncClient(
            d.urls, ROUTER_KEY, ca_file=d.ca_file, transport=transport,  # type: ignore[arg-type]
            http=http,  # type: ignore[arg-type]
            reprobe_interval_s=None,
        ))
        first = await stack.enter_async_context(
            client.stream(model="sim-instant", messages=MESSAGES, max_tokens=TOKENS))
        first_text = ""
        async for delta in first:
            first_text += delta.text
            if busy and delta.is_content:
                break  # in flight on east-a's connection from here
        assert first.timings.region == "east"
        assert await d.sessions("a") >= 1
        b_sessions = await d.sessions("b")
        await d.drain_east_a()
        async with client.stream(model="sim-instant", messages=MESSAGES,
                                 max_tokens=TOKENS) as stream:
            # Refused by east-a (before it stops: its drain grace is 5 s), opened on east-b.
            assert outcomes(await d.counted("east-a")).get("draining") == 1
            text = "".join([delta.text async for delta in stream])
        first_text += "".join([delta.text async for delta in first])
        await first.aclose()
        assert len(text.split()) == TOKENS
        assert stream.text == text
        assert stream.timings.region == "east"
        assert await d.sessions("b") > b_sessions
        served = outcomes(await d.counted("east-b"))
        assert served["ok"] >= 1, served
        assert "draining" not in served, served
        assert await d.counted("west") == {}
        assert len(first_text.split()) == TOKENS
        assert first.text == first_text


async def test_a_create_refused_by_a_draining_router_goes_to_its_region_sibling(
    tmp_path: Path, tls_files: tuple[str, str, str]
) -> None:
    """The same for a non-streamed call (``create``) on the kept-alive HTTP/1.1 connection."""
    async with deployment(tmp_path, tls_files) as d, AsyncClient(
        d.urls, ROUTER_KEY, ca_file=d.ca_file, http="1.1", reprobe_interval_s=None,
    ) as client:
        first = await client.completions.create(model="sim-instant", prompt="hi",
                                                max_tokens=TOKENS)
        await d.drain_east_a()
        again = await client.completions.create(model="sim-instant", prompt="hi",
                                                max_tokens=TOKENS)
        assert outcomes(await d.counted("east-a")) == {"ok": 1, "draining": 1}
        assert outcomes(await d.counted("east-b")) == {"ok": 1}
        assert await d.counted("west") == {}
    assert again.text == first.text  # the sim's answer to the same request


@pytest.mark.parametrize(("transport", "http"), [("sse", "1.1"), ("websocket", "1.1")])
async def test_a_keep_warm_ping_refused_by_a_draining_router_rewarms_its_region(
    tmp_path: Path, tls_files: tuple[str, str, str], transport: str, http: str
) -> None:
    """Keep-warm's ``/healthz`` on the connection to ``east-a`` says ``draining``: the SDK
    warms a new connection (to ``east-b``) instead of setting ``east`` aside, and the next
    request goes to ``east`` (over WebSocket its socket to ``east-a`` refuses it first: a pong
    says nothing of the router, the HTTP connection is the one asked), never to ``west``."""
    async with AsyncExitStack() as stack:
        d = await stack.enter_async_context(deployment(tmp_path, tls_files))
        client = await stack.enter_async_context(AsyncClient(
            d.urls, ROUTER_KEY, ca_file=d.ca_file, transport=transport,  # type: ignore[arg-type]
            http=http,  # type: ignore[arg-type]
            keepalive_interval_s=0.3,
            reprobe_interval_s=600,  # not due: only keep-warm sees the drain
        ))
        await client.prewarm()
        east, west = client.regions.regions
        client.regions.keep([east, west])
        assert await d.sessions("b") == 0
        await d.drain_east_a()
        deadline = time.monotonic() + 10
        while await d.sessions("b") == 0 and client.regions.available("east", time.monotonic()):
            assert time.monotonic() < deadline, "no keep-warm ping after the drain"
            await asyncio.sleep(0.02)
        assert client.regions.available("east", time.monotonic())
        async with client.stream(model="sim-instant", messages=MESSAGES,
                                 max_tokens=TOKENS) as stream:
            text = "".join([delta.text async for delta in stream])
        assert len(text.split()) == TOKENS
        assert stream.timings.region == "east"
        served = outcomes(await d.counted("east-b"))
        assert served["ok"] >= 1, served
        assert "draining" not in served, served
        assert await d.counted("west") == {}
        refused_on_a = {"draining": 1} if transport == "websocket" else {}
        assert outcomes(await d.counted("east-a")) == refused_on_a


async def test_a_reprobe_answered_draining_keeps_its_region(
    tmp_path: Path, tls_files: tuple[str, str, str]
) -> None:
    """A re-probe's ``/healthz`` on the connection to ``east-a`` says ``draining``: the probe
    runs again on a new connection (to ``east-b``), and ``east`` stays the primary."""
    async with deployment(tmp_path, tls_files) as d, AsyncClient(
        d.urls, ROUTER_KEY, ca_file=d.ca_file, http="1.1", reprobe_interval_s=600,
        keepalive_interval_s=600,
    ) as client:
        await client.prewarm()
        east, west = client.regions.regions
        client.regions.keep([east, west])
        await d.drain_east_a()
        await client.reprobe()
        now = time.monotonic()
        assert client.regions.available("east", now)
        chosen = client.regions.choose(now)
        assert chosen is not None
        assert chosen.name == "east"
        assert await d.sessions("b") >= 1
