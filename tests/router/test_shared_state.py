"""Many router processes, one region: state shared through a real Redis-compatible server.

Every test runs real ``firstbyte router`` processes (TLS, on loopback) and a real
``valkey-server``: two routers on two ports sharing one Redis stand for two processes behind a
load balancer (the store cannot tell the difference, and the test chooses which process
answers); one test runs ``--workers 2`` on one port to show SO_REUSEPORT really serves from two
processes; one kills the process producing a stream mid-stream; two drain a process (SIGTERM)
and read its streams from the other.
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
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from websockets.asyncio.client import connect as ws_connect

from firstbyte.benchmarks.ports import free_port
from firstbyte.benchmarks.redis_server import RedisServer
from firstbyte.client_sdk import AsyncClient
from firstbyte.client_sdk.errors import APIError, StreamLostError
from firstbyte.protocol import error_codes
from firstbyte.protocol.sse import SSEDecoder
from firstbyte.router.sim.server import SimServer, sim_server
from tests.router.conftest import API_KEY, OTHER_KEY, auth, client_tls
from tests.router.h3client import h3_request
from tests.router.redis_fixture import redis_server  # noqa: F401 (a fixture)

pytestmark = pytest.mark.slow

BODY = {
    "model": "sim-llama-7b",
    "messages": [{"role": "user", "content": "Share me."}],
    "stream": True,
    "max_tokens": 80,
    "seed": 5,
}
LEASE_S = 1.0
"""Short, so a dead process is noticed in ~1.3 s: the readers check every lease_s / 3."""


@dataclass
class RouterProcess:
    process: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"


def _config(tmp: Path, name: str, upstream: str, tls: dict[str, str], redis_url: str,
            port: int, workers: int = 1, *, upstreams: str | None = None,
            key_prefix: str = "firstbyte:", extra: str = "") -> Path:
    """A router's TOML: one upstream (or the ``[[upstreams]]`` tables in ``upstreams``), its
    state under ``key_prefix`` in Redis, and ``extra`` sections at the end."""
    path = tmp / f"{name}.toml"
    tables = upstreams if upstreams is not None else f'[[upstreams]]\nurl = "{upstream}"'
    path.write_text(
        f"""
