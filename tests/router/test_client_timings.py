"""``POST /v1/edge/timings`` on a real router (TLS, loopback) with a real GeoIP database:
reports land in the client histograms on ``/metrics`` with the right labels, joined with the
router's own stream; implausible reports are refused with 400 and counted by reason; the
``country`` label collapses into ``other`` past ``max_countries``; size, batch and rate bounds."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from firstbyte.protocol import paths
from firstbyte.router.client_timings import Served
from firstbyte.router.serve import RouterEndpoints
from firstbyte.router.streams import owner_of
from tests.router.conftest import API_KEY, OTHER_KEY, RouterFactory, auth, client_tls
from tests.router.geo_fixtures import (
    FRANKFURT_CLIENT,
    TOKYO_CLIENT,
    UNKNOWN_CLIENT,
    VIRGINIA_CLIENT,
    write_city_mmdb,
)
from tests.router.upstream import Upstream

TTFT = "firstbyte_client_ttft_seconds"
NETWORK = "firstbyte_client_network_seconds"
REJECTED = "firstbyte_client_timings_rejected_total"


def record(**fields: Any) -> dict[str, Any]:
    """A plausible cold HTTP/2 SSE record served by this router's region; ``fields`` override."""
    base: dict[str, Any] = {
        "transport": "sse", "http_version": "HTTP/2", "region": "test-1",
        "dns_ms": 1.0, "tcp_connect_ms": 20.0, "tls_handshake_ms": 40.0,
        "request_sent_ms": 62.0, "first_byte_ms": 90.0, "first_token_ms": 120.0,
        "last_token_ms": 300.0, "render_ms": 121.0,
    }
    base.update(fields)
    return {k: v for k, v in base.items() if v is not None}


def metric(text: str, name: str, **labels: str) -> float:
    """The value of the one sample of ``name`` whose labels include ``labels`` (0 if none)."""
    found = 0.0
    for line in text.splitlines():
        match = re.match(rf"^{re.escape(name)}(?:\{{(.*)\}})? (\S+)$", line)
        if match is None:
            continue
        have = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            found += float(match.group(2))
    return found


@pytest.fixture
async def geo_router(
    start_router: RouterFactory, upstream: Upstream, tmp_path: Path
) -> AsyncIterator[RouterEndpoints]:
    mmdb = write_city_mmdb(tmp_path / "cities.mmdb")
    async with start_router(
        [upstream.url],
        geo={"database": str(mmdb), "trusted_proxies": ["127.0.0.1/32"],
             "latitude": 35.68, "longitude": 139.69},
        routing={"peer_key": "a-peer-key-of-16-chars"},
        peers=[{"name": "eu-central-1", "url": "https://127.0.0.1:9/"}],
        client_timings={"max_countries": 2, "max_records_per_report": 5,
                        "max_report_bytes": 4096, "reports_per_s_per_key": 100,
                        "report_burst_per_key": 100},
    ) as endpoints:
        yield endpoints


@pytest.fixture
async def http(tls_files: dict[str, str]) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(verify=client_tls(tls_files), timeout=30) as client:
        yield client


async def post(http: httpx.AsyncClient, router: RouterEndpoints, records: list[dict[str, Any]],
               *, client: str = TOKYO_CLIENT, key: str = API_KEY) -> httpx.Response:
    return await http.post(router.base_url + paths.EDGE_TIMINGS, json={"records": records},
                           headers={**auth(key), "x-forwarded-for": client})


async def scrape(http: httpx.AsyncClient, router: RouterEndpoints) -> str:
    response = await http.get(router.base_url + paths.METRICS, headers=auth())
    assert response.status_code == 200
    return response.text


def code(response: httpx.Response) -> str:
    return str(json.loads(response.content)["error"]["code"])


async def serve(
    http: httpx.AsyncClient, router: RouterEndpoints, n: int = 1, *, key: str = API_KEY
) -> list[str]:
    """Stream ``n`` short completions for ``key``: each lets the key report one record."""
    body = {"model": "test-model", "stream": True, "max_tokens": 2,
            "messages": [{"role": "user", "content": "hi"}]}  # fmt: skip
    ids = []
    for _ in range(n):
        async with http.stream("POST", router.openai_base_url + "/chat/completions", json=body,
                               headers=auth(key)) as response:
            assert response.status_code == 200
            ids.append(response.headers["x-firstbyte-stream"])
            await response.aread()
    return ids


