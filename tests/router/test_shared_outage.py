"""Shared state that holds: bursts, Redis outages and a wrong ``state.redis_url``.

Real ``firstbyte router`` processes (TLS, loopback) and real ``valkey-server`` processes: the
session's server for the burst tests, a server of its own for each test that stops, kills,
freezes or password-protects it. A Redis error reaches a client as ``503 state_unavailable``
with ``Retry-After``, never a 500, and ``/healthz`` says ``state_unavailable`` meanwhile; a
request that failed leaves nothing claimed, here or in Redis; a wrong URL or password stops
the router at start with one line.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
import redis
from websockets.asyncio.client import connect as ws_connect

from firstbyte.benchmarks.ports import free_port
from firstbyte.benchmarks.redis_server import RedisServer, running_redis
from firstbyte.protocol import error_codes
from firstbyte.router.config import RouterConfig, parse_config
from firstbyte.router.pipeline.admit import admit_body
from firstbyte.router.pipeline.context import CONTINUE, RequestContext
from firstbyte.router.placement import place
from firstbyte.router.shared import connect
from firstbyte.router.shared.admission import Claim, Verdict
from firstbyte.router.shared.errors import RETRY_AFTER_S
from firstbyte.router.shared.keys import Keys
from firstbyte.router.shared.tickets import PAUSE_S, RedisTicketStore
from firstbyte.router.sim.server import SimServer, sim_server
from firstbyte.router.state import RouterState
from tests.router.conftest import auth, client_tls
from tests.router.redis_fixture import redis_server  # noqa: F401 (a fixture)
from tests.router.test_shared_state import (
    RouterProcess,
    _config,
    _start,
    _stop,
    _until_listening,
)
from tests.router.upstream import Upstream

pytestmark = pytest.mark.slow

BODY = {
    "model": "sim-llama-7b",
    "messages": [{"role": "user", "content": "Hold on."}],
    "stream": True,
    "max_tokens": 8,
    "seed": 3,
}
LIMITS = """
[limits]
max_streams_per_key = 10000
max_connections_per_client = 10000
"""
"""A burst from one test client is one key and one address: neither limit is under test."""


@pytest.fixture
async def sim() -> AsyncIterator[SimServer]:
    async with sim_server("h100-7b") as server:
        yield server


def _shared_config(url: str, prefix: str) -> RouterConfig:
    return parse_config(
        {
            "upstreams": [{"url": "http://127.0.0.1:9/v1"}],
            "auth": {"allow_anonymous": True},
            "listen": {"insecure_plain_http": True},
            "state": {"redis_url": url, "key_prefix": prefix},
        },
        "test",
    )


async def test_2000_admissions_at_once_are_all_answered(
    redis_server: RedisServer,  # noqa: F811
) -> None:
    """redis-py 8's default asyncio pool raised MaxConnectionsError past 100 connections."""
    config = _shared_config(redis_server.url, f"burst{os.getpid()}:")
    shared = connect(config)
    assert shared is not None
    try:
        await shared.start()

        async def one(i: int) -> Verdict:
            answer = await shared.admission.admit(Claim(b"k%d" % (i % 7), "b0"))
            return answer.verdict

        results = await asyncio.gather(*(one(i) for i in range(2000)), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        assert errors == []
        assert Counter(results) == {Verdict.ADMITTED: 2000}
        assert await shared.redis.hget(shared.keys.backend_load("b0"), shared.process) == b"2000"
        assert shared.admission.held[shared.keys.backend_load("b0")] == 2000
        for _ in range(2000):
            shared.admission.release_backend("b0")
        await shared.admission.background.drain(10.0)
        assert await shared.redis.hgetall(shared.keys.backend_load("b0")) == {}
    finally:
        await shared.aclose()


async def _stream(client: httpx.AsyncClient, url: str) -> tuple[int, str, str]:
    """One streamed completion: (status, error code (its message if it has none) or last SSE
    data, Retry-After)."""
    async with client.stream("POST", url + "/v1/chat/completions", json=BODY,
                             headers=auth()) as response:
        body = await response.aread()
    if response.status_code != 200:
        code = ""
        with contextlib.suppress(ValueError, KeyError, TypeError):
            error = response.json()["error"]
            code = error["code"] or error["message"]
        return response.status_code, code, response.headers.get("retry-after", "")
    data = [line[6:] for line in body.decode().splitlines() if line.startswith("data: ")]
    return 200, data[-1] if data else "", ""


async def test_300_streams_at_once_with_shared_state(
    sim: SimServer, redis_server: RedisServer, tls_files: dict[str, str],  # noqa: F811
    tmp_path: Path,
) -> None:
    port = free_port()
    # The sim shares this test's event loop with the 300 clients, and the suite's other
    # workers share the cores: on a busy host its answers to the burst's last requests have
    # come later than the first-byte deadline's 5 s floor (a CI run: the last 56 requests
    # of the burst ended 502 upstream_error 5.3 s after they arrived, and the log had no
    # "upstream ... is down" line, which a connect failure writes). That deadline has its
    # own tests (test_backend_health.py); this one is about the burst's shared state, and a
    # failure now names the upstream's error, not only its status.
    patient = "[routing]\nfirst_byte_timeout_min_s = 30.0\n"
    path = _config(tmp_path, "burst", sim.url, tls_files, redis_server.url, port,
                   key_prefix=f"b300{os.getpid()}:", extra=LIMITS + patient)
    router = _start(path, port, tmp_path, "burst")
    try:
        await _until_listening(router)
        limits = httpx.Limits(max_connections=400, max_keepalive_connections=400)
        async with httpx.AsyncClient(verify=client_tls(tls_files), timeout=60,
                                     limits=limits) as client:
            results = await asyncio.gather(*(_stream(client, router.url) for _ in range(300)))
        assert Counter(results) == {(200, "[DONE]", ""): 300}
        assert "Traceback" not in router.log.read_text()
    finally:
        _stop(router)


@contextlib.contextmanager
def _own_redis(port: int | None = None) -> Iterator[RedisServer]:
    with running_redis(port=port) as server:
        yield server


async def _in_flight(client: httpx.AsyncClient, router: RouterProcess) -> float:
    """The router's own count of requests in flight to its backends."""
    text = (await client.get(router.url + "/metrics", headers=auth())).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("firstbyte_backend_in_flight{"))


