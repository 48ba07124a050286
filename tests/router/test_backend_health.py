"""Backend health as a client sees it: an upstream URL written with ``/v1`` works, the status
says why a request was refused, a backend that stops answering (resets, answers 5xx) is
ejected at once and re-admitted when it heals (passive health, as Envoy's outlier detection),
and the first request after ``/healthz`` turns 200 is served."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import pytest

from firstbyte.router import hosting, multiregion
from firstbyte.router.serve import RouterEndpoints
from firstbyte.router.sim.server import SimConfig, build_app, options, running_app, running_sim
from firstbyte.router.state import RouterState
from tests.router.conftest import RouterFactory, auth, router_config
from tests.router.logs import CHAT_PATH, access_records, upstream_state_lines

pytestmark = pytest.mark.asyncio

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


async def test_an_upstream_url_ending_in_v1_is_served(start_router: RouterFactory) -> None:
    async with (
        running_sim("instant", served_model_names=["m"]) as sim_url,
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
        assert 'reason="no_healthy_backend",model=""} 2' in metrics.text


async def test_a_refusal_for_one_models_backends_names_that_model(
    start_router: RouterFactory,
) -> None:
    # Model "b" is served only by a backend that is down, model "a" by one with one slot:
    # "No backend of region R is answering" / "Region R is at capacity" read as the whole
    # region out while "a" was being served; the message says which model's backends.
    upstreams = [
        {"name": "up", "url": "", "models": ["a"], "max_in_flight": 1},
        {"name": "down", "url": f"http://127.0.0.1:{_closed_port()}", "models": ["b"]},
    ]
    async with (
        running_sim("instant", served_model_names=["a"], faults=["delay:ms=3000"]) as sim_url,
    ):
        upstreams[0]["url"] = sim_url
        async with (
            start_router(
                [], tls=False, upstreams=upstreams,
                routing={"backend_metrics_interval_s": 0.2},
            ) as router,
            httpx.AsyncClient(timeout=10) as client,
        ):
            url = router.base_url + "/v1/chat/completions"

            async def b_refused() -> bool:
                answer = await client.post(url, json={**BODY, "model": "b"}, headers=auth())
                return answer.status_code == 503

            await _until(b_refused)
            refused = await client.post(url, json={**BODY, "model": "b"}, headers=auth())
            assert refused.json()["error"]["message"].startswith(
                "No backend of region test-1 for model 'b' is answering"
            )
            holding = asyncio.ensure_future(
                client.post(url, json={**BODY, "model": "a"}, headers=auth())
            )
            await asyncio.sleep(0.5)  # the one slot of "a" taken
            full = await client.post(url, json={**BODY, "model": "a"}, headers=auth())
            assert full.status_code == 429, full.text
            assert full.json()["error"]["message"].startswith(
                "Region test-1 is at capacity for model 'a' and"
            )
            assert (await holding).status_code == 200


async def test_retry_after_for_a_models_down_backends_is_theirs_not_the_regions() -> None:
    # "qwen"'s only backend is down by its scrapes (back within the scrape interval, 1 s);
    # another model's backend is ejected for 10 s: qwen's 503 said "retry after 10 s".
    upstreams = [
        {"name": "llama", "url": "http://127.0.0.1:9", "models": ["llama"]},
        {"name": "llama-2", "url": "http://127.0.0.1:10", "models": ["llama"]},
        {"name": "qwen", "url": "http://127.0.0.1:11", "models": ["qwen"]},
    ]
    state = RouterState(router_config([], None, upstreams=upstreams, listen={
        "port": 0, "host": "127.0.0.1", "insecure_plain_http": True,
    }))
    try:
        routing = state.routing
        routing.eject("llama", ConnectionResetError("reset"), "reset")  # ejected for 10 s
        assert routing.down_retry_after_s(routing.clock()) == 10  # the region's soonest
        assert routing.down_retry_after_s(routing.clock(), frozenset({"qwen"})) == 1
    finally:
        await state.aclose()


@contextlib.asynccontextmanager
async def _sim_on(port: int, model: str = "m") -> AsyncIterator[None]:
    """A sim on a given loopback port (the backend healed, where it was). With
    ``SO_REUSEPORT``, as :func:`_broken_on`: the one starts before the other stops, so the
    router's scrapes never find the port closed (that alone takes a backend down)."""
    listeners = hosting.bind("127.0.0.1", port, reuse_port=True)
    config = SimConfig(profile="instant", served_model_names=[model])
    async with running_app(build_app(config), listeners, options("uvicorn")):
        yield