def served_by_peer(router: RouterEndpoints, region: str, *, key: str = API_KEY) -> None:
    """A stream of ``key`` forwarded to the peer ``region`` (the test's peer is not running:
    recorded as the forwarding path records it)."""
    state = router.app.state
    state.client_latency.stream_started(owner_of(key), region, state.clock())


async def test_reports_fill_the_client_histograms_by_region_country_transport_and_conn(
    geo_router: RouterEndpoints, http: httpx.AsyncClient
) -> None:
    await serve(http, geo_router, 4)
    served_by_peer(geo_router, "eu-central-1")
    answer = await post(http, geo_router, [
        record(),
        record(transport="websocket", http_version="HTTP/1.1", warm=True, dns_ms=None,
               tcp_connect_ms=None, tls_handshake_ms=None, request_sent_ms=0.1),
        record(http_version="HTTP/3", zero_rtt=True, tcp_connect_ms=None,
               tls_handshake_ms=None, quic_handshake_ms=3.0, first_token_ms=2_500.0,
               last_token_ms=2_600.0, render_ms=None),
        record(region="eu-central-1"),  # served by the peer it was forwarded to
    ])
    assert answer.status_code == 202, answer.text
    assert answer.json() == {"accepted": 4}
    assert (await post(http, geo_router, [record()], client=FRANKFURT_CLIENT)).status_code == 202
    text = await scrape(http, geo_router)
    tokyo = {"region": "test-1", "country": "JP"}
    cold_h2 = {"transport": "sse", "http": "2", "conn": "cold"}
    assert metric(text, f"{TTFT}_count", **tokyo, **cold_h2) == 1
    assert metric(text, f"{TTFT}_bucket", **tokyo, **cold_h2, le="0.1") == 0
    assert metric(text, f"{TTFT}_bucket", **tokyo, **cold_h2, le="0.25") == 1
    assert metric(text, f"{TTFT}_sum", **tokyo, **cold_h2) == pytest.approx(0.12)
    assert metric(text, f"{TTFT}_count", **tokyo, transport="websocket", http="1.1",
                  conn="warm") == 1
    assert metric(text, f"{TTFT}_bucket", **tokyo, transport="sse", http="3", conn="0rtt",
                  le="2.5") == 1
    assert metric(text, f"{TTFT}_count", region="eu-central-1", country="JP") == 1
    assert metric(text, f"{TTFT}_count", region="test-1", country="DE") == 1
    assert metric(text, f"{TTFT}_count") == 5
    # No stream id: nothing to join with, so no network time (and no estimate either).
    assert metric(text, f"{NETWORK}_count") == 0
    assert metric(text, "firstbyte_client_timings_records_total", join="unjoined") == 5
    # Next to the router's own server-side TTFT.
    assert "# TYPE firstbyte_router_ttft_seconds histogram" in text