async def _claimed(url: str, prefix: str) -> dict[str, int]:
    """What every slots hash in Redis says is in flight (key and backend slots)."""
    client = redis.asyncio.Redis.from_url(url)
    try:
        out: dict[str, int] = {}
        for pattern in (f"{prefix}c:*", f"{prefix}l:*"):
            async for key in client.scan_iter(match=pattern):
                fields = await client.hgetall(key)
                out[key.decode()] = sum(int(v) for v in fields.values())
        return {k: v for k, v in out.items() if v}
    finally:
        await client.aclose()


class _Load:
    """``workers`` clients sending streamed completions one after another until stopped
    (bounded in count too), recording what each got and when."""

    def __init__(self, client: httpx.AsyncClient, url: str, workers: int) -> None:
        self.results: list[tuple[float, int, str, str]] = []
        self._client, self._url = client, url
        self._stop = asyncio.Event()
        self._tasks = [asyncio.create_task(self._run()) for _ in range(workers)]

    async def _run(self) -> None:
        for _ in range(2000):
            if self._stop.is_set():
                return
            try:
                status, what, retry = await _stream(self._client, self._url)
            except httpx.HTTPError as exc:
                status, what, retry = -1, type(exc).__name__, ""
            self.results.append((time.monotonic(), status, what, retry))
            if status != 200:
                await asyncio.sleep(0.05)

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)