_500 = b'{"error": {"message": "engine died", "type": "server_error", "param": null, "code": null}}'


@contextlib.asynccontextmanager
async def _broken_on(port: int, mode: str) -> AsyncIterator[None]:
    """A server on ``port`` that accepts every connection and then never answers
    (``blackhole``), answers every request ``500`` (``500``), or resets the connection on
    every ``POST`` while its ``GET /metrics`` answers (``reset``): a hung or broken engine
    behind a live socket. Its connections are closed when the block ends."""
    writers: set[asyncio.StreamWriter] = set()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.add(writer)
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                if mode == "blackhole":
                    await reader.read()  # never answers; returns when the peer leaves
                    return
                length = 0
                for line in head.split(b"\r\n"):
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                await reader.readexactly(length)
                if mode == "reset" and head.startswith(b"POST"):
                    sock = writer.get_extra_info("socket")
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    writer.transport.abort()  # RST, before any byte of an answer
                    return
                if mode == "reset":
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
                    await writer.drain()
                    continue
                writer.write(
                    b"HTTP/1.1 500 Internal Server Error\r\ncontent-type: application/json\r\n"
                    b"content-length: %d\r\n\r\n%s" % (len(_500), _500)
                )
                await writer.drain()

    server = await asyncio.start_server(serve, "127.0.0.1", port, reuse_port=True)
    try:
        yield
    finally:
        server.close()
        for writer in writers:
            writer.close()
        await server.wait_closed()


async def _stream(client: httpx.AsyncClient, router: RouterEndpoints) -> float:
    """One streamed completion, whole and without an error event; its duration (s)."""
    started = time.monotonic()
    response = await client.post(
        router.base_url + "/v1/chat/completions", json={**BODY, "stream": True}, headers=auth()
    )
    assert response.status_code == 200, response.text
    assert response.text.endswith("data: [DONE]\n\n")
    assert '"error"' not in response.text
    return time.monotonic() - started


@contextlib.asynccontextmanager
async def _router_that_listed(
    start_router: RouterFactory, port: int, **overrides: Any
) -> AsyncIterator[RouterEndpoints]:
    """A router whose backend on ``port`` answered until the router had read its model list,
    and refuses connections from then on: the router knows it serves the model, so requests
    still go to it (one whose list is unknown takes no model another backend lists)."""
    gone = contextlib.AsyncExitStack()
    await gone.enter_async_context(_sim_on(port))
    try:
        async with start_router([], tls=False, **overrides) as router:
            await router.app.state.until_warm()
            await gone.aclose()
            yield router
    finally:
        await gone.aclose()


async def test_a_backend_back_from_down_is_asked_its_models_at_once(
    start_router: RouterFactory,
) -> None:
    # A backend redeployed with another model: down, then up serving "m2". Its list was
    # read again only at the next routing.models_refresh_s (30 s): "m2" was 404
    # model_not_found all that time while the backend served it.
    port = _closed_port()
    routing = {"backend_metrics_interval_s": 0.2, "models_refresh_s": 300.0}
    async with (
        _router_that_listed(start_router, port, routing=routing, upstreams=[
            {"name": "redeployed", "url": f"http://127.0.0.1:{port}"},
        ]) as router,
        httpx.AsyncClient(timeout=10) as client,
    ):
        url = router.base_url + "/v1/chat/completions"

        async def down() -> bool:
            answer = await client.get(router.base_url + "/healthz")
            return answer.status_code == 503

        await _until(down)
        async with _sim_on(port, model="m2"):

            async def m2_served() -> bool:
                answer = await client.post(url, json={**BODY, "model": "m2"}, headers=auth())
                return answer.status_code == 200

            await _until(m2_served, timeout_s=5.0)
            gone = await client.post(url, json=BODY, headers=auth())
            assert gone.json()["error"]["code"] == "model_not_found"


