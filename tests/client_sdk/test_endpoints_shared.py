"""A Responses or Messages stream started on one router process and resumed by the SDK on
another, through a balancer: the two processes share a real valkey-server
(:mod:`tests.router.redis_fixture`), the balancer sends the SDK's first connection to A and
cuts it mid-stream, and every later connection to B. The SDK's resume reads the rest from B
with no event lost or repeated."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from firstbyte.benchmarks.redis_server import RedisServer
from firstbyte.client_sdk.client import AsyncClient
from tests.client_sdk.cutproxy import TcpCutProxy
from tests.client_sdk.test_endpoints import check_events, open_stream, read
from tests.router.conftest import API_KEY
from tests.router.formats_upstream import MODEL, running_formats_upstream
from tests.router.redis_fixture import redis_server  # noqa: F401 (a fixture)
from tests.router.test_shared_state import running_pair

WORDS = 60


class Balancer(TcpCutProxy):
    """The first connection to ``first`` (cut after ``cut_after`` bytes), the rest to ``rest``."""

    def __init__(self, first: int, rest: int, *, cut_after: int) -> None:
        super().__init__(first, cut_after=cut_after)
        self.rest = rest

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.connections:
            self.target_port = self.rest
        await super()._handle(reader, writer)


@pytest.mark.parametrize(("fmt", "transport", "http"), [
    ("messages", "sse", "2"), ("responses", "websocket", "1.1"), ("messages", "longpoll", "1.1"),
])
async def test_a_stream_cut_on_one_process_resumes_on_another(
    redis_server: RedisServer,  # noqa: F811
    tls_files: tuple[str, str, str], tmp_path: Path, fmt: str, transport: str, http: str,
) -> None:
    ca_file, cert_file, key_file = tls_files
    tls = {"cafile": ca_file, "certfile": cert_file, "keyfile": key_file}
    async with running_formats_upstream(delay_s=0.02) as up, running_pair(
        tmp_path, tls, redis_server.url, up.url, key_prefix=f"fb-sdk-{fmt}-{transport}:"
    ) as (a, b), Balancer(a.port, b.port, cut_after=6000) as balancer, AsyncClient(
        f"https://localhost:{balancer.port}/v1", API_KEY, transport=transport,  # type: ignore[arg-type]
        http=http, ca_file=ca_file, idle_timeout_s=10,
    ) as client:
        stream = open_stream(client, fmt, WORDS, model=MODEL)
        events = await read(stream)
    assert balancer.cuts_done == 1
    assert balancer.connections >= 2  # A's, cut, then B's
    check_events(fmt, stream, events, " ".join(f"w{i}" for i in range(WORDS)))
    assert stream.timings.output_chunks == WORDS
    if transport != "longpoll":
        assert stream.timings.resumes >= 1