async def _websocket_refusals(router: RouterProcess, tls_files: dict[str, str]) -> None:
    """Redis away: a WebSocket's request and its resume each get an error message (status
    503, ``state_unavailable``, SSE's ``Retry-After`` as ``retry_after``), and the socket
    stays open for the next try."""
    url = router.url.replace("https://", "wss://") + "/v1/ws"
    async with ws_connect(url, ssl=client_tls(tls_files), additional_headers=auth()) as ws:
        for message in ({"type": "request", "body": BODY},
                        {"type": "resume", "stream": "AAAAAAAAAAAAAAAAAAAAAA", "after": 0},
                        {"type": "request", "body": BODY}):
            await ws.send(json.dumps(message))
            answer = json.loads(await ws.recv())
            assert (answer["type"], answer["status"], answer["error"]["code"]) == (
                "error", 503, error_codes.STATE_UNAVAILABLE)
            assert answer["retry_after"] == RETRY_AFTER_S


def _check_answers(results: list[tuple[float, int, str, str]]) -> None:
    """Every answer is a finished stream or a 503 state_unavailable with Retry-After."""
    for _, status, what, retry in results:
        if status == 200:
            assert what == "[DONE]"  # a stream that started was not lost
        else:
            assert (status, what) == (503, error_codes.STATE_UNAVAILABLE)
            assert retry.isdigit()


async def _settled(client: httpx.AsyncClient, router: RouterProcess, url: str,
                   prefix: str) -> None:
    """Within a few seconds of the load ending nothing is held, here or in Redis."""
    deadline = time.monotonic() + 15
    while True:
        local, claimed = await _in_flight(client, router), await _claimed(url, prefix)
        if local == 0 and claimed == {}:
            return
        assert time.monotonic() < deadline, (local, claimed)
        await asyncio.sleep(0.2)


@pytest.mark.parametrize(("outage", "workers"), [("kill", 1), ("freeze", 1), ("freeze", 2)])
async def test_redis_outage_mid_load_then_served_again_with_nothing_held(
    outage: str, workers: int, sim: SimServer, tls_files: dict[str, str], tmp_path: Path
) -> None:
    """Redis killed and started again (its data gone), or frozen with SIGSTOP past the
    router's timeout (commands that timed out run when it wakes): 503s meanwhile, streams
    in flight finish, and afterwards nothing stays claimed and requests are served. With two
    workers both reconcile (this process's in-flight count is read from one of them)."""
    prefix = "outage:"
    extra = "timeout_s = 0.5\n" + LIMITS
    port = free_port()
    redis_port = free_port()
    stack = contextlib.ExitStack()
    server = stack.enter_context(_own_redis(redis_port))
    path = _config(tmp_path, outage, sim.url, tls_files, server.url, port, workers,
                   key_prefix=prefix, extra=extra)
    router = _start(path, port, tmp_path, outage)
    try:
        await _until_listening(router, workers)
        async with httpx.AsyncClient(verify=client_tls(tls_files), timeout=30) as client:
            load = _Load(client, router.url, workers=12)
            await asyncio.sleep(1.5)
            if outage == "kill":
                stack.close()  # SIGKILL: every key gone with it
                await asyncio.sleep(2.0)
                lookup = await client.get(router.url + "/v1/streams/AAAAAAAAAAAAAAAAAAAAAA",
                                          headers=auth())
                assert lookup.status_code == 503
                assert lookup.json()["error"]["code"] == error_codes.STATE_UNAVAILABLE
                await _websocket_refusals(router, tls_files)
                server = stack.enter_context(_own_redis(redis_port))
            else:
                os.kill(server.pid, signal.SIGSTOP)
                try:
                    await asyncio.sleep(2.5)
                finally:
                    os.kill(server.pid, signal.SIGCONT)
            back_at = time.monotonic()
            await asyncio.sleep(4.0)
            await load.stop()
            results = load.results
            _check_answers(results)
            outage_answers = [r for r in results if back_at - 2 <= r[0] <= back_at]
            assert any(status == 503 for _, status, _, _ in outage_answers)
            # Served again within a few seconds of Redis coming back.
            served = [t for t, status, _, _ in results if status == 200 and t > back_at]
            assert served
            assert served[0] - back_at < 3.0
            await _settled(client, router, server.url, prefix)
            after = await asyncio.gather(*(_stream(client, router.url) for _ in range(20)))
            assert Counter(after) == {(200, "[DONE]", ""): 20}
        log = router.log.read_text()
        assert "Traceback" not in log
        assert log.count("shared state unavailable") <= 3 * workers  # one line per 10 s
        warnings = [line for line in log.splitlines() if '"level":"warning"' in line]
        assert len(warnings) <= 16 * workers, "\n".join(warnings)  # few kinds, once per 10 s
    finally:
        _stop(router)
        stack.close()