def _upstreams(flaky_port: int, live_url: str) -> list[dict[str, Any]]:
    return [
        # Configured: known to serve "m" even while it does not answer (a backend whose list
        # is unknown takes no model another backend lists).
        {"name": "flaky", "url": f"http://127.0.0.1:{flaky_port}", "models": ["m"]},
        {"name": "live", "url": live_url},
    ]


@pytest.mark.parametrize("mode", ["blackhole", "500", "reset"])
async def test_a_backend_that_stops_serving_is_ejected_and_readmitted_when_healed(
    start_router: RouterFactory, caplog: pytest.LogCaptureFixture, mode: str
) -> None:
    caplog.set_level(logging.INFO, logger="firstbyte")
    port = _closed_port()
    # The first-byte deadline is 4x the backends' observed TTFT (an instant sim: ms), at
    # least 0.3 s; 30 s (its ceiling) only before any TTFT is known. The client gives up
    # after 20 s: without passive health a blackholed stream waits the read timeout (300 s).
    routing = {
        "backend_policy": "round_robin", "backend_metrics_interval_s": 0.2,
        "first_byte_timeout_min_s": 0.3, "first_byte_timeout_max_s": 30.0,
        "backend_eject_consecutive_5xx": 2,
        "backend_eject_s": 1.0 if mode == "blackhole" else 3.0,
    }
    async with (
        contextlib.AsyncExitStack() as stacks,
        running_sim("instant", served_model_names=["m"]) as live_url,
        start_router([], tls=False, upstreams=_upstreams(port, live_url), routing=routing)
        as router,
        httpx.AsyncClient(timeout=20) as client,
    ):
        async def serving(
            server: contextlib.AbstractAsyncContextManager[None],
        ) -> contextlib.AsyncExitStack:
            """``server`` runs until the returned stack is closed (or the test ends)."""
            stack = contextlib.AsyncExitStack()
            stacks.push_async_callback(stack.aclose)
            await stack.enter_async_context(server)
            return stack

        state = router.app.state.routing
        healthy = await serving(_sim_on(port))  # both serve: the region learns their TTFT
        for _ in range(4):
            await _stream(client, router)
        assert {line["backend"] for line in access_records(caplog, CHAT_PATH)} == {"flaky", "live"}
        # From its TTFT (the floor, on a quiet machine; a loaded one's can be slower), where a
        # backend that had shown none would wait for the ceiling, 30 s.
        assert 0.3 <= state.first_byte_timeout_s("flaky") < 3.0

        # The engine breaks behind a live socket (the broken server takes the port over).
        broken = await serving(_broken_on(port, mode))
        await healthy.aclose()
        durations = [await _stream(client, router) for _ in range(6)]
        whole = await client.post(
            router.base_url + "/v1/chat/completions", json=BODY, headers=auth()
        )
        assert whole.status_code == 200, whole.text
        # Every request was served by the live backend, none waited past the deadline much
        # (a generous bound: a loaded machine; the read timeout is 300 s).
        lines = access_records(caplog, CHAT_PATH)[-7:]
        assert {line["backend"] for line in lines} == {"live"}
        assert [line["outcome"] for line in lines] == ["ok"] * 7
        assert max(durations) < 10.0
        moved = [line["route_reason"] for line in lines if line.get("route_reason")]
        cause = {"blackhole": "first_byte_timeout", "500": "5xx", "reset": "reset"}[mode]
        assert moved[-1] == f"backend_{cause}"
        assert not state.backends["flaky"].healthy
        assert state.backends["flaky"].in_flight == state.tracker["flaky"].in_flight == 0
        metrics = await client.get(router.base_url + "/metrics", headers=auth())
        assert 'firstbyte_backend_healthy{backend="flaky"} 0' in metrics.text
        assert (
            f'firstbyte_backend_ejections_total{{backend="flaky",cause="{cause}"}}'
            in metrics.text
        )
        down = upstream_state_lines(caplog, "flaky")
        assert len(down) == 1  # one line, however many requests found it broken
        assert f"is down: ejected ({cause})" in down[0]

        # Healed: a scrape after backend_eject_s re-admits it.
        await serving(_sim_on(port))
        await broken.aclose()

        async def readmitted() -> bool:
            return bool(state.backends["flaky"].healthy)

        await _until(readmitted)
        for _ in range(4):
            await _stream(client, router)
        assert {line["backend"] for line in access_records(caplog, CHAT_PATH)[-4:]} == {"flaky", "live"}
        assert upstream_state_lines(caplog, "flaky")[1:] == [
            f"upstream flaky (http://127.0.0.1:{port}) is up again"
        ]