async def test_a_record_joins_the_routers_own_stream_for_network_time(
    geo_router: RouterEndpoints, http: httpx.AsyncClient, upstream: Upstream
) -> None:
    upstream.delay_s = 0.05  # the upstream takes >= 50 ms to its first token
    body = {"model": "test-model", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    async with http.stream("POST", geo_router.openai_base_url + "/chat/completions", json=body,
                           headers=auth()) as response:
        assert response.status_code == 200
        stream_id = response.headers["x-firstbyte-stream"]
        await response.aread()
    stream = geo_router.app.state.store.get(stream_id, owner_of(API_KEY))
    assert stream is not None
    upstream_ttft_ms = stream.upstream_ttft_ms  # what the router measured itself
    assert upstream_ttft_ms is not None
    assert upstream_ttft_ms >= 50
    felt = upstream_ttft_ms + 80.0
    answer = await post(http, geo_router, [record(stream_id=stream_id, first_token_ms=felt,
                                                  last_token_ms=felt + 200, render_ms=felt)])
    assert answer.status_code == 202, answer.text
    text = await scrape(http, geo_router)
    assert metric(text, f"{NETWORK}_count", region="test-1", country="JP") == 1
    assert metric(text, f"{NETWORK}_sum", country="JP") == pytest.approx(0.08, abs=1e-5)
    assert metric(text, f"{NETWORK}_bucket", country="JP", le="0.05") == 0
    assert metric(text, f"{NETWORK}_bucket", country="JP", le="0.1") == 1
    assert metric(text, "firstbyte_client_timings_records_total", join="joined") == 1
    # A TTFT shorter than the upstream's own for the same stream was never felt.
    quick = record(stream_id=stream_id, dns_ms=None, tcp_connect_ms=None, tls_handshake_ms=None,
                   request_sent_ms=1.0, first_byte_ms=5.0, first_token_ms=10.0,
                   last_token_ms=20.0, render_ms=None)
    fast = await post(http, geo_router, [quick])
    assert fast.status_code == 400
    assert code(fast) == "invalid_timings"
    assert "records[0]: faster_than_server" in fast.json()["error"]["message"]
    # Another key's stream is not joined (stream ids are bound to their key).
    await serve(http, geo_router, key=OTHER_KEY)
    other = await post(http, geo_router, [quick], key=OTHER_KEY)
    assert other.status_code == 202, other.text
    text = await scrape(http, geo_router)
    assert metric(text, REJECTED, reason="faster_than_server") == 1
    assert metric(text, f"{NETWORK}_count") == 1


@pytest.mark.parametrize(("fields", "reason"), [
    ({"dns_ms": -1.0}, "out_of_range"),
    ({"first_token_ms": 700_000.0, "last_token_ms": 700_001.0}, "out_of_range"),
    ({"resumes": -1}, "out_of_range"),
    ({"first_byte_ms": 130.0}, "unordered"),  # after the first token
    ({"tls_handshake_ms": 400.0}, "unordered"),  # setup longer than request_sent
    ({"last_token_ms": 100.0}, "unordered"),
    ({"render_ms": 50.0}, "unordered"),
    ({"transport": "carrier-pigeon"}, "unknown_transport"),
    ({"http_version": "HTTP/0.9"}, "unknown_http_version"),
    ({"region": "atlantis"}, "unknown_region"),
])
async def test_implausible_reports_are_refused_with_400_and_counted(
    geo_router: RouterEndpoints, http: httpx.AsyncClient, fields: dict[str, Any], reason: str
) -> None:
    await serve(http, geo_router, 2)
    answer = await post(http, geo_router, [record(), record(**fields)])
    assert answer.status_code == 400, answer.text
    assert code(answer) == "invalid_timings"
    assert f"records[1]: {reason}" in answer.json()["error"]["message"]
    text = await scrape(http, geo_router)
    assert metric(text, REJECTED, reason=reason) == 1
    assert metric(text, f"{TTFT}_count") == 0  # the plausible record went with the report


async def test_malformed_reports_and_text_fields_are_refused(
    geo_router: RouterEndpoints, http: httpx.AsyncClient
) -> None:
    url = geo_router.base_url + paths.EDGE_TIMINGS
    for body in (b"not json", b'{"records": [{"transport": "sse"}]}',
                 json.dumps({"records": [record(output="the model's answer")]}).encode(),
                 json.dumps({"records": [record(first_token_ms=float("nan"))]}).encode()):
        answer = await http.post(url, content=body, headers=auth())
        assert answer.status_code == 400, body
        assert code(answer) == "invalid_timings"
    text = await scrape(http, geo_router)
    assert metric(text, REJECTED, reason="malformed") == 4  # NaN is not JSON either


async def test_countries_past_max_countries_count_as_other(
    geo_router: RouterEndpoints, http: httpx.AsyncClient
) -> None:
    # max_countries = 2: the first two countries seen keep their label.
    await serve(http, geo_router, 6)
    for client in (TOKYO_CLIENT, FRANKFURT_CLIENT, VIRGINIA_CLIENT, UNKNOWN_CLIENT,
                   "127.0.0.1", TOKYO_CLIENT):
        assert (await post(http, geo_router, [record()], client=client)).status_code == 202
    text = await scrape(http, geo_router)
    counts = {country: metric(text, f"{TTFT}_count", country=country)
              for country in ("JP", "DE", "US", "other", "unknown")}
    assert counts == {"JP": 2, "DE": 1, "US": 0, "other": 1, "unknown": 2}
    countries = set(re.findall(rf'^{TTFT}_count{{[^}}]*country="([^"]*)"', text, re.M))
    assert countries == {"JP", "DE", "other", "unknown"}


async def test_size_batch_auth_and_rate_bounds(
    geo_router: RouterEndpoints, http: httpx.AsyncClient
) -> None:
    url = geo_router.base_url + paths.EDGE_TIMINGS
    too_many = await post(http, geo_router, [record()] * 6)  # max_records_per_report = 5
    assert too_many.status_code == 400
    assert "5 records" in too_many.json()["error"]["message"]
    big = await http.post(url, content=b"{" + b" " * 5000 + b"}", headers=auth())
    assert big.status_code == 413
    assert code(big) == "request_too_large"
    assert (await http.post(url, json={"records": [record()]})).status_code == 401
    assert (await http.get(url, headers=auth())).status_code == 405
    text = await scrape(http, geo_router)
    assert metric(text, REJECTED, reason="too_many_records") == 1
    assert metric(text, REJECTED, reason="too_large") == 1
    assert metric(text, f"{TTFT}_count") == 0


async def test_reports_are_rate_limited_per_key(
    start_router: RouterFactory, upstream: Upstream, tls_files: dict[str, str]
) -> None:
    async with start_router([upstream.url], client_timings={
            "reports_per_s_per_key": 0.001, "report_burst_per_key": 2}) as router, \
            httpx.AsyncClient(verify=client_tls(tls_files)) as http:
        await serve(http, router, 3)
        await serve(http, router, key=OTHER_KEY)
        statuses = [(await post(http, router, [record()])).status_code for _ in range(3)]
        assert statuses == [202, 202, 429]
        # Another key has its own bucket.
        assert (await post(http, router, [record()], key=OTHER_KEY)).status_code == 202
        text = await scrape(http, router)
        assert metric(text, REJECTED, reason="rate_limited") == 1
        assert metric(text, f"{TTFT}_count", country="unknown") == 3


async def test_disabled_answers_404(
    start_router: RouterFactory, upstream: Upstream, tls_files: dict[str, str]
) -> None:
    async with start_router([upstream.url], client_timings={"enabled": False}) as router, \
            httpx.AsyncClient(verify=client_tls(tls_files)) as http:
        answer = await post(http, router, [record()])
        assert answer.status_code == 404
        text = await scrape(http, router)
        assert metric(text, f"{TTFT}_count") == 0
        assert metric(text, REJECTED, reason="disabled") == 1


async def test_a_browsers_client_token_reports_and_joins_its_keys_streams(
    geo_router: RouterEndpoints, http: httpx.AsyncClient, upstream: Upstream
) -> None:
    upstream.delay_s = 0.02
    body = {"model": "test-model", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    async with http.stream("POST", geo_router.openai_base_url + "/chat/completions", json=body,
                           headers=auth()) as response:
        stream_id = response.headers["x-firstbyte-stream"]
        await response.aread()
    minted = await http.post(geo_router.base_url + paths.EDGE_TOKENS, json={}, headers=auth())
    assert minted.status_code == 200, minted.text
    token = minted.json()["token"]
    answer = await post(http, geo_router, [record(stream_id=stream_id, first_token_ms=5_000.0,
                                                  last_token_ms=5_001.0, render_ms=None)],
                        key=token)
    assert answer.status_code == 202, answer.text
    text = await scrape(http, geo_router)
    assert metric(text, "firstbyte_client_timings_records_total", join="joined") == 1


async def test_records_only_for_streams_and_regions_the_key_was_served(
    geo_router: RouterEndpoints, http: httpx.AsyncClient
) -> None:
    """A key posts at most one record per stream it had, for the region that served it: a
    key that never streamed, a region that never served it and records beyond its streams
    are refused (``not_served``); before, a key could post any number of 599 s records for
    any configured region."""
    fabricated = record(first_token_ms=599_000.0, last_token_ms=599_001.0, render_ms=None)
    never = await post(http, geo_router, [fabricated])
    assert never.status_code == 400
    assert "records[0]: not_served" in never.json()["error"]["message"]
    await serve(http, geo_router, 3)
    peer = await post(http, geo_router, [record(region="eu-central-1")])
    assert peer.status_code == 400  # the peer never served this key
    assert "records[0]: not_served" in peer.json()["error"]["message"]
    # Two streams' worth, then one more than is left: the whole report is refused.
    assert (await post(http, geo_router, [record()] * 2)).status_code == 202
    over = await post(http, geo_router, [record()] * 2)
    assert over.status_code == 400
    assert "records[1]: not_served" in over.json()["error"]["message"]
    # Flooding with full reports gets exactly one more record in, however many are sent.
    statuses = [(await post(http, geo_router, [fabricated] * 5)).status_code for _ in range(20)]
    assert statuses == [400] * 20
    assert (await post(http, geo_router, [record()])).status_code == 202
    assert (await post(http, geo_router, [record()])).status_code == 400
    # Another key's streams are its own.
    assert (await post(http, geo_router, [record()], key=OTHER_KEY)).status_code == 400
    text = await scrape(http, geo_router)
    assert metric(text, f"{TTFT}_count") == 3
    assert metric(text, REJECTED, reason="not_served") == 25


async def test_one_key_brings_in_at_most_its_share_of_countries(
    start_router: RouterFactory, upstream: Upstream, tmp_path: Path, tls_files: dict[str, str]
) -> None:
    """``max_countries_per_key = 1`` of 3: key A reporting from Japan, Germany and the US
    gives Japan a label and counts the others as ``other``; key B's Germany still gets its
    own. Before, the first key's countries took every label."""
    mmdb = write_city_mmdb(tmp_path / "cities.mmdb")
    async with start_router(
        [upstream.url],
        geo={"database": str(mmdb), "trusted_proxies": ["127.0.0.1/32"]},
        client_timings={"max_countries": 3, "max_countries_per_key": 1,
                        "reports_per_s_per_key": 100, "report_burst_per_key": 100},
    ) as router, httpx.AsyncClient(verify=client_tls(tls_files), timeout=30) as http:
        await serve(http, router, 3)
        await serve(http, router, 1, key=OTHER_KEY)
        for client in (TOKYO_CLIENT, FRANKFURT_CLIENT, VIRGINIA_CLIENT):
            assert (await post(http, router, [record()], client=client)).status_code == 202
        other = await post(http, router, [record()], client=FRANKFURT_CLIENT, key=OTHER_KEY)
        assert other.status_code == 202
        text = await scrape(http, router)
    counts = {country: metric(text, f"{TTFT}_count", country=country)
              for country in ("JP", "DE", "US", "other")}
    assert counts == {"JP": 1, "DE": 1, "US": 0, "other": 2}


def test_served_streams_are_good_for_one_record_each_within_the_window() -> None:
    served = Served(window_s=600.0)
    for now in (0.0, 30.0, 90.0):
        served.started(b"a", "r", now)
    assert served.available(b"a", "r", 100.0) == 3
    assert served.available(b"a", "other-region", 100.0) == 0
    assert served.available(b"b", "r", 100.0) == 0
    served.take(b"a", "r", 1, 100.0)  # the oldest first
    assert served.available(b"a", "r", 100.0) == 2
    assert served.available(b"a", "r", 659.0) == 2  # both minutes within the window
    assert served.available(b"a", "r", 661.0) == 1  # the first minute's has aged out
    served.forget_old(800.0)
    assert served.available(b"a", "r", 800.0) == 0


async def test_prewarmed_streams_have_their_own_conn_label(
    geo_router: RouterEndpoints, http: httpx.AsyncClient
) -> None:
    await serve(http, geo_router, 3)
    reused = {"warm": True, "dns_ms": None, "tcp_connect_ms": None, "tls_handshake_ms": None,
              "request_sent_ms": 0.5}
    answer = await post(http, geo_router, [
        record(**reused, prewarmed=True), record(**reused, prewarmed=True),
        record(**reused),
    ])
    assert answer.status_code == 202, answer.text
    text = await scrape(http, geo_router)
    assert metric(text, f"{TTFT}_count", transport="sse", conn="prewarmed") == 2
    assert metric(text, f"{TTFT}_count", transport="sse", conn="warm") == 1