def _run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "firstbyte", "router", *args], capture_output=True, text=True,
        timeout=60, env={**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", "")},
    )


@pytest.fixture
def password_redis() -> Iterator[RedisServer]:
    with _own_redis() as server:
        redis.Redis(host=server.host, port=server.port).config_set("requirepass", "s3cret")
        yield server


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("redis://:wrong@{host}:{port}/0", "authentication failed"),
        ("redis://{host}:{port}/0", "Redis wants a password"),
        ("redis://{host}:{unused}/0", "no answer"),
    ],
)
def test_bad_redis_url_fails_check_config_and_start_in_one_line(
    url: str, reason: str, password_redis: RedisServer, tls_files: dict[str, str],
    tmp_path: Path,
) -> None:
    redis_url = url.format(host=password_redis.host, port=password_redis.port,
                           unused=free_port())
    path = _config(tmp_path, "bad", "http://127.0.0.1:9/v1", tls_files, redis_url,
                   free_port())
    for args in (("--check-config", str(path)), ("--config", str(path))):
        started = time.monotonic()
        done = _run_cli(*args)
        assert done.returncode == 2, done
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1, done.stderr
        assert "state.redis_url" in lines[0]
        assert reason in lines[0]
        assert "wrong" not in lines[0]  # the password is not printed
        assert "serving" not in done.stdout
        assert time.monotonic() - started < 30


def test_right_password_passes_check_config(
    password_redis: RedisServer, tls_files: dict[str, str], tmp_path: Path
) -> None:
    redis_url = f"redis://:s3cret@{password_redis.host}:{password_redis.port}/0"
    path = _config(tmp_path, "good", "http://127.0.0.1:9/v1", tls_files, redis_url,
                   free_port())
    done = _run_cli("--check-config", str(path))
    assert (done.returncode, done.stdout.strip()) == (0, "OK"), done.stderr


def test_ticket_store_stops_asking_a_frozen_redis_for_a_moment() -> None:
    """aioquic calls the ticket store synchronously in every handshake: with Redis frozen
    each call stalled the whole event loop for the timeout."""
    with _own_redis() as server:
        store = RedisTicketStore(server.url, Keys("tickets:"), timeout_s=2.0)
        try:
            assert store.pop(b"nothing") is None  # connected, answered
            os.kill(server.pid, signal.SIGSTOP)
            try:
                started = time.monotonic()
                assert store.pop(b"label") is None
                assert time.monotonic() - started >= 1.9  # waited out the timeout, once
                started = time.monotonic()
                assert store.pop(b"label") is None
                assert store.pop(b"label") is None
                assert time.monotonic() - started < 1.0  # not twice more
                assert (store.failures, store.skipped) == (1, 2)
            finally:
                os.kill(server.pid, signal.SIGCONT)
            time.sleep(PAUSE_S)
            redis.Redis(host=server.host, port=server.port).set(
                Keys("tickets:").ticket(b"label"), b"not a ticket"
            )
            assert store.pop(b"label") is None  # asked again: found, failed to decode
            assert store.failures == 2
            assert store.pop(b"label") is None  # taken once (GETDEL): no pause after decode
            assert store.skipped == 2
        finally:
            store.close()