async def test_the_last_healthy_backend_is_not_ejected(
    start_router: RouterFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="firstbyte")
    port = _closed_port()
    routing = {"first_byte_timeout_min_s": 0.3, "first_byte_timeout_max_s": 0.5}
    upstreams = [{"name": "only", "url": f"http://127.0.0.1:{port}", "kind": "openai"}]
    async with (
        _broken_on(port, "blackhole"),
        start_router([], tls=False, upstreams=upstreams, routing=routing) as router,
        httpx.AsyncClient(timeout=20) as client,
    ):
        started = time.monotonic()
        response = await client.post(
            router.base_url + "/v1/chat/completions", json={**BODY, "stream": True},
            headers=auth(),
        )
        # Nowhere else to go: the request fails at the deadline (not the read timeout), as
        # an upstream error, and the backend stays in rotation (the next request tries it).
        assert response.status_code == 502, response.text
        assert response.json()["error"]["message"] == "Upstream failed: ReadTimeout."
        assert time.monotonic() - started < 10.0
        assert router.app.state.routing.backends["only"].healthy
        # Not ejected, but not silent: one warning names the backend and the deadline, and
        # a second failure within 10 s adds no line.
        again = await client.post(
            router.base_url + "/v1/chat/completions", json={**BODY, "stream": True},
            headers=auth(),
        )
        assert again.status_code == 502, again.text
    assert upstream_state_lines(caplog, "only") == [
        f"upstream only (http://127.0.0.1:{port}) failed a request (first_byte_timeout): "
        "ReadTimeout: no response within 0.5 s (first-byte deadline); kept in rotation, the "
        "region's last"
    ]


PREFIX = "You are the support assistant of an online shop. Answer briefly. " * 20


@pytest.mark.parametrize("run", range(2))
async def test_the_first_request_after_healthz_200_is_served(
    start_router: RouterFactory, run: int
) -> None:
    # The start-up warmup's last metrics scrape saw its own probes running and waiting on the
    # backend; counted as someone else's load after they ended, they filled a backend of
    # max_in_flight = 2, and the first request after /healthz turned 200 was refused (429).
    async with (
        running_sim("h100-7b", served_model_names=["m"]) as sim_url,
        httpx.AsyncClient(timeout=20) as client,
        start_router(
            [], tls=False, upstreams=[{"url": sim_url, "max_in_flight": 2}],
            warm_prefixes=[{"name": "support", "text": PREFIX}],
        ) as router,
    ):
        async def ready() -> bool:
            return (await client.get(router.base_url + "/healthz")).status_code == 200

        await _until(ready)
        response = await client.post(
            router.base_url + "/v1/chat/completions", headers=auth(),
            json={
                "model": "m", "max_tokens": 3, "stream": True,
                "messages": [
                    {"role": "system", "content": PREFIX}, {"role": "user", "content": "hi"}
                ],
            },
        )
        assert response.status_code == 200, response.text
        assert response.text.endswith("data: [DONE]\n\n")
        routing = router.app.state.routing
        assert routing.tracker.in_flight() == 0  # the probes' counts were given back
        assert routing.scheduler.all_warm()


