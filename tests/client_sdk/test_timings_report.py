"""``report_timings=True``: the SDK reports each finished stream's timings to the router that
served it, and nothing else. The real stack (the sim behind the real router, a real GeoIP
database placing the client in Tokyo through a trusted proxy's ``X-Forwarded-For``); the
bytes the router received are read off the wire by a relay in between."""

from __future__ import annotations

import asyncio
import contextlib
import re
import ssl
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from firstbyte.client_sdk import AsyncClient
from firstbyte.client_sdk.timings import Timings
from firstbyte.client_sdk.timings_report import TimingsQueue, TimingsReporter, timings_record
from firstbyte.protocol import paths
from firstbyte.protocol.timings import TimingsRecord, TimingsReport
from firstbyte.router.config import parse_config
from firstbyte.router.serve import RouterEndpoints, running_router
from firstbyte.router.sim.server import running_sim
from tests.client_sdk.conftest import ROUTER_KEY
from tests.client_sdk.cutproxy import TcpCutProxy
from tests.router.geo_fixtures import TOKYO_CLIENT, write_city_mmdb
from tests.router.test_client_timings import metric

PROMPT = "Tell me about the quokka of Rottnest Island"
TTFT = "firstbyte_client_ttft_seconds"


def request_bodies(sent: bytes, path: str) -> list[bytes]:
    """The bodies of every HTTP/1.1 ``POST path`` in the bytes a client ``sent``."""
    bodies = []
    for match in re.finditer(rb"POST " + re.escape(path.encode()) + rb" HTTP/1.1\r\n", sent):
        head_end = sent.index(b"\r\n\r\n", match.end()) + 4
        head = sent[match.end():head_end].decode("latin-1").lower()
        length = re.search(r"content-length: *(\d+)", head)
        assert length is not None
        bodies.append(sent[head_end:head_end + int(length.group(1))])
    return bodies


@contextlib.asynccontextmanager
async def geo_stack(tmp_path: Path, tls_files: tuple[str, str, str] | None,
                    ) -> AsyncIterator[RouterEndpoints]:
    """The sim behind a router that believes 127.0.0.1's X-Forwarded-For and knows cities."""
    mmdb = write_city_mmdb(tmp_path / "cities.mmdb")
    listen: dict[str, Any] = {"host": "127.0.0.1", "port": 0}
    if tls_files is None:
        listen["insecure_plain_http"] = True
    else:
        listen.update(certfile=tls_files[1], keyfile=tls_files[2])
    async with running_sim("instant", seed=7) as sim_url:
        config = parse_config({
            "region": "sdk-test",
            "upstreams": [{"url": sim_url}],
            "listen": listen,
            "auth": {"api_keys": [ROUTER_KEY]},
            "geo": {"database": str(mmdb), "trusted_proxies": ["127.0.0.1/32"]},
        }, "<timings-test>")
        async with running_router(config) as endpoints:
            yield endpoints


async def scrape(router: RouterEndpoints, ca_file: str | None = None) -> str:
    verify = True if ca_file is None else ssl.create_default_context(cafile=ca_file)
    async with httpx.AsyncClient(verify=verify) as http:
        response = await http.get(router.base_url + paths.METRICS,
                                  headers={"authorization": f"Bearer {ROUTER_KEY}"})
    assert response.status_code == 200
    return response.text


async def stream_text(client: AsyncClient, prompt: str = PROMPT) -> tuple[str, str | None]:
    """The answer's text and its stream id."""
    async with client.stream(model="sim-instant", max_tokens=12,
                             messages=[{"role": "user", "content": prompt}]) as stream:
        return "".join([delta.text async for delta in stream]), stream.stream_id


async def test_the_router_receives_timings_and_never_the_prompt_or_output(
    tmp_path: Path
) -> None:
    async with geo_stack(tmp_path, None) as router, \
            TcpCutProxy(router.port, cut_after=1 << 62, cuts=0, record=True) as relay:
        client = AsyncClient(f"http://127.0.0.1:{relay.port}/v1", ROUTER_KEY,
                             report_timings=True, keepalive_interval_s=300.0)
        client.headers["x-forwarded-for"] = TOKYO_CLIENT  # as a load balancer would say
        answers = [await stream_text(client) for _ in range(3)]
        timings_seen = client.timings_reporter
        assert timings_seen is not None
        assert len(timings_seen.queue) == 3  # after the streams ended, before any flush
        await client.aclose()  # flushes
        assert (timings_seen.sent_reports, timings_seen.failed_reports) == (1, 0)

        bodies = request_bodies(bytes(relay.upstream_bytes), paths.EDGE_TIMINGS)
        assert len(bodies) == 1
        report = msgspec.json.decode(bodies[0], type=TimingsReport)
        assert len(report.records) == 3
        assert [r.stream_id for r in report.records] == [sid for _, sid in answers]
        assert [r.warm for r in report.records] == [False, True, True]
        # Only the record's own fields, and no string but the enums, region and stream ids:
        # nothing of the prompt or of the answers, in any form.
        raw = msgspec.json.decode(bodies[0])
        assert set(raw) == {"records"}
        assert {key for r in raw["records"] for key in r} <= set(TimingsRecord.__struct_fields__)
        strings = {v for r in raw["records"] for v in r.values() if isinstance(v, str)}
        assert strings == {"sse", "HTTP/1.1", "sdk-test"} | {sid for _, sid in answers}
        for text in [PROMPT, *(answer for answer, _ in answers)]:
            assert text
            assert text.encode() not in bodies[0]
        assert PROMPT.encode() in bytes(relay.upstream_bytes)  # the relay did see the prompt

        text = await scrape(router)
        cold = {"region": "sdk-test", "country": "JP", "transport": "sse", "http": "1.1"}
        assert metric(text, f"{TTFT}_count", **cold, conn="cold") == 1
        assert metric(text, f"{TTFT}_count", **cold, conn="warm") == 2
        # Joined with the router's own streams: network time for every record.
        assert metric(text, "firstbyte_client_network_seconds_count", country="JP") == 3
        assert metric(text, "firstbyte_client_timings_records_total", join="joined") == 3