async def test_a_restarted_redis_learns_the_slots_requests_in_flight_hold(
    upstream: Upstream, tls_files: dict[str, str], tmp_path: Path
) -> None:
    """Redis restarted empty while requests are in flight: the process finds its lease gone
    at the next renewal and writes what it holds again, so the key's and backend's counts
    (every process's limits) include those requests instead of starting from 0."""
    prefix = "restart:"
    port, redis_port = free_port(), free_port()
    stack = contextlib.ExitStack()
    server = stack.enter_context(_own_redis(redis_port))
    path = _config(tmp_path, "restart", upstream.url, tls_files, server.url, port,
                   key_prefix=prefix, extra="timeout_s = 0.5\n")
    router = _start(path, port, tmp_path, "restart")
    upstream.hold = asyncio.Event()  # the requests wait upstream, their slots claimed
    try:
        await _until_listening(router)
        async with httpx.AsyncClient(verify=client_tls(tls_files), timeout=60) as client:
            held = [asyncio.create_task(_stream(client, router.url)) for _ in range(3)]
            try:
                deadline = time.monotonic() + 20
                while sorted((await _claimed(server.url, prefix)).values()) != [3, 3]:
                    assert time.monotonic() < deadline, await _claimed(server.url, prefix)
                    await asyncio.sleep(0.1)
                stack.close()  # killed: every key gone
                server = stack.enter_context(_own_redis(redis_port))
                deadline = time.monotonic() + 10
                while sorted((await _claimed(server.url, prefix)).values()) != [3, 3]:
                    assert time.monotonic() < deadline, await _claimed(server.url, prefix)
                    await asyncio.sleep(0.1)
            finally:
                upstream.hold.set()
            assert [await task for task in held] == [(200, "[DONE]", "")] * 3
            await _settled(client, router, server.url, prefix)
        assert "Traceback" not in router.log.read_text()
    finally:
        _stop(router)
        stack.close()


async def test_a_claim_cancelled_in_flight_is_undone_when_redis_answers() -> None:
    """A request whose client leaves while its admission waits on a frozen Redis: the script
    runs when Redis wakes (the command was sent), so the slot it claimed is given back by the
    reconciliation, not left to the hash's expiry."""
    with _own_redis() as server:
        shared = connect(_shared_config(server.url, "cancel:"))
        assert shared is not None
        load = shared.keys.backend_load("b0")
        try:
            await shared.start()
            os.kill(server.pid, signal.SIGSTOP)
            try:
                claim = asyncio.create_task(shared.admission.admit(Claim(b"k", "b0")))
                await asyncio.sleep(0.3)
                claim.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await claim
            finally:
                os.kill(server.pid, signal.SIGCONT)
            assert shared.admission.held[load] == 0
            deadline = time.monotonic() + 5
            while await shared.redis.hget(load, shared.process) != b"1":  # it ran on waking
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            while not await shared.admission.reconcile(1.0):  # the housekeeping tick's call
                assert time.monotonic() < deadline
            assert await shared.redis.hgetall(load) == {}
        finally:
            await shared.aclose()


async def test_a_request_cancelled_during_admission_leaves_no_routing_record() -> None:
    """The placement stage cancelled while its claim waits on a frozen Redis (the task of a
    request whose client left): this process's count of requests on the backend goes back."""
    with _own_redis() as server:
        state = RouterState(_shared_config(server.url, "placed:"))
        ctx = RequestContext("POST", "/v1/chat/completions", {}, body=json.dumps(BODY).encode())
        assert admit_body(ctx, 1 << 20, force_stream=False) is CONTINUE
        os.kill(server.pid, signal.SIGSTOP)
        try:
            placing = asyncio.create_task(place(state, ctx))
            await asyncio.sleep(0.3)
            assert sum(b.in_flight for b in state.routing.tracker.backends.values()) == 1
            placing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await placing
            assert sum(b.in_flight for b in state.routing.tracker.backends.values()) == 0
        finally:
            os.kill(server.pid, signal.SIGCONT)
            await state.aclose()


