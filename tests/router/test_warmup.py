from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import httpx
import pytest

from firstbyte.router import warmup
from firstbyte.router.sim.server import SimServer, sim_server
from firstbyte.router.upstream_h1 import H1Pool
from firstbyte.router.upstream_metrics import BackendMetrics, parse_backend_metrics
from firstbyte.router.warmup import WarmPrefix, WarmState, WarmupRunner, WarmupScheduler
from tests.router.conftest import RouterFactory, auth
from tests.router.upstream import running_upstream

SUPPORT = WarmPrefix("support", "You are a support agent for ACME routers. " * 40, ())
CODER = WarmPrefix("coder", "You write Python code. " * 40, ("code-model",))


def scheduler(**kw: float) -> WarmupScheduler:
    s = WarmupScheduler([SUPPORT, CODER], interval_s=60, pressure_interval_s=5,
                        busy_running_threshold=2, retry_s=2, **kw)  # type: ignore[arg-type]
    s.add_backend("a", ["chat-model"])
    s.add_backend("b", ["chat-model", "code-model"])
    return s


def finish_all(s: WarmupScheduler, now: float, cached: int = 0) -> None:
    for task in s.due(now):
        s.finished(task, now, ok=True, prompt_tokens=400, cached_tokens=cached)


def test_everything_cold_is_due_at_start_respecting_models() -> None:
    s = scheduler()
    tasks = s.due(0.0)
    assert sorted((t.backend, t.prefix, t.model, t.reason) for t in tasks) == [
        ("a", "support", "chat-model", "cold"),
        ("b", "coder", "code-model", "cold"),
        ("b", "support", "chat-model", "cold"),
    ]
    assert s.due(0.1) == []  # in progress: not handed out twice
    for t in tasks:
        s.finished(t, 0.5, ok=True, prompt_tokens=400)
    assert s.all_warm()
    assert s.registry() == {"a": {"support": "warm"}, "b": {"support": "warm", "coder": "warm"}}


def test_schedule_and_pressure_intervals() -> None:
    s = scheduler()
    finish_all(s, 0.0)
    assert s.due(30.0) == []
    assert {t.reason for t in s.due(60.0)} == {"schedule"}
    s2 = scheduler()
    finish_all(s2, 0.0)
    s2.metrics("a", BackendMetrics(running=0, waiting=0, cache_usage=0.95))
    assert [(t.backend, t.reason) for t in s2.due(6.0)] == [("a", "pressure")]


def test_never_warm_a_busy_backend() -> None:
    s = scheduler()
    s.metrics("a", BackendMetrics(running=0, waiting=1))
    s.metrics("b", BackendMetrics(running=5, waiting=0))
    assert s.due(0.0) == []
    s.metrics("a", BackendMetrics(running=2, waiting=0))  # at the threshold: fine
    assert [t.backend for t in s.due(1.0)] == ["a"]


def test_restart_by_health_flap_and_by_counters_going_back() -> None:
    s = scheduler()
    finish_all(s, 0.0)
    s.health("a", False)
    assert s.due(1.0) == []  # unhealthy: nothing to do
    s.health("a", True)
    assert [(t.backend, t.reason) for t in s.due(2.0)] == [("a", "cold")]
    assert s.restarts_total["a"] == 1
    s.metrics("b", BackendMetrics(prefix_queries=1000, prefix_hits=800))
    s.metrics("b", BackendMetrics(prefix_queries=1200, prefix_hits=900))
    assert [t.backend for t in s.due(3.0)] == []
    s.metrics("b", BackendMetrics(prefix_queries=10, prefix_hits=0))
    assert sorted(t.prefix for t in s.due(4.0)) == ["coder", "support"]
    assert s.restarts_total["b"] == 1


