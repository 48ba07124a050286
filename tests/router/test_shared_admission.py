"""Per-key limits, affinity and backend load across router processes sharing one Redis.

Real ``firstbyte router`` processes (TLS, loopback) and a real ``valkey-server``, as in
:mod:`tests.router.test_shared_state`; each test keeps its state under its own key prefix, so
slots held by an earlier test's killed processes (until their lease lapses) cannot count here.
Every test fails with per-process counts: each process alone sees fewer than the limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from firstbyte.benchmarks.redis_server import RedisServer
from firstbyte.protocol import error_codes
from firstbyte.protocol.openai import ChatCompletionRequest
from firstbyte.router.pipeline.affinity import affinity_key, rendezvous_rank
from firstbyte.router.sim.server import SimServer, sim_server
from tests.router.conftest import OTHER_KEY, auth, client_tls
from tests.router.redis_fixture import redis_server  # noqa: F401 (a fixture)
from tests.router.test_shared_state import BODY, LEASE_S, RouterProcess, running_pair
from tests.waits import until

pytestmark = pytest.mark.slow

LONG = {**BODY, "max_tokens": 3000}
"""~30 s at the sim's ~10 ms per token: still running when the test is over."""


def _routers(
    tmp: Path, tls: dict[str, str], redis_url: str, upstream: str, *, extra: str = "",
    upstreams: str | None = None,
) -> contextlib.AbstractAsyncContextManager[tuple[RouterProcess, RouterProcess]]:
    """Two router processes (A, B) sharing one Redis under a fresh key prefix."""
    return running_pair(tmp, tls, redis_url, upstream, key_prefix=f"t{secrets.token_hex(4)}:",
                        extra=extra, upstreams=upstreams)


@pytest.fixture
async def sim() -> AsyncIterator[SimServer]:
    async with sim_server("h100-7b") as server:
        yield server


@pytest.fixture
async def client(tls_files: dict[str, str]) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(verify=client_tls(tls_files), timeout=20) as http:
        yield http


@pytest.fixture
async def three_held(
    sim: SimServer, redis_server: RedisServer, tls_files: dict[str, str],  # noqa: F811
    tmp_path: Path, client: httpx.AsyncClient,
) -> AsyncIterator[tuple[RouterProcess, RouterProcess]]:
    """A and B with ``max_streams_per_key = 3``, the key's 3 streams held: 2 on A, 1 on B."""
    extra = "[limits]\nmax_streams_per_key = 3\n"
    async with _routers(tmp_path, tls_files, redis_server.url, sim.url, extra=extra) as (a, b):
        for router in (a, a, b):
            assert (await _hold(client, router)).status_code == 201
        yield a, b


async def _hold(client: httpx.AsyncClient, router: RouterProcess, key: str | None = None
                ) -> httpx.Response:
    """Start a long stream on ``router`` (``POST /v1/streams``: it runs without a reader)."""
    return await client.post(router.url + "/v1/streams", json=LONG,
                             headers=auth(key) if key else auth())


def _refused(response: httpx.Response, code: str) -> bool:
    return response.status_code == 429 and response.json()["error"]["code"] == code


async def test_key_concurrency_limit_counts_every_process(
    three_held: tuple[RouterProcess, RouterProcess], client: httpx.AsyncClient,
) -> None:
    a, b = three_held  # 3 streams of one key, spread over both processes
    for router in (a, b):  # the 4th is refused on either
        refused = await _hold(client, router)
        assert _refused(refused, error_codes.KEY_CONCURRENCY_EXCEEDED), refused.text
        assert refused.headers["retry-after"] == "1"
    assert (await _hold(client, b, OTHER_KEY)).status_code == 201  # other keys go on


