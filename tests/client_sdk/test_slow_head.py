"""A response head slower than the idle timeout, on the only region: real ``firstbyte sim``
and ``firstbyte router`` processes.

The router answers a stream's request once its upstream answered (SSE's head, long-poll's
``201``, WebSocket's ``started``), so an upstream slow to answer (a queue, a long prefill)
leaves the SDK with no stream id when its idle watchdog fires. Sending the request again then
ran the model again for the same call (one run per stall, each cancelled or not, and on
long-poll both ran to the end). The router still answers, so it holds the request: the SDK
waits for that answer, and every token arrives once from one upstream request.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from firstbyte.benchmarks.ports import free_port
from firstbyte.client_sdk.client import AsyncClient
from tests.cli import FIRSTBYTE
from tests.client_sdk.conftest import ROUTER_KEY
from tests.client_sdk.test_client import MESSAGES
from tests.client_sdk.test_stream_lost import start_router

pytestmark = pytest.mark.slow

HEAD_DELAY_S = 1.5
"""How late the sim answers every request (its ``delay`` fault): past the SDK's idle timeout."""
IDLE_S = 1.0
TOKENS = 12
TRANSPORTS = [("sse", "1.1"), ("sse", "2"), ("longpoll", "2"), ("websocket", "1.1")]


@contextlib.asynccontextmanager
async def sim_process(*faults: str) -> AsyncIterator[str]:
    """``firstbyte sim`` (profile ``instant``) as a process; yields its base URL once it answers."""
    port = free_port()
    process = await asyncio.create_subprocess_exec(
        *FIRSTBYTE, "sim", "--port", str(port), "--profile", "instant", "--seed", "7",
        *[arg for fault in faults for arg in ("--fault", fault)],
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient() as client:
            for _ in range(400):
                try:
                    if (await client.get(f"{url}/health")).status_code == 200:
                        break
                except httpx.HTTPError:
                    assert process.returncode is None, await process.stderr.read()  # type: ignore[union-attr]
                    await asyncio.sleep(0.05)
            else:
                raise TimeoutError("the sim did not come up")
        yield url
    finally:
        process.terminate()
        await process.wait()


async def sim_requests(sim: str) -> float:
    """Requests the sim's engine took so far (``vllm:request_success_total`` over every
    finish reason, aborts included), once none is running or waiting."""
    async with httpx.AsyncClient() as client:
        while True:
            text = (await client.get(f"{sim}/metrics")).text
            samples = [line.rsplit(" ", 1) for line in text.splitlines()
                       if line.startswith("vllm:")]
            busy = sum(float(v) for name, v in samples
                       if name.startswith(("vllm:num_requests_running",
                                           "vllm:num_requests_waiting")))
            if not busy:
                return sum(float(v) for name, v in samples
                           if name.startswith("vllm:request_success_total"))
            await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def router_before(
    sim: str, region: str, tmp_path: Path, tls_files: tuple[str, str, str]
) -> AsyncIterator[int]:
    """``firstbyte router`` (TLS, one key) in front of ``sim`` as a process; yields its port."""
    ca_file, cert_file, key_file = tls_files
    port = free_port(udp=True)
    config = tmp_path / "router.toml"
    config.write_text(
        f'region = "{region}"\n[[upstreams]]\nurl = "{sim}"\n'
        f'[listen]\nport = {port}\ncertfile = "{cert_file}"\nkeyfile = "{key_file}"\n'
        f'[auth]\napi_keys = ["{ROUTER_KEY}"]\n'
    )
    router = await start_router(config, port, ca_file)
    try:
        yield port
    finally:
        router.terminate()
        await router.wait()


async def sim_answer(sim: str, tokens: int) -> str:
    """The text the sim answers the tests' request with, asked directly (one engine request)."""
    async with httpx.AsyncClient(timeout=10) as direct:
        answer = await direct.post(f"{sim}/v1/chat/completions", json={
            "model": "sim-instant", "messages": MESSAGES, "max_tokens": tokens, "seed": 11})
    text: str = answer.json()["choices"][0]["message"]["content"]
    return text


async def test_a_head_later_than_the_idle_timeout_is_waited_for_not_sent_again(
    tmp_path: Path, tls_files: tuple[str, str, str]
) -> None:
    ca_file = tls_files[0]
    async with (
        sim_process(f"delay:ms={HEAD_DELAY_S * 1000:g}") as sim,
        router_before(sim, "slow-head", tmp_path, tls_files) as port,
    ):
        # What the sim answers, asked directly (one engine request, counted below).
        expected = await sim_answer(sim, TOKENS)
        outcomes: dict[str, tuple[float, str, str | None]] = {}
        for transport, http in TRANSPORTS:
            before = await sim_requests(sim)
            text, error = "", None
            async with AsyncClient(
                f"https://localhost:{port}/v1", ROUTER_KEY, ca_file=ca_file,
                transport=transport, http=http,  # type: ignore[arg-type]
                idle_timeout_s=IDLE_S, stall_retries=3,
            ) as client:
                try:
                    async with client.stream(model="sim-instant", messages=MESSAGES,
                                             max_tokens=TOKENS, seed=11) as stream:
                        async for delta in stream:
                            text += delta.text
                except Exception as exc:  # reported with the count below
                    error = f"{type(exc).__name__}: {exc}"
            # An attempt abandoned during the sim's delay reaches its engine at the end
            # of that delay: count once every attempt would have.
            await asyncio.sleep(HEAD_DELAY_S + 0.3)
            outcomes[f"{transport} http/{http}"] = (
                await sim_requests(sim) - before, text, error)
    assert outcomes == {
        f"{transport} http/{http}": (1.0, expected, None) for transport, http in TRANSPORTS
    }


async def test_the_slow_head_fixture_sim_delays_every_request() -> None:
    # The premise of the test above: the sim's delay fault holds back every request's head.
    async with sim_process("delay:ms=600") as sim, httpx.AsyncClient(timeout=10) as client:
        loop = asyncio.get_running_loop()
        for _ in range(2):
            started = loop.time()
            async with client.stream("POST", f"{sim}/v1/chat/completions", json={
                "model": "sim-instant", "messages": MESSAGES, "max_tokens": 2,
                "stream": True}) as response:
                assert response.status_code == 200
                assert loop.time() - started >= 0.55
                await response.aread()
        assert await sim_requests(sim) == 2.0