def test_uncached_reprobe_counts_an_eviction_and_failures_retry() -> None:
    s = scheduler()
    finish_all(s, 0.0)
    tasks = s.due(60.0)
    for t in tasks:
        s.finished(t, 60.0, ok=True, prompt_tokens=400, cached_tokens=0 if t.backend == "a" else 384)
    assert s.evictions_total == {("a", "support"): 1}
    t = next(t for t in s.due(120.0) if t.backend == "a")
    s.finished(t, 120.0, ok=False)
    assert s.state("a", "support") is WarmState.COLD
    assert [x for x in s.due(121.0) if x.backend == "a"] == []
    assert [x.reason for x in s.due(122.5) if x.backend == "a"] == ["cold"]


@contextlib.asynccontextmanager
async def clients(urls: dict[str, str]) -> AsyncIterator[dict[str, httpx.AsyncClient]]:
    cs = {n: httpx.AsyncClient(base_url=u) for n, u in urls.items()}
    try:
        yield cs
    finally:
        for c in cs.values():
            await c.aclose()


async def cached_tokens_for(sim: SimServer, system: str) -> tuple[int, int]:
    async with httpx.AsyncClient(base_url=sim.url) as c:
        r = await c.post("/v1/chat/completions", json={
            "model": "chat-model", "max_tokens": 2,
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": "How do I reset my router?"}],
        })
        usage = r.json()["usage"]
        return usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]


async def test_runner_warms_real_sims_and_rewarms_after_restart() -> None:
    s = WarmupScheduler([SUPPORT], interval_s=600)
    async with sim_server(served_model_names=["chat-model"]) as one, sim_server(served_model_names=["chat-model"]) as two:
        s.add_backend("one", ["chat-model"])
        s.add_backend("two", ["chat-model"])
        async with clients({"one": one.url, "two": two.url}) as cs:
            runner = WarmupRunner(s, cs["one"], {"one": one.url, "two": two.url},
                                  poll_interval_s=0.05)
            assert await runner.wait_all_warm(timeout_s=20)
            for sim in (one, two):
                metrics = parse_backend_metrics((await cs["one"].get(f"{sim.url}/metrics")).text)
                assert metrics.prefix_queries is not None
                assert metrics.prefix_queries > 0  # the probe went through the prefix cache
                prompt, cached = await cached_tokens_for(sim, SUPPORT.text)
                # The whole system prompt is cached (minus the partial last block and the user turn).
                assert cached >= len(SUPPORT.text) // 4 - 32
                assert cached < prompt
            await runner.step()  # the scrape sees the counters the probes and requests moved
            assert s.restarts_total["two"] == 0
            # "two" restarts: a fresh sim behind the same name has its counters back at zero.
            async with sim_server(served_model_names=["chat-model"]) as two_again:
                runner.urls["two"] = two_again.url
                await runner.step()
                assert s.restarts_total["two"] == 1
                assert s.state("two", "support") is not WarmState.WARM
                assert await runner.wait_all_warm(timeout_s=20)
                _, cached = await cached_tokens_for(two_again, SUPPORT.text)
                assert cached >= len(SUPPORT.text) // 4 - 32
            await runner.stop()


async def test_startup_wait_does_not_wait_for_a_dead_backend() -> None:
    import socket
    import time

    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
    try:
        s = WarmupScheduler([SUPPORT])
        async with sim_server(served_model_names=["chat-model"]) as alive, httpx.AsyncClient() as client:
            s.add_backend("alive", ["chat-model"])
            s.add_backend("dead", ["chat-model"])
            urls = {"alive": alive.url, "dead": f"http://127.0.0.1:{dead.getsockname()[1]}"}
            runner = WarmupRunner(s, client, urls, poll_interval_s=0.05)
            start = time.monotonic()
            assert await runner.wait_all_warm(timeout_s=20)
            assert time.monotonic() - start < 10
            assert s.warm("alive") == ["support"]
            assert s.warm("dead") == []
            await runner.stop()
    finally:
        dead.close()


