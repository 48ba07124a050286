"""Backend health as a client sees it: an upstream URL written with ``/v1`` works, the status
says why a request was refused, and a backend that stops answering (or answers 5xx) is
ejected at once and re-admitted when it heals (passive health, as Envoy's outlier detection)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable

import httpx
import pytest

from firstbyte.router.sim.server import running_sim
from tests.router.conftest import RouterFactory, auth

pytestmark = pytest.mark.asyncio

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


async def test_an_upstream_url_ending_in_v1_is_served(start_router: RouterFactory) -> None:
    async with (
        running_sim("instant") as sim_url,
        start_router([sim_url + "/v1/"], tls=False) as router,
        httpx.AsyncClient(timeout=10) as client,
    ):
        url = router.base_url + "/v1/chat/completions"
        streamed = await client.post(url, json={**BODY, "stream": True}, headers=auth())
        assert streamed.status_code == 200, streamed.text
        assert streamed.text.endswith("data: [DONE]\n\n")
        assert '"error"' not in streamed.text
        whole = await client.post(url, json=BODY, headers=auth())
        assert whole.status_code == 200, whole.text
        models = await client.get(router.base_url + "/v1/models", headers=auth())
        assert models.status_code == 200, models.text


def _closed_port() -> int:
    """A loopback port nothing listens on: connecting to it is refused."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def _until(predicate: Callable[[], Awaitable[bool]], timeout_s: float = 10.0) -> None:
    """Poll ``predicate`` (every 50 ms) until true; fail after ``timeout_s``."""
    async with asyncio.timeout(timeout_s):
        while not await predicate():  # noqa: ASYNC110 - polls a server over HTTP
            await asyncio.sleep(0.05)


async def test_every_backend_down_is_503_no_healthy_backend_not_429(
    start_router: RouterFactory,
) -> None:
    # The case: the region's backend is down (its scrapes are refused) and its peer
    # region is unreachable too. That was "429 region_saturated, retry after 5 s": load.
    upstreams = [{"name": "down", "url": f"http://127.0.0.1:{_closed_port()}"}]
    peers = [{
        "name": "elsewhere", "url": f"http://127.0.0.1:{_closed_port()}",
        "latitude": 40.0, "longitude": -74.0,
    }]
    async with (
        start_router(
            [], tls=False, upstreams=upstreams, peers=peers,
            routing={"peer_key": "p" * 16, "backend_metrics_interval_s": 0.2},
            geo={"latitude": 50.0, "longitude": 8.0},
        ) as router,
        httpx.AsyncClient(timeout=10) as client,
    ):
        async def unhealthy() -> bool:
            answer = await client.get(router.base_url + "/healthz")
            return answer.status_code == 503 and answer.text == "unhealthy\n"

        await _until(unhealthy)
        for body in ({**BODY, "stream": True}, BODY):
            refused = await client.post(
                router.base_url + "/v1/chat/completions", json=body, headers=auth()
            )
            assert refused.status_code == 503, refused.text
            error = refused.json()["error"]
            assert error["code"] == "no_healthy_backend"
            assert error["type"] == "server_error"
            assert 1 <= int(refused.headers["retry-after"]) <= 10
        metrics = await client.get(router.base_url + "/metrics", headers=auth())
        assert 'reason="no_healthy_backend"} 2' in metrics.text