region = "shared-1"
{tables}
[listen]
host = "127.0.0.1"
port = {port}
certfile = "{tls['certfile']}"
keyfile = "{tls['keyfile']}"
workers = {workers}
drain_timeout_s = 5.0
[auth]
api_keys = ["{API_KEY}", "{OTHER_KEY}"]
[streams]
resume_grace_s = 10.0
[state]
redis_url = "{redis_url}"
lease_s = {LEASE_S}
key_prefix = "{key_prefix}"
{extra}"""
    )
    return path


def _start(config: Path, port: int, tmp: Path, name: str, workers: int = 1) -> RouterProcess:
    log = tmp / f"{name}.log"
    process = subprocess.Popen(
        [sys.executable, "-m", "firstbyte", "router", "--config", str(config)],
        stdout=log.open("wb"),  # the log lines
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", "")},
        start_new_session=True,
    )
    return RouterProcess(process, port, log)


async def _until_listening(router: RouterProcess, workers: int = 1) -> None:
    deadline = time.monotonic() + 30
    while router.log.read_text().count(" serving https://") < workers:
        assert router.process.poll() is None, router.log.read_text()
        assert time.monotonic() < deadline, router.log.read_text()
        await asyncio.sleep(0.05)


def _stop(router: RouterProcess) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(router.process.pid, signal.SIGKILL)
    router.process.wait()


@pytest.fixture
async def sim() -> AsyncIterator[SimServer]:
    # ~10 ms per token: an 80-token stream is still running while a reader moves over.
    async with sim_server("h100-7b") as server:
        yield server


@contextlib.asynccontextmanager
async def running_pair(
    tmp: Path, tls: dict[str, str], redis_url: str, upstream: str, *, key_prefix: str,
    extra: str = "", upstreams: str | None = None,
) -> AsyncIterator[tuple[RouterProcess, RouterProcess]]:
    """Two router processes (A, B) on two ports sharing one Redis (see :func:`_config`)."""
    routers = []
    try:
        for name in ("a", "b"):
            port = free_port()
            config = _config(tmp, name, upstream, tls, redis_url, port, upstreams=upstreams,
                             key_prefix=key_prefix, extra=extra)
            routers.append(_start(config, port, tmp, name))
        for router in routers:
            await _until_listening(router)
        yield routers[0], routers[1]
    finally:
        for router in routers:
            _stop(router)


@pytest.fixture
async def pair(
    sim: SimServer, redis_server: RedisServer, tls_files: dict[str, str], tmp_path: Path  # noqa: F811
) -> AsyncIterator[tuple[RouterProcess, RouterProcess]]:
    """Two router processes (A, B) on two ports, sharing one Redis."""
    async with running_pair(tmp_path, tls_files, redis_server.url, sim.url,
                            key_prefix="firstbyte:") as routers:
        yield routers


@pytest.fixture
async def client(tls_files: dict[str, str]) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(verify=client_tls(tls_files), timeout=20) as http:
        yield http


def _events(raw: bytes, decoder: SSEDecoder) -> list[tuple[int, str]]:
    return [(int(e.id or 0), e.data) for e in decoder.receive_data(raw)]


async def _start_sse(client: httpx.AsyncClient, url: str, n: int,
                     body: dict[str, Any] = BODY) -> tuple[str, list[tuple[int, str]]]:
    """Start a stream on ``url``, read its first ``n`` events, drop the connection."""
    decoder = SSEDecoder()
    seen: list[tuple[int, str]] = []
    async with client.stream("POST", url + "/v1/chat/completions", json=body, headers=auth()) as r:
        assert r.status_code == 200
        stream_id = r.headers["x-firstbyte-stream"]
        async for piece in r.aiter_raw():
            seen += _events(piece, decoder)
            if len(seen) >= n:
                break
    return stream_id, seen[:n]


async def _read_sse(client: httpx.AsyncClient, url: str, stream_id: str, after: int,
                    key: str = API_KEY) -> list[tuple[int, str]]:
    decoder = SSEDecoder()
    seen: list[tuple[int, str]] = []
    headers = {**auth(key), "last-event-id": str(after)}
    async with client.stream("GET", f"{url}/v1/streams/{stream_id}", headers=headers) as r:
        assert r.status_code == 200
        async for piece in r.aiter_raw():
            seen += _events(piece, decoder)
    return seen


def _content(events: list[tuple[int, str]]) -> str:
    text = ""
    for _, data in events:
        if data != "[DONE]":
            for choice in json.loads(data).get("choices", []):
                text += (choice.get("delta") or {}).get("content") or ""
    return text


async def test_sse_resume_on_another_process(
    pair: tuple[RouterProcess, RouterProcess], client: httpx.AsyncClient
) -> None:
    a, b = pair
    stream_id, first = await _start_sse(client, a.url, 5)
    rest = await _read_sse(client, b.url, stream_id, after=5)
    seqs = [seq for seq, _ in first + rest]
    assert seqs == list(range(1, len(seqs) + 1))  # every event exactly once, in order
    assert rest[-1][1] == "[DONE]"
    # The same stream read whole from B (finished by now) and from A agree byte for byte.
    assert await _read_sse(client, b.url, stream_id, after=0) == first + rest
    assert await _read_sse(client, a.url, stream_id, after=0) == first + rest
    assert len(_content(first + rest)) > 0


async def test_stream_is_bound_to_its_key_on_every_process(
    pair: tuple[RouterProcess, RouterProcess], client: httpx.AsyncClient
) -> None:
    a, b = pair
    stream_id, _ = await _start_sse(client, a.url, 2)
    for url in (a.url, b.url):
        foreign = await client.get(f"{url}/v1/streams/{stream_id}/poll?wait=0",
                                   headers=auth(OTHER_KEY))
        assert foreign.status_code == 404
        assert foreign.json()["error"]["code"] == error_codes.STREAM_NOT_FOUND
    unknown = await client.get(f"{b.url}/v1/streams/AAAAAAAAAAAAAAAAAAAAAA/poll?wait=0",
                               headers=auth())
    assert unknown.status_code == 404
    assert unknown.json() == foreign.json()  # unknown and foreign look the same


async def test_long_poll_on_another_process(
    pair: tuple[RouterProcess, RouterProcess], client: httpx.AsyncClient
) -> None:
    a, b = pair
    started = await client.post(a.url + "/v1/streams", json=BODY, headers=auth())
    assert started.status_code == 201
    stream_id = started.json()["stream"]
    after, seqs, done = 0, [], False
    for _ in range(200):
        batch = (await client.get(f"{b.url}/v1/streams/{stream_id}/poll?after={after}&wait=5",
                                  headers=auth())).json()
        seqs += [e["seq"] for e in batch["events"]]
        after = batch["next"]
        if batch["done"]:
            done = True
            break
    assert done
    assert seqs == list(range(1, len(seqs) + 1))
    assert len(seqs) > 10


async def test_websocket_resume_on_another_process(
    pair: tuple[RouterProcess, RouterProcess], tls_files: dict[str, str]
) -> None:
    a, b = pair
    ssl_context = client_tls(tls_files)
    wss = lambda router: router.url.replace("https://", "wss://") + "/v1/ws"  # noqa: E731
    first: list[int] = []
    async with ws_connect(wss(a), ssl=ssl_context, additional_headers=auth()) as ws:
        await ws.send(json.dumps({"type": "request", "body": BODY}))
        stream_id = json.loads(await ws.recv())["stream"]
        while len(first) < 4:
            message = json.loads(await ws.recv())
            assert message["type"] == "event"
            first.append(message["seq"])
    rest: list[int] = []
    async with ws_connect(wss(b), ssl=ssl_context, additional_headers=auth()) as ws:
        await ws.send(json.dumps({"type": "resume", "stream": stream_id, "after": first[-1]}))
        assert json.loads(await ws.recv()) == {"type": "start", "stream": stream_id}
        while True:
            message = json.loads(await ws.recv())
            rest.append(message["seq"])
            if message["type"] == "done":
                break
            assert message["type"] == "event"
    seqs = first + rest
    assert seqs == list(range(1, len(seqs) + 1))


async def test_a_tokens_subject_reads_only_its_own_streams_on_every_process(
    pair: tuple[RouterProcess, RouterProcess], client: httpx.AsyncClient,
    tls_files: dict[str, str],
) -> None:
    a, b = pair

    async def mint(router: RouterProcess, subject: str) -> str:
        # No shared token_secret here: a token is valid on the process that minted it.
        answer = await client.post(router.url + "/v1/edge/tokens", headers=auth(),
                                   json={"subject": subject})
        assert answer.status_code == 200, answer.text
        token: str = answer.json()["token"]
        return token

    started = await client.post(a.url + "/v1/streams", json=BODY,
                                headers=auth(await mint(a, "alice")))
    assert started.status_code == 201
    stream_id = started.json()["stream"]
    alice_b, bob_b = await mint(b, "alice"), await mint(b, "bob")
    # On B the stream is one of A's, found through Redis with its subject.
    mine = await client.get(f"{b.url}/v1/streams/{stream_id}/poll?wait=0",
                            headers=auth(alice_b))
    theirs = await client.get(f"{b.url}/v1/streams/{stream_id}/poll?wait=0",
                              headers=auth(bob_b))
    assert mine.status_code == 200
    assert theirs.status_code == 404
    assert theirs.json()["error"]["code"] == error_codes.STREAM_NOT_FOUND
    wss = b.url.replace("https://", "wss://") + "/v1/ws"
    protocols = ["firstbyte.v1", f"firstbyte.token.{bob_b}"]
    async with ws_connect(wss, ssl=client_tls(tls_files), subprotocols=protocols) as ws:  # type: ignore[arg-type]
        await ws.send(json.dumps({"type": "resume", "stream": stream_id, "after": 0}))
        refused = json.loads(await ws.recv())
    assert (refused["type"], refused["status"]) == ("error", 404)
    assert refused["error"]["code"] == error_codes.STREAM_NOT_FOUND


async def test_zero_rtt_ticket_from_one_process_accepted_once_by_another(
    pair: tuple[RouterProcess, RouterProcess], tls_files: dict[str, str]
) -> None:
    a, b = pair
    cafile = tls_files["cafile"]
    tickets: list[Any] = []
    first = await h3_request(a.port, "GET", "/healthz", cafile=cafile, tickets=tickets)
    assert first.status == 200
    assert tickets, "router A issued no session ticket"
    ticket = tickets[-1]
    resumed = await h3_request(b.port, "GET", "/healthz", cafile=cafile, ticket=ticket)
    assert resumed.status == 200
    assert resumed.session_resumed
    assert resumed.early_data_accepted  # 0-RTT accepted by the process that did not issue it
    replayed = await h3_request(a.port, "GET", "/healthz", cafile=cafile, ticket=ticket)
    assert replayed.status == 200  # served, after a full handshake
    assert not replayed.session_resumed  # the ticket was single-use, across processes
    assert not replayed.early_data_accepted


async def test_killed_process_mid_stream_ends_readers_elsewhere_with_stream_lost(
    pair: tuple[RouterProcess, RouterProcess], client: httpx.AsyncClient
) -> None:
    a, b = pair
    body = {**BODY, "max_tokens": 3000}  # ~30 s: still running when A dies
    stream_id, first = await _start_sse(client, a.url, 3, body)
    reader = asyncio.ensure_future(_read_sse(client, b.url, stream_id, after=3))
    await asyncio.sleep(0.3)
    assert not reader.done()
    os.killpg(a.process.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    rest = await asyncio.wait_for(reader, 10)
    waited_s = time.monotonic() - killed_at
    assert waited_s < LEASE_S + 3  # the lease lapsed, readers check every lease_s / 3
    assert rest[-1][1] == "[DONE]"
    error = json.loads(rest[-2][1])["error"]
    assert error["code"] == error_codes.STREAM_LOST
    seqs = [seq for seq, _ in first + rest]
    assert seqs == list(range(1, len(seqs) + 1))  # what A produced, then the error, then DONE


async def _wait_for_pid_of(redis_url: str, stream_id: str) -> int:
    meta = redis.Redis.from_url(redis_url).hget(f"firstbyte:m:{stream_id}", "proc")
    assert meta is not None
    return int(meta.split(b"-")[0])


@pytest.fixture
async def workers(
    sim: SimServer, redis_server: RedisServer, tls_files: dict[str, str], tmp_path: Path  # noqa: F811
) -> AsyncIterator[RouterProcess]:
    """``firstbyte router --workers 2`` (a supervisor and two workers) on one port."""
    port = free_port()
    config = _config(tmp_path, "w", sim.url, tls_files, redis_server.url, port, workers=2)
    router = _start(config, port, tmp_path, "w")
    try:
        await _until_listening(router, workers=2)
        yield router
    finally:
        _stop(router)


async def test_workers_share_one_port_and_sdk_raises_stream_lost_error_with_delivered_text(
    workers: RouterProcess, redis_server: RedisServer, tls_files: dict[str, str]  # noqa: F811
) -> None:
    router = workers
    url = router.url
    # Two worker processes serve the port: streams from several connections are produced
    # by two different pids (the kernel hashes each connection's 4-tuple).
    pids = set()
    for _ in range(40):
        async with httpx.AsyncClient(verify=client_tls(tls_files), timeout=20) as fresh:
            started = await fresh.post(url + "/v1/streams", json={**BODY, "max_tokens": 2},
                                       headers=auth())
        pids.add(await _wait_for_pid_of(redis_server.url, started.json()["stream"]))
        if len(pids) == 2:
            break
    assert len(pids) == 2
    assert router.process.pid not in pids  # the supervisor serves nothing itself

    delivered: list[str] = []

    async def read_and_kill_the_producer() -> None:
        async with AsyncClient(base_url=url + "/v1", api_key=API_KEY, transport="sse",
                               http="1.1", ca_file=tls_files["cafile"], max_resumes=20,
                               resume_backoff_s=0.2) as sdk, sdk.stream(
            # seed 1906: the sim's longest answer to this prompt (256 tokens, ~2.6 s; with no
            # seed it is 107, which a loaded machine's client could read to the end before
            # the kill, and no loss to raise)
            model="sim-llama-7b", max_tokens=3000, seed=1906,
            messages=[{"role": "user", "content": "Lose me."}],
        ) as s:
            async for delta in s:
                delivered.append(delta.text or "")
                if len(delivered) == 10:  # kill the worker producing this stream
                    owner = await _wait_for_pid_of(redis_server.url, s.stream_id or "")
                    os.kill(owner, signal.SIGKILL)

    with pytest.raises(StreamLostError) as raised:
        await read_and_kill_the_producer()
    lost = raised.value
    assert lost.delivered_text == "".join(delivered)  # what came before the loss
    assert len(delivered) >= 10
    assert lost.stream_id
    assert lost.last_seq >= 10
    assert isinstance(lost.__cause__, APIError)
    assert lost.__cause__.code == error_codes.STREAM_LOST  # the router's error event


async def test_drained_process_streams_stay_readable_from_another(
    pair: tuple[RouterProcess, RouterProcess], client: httpx.AsyncClient
) -> None:
    a, b = pair
    finishing = {**BODY, "max_tokens": 150}  # ~1.5 s: finishes within the drain (5 s)
    stream_id, first = await _start_sse(client, a.url, 3, finishing)
    a.process.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(a.process.wait, 30) == 0
    whole = await _read_sse(client, b.url, stream_id, after=0)
    assert whole[:3] == first
    assert whole[-1][1] == "[DONE]"
    assert "error" not in whole[-2][1]
    assert [seq for seq, _ in whole] == list(range(1, len(whole) + 1))


async def test_workers_drain_on_sigterm_and_the_supervisor_exits_0(
    workers: RouterProcess, client: httpx.AsyncClient
) -> None:
    await _start_sse(client, workers.url, 3, {**BODY, "max_tokens": 100})  # in flight at SIGTERM
    workers.process.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(workers.process.wait, 30) == 0
    lines = [json.loads(line) for line in workers.log.read_text().splitlines()
             if line.startswith("{")]
    # Each worker's lines say which worker wrote them.
    assert sorted(line.get("worker") for line in lines
                  if line["msg"].startswith("draining: no new work")) == [0, 1]


async def test_sighup_to_the_supervisor_reloads_every_worker(
    workers: RouterProcess, tls_files: dict[str, str], tmp_path: Path
) -> None:
    config = tmp_path / "w.toml"
    added = "sk-added-to-every-worker"
    config.write_text(config.read_text().replace(f'"{OTHER_KEY}"]', f'"{OTHER_KEY}", "{added}"]'))
    workers.process.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 15
    while workers.log.read_text().count("config reloaded: auth.api_keys changed") < 2:
        assert time.monotonic() < deadline, workers.log.read_text()[-3000:]
        await asyncio.sleep(0.05)
    for _ in range(8):  # new connections: the kernel spreads them over both workers
        async with httpx.AsyncClient(verify=client_tls(tls_files), timeout=20) as fresh:
            answer = await fresh.post(workers.url + "/v1/chat/completions",
                                      json={**BODY, "stream": False, "max_tokens": 2},
                                      headers=auth(added))
        assert answer.status_code == 200, answer.text
    assert workers.process.poll() is None


async def test_a_killed_worker_counts_as_a_restart_of_its_slot_on_metrics(
    workers: RouterProcess, tls_files: dict[str, str]
) -> None:
    """``firstbyte_router_worker_restarts_total{worker}``: the new process in a killed
    worker's slot says 1, the other slot still 0, whichever worker a scrape reaches."""
    supervisor = workers.process.pid
    children_file = Path(f"/proc/{supervisor}/task/{supervisor}/children")
    children = (await asyncio.to_thread(children_file.read_text)).split()
    assert len(children) == 2
    os.kill(int(children[0]), signal.SIGKILL)
    await _until_listening(workers, workers=3)  # the supervisor started another
    seen: dict[str, str] = {}
    for _ in range(60):  # fresh connections: the kernel spreads them over both workers
        async with httpx.AsyncClient(verify=client_tls(tls_files), timeout=20) as fresh:
            text = (await fresh.get(workers.url + "/metrics", headers=auth())).text
        for line in text.splitlines():
            if line.startswith("firstbyte_router_worker_restarts_total{"):
                label, value = line.split()
                seen[label] = value
        if len(seen) == 2:
            break
    assert sorted(seen.values()) == ["0", "1"], seen