async def test_router_listens_while_warming_and_holds_requests_until_warm(
    start_router: RouterFactory,
) -> None:
    """/healthz says "warming" at once; a user request waits for the warmup to end."""
    async with running_upstream() as upstream:
        upstream.hold = asyncio.Event()  # the warmup request stays unanswered until released
        async with start_router(
            [upstream.url], tls=False, warm_prefixes=[{"name": "support", "text": SUPPORT.text}],
            upstreams=[{"url": upstream.url, "models": ["test-model"]}],
        ) as router, httpx.AsyncClient(timeout=30) as client:
            try:
                state = router.app.state
                health = await client.get(router.base_url + "/healthz")
                assert (health.status_code, health.text) == (503, "warming\n")
                # Peers and the SDKs read /v1/edge/status: with a key or without, a warming
                # region is not one to send requests to, as /healthz says.
                status = router.base_url + "/v1/edge/status"
                keyed = (await client.get(status, headers=auth())).json()
                assert "warm" in keyed  # the whole report
                assert keyed["healthy"] is False
                assert (await client.get(status)).json()["healthy"] is False
                body = {"model": "test-model", "max_tokens": 2,
                        "messages": [{"role": "user", "content": "hello"}]}
                user = asyncio.ensure_future(
                    client.post(router.base_url + "/v1/chat/completions", json=body, headers=auth()))
                await asyncio.sleep(0.5)
                assert not user.done()
                assert state.warming
                # Only the warmup reached the backend: the user's request is held by the router.
                assert "hello" not in upstream.chat_requests
                assert len(upstream.chat_requests) == 1
                upstream.hold.set()
                response = await user
                assert response.status_code == 200, response.text
                assert upstream.chat_requests[-1] == "hello"
                assert not state.warming
                assert (await client.get(router.base_url + "/healthz")).text == "ok\n"
                assert (await client.get(status, headers=auth())).json()["healthy"] is True
                assert (await client.get(status)).json()["healthy"] is True
            finally:
                # A failed check must not leave the warmup, and so the router's stop, hanging.
                upstream.hold.set()


@dataclass
class _Scraped:
    served: list[tuple[int, int]] = field(default_factory=list)
    """(connection, request on it) answered, in the order served."""
    dropped: list[tuple[int, int]] = field(default_factory=list)
    """Those read and left unanswered, their connection closed."""
    seen: list[BackendMetrics | None] = field(default_factory=list)
    """What each scrape reported (None: the backend taken out of rotation)."""


def scrape_pool() -> H1Pool:
    """A pool like the router's for its scrapes (``Proxy.scrape_pool``)."""
    return H1Pool(max_connections=64, keepalive_expiry_s=60, connect_timeout_s=2,
                  read_timeout_s=5)


async def _scrape_a_server_that_drops(
    drop: Callable[[int, int], bool], scrapes: Callable[[WarmupRunner], Awaitable[object]],
    via: str, body: bytes = b"vllm:num_requests_running 0\n",
) -> _Scraped:
    """Run ``scrapes`` against a metrics server that closes a kept-alive connection with its
    request unanswered where ``drop(connection, request)`` says (its keep-alive timer closed
    it just as the scrape reused it); ``via``: ``httpx`` (the client) or ``pool`` (the
    router's HTTP/1.1 pool, as the router scrapes)."""
    out = _Scraped()
    connections = 0

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connection, connections = connections, connections + 1
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            for request in range(100):
                await reader.readuntil(b"\r\n\r\n")
                if drop(connection, request):
                    out.dropped.append((connection, request))
                    break  # closed with the request unanswered
                out.served.append((connection, request))
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n"
                             b"content-length: %d\r\n\r\n%s" % (len(body), body))
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    s = WarmupScheduler([SUPPORT])
    s.add_backend("b", ["chat-model"])
    try:
        async with httpx.AsyncClient() as client:
            pool = scrape_pool() if via == "pool" else None
            await scrapes(WarmupRunner(s, client, {"b": url}, scrape_pool=pool,
                                       on_metrics=lambda name, m: out.seen.append(m) is not None))
            if pool is not None:
                await pool.aclose()
    finally:
        server.close()
        await server.wait_closed()
    return out