async def test_slots_of_a_killed_process_come_back_within_its_lease(
    three_held: tuple[RouterProcess, RouterProcess], client: httpx.AsyncClient,
) -> None:
    a, b = three_held
    assert _refused(await _hold(client, b), error_codes.KEY_CONCURRENCY_EXCEEDED)
    os.killpg(a.process.pid, signal.SIGKILL)  # dies holding 2 of the key's 3 slots
    killed_at = time.monotonic()
    while (answer := await _hold(client, b)).status_code != 201:
        assert _refused(answer, error_codes.KEY_CONCURRENCY_EXCEEDED), answer.text
        assert time.monotonic() - killed_at < LEASE_S + 2, "slots not released"
        await asyncio.sleep(0.05)
    assert time.monotonic() - killed_at > LEASE_S / 2  # the lease, not something sooner
    assert (await _hold(client, b)).status_code == 201  # both of A's slots came back
    assert _refused(await _hold(client, b), error_codes.KEY_CONCURRENCY_EXCEEDED)


def _key_of(content: str) -> str:
    request = msgspec.convert({**BODY, "messages": [{"role": "user", "content": content}]},
                              ChatCompletionRequest)
    return affinity_key(request)


async def test_a_prompt_goes_to_the_same_backend_whichever_process_answers(
    redis_server: RedisServer, tls_files: dict[str, str], tmp_path: Path,  # noqa: F811
    client: httpx.AsyncClient,
) -> None:
    # Two prompts whose first choice is the same backend: after B placed Y there, B's own
    # bounded-load count sends a new X to the other backend, unless it learns where A put X.
    weights = {"gpu-a": 1.0, "gpu-b": 1.0}
    firsts = [c for c in (f"Conversation {i}" for i in range(200))
              if rendezvous_rank(_key_of(c), weights)[0] == "gpu-a"]
    x, y = firsts[:2]
    async with sim_server("instant", served_model_names=["sim-llama-7b"]) as gpu_a, sim_server(
        "instant", served_model_names=["sim-llama-7b"]
    ) as gpu_b:
        upstreams = (f'[[upstreams]]\nname = "gpu-a"\nurl = "{gpu_a.url}"\n'
                     f'[[upstreams]]\nname = "gpu-b"\nurl = "{gpu_b.url}"')
        sims = {"gpu-a": gpu_a, "gpu-b": gpu_b}
        async with _routers(tmp_path, tls_files, redis_server.url, gpu_a.url,
                            upstreams=upstreams) as (a, b):

            async def served_by(router: RouterProcess, content: str, turn: int = 1) -> str:
                """Which backend served a conversation opened by ``content`` at its
                ``turn``-th message (its affinity key is its first message's)."""
                before = {n: s.engine.prompt_tokens_total for n, s in sims.items()}
                messages = [{"role": "user", "content": content}]
                for i in range(1, turn):
                    messages += [{"role": "assistant", "content": f"Answer {i}."},
                                 {"role": "user", "content": f"Question {i + 1}?"}]
                body: dict[str, Any] = {**BODY, "stream": False, "max_tokens": 2,
                                        "messages": messages}
                answer = await client.post(router.url + "/v1/chat/completions", json=body,
                                           headers=auth())
                assert answer.status_code == 200, answer.text
                (name,) = [n for n, s in sims.items()
                           if s.engine.prompt_tokens_total > before[n]]
                return name

            home = await served_by(a, x)
            assert home == "gpu-a"
            assert await served_by(b, y) == "gpu-a"
            # The conversation's next turn reaches B, which never saw it: it asks Redis
            # (an opening message goes at once: nobody can have placed it yet).
            assert await served_by(b, x, turn=2) == home  # B followed A's placement
            assert await served_by(a, x, turn=3) == home
            assert await served_by(b, x, turn=3) == home


async def test_two_processes_together_respect_a_backends_max_in_flight(
    sim: SimServer, redis_server: RedisServer, tls_files: dict[str, str],  # noqa: F811
    tmp_path: Path, client: httpx.AsyncClient,
) -> None:
    # The backend's own metrics would also show the other process's requests, a scrape later:
    # scraped once a minute here, so only the shared count can keep the limit.
    upstreams = f'[[upstreams]]\nurl = "{sim.url}"\nmax_in_flight = 2'
    extra = "[routing]\nbackend_metrics_interval_s = 60\n"
    async with _routers(tmp_path, tls_files, redis_server.url, sim.url, upstreams=upstreams,
                        extra=extra) as (a, b):
        assert (await _hold(client, a)).status_code == 201
        assert (await _hold(client, b)).status_code == 201
        for router in (a, b):
            refused = await _hold(client, router)
            assert _refused(refused, error_codes.REGION_SATURATED), refused.text
            assert int(refused.headers["retry-after"]) >= 1
        # A detached stream's 201 comes once it is admitted, before its request has reached
        # the sim: wait for the two, then none more went (the two refused never do).
        def at_sim() -> int:
            return len(sim.engine.running) + len(sim.engine.waiting)
        await until(lambda: at_sim() >= 2, what="both admitted streams at the sim")
        await asyncio.sleep(0.2)
        assert at_sim() == 2  # and only two went


