"""A backend that refuses connections: requests go to another backend of the region at once,
the backend stays out of rotation until it is back, and each change is one log line."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import socket
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

from firstbyte.benchmarks.redis_server import RedisServer
from firstbyte.router import hosting, multiregion
from firstbyte.router.serve import RouterEndpoints
from firstbyte.router.sim.server import SimConfig, build_app, options, running_app, running_sim
from tests.router.conftest import RouterFactory, auth, router_config
from tests.router.logs import CHAT_PATH, access_records, upstream_state_lines
from tests.router.redis_fixture import redis_server  # noqa: F401 (a fixture)

pytestmark = pytest.mark.asyncio

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6}


def _closed_port() -> int:
    """A loopback port nothing listens on: connecting to it is refused."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextlib.asynccontextmanager
async def _sim_on(port: int) -> AsyncIterator[None]:
    """A sim on a given loopback port (the backend coming back where it was)."""
    listeners = hosting.bind("127.0.0.1", port)
    async with running_app(build_app(SimConfig(profile="instant", served_model_names=["m"])), listeners, options("uvicorn")):
        yield


@contextlib.asynccontextmanager
async def _router_that_listed(
    start_router: RouterFactory, dead_port: int, **overrides: Any
) -> AsyncIterator[RouterEndpoints]:
    """A router whose "gone" backend (on ``dead_port``) answered until the router had read its
    model list, and refuses connections from then on: the router knows "gone" serves the
    model, so requests still go to it (one whose list is unknown takes no model another
    backend lists)."""
    gone = contextlib.AsyncExitStack()
    await gone.enter_async_context(_sim_on(dead_port))
    try:
        async with start_router([], tls=False, **overrides) as router:
            await router.app.state.until_warm()
            await gone.aclose()
            yield router
    finally:
        await gone.aclose()


def _upstreams(dead_port: int, live_url: str) -> list[dict[str, Any]]:
    # "gone" has no metrics scrape (kind openai, no models), so only a request can find it
    # down; round-robin routing sends it every other request while it is in rotation.
    return [
        {"name": "gone", "url": f"http://127.0.0.1:{dead_port}", "kind": "openai"},
        {"name": "live", "url": live_url},
    ]


async def _stream(client: httpx.AsyncClient, router: RouterEndpoints) -> None:
    """One streamed completion, whole and without an error event."""
    response = await client.post(
        router.base_url + "/v1/chat/completions", json={**BODY, "stream": True}, headers=auth()
    )
    assert response.status_code == 200, response.text
    assert response.text.endswith("data: [DONE]\n\n")
    assert '"error"' not in response.text