@pytest.mark.parametrize(("transport", "http"), [
    ("sse", "2"), ("websocket", "1.1"), ("longpoll", "2"), ("sse", "3"),
])
async def test_every_transport_reports_in_the_background(
    tmp_path: Path, tls_files: tuple[str, str, str], transport: str, http: str
) -> None:
    ca_file = tls_files[0]
    async with geo_stack(tmp_path, tls_files) as router:
        client = AsyncClient(f"https://localhost:{router.port}/v1", ROUTER_KEY,
                             transport=transport, http=http,  # type: ignore[arg-type]
                             ca_file=ca_file, report_timings=True, report_interval_s=0.2)
        try:
            await stream_text(client)
            await stream_text(client)
            deadline = time.monotonic() + 10
            while True:  # the background flush, not aclose, sends them
                text = await scrape(router, ca_file)
                if metric(text, f"{TTFT}_count") == 2 or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.1)
            rejected = metric(text, "firstbyte_client_timings_rejected_total")
            assert rejected == 0, text
            assert metric(text, f"{TTFT}_count", transport=transport, http=http,
                          country="unknown") == 2  # 127.0.0.1 without X-Forwarded-For
            assert metric(text, "firstbyte_client_network_seconds_count") == 2
        finally:
            await client.aclose()


def timings(**fields: Any) -> Timings:
    base: dict[str, Any] = {"transport": "sse", "http_version": "HTTP/2", "region": "r",
                            "stream_id": "s", "request_sent_ms": 1.0, "first_byte_ms": 2.0,
                            "first_token_ms": 3.0, "last_token_ms": 4.0}
    return Timings(**{**base, **fields})


def test_only_complete_plausible_timings_from_a_firstbyte_router_become_records() -> None:
    record = timings_record(timings(inter_token_ms=[1.0], output_chunks=9, started_at=1e9))
    assert record is not None
    assert set(msgspec.structs.asdict(record)) == set(TimingsRecord.__struct_fields__)
    assert timings_record(timings(first_token_ms=None)) is None  # no first token
    assert timings_record(timings(region=None)) is None  # not a firstbyte router
    assert timings_record(timings(first_byte_ms=5.0)) is None  # after the first token


def test_the_queue_is_bounded_drops_the_oldest_and_batches_per_router() -> None:
    queue: TimingsQueue[str] = TimingsQueue(max_queued=3, batch_records=2, interval_s=10.0)
    records = [timings_record(timings(stream_id=str(i))) for i in range(4)]
    assert None not in records
    queue.add("a", records[0], now=0.0)  # type: ignore[arg-type]
    assert not queue.due(5.0)
    assert queue.wait_s(5.0) == 5.0
    assert queue.due(10.0)  # the oldest waited interval_s
    queue.add("b", records[1], now=1.0)  # type: ignore[arg-type]
    assert queue.due(1.0)  # batch_records reached
    queue.add("a", records[2], now=2.0)  # type: ignore[arg-type]
    queue.add("a", records[3], now=3.0)  # type: ignore[arg-type]
    assert (len(queue), queue.dropped) == (3, 1)
    batches = [(target, [r.stream_id for r in batch]) for target, batch in queue.take()]
    assert batches == [("b", ["1"]), ("a", ["2", "3"])]
    assert len(queue) == 0
    assert queue.wait_s(0.0) is None


async def test_a_failing_router_never_reaches_the_application() -> None:
    calls: list[bytes] = []
    posted = asyncio.Event()

    async def post(target: str, body: bytes) -> int:
        calls.append(body)
        posted.set()
        raise OSError("connection refused")

    reporter: TimingsReporter[str] = TimingsReporter(post, interval_s=0.01)
    reporter.note("a", timings())  # returns at once: the post runs in the background
    await asyncio.wait_for(posted.wait(), 5)
    await reporter.aclose()
    assert (reporter.sent_reports, reporter.failed_reports, len(calls)) == (0, 1, 1)


async def test_closing_gives_up_on_a_router_that_does_not_answer() -> None:
    async def post(target: str, body: bytes) -> int:
        await asyncio.sleep(60)
        return 202

    stall: Callable[[str, bytes], Any] = post
    reporter: TimingsReporter[str] = TimingsReporter(stall, interval_s=60, close_timeout_s=0.1)
    reporter.note("a", timings())
    started = time.monotonic()
    await reporter.aclose()
    assert time.monotonic() - started < 5  # bounded by close_timeout_s, not the post