async def test_a_backend_blackholed_from_the_start_costs_a_deadline_from_warmup_probes(
    start_router: RouterFactory, caplog: pytest.LogCaptureFixture
) -> None:
    # Before any user request the region knows its TTFT from the warmup probes (one token
    # each), so a backend that never answered is cut off at the floor, not the ceiling.
    caplog.set_level(logging.INFO, logger="firstbyte")
    port = _closed_port()
    routing = {
        "backend_policy": "round_robin", "backend_metrics_interval_s": 0.2,
        "first_byte_timeout_min_s": 0.3, "first_byte_timeout_max_s": 30.0,
    }
    async with (
        _broken_on(port, "blackhole"),
        running_sim("instant", served_model_names=["m"]) as live_url,
        start_router(
            [], tls=False, upstreams=_upstreams(port, live_url), routing=routing,
            warm_prefixes=[{"name": "support", "text": PREFIX}],
            warmup={"startup_timeout_s": 2.0},
        ) as router,
        httpx.AsyncClient(timeout=20) as client,
    ):
        async def ready() -> bool:
            return (await client.get(router.base_url + "/healthz")).status_code == 200

        await _until(ready)
        state = router.app.state.routing
        assert state.scheduler.warm("live") == ["support"]
        # From the probes' TTFT (the floor, on a quiet machine; a loaded one's probes can be
        # slower), where a region that had seen no TTFT would wait for the ceiling, 30 s.
        assert 0.3 <= state.first_byte_timeout_s("flaky") < 3.0
        durations = [await _stream(client, router) for _ in range(3)]
        assert max(durations) < 10.0
        assert {line["backend"] for line in access_records(caplog, CHAT_PATH)} == {"live"}
        assert not state.backends["flaky"].healthy


async def test_a_reload_keeps_a_backend_out_of_rotation_until_it_is_due_back(
    start_router: RouterFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(multiregion, "PASSIVE_DOWN_S", 0.5)
    port = _closed_port()

    def upstreams(live_url: str) -> list[dict[str, Any]]:
        # No scrapes for "gone": only time brings it back into rotation.
        return [
            {"name": "gone", "url": f"http://127.0.0.1:{port}", "kind": "openai"},
            {"name": "live", "url": live_url},
        ]

    async with (
        running_sim("instant", served_model_names=["m"]) as live_url,
        _router_that_listed(
            start_router, port, upstreams=upstreams(live_url),
            routing={"backend_policy": "round_robin"},
        ) as router,
        httpx.AsyncClient(timeout=10) as client,
    ):
        for _ in range(2):
            await _stream(client, router)  # one of them finds "gone" refusing
        state = router.app.state
        assert not state.routing.backends["gone"].healthy
        # A reload that changes routing builds a new routing stage; before, it forgot when
        # "gone" was due back, and "gone" stayed out of rotation until the process ended.
        reloaded = router_config(
            [], None, upstreams=upstreams(live_url),
            routing={"backend_policy": "round_robin", "balance_abs_threshold": 9},
        )
        previous = state.routing
        await router.app.reconfigure(reloaded)
        assert state.routing is not previous
        assert not state.routing.backends["gone"].healthy
        async with _sim_on(port):
            await asyncio.sleep(0.6)
            for _ in range(4):
                await _stream(client, router)
            assert state.routing.backends["gone"].healthy