async def test_a_stream_read_on_another_process_goes_on_through_a_redis_freeze(
    upstream: Upstream, tls_files: dict[str, str], tmp_path: Path
) -> None:
    """Process B follows a stream process A produces, through Redis; Redis freezes for 3.5 s
    (past ``state.timeout_s`` and B's check of A's lease every 2 s, within the 6 s lease):
    B's reader waits instead of failing, and gets every event, in order, to ``[DONE]``, once
    Redis wakes."""
    upstream.delay_s = 0.06  # 100 tokens: ~6 s, the freeze falls inside the stream
    body = {**BODY, "max_tokens": 100}
    with _own_redis() as server:
        routers: list[RouterProcess] = []
        try:
            for name in ("a", "b"):
                port = free_port()
                path = _config(tmp_path, name, upstream.url, tls_files, server.url, port,
                               key_prefix="follow:", extra="timeout_s = 0.5\n")
                # A lease longer than the freeze: the producer is not declared lost.
                path.write_text(path.read_text().replace("lease_s = 1.0", "lease_s = 6.0"))
                routers.append(_start(path, port, tmp_path, name))
            for router in routers:
                await _until_listening(router)
            a, b = routers
            async with httpx.AsyncClient(verify=client_tls(tls_files), timeout=60) as client:
                stream_id, first = await _first_events(client, a.url, body, 3)
                reader = asyncio.create_task(_follow(client, b.url, stream_id, after=3))
                await asyncio.sleep(0.5)
                os.kill(server.pid, signal.SIGSTOP)
                try:
                    await asyncio.sleep(3.5)
                finally:
                    os.kill(server.pid, signal.SIGCONT)
                rest = await asyncio.wait_for(reader, 30)
            seqs = first + [seq for seq, _ in rest]
            assert seqs == list(range(1, len(seqs) + 1))
            assert rest[-1][1] == "[DONE]"
            assert len(seqs) > 100  # every token (a few events besides)
            for router in routers:
                assert "Traceback" not in router.log.read_text()
        finally:
            for router in routers:
                _stop(router)


async def _first_events(
    client: httpx.AsyncClient, url: str, body: dict[str, object], n: int
) -> tuple[str, list[int]]:
    """Start a stream on ``url``, read the sequence numbers of its first ``n`` events, leave."""
    seqs: list[int] = []
    async with client.stream("POST", url + "/v1/chat/completions", json=body,
                             headers=auth()) as response:
        assert response.status_code == 200
        stream_id = response.headers["x-firstbyte-stream"]
        async for line in response.aiter_lines():
            if line.startswith("id: "):
                seqs.append(int(line[4:]))
                if len(seqs) == n:
                    break
    return stream_id, seqs


async def _follow(
    client: httpx.AsyncClient, url: str, stream_id: str, after: int
) -> list[tuple[int, str]]:
    """``(seq, data)`` of every event of the stream after ``after``, read over SSE."""
    events: list[tuple[int, str]] = []
    seq = 0
    headers = {**auth(), "last-event-id": str(after)}
    async with client.stream("GET", f"{url}/v1/streams/{stream_id}",
                             headers=headers) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("id: "):
                seq = int(line[4:])
            elif line.startswith("data: "):
                events.append((seq, line[6:]))
    return events


async def test_redis_up_on_metrics_follows_a_frozen_redis(upstream: Upstream) -> None:
    """``firstbyte_router_redis_up`` is 1 while lease renewals reach Redis, 0 while it is
    frozen past ``state.timeout_s``, and 1 again once it answers."""
    from firstbyte.router.serve import running_router
    from tests.router.conftest import router_config

    async def redis_up(client: httpx.AsyncClient, base: str) -> str:
        text = (await client.get(base + "/metrics", headers=auth())).text
        return next(line.split()[1] for line in text.splitlines()
                    if line.startswith("firstbyte_router_redis_up "))

    async def until(client: httpx.AsyncClient, base: str, value: str) -> None:
        deadline = time.monotonic() + 15
        while (seen := await redis_up(client, base)) != value:
            assert time.monotonic() < deadline, f"redis_up stayed {seen}, not {value}"
            await asyncio.sleep(0.2)

    with _own_redis() as server:
        config = router_config([upstream.url], None, state={
            "redis_url": server.url, "lease_s": 1.5, "timeout_s": 0.5, "key_prefix": "up:"})
        async with running_router(config) as router, httpx.AsyncClient(timeout=10) as client:
            await until(client, router.base_url, "1")
            os.kill(server.pid, signal.SIGSTOP)
            try:
                await until(client, router.base_url, "0")
            finally:
                os.kill(server.pid, signal.SIGCONT)
            await until(client, router.base_url, "1")


