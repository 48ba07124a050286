"""A router that dies mid-stream and comes back (a fresh process: an empty stream store).

Every transport's resume then finds no such stream, and the SDK says so with one typed error,
:class:`StreamLostError`, carrying what was delivered (not ``NotFoundError 404``).
"""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path

import httpx
import pytest

from firstbyte.benchmarks.ports import free_port
from firstbyte.client_sdk.client import AsyncClient
from firstbyte.client_sdk.errors import StreamBrokenError, StreamLostError
from firstbyte.router.sim.server import running_sim
from tests.cli import FIRSTBYTE
from tests.client_sdk.conftest import ROUTER_KEY
from tests.client_sdk.protocol_server import expected_text, running_protocol_server
from tests.client_sdk.test_client import MESSAGES
from tests.waits import until

pytestmark = pytest.mark.slow

TRANSPORTS = [("sse", "1.1"), ("sse", "2"), ("sse", "3"), ("websocket", "1.1"),
              ("longpoll", "1.1"), ("longpoll", "2")]
BEFORE_DEATH = 5
"""Content tokens the sim sends before it stalls: the router dies during the stall."""


async def start_router(config: Path, port: int, ca_file: str) -> asyncio.subprocess.Process:
    """``firstbyte router --config`` as a process, once ``/healthz`` answers."""
    process = await asyncio.create_subprocess_exec(
        *FIRSTBYTE, "router", "--config", str(config),
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    async with httpx.AsyncClient(verify=ssl.create_default_context(cafile=ca_file)) as client:
        for _ in range(400):
            try:
                if (await client.get(f"https://localhost:{port}/healthz")).status_code == 200:
                    return process
            except httpx.HTTPError:
                assert process.returncode is None, await process.stderr.read()  # type: ignore[union-attr]
                await asyncio.sleep(0.05)
    raise TimeoutError("the router did not come up")


async def test_restarted_router_surfaces_stream_lost_on_every_transport(
    tmp_path: Path, tls_files: tuple[str, str, str]
) -> None:
    ca_file, cert_file, key_file = tls_files
    async with running_sim("instant", faults=[f"stall:after={BEFORE_DEATH}"], seed=7) as sim:
        port = free_port(udp=True)
        config = tmp_path / "router.toml"
        config.write_text(
            f'region = "lost"\n[[upstreams]]\nurl = "{sim}"\n'
            f'[listen]\nport = {port}\ncertfile = "{cert_file}"\nkeyfile = "{key_file}"\n'
            f'[auth]\napi_keys = ["{ROUTER_KEY}"]\n[limits]\nheartbeat_interval_s = 0.2\n'
        )
        router = await start_router(config, port, ca_file)
        received = {t: "" for t in TRANSPORTS}
        tokens = dict.fromkeys(TRANSPORTS, 0)
        stalled = {t: asyncio.Event() for t in TRANSPORTS}

        resumes = dict.fromkeys(TRANSPORTS, 0)

        async def read(transport: str, http: str) -> BaseException | None:
            # A dead QUIC peer says nothing: the idle watchdog finds it, then resumes.
            async with AsyncClient(
                f"https://localhost:{port}/v1", ROUTER_KEY, transport=transport,  # type: ignore[arg-type]
                http=http,  # type: ignore[arg-type]
                ca_file=ca_file, idle_timeout_s=1.5, stall_retries=20, max_resumes=60,
            ) as client:
                try:
                    async with client.stream(model="sim-instant", messages=MESSAGES,
                                             max_tokens=20) as stream:
                        async for delta in stream:
                            received[transport, http] += delta.text
                            tokens[transport, http] += delta.is_content
                            if tokens[transport, http] == BEFORE_DEATH:
                                stalled[transport, http].set()
                except StreamBrokenError as exc:
                    resumes[transport, http] = stream.timings.resumes
                    return exc
            return None

        readers = [asyncio.create_task(read(*t)) for t in TRANSPORTS]
        try:
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in stalled.values())), 20)
            router.kill()  # dies: no drain, no goodbye
            await router.wait()
            router = await start_router(config, port, ca_file)
            outcomes = await asyncio.wait_for(asyncio.gather(*readers), 60)
        finally:
            for task in readers:
                task.cancel()
            router.kill()
            await router.wait()
    for transport, outcome in zip(TRANSPORTS, outcomes, strict=True):
        assert isinstance(outcome, StreamLostError), (transport, repr(outcome))
        assert outcome.delivered_text == received[transport], transport
        assert tokens[transport] == BEFORE_DEATH, transport
        assert outcome.last_seq >= BEFORE_DEATH, transport  # the role chunk and the tokens
        assert outcome.stream_id
        # The message counts the resumes Timings counts (a long-poll's retried polls too).
        assert resumes[transport] >= 1, transport
        assert f"; resumed {resumes[transport]} times" in str(outcome), (transport, outcome)