@pytest.mark.parametrize("via", ["httpx", "pool"])
async def test_a_scrape_on_a_connection_closed_as_it_was_reused_is_asked_again(via: str) -> None:
    """The server closes a kept-alive connection just as the next scrape reuses it (its
    keep-alive timer; a loaded router's loop sees the FIN late): the scrape is asked again on
    a new connection, and the backend is not taken out of rotation for it."""

    async def three_in_a_row(runner: WarmupRunner) -> None:
        for _ in range(3):
            await runner.scrape("b")

    out = await _scrape_a_server_that_drops(lambda c, r: (c, r) == (0, 1), three_in_a_row, via)
    assert out.dropped == [(0, 1)]
    assert out.served == [(0, 0), (1, 0), (1, 1)]  # asked again on a new connection, kept alive
    assert [m is not None for m in out.seen] == [True, True, True]


@pytest.mark.parametrize("via", ["httpx", "pool"])
async def test_a_scrape_tries_past_several_kept_alive_connections_closed_at_once(
    via: str,
) -> None:
    """Two kept-alive connections whose server closed them both (keep-alive timers that ran
    out together while the loop was late): the scrape is lost on each, then answered on a
    new one, and the backend stays in rotation. It was asked once more only, so the second
    loss took the backend out of rotation (a region's only backend: every request a 503)."""
    async def two_at_once_then_one(runner: WarmupRunner) -> None:
        await asyncio.gather(runner.scrape("b"), runner.scrape("b"))  # two connections
        await runner.scrape("b")

    out = await _scrape_a_server_that_drops(lambda c, r: c < 2 and r == 1, two_at_once_then_one,
                                            via)
    assert sorted(out.dropped) == [(0, 1), (1, 1)]
    assert sorted(out.served) == [(0, 0), (1, 0), (2, 0)]
    assert [m is not None for m in out.seen] == [True, True, True]


@pytest.mark.parametrize("via", ["httpx", "pool"])
async def test_a_metrics_page_over_the_bound_is_an_answer_without_metrics(
    via: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A page past :data:`~firstbyte.router.warmup.MAX_METRICS_BYTES` is not read whole: the
    backend answered, so it stays in rotation, with nothing learnt from the page."""
    monkeypatch.setattr(warmup, "MAX_METRICS_BYTES", 1000)

    async def one(runner: WarmupRunner) -> None:
        await runner.scrape("b")

    page = b"vllm:num_requests_running 7\n" + b"# padding\n" * 90  # 928 bytes: read
    out = await _scrape_a_server_that_drops(lambda c, r: False, one, via, page)
    assert [m.running if m else None for m in out.seen] == [7]
    out = await _scrape_a_server_that_drops(lambda c, r: False, one, via, page + b"#" * 100)
    assert out.seen == [BackendMetrics()]


async def test_the_router_scrapes_its_backends_over_its_own_pool(
    start_router: RouterFactory,
) -> None:
    """The router's scrapes go through ``Proxy.scrape_pool`` (not httpx): its backend's load
    is learnt, and the pool keeps the scrape's connection for the next one."""
    async with sim_server(served_model_names=["chat-model"]) as sim, start_router(
        [sim.url], tls=False, upstreams=[{"url": sim.url, "models": ["chat-model"]}],
    ) as router:
        state = router.app.state
        runner, pool = state.routing.runner, state.proxy.scrape_pool
        assert runner.scrape_pool is pool
        seen: list[BackendMetrics | None] = []
        learn = runner.on_metrics
        assert learn is not None
        runner.on_metrics = lambda name, m: (seen.append(m), learn(name, m))[1]
        for _ in range(100):  # its own scrapes, every backend_metrics_interval_s (1 s)
            if seen:
                break
            await asyncio.sleep(0.05)
        assert seen
        assert seen[0] is not None
        assert seen[0].running == 0  # the sim's page, parsed
        assert "0 active, 0 idle" not in repr(pool)  # its connection, kept for the next