async def _healthz(client: httpx.AsyncClient, router: RouterProcess) -> tuple[int, str, str]:
    """``/healthz``'s status, text and Retry-After."""
    answer = await client.get(router.url + "/healthz")
    return answer.status_code, answer.text, answer.headers.get("retry-after", "")


async def _until_healthz(client: httpx.AsyncClient, router: RouterProcess,
                         status: int) -> tuple[int, str, str]:
    """Ask ``/healthz`` every 0.1 s until it answers ``status`` (15 s at most)."""
    deadline = time.monotonic() + 15
    while (seen := await _healthz(client, router))[0] != status:
        assert time.monotonic() < deadline, f"/healthz stayed {seen}, not {status}"
        await asyncio.sleep(0.1)
    return seen


@pytest.mark.parametrize("outage", ["kill", "freeze"])
async def test_healthz_says_state_unavailable_while_redis_is_away(
    outage: str, sim: SimServer, tls_files: dict[str, str], tmp_path: Path
) -> None:
    """A router process whose Redis is killed, or frozen past ``state.timeout_s``: once two
    lease renewals in a row failed, ``/healthz`` answers 503 ``state_unavailable`` with
    ``Retry-After`` (a balancer, and the SDK's region probe, send users elsewhere) and
    ``/v1/edge/status`` says unhealthy (peers stop forwarding here), while a stream request
    still gets its own ``503 state_unavailable``. Redis started again on its port (empty), or
    woken: ``/healthz`` is 200 ``ok`` again without a restart, and streams are served.

    The key has a cap (``LIMITS``), so its requests wait for Redis and each gets its 503; one
    of a key without (the default) may still be served from a backend slot the process holds
    spare (docs/router.md), until those are used up."""
    port, redis_port = free_port(), free_port()
    stack = contextlib.ExitStack()
    server = stack.enter_context(_own_redis(redis_port))
    path = _config(tmp_path, outage, sim.url, tls_files, server.url, port,
                   key_prefix="healthz:", extra="timeout_s = 0.5\n" + LIMITS)
    router = _start(path, port, tmp_path, outage)
    try:
        await _until_listening(router)
        async with httpx.AsyncClient(verify=client_tls(tls_files), timeout=10) as client:
            assert await _until_healthz(client, router, 200) == (200, "ok\n", "")
            assert await _stream(client, router.url) == (200, "[DONE]", "")
            if outage == "kill":
                stack.close()
            else:
                os.kill(server.pid, signal.SIGSTOP)
            try:
                assert await _until_healthz(client, router, 503) == (
                    503, f"{error_codes.STATE_UNAVAILABLE}\n", "1")
                assert await _stream(client, router.url) == (
                    503, error_codes.STATE_UNAVAILABLE, "1")
                public = (await client.get(router.url + "/v1/edge/status")).json()
                assert public["healthy"] is False
                status = (await client.get(router.url + "/v1/edge/status", headers=auth())).json()
                assert status["healthy"] is False
                assert [m["healthy"] for m in status["models"]] == [False]
                assert (await _healthz(client, router))[0] == 503  # it stays so
            finally:
                if outage == "kill":
                    server = stack.enter_context(_own_redis(redis_port))
                else:
                    os.kill(server.pid, signal.SIGCONT)
            assert await _until_healthz(client, router, 200) == (200, "ok\n", "")
            status = (await client.get(router.url + "/v1/edge/status", headers=auth())).json()
            assert status["healthy"] is True
            assert [m["healthy"] for m in status["models"]] == [True]
            assert await _stream(client, router.url) == (200, "[DONE]", "")
        log = router.log.read_text()
        assert "Traceback" not in log
        assert log.count("/healthz answers 503 state_unavailable") == 1, log
    finally:
        _stop(router)
        stack.close()