async def test_processes_admitting_at_once_never_put_more_than_the_limit_on_a_backend(
    redis_server: RedisServer, tls_files: dict[str, str], tmp_path: Path,  # noqa: F811
) -> None:
    """With a limit of 128 each process keeps 2 spare slots of the backend and admits new
    conversations on them without waiting for Redis: 150 streams at once over both processes
    put at most 128 on the backend (at least 124: what one process keeps spare the other
    cannot take), and the rest are refused as a full region. (Each stream sends a token,
    then holds 10 s: none ends and frees its slot while the test counts.)"""
    async with sim_server("h100-7b", faults=["stall:after=1,ms=10000"]) as held_sim:
        upstreams = f'[[upstreams]]\nurl = "{held_sim.url}"\nmax_in_flight = 128'
        extra = "[routing]\nbackend_metrics_interval_s = 60\n"
        async with _routers(tmp_path, tls_files, redis_server.url, held_sim.url,
                            upstreams=upstreams, extra=extra) as (a, b):
            limits = httpx.Limits(max_connections=150, max_keepalive_connections=150)
            async with httpx.AsyncClient(verify=client_tls(tls_files), timeout=30,
                                         limits=limits) as http:
                for router in (a, b):  # each holds spare slots of the backend now
                    assert (await _hold(http, router)).status_code == 201
                answers = await asyncio.gather(*(
                    http.post(router.url + "/v1/streams",
                              json={**BODY, "messages": [{"role": "user", "content": f"Hi {i}"}]},
                              headers=auth())
                    for i, router in enumerate([a, b] * 75)
                ))
                statuses = [r.status_code for r in answers]
                assert statuses.count(201) + statuses.count(429) == len(statuses), statuses
                assert all(_refused(r, error_codes.REGION_SATURATED)
                           for r in answers if r.status_code == 429)
                admitted = statuses.count(201) + 2
                assert 124 <= admitted <= 128, admitted
                engine = held_sim.engine  # and the backend itself never had more
                assert len(engine.running) + len(engine.waiting) <= 128
                text = (await http.get(a.url + "/metrics", headers=auth())).text
                at_once = next(
                    float(line.split()[1]) for line in text.splitlines()
                    if line.startswith('firstbyte_router_shared_admissions_total{waited="none"}'))
                assert at_once > 0  # and some of them went without waiting for Redis


async def test_no_default_caps_a_key_across_processes(
    redis_server: RedisServer, tls_files: dict[str, str], tmp_path: Path,  # noqa: F811
) -> None:
    # The old default capped a key at 128 completions in flight region-wide. Each stream
    # here sends a token, then holds 10 s: 140 of one key, over both processes, at once.
    async with sim_server("h100-7b", faults=["stall:after=1,ms=10000"]) as held_sim, _routers(
        tmp_path, tls_files, redis_server.url, held_sim.url
    ) as (a, b):
        limits = httpx.Limits(max_connections=140, max_keepalive_connections=140)
        async with httpx.AsyncClient(verify=client_tls(tls_files), timeout=30,
                                     limits=limits) as http:
            body = {**BODY, "max_tokens": 4}
            started = await asyncio.gather(*(
                http.post(router.url + "/v1/streams", json=body, headers=auth())
                for router in [a, b] * 70
            ))
    statuses = [r.status_code for r in started]
    assert statuses.count(201) == 140, {s: statuses.count(s) for s in set(statuses)}