async def test_refused_backend_fails_over_and_comes_back(
    start_router: RouterFactory,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    caplog.set_level(logging.INFO, logger="firstbyte")
    monkeypatch.setattr(multiregion, "PASSIVE_DOWN_S", 0.5)
    dead_port = _closed_port()
    async with (
        running_sim("instant", served_model_names=["m"]) as live_url,
        _router_that_listed(
            start_router, dead_port, upstreams=_upstreams(dead_port, live_url),
            routing={"backend_policy": "round_robin"},
        ) as router,
        httpx.AsyncClient(timeout=10) as client,
    ):
        routing = router.app.state.routing
        # Streams and a whole answer: every one served, none sees the refusal.
        for _ in range(4):
            await _stream(client, router)
        whole = await client.post(
            router.base_url + "/v1/chat/completions", json=BODY, headers=auth()
        )
        assert whole.status_code == 200, whole.text
        assert whole.json()["choices"][0]["message"]["content"]
        lines = access_records(caplog, CHAT_PATH)
        assert [line["outcome"] for line in lines] == ["ok"] * 5
        assert {line["backend"] for line in lines} == {"live"}
        moved = [line for line in lines if line.get("route_reason") == "backend_unreachable"]
        assert len(moved) == 1  # the first to find it gone; it was out of rotation after
        # Its line says what the refused attempt met (the client saw none of it).
        assert moved[0]["upstream_error"].startswith("ConnectError: "), moved[0]
        assert [line for line in lines if "upstream_error" in line] == moved
        assert not routing.backends["gone"].healthy
        assert routing.backends["gone"].in_flight == routing.backends["live"].in_flight == 0
        assert routing.tracker["gone"].in_flight == routing.tracker["live"].in_flight == 0
        metrics = await client.get(router.base_url + "/metrics", headers=auth())
        assert 'firstbyte_backend_healthy{backend="gone"} 0' in metrics.text
        assert 'firstbyte_route_backend_choices_total{reason="failover"} 1' in metrics.text

        # Tried again after PASSIVE_DOWN_S: still refused, moved again, no second warning.
        await asyncio.sleep(0.6)
        for _ in range(2):
            await _stream(client, router)
        moved = [x for x in access_records(caplog, CHAT_PATH) if x.get("route_reason") == "backend_unreachable"]
        assert len(moved) == 2
        down = upstream_state_lines(caplog, "gone")
        assert len(down) == 1
        assert down[0].startswith(f"upstream gone (http://127.0.0.1:{dead_port}) is down: Connect")

        # It comes back: in rotation after PASSIVE_DOWN_S, it serves, one line says so.
        async with _sim_on(dead_port):
            await asyncio.sleep(0.6)
            for _ in range(4):
                await _stream(client, router)
            served = {line["backend"] for line in access_records(caplog, CHAT_PATH)[-4:]}
            assert served == {"gone", "live"}
            assert routing.backends["gone"].healthy
            assert upstream_state_lines(caplog, "gone")[1:] == [
                f"upstream gone (http://127.0.0.1:{dead_port}) is up again"
            ]


async def test_a_lone_backend_fails_the_request_and_stays_in_rotation(
    start_router: RouterFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="firstbyte")
    dead_port = _closed_port()
    upstreams = [{"name": "gone", "url": f"http://127.0.0.1:{dead_port}", "kind": "openai"}]
    async with (
        start_router([], tls=False, upstreams=upstreams) as router,
        httpx.AsyncClient(timeout=10) as client,
    ):
        response = await client.post(
            router.base_url + "/v1/chat/completions", json={**BODY, "stream": True}, headers=auth()
        )
        assert response.status_code == 502
        assert response.json()["error"]["message"] == "Upstream failed: ConnectError."
        routing = router.app.state.routing
        assert routing.backends["gone"].in_flight == 0
        # The region's only backend, and no peer region: it stays in rotation (as nginx keeps
        # a lone server), so the next request tries it again rather than being refused.
        assert routing.backends["gone"].healthy
        again = await client.post(
            router.base_url + "/v1/chat/completions", json={**BODY, "stream": True}, headers=auth()
        )
        assert again.status_code == 502, again.text
    assert len(upstream_state_lines(caplog, "gone")) == 1


async def test_failover_with_shared_state_moves_the_backend_slot(
    start_router: RouterFactory,
    redis_server: RedisServer,  # noqa: F811
) -> None:
    prefix = f"fo{secrets.token_hex(4)}:"
    dead_port = _closed_port()
    redis = Redis.from_url(redis_server.url)
    try:
        async with (
            running_sim("instant", served_model_names=["m"]) as live_url,
            _router_that_listed(
                start_router, dead_port, upstreams=_upstreams(dead_port, live_url),
                routing={"backend_policy": "round_robin"},
                state={"redis_url": redis_server.url, "key_prefix": prefix},
            ) as router,
            httpx.AsyncClient(timeout=10) as client,
        ):
            state = router.app.state
            slots: list[dict[bytes, bytes]] = []
            for _ in range(3):
                await _stream(client, router)
                await state.shared.admission.background.drain()
                slots.append(await _in_flight(redis, f"{prefix}l:gone"))
            # Nothing held anywhere once the streams ended: the slot claimed on "gone" was
            # given back when the request moved, the one claimed on "live" at its end.
            # (The process's spare slots, fields "<process>/s", are no request's.)
            assert slots == [{}, {}, {}]
            assert await _in_flight(redis, f"{prefix}l:live") == {}
            assert not state.routing.backends["gone"].healthy

            # A reload that changes routing builds a new routing stage: it still gives slots
            # back to Redis (before, it lost the hook and every slot leaked until expiry).
            reloaded = router_config(
                [], None, upstreams=_upstreams(dead_port, live_url),
                routing={"backend_policy": "round_robin", "balance_abs_threshold": 9},
                state={"redis_url": redis_server.url, "key_prefix": prefix},
            )
            previous = state.routing
            await router.app.reconfigure(reloaded)
            assert state.routing is not previous
            for _ in range(2):
                await _stream(client, router)
            await state.shared.admission.background.drain()
            assert await _in_flight(redis, f"{prefix}l:live") == {}
            assert await _in_flight(redis, f"{prefix}l:gone") == {}
    finally:
        await redis.aclose()


async def _in_flight(redis: Redis, slots: str) -> dict[bytes, bytes]:
    """The fields of a backend's slots hash that count requests in flight (a process's
    spare slots, claimed ahead, are its field ``<process>/s``)."""
    return {k: v for k, v in (await redis.hgetall(slots)).items() if not k.endswith(b"/s")}