@pytest.mark.parametrize(("transport", "http"), [("sse", "1.1"), ("sse", "2")])
async def test_a_router_gone_before_the_first_token_fails_over_to_the_next_region(
    tls_files: tuple[str, str, str], transport: str, http: str
) -> None:
    # A router killed after its stream started, before any token: every resume failed to
    # connect and the stream raised StreamBrokenError (239 of 500 in flight at a kill -9),
    # though nothing was delivered and the other region was up.
    ca_file, cert, key = tls_files
    with running_protocol_server(cert, key, api_key="test-key") as standby:
        dying = running_protocol_server(cert, key, api_key="test-key", token_interval=60.0)
        primary = dying.__enter__()
        stopped = False
        try:
            async with AsyncClient([primary.base_url, standby.base_url], "test-key",
                                   transport=transport, http=http,  # type: ignore[arg-type]
                                   ca_file=ca_file, resume_backoff_s=0.01) as client, \
                    client.stream(model="m", messages=MESSAGES, max_tokens=5) as stream:
                await until(lambda: bool(primary.app.streams), timeout_s=10)
                await asyncio.to_thread(dying.__exit__, None, None, None)
                stopped = True
                text = "".join([delta.text async for delta in stream])
        finally:
            if not stopped:
                dying.__exit__(None, None, None)
    assert text == expected_text(5)
    assert stream.timings.stream_id in standby.app.streams


async def test_a_stream_lost_before_its_first_token_is_sent_again(
    tmp_path: Path, tls_files: tuple[str, str, str]
) -> None:
    # Nothing was delivered, so a new stream repeats nothing; it used to raise
    # StreamLostError (244 of 500 streams in flight when a router was restarted).
    ca_file, cert_file, key_file = tls_files
    async with running_sim("instant", faults=["stall:after=0,ms=2000"], seed=7) as sim:
        port = free_port(udp=True)
        config = tmp_path / "router.toml"
        config.write_text(
            f'region = "lost"\n[[upstreams]]\nurl = "{sim}"\n'
            f'[listen]\nport = {port}\ncertfile = "{cert_file}"\nkeyfile = "{key_file}"\n'
            f'[auth]\napi_keys = ["{ROUTER_KEY}"]\n'
        )
        router = await start_router(config, port, ca_file)
        try:
            async with AsyncClient(f"https://localhost:{port}/v1", ROUTER_KEY, ca_file=ca_file,
                                   idle_timeout_s=5) as client, \
                    client.stream(model="sim-instant", messages=MESSAGES,
                                  max_tokens=5) as stream:
                router.kill()  # the stream started (its head came), no token yet
                await router.wait()
                router = await start_router(config, port, ca_file)
                tokens = [delta.text async for delta in stream if delta.is_content]
        finally:
            router.kill()
            await router.wait()
    assert len(tokens) == 5
    assert stream.timings.resumes >= 1
