"""End to end over real TLS on loopback: the router streams the sim's text unchanged over
HTTP/1.1, HTTP/2 (httpx), HTTP/3 (aioquic, with 0-RTT on resumption), the official openai
SDK and curl."""

from __future__ import annotations

import asyncio
import itertools
import json
import subprocess
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest

from firstbyte.protocol.sse import SSEDecoder
from firstbyte.router.serve import RouterEndpoints
from firstbyte.router.sim.server import SimServer, sim_server
from tests.router.conftest import API_KEY, RouterFactory, auth, client_tls
from tests.router.h3client import h3_request
from tests.router.streamtext import sim_text, sse_text
from tests.router.test_http10 import curl_http10

BODY = {
    "model": "sim-instant",
    "messages": [{"role": "user", "content": "Tell me about latency."}],
    "stream": True,
    "max_tokens": 24,
    "seed": 7,
}


@pytest.fixture
async def sim() -> AsyncIterator[SimServer]:
    async with sim_server("instant") as server:
        yield server


@pytest.fixture
async def sim_router(start_router: RouterFactory, sim: SimServer) -> AsyncIterator[RouterEndpoints]:
    async with start_router([sim.url]) as endpoints:
        yield endpoints


async def direct_text(sim: SimServer) -> str:
    text = await sim_text(sim, BODY)
    assert len(text.split()) == 24
    return text


@pytest.mark.parametrize("http2", [False, True])
async def test_sse_over_h1_and_h2_matches_the_sim(
    sim: SimServer, sim_router: RouterEndpoints, tls_files: dict[str, str], http2: bool
) -> None:
    expected = await direct_text(sim)
    async with (
        httpx.AsyncClient(verify=client_tls(tls_files), http2=http2) as client,
        client.stream(
            "POST",
            sim_router.base_url + "/v1/chat/completions",
            json=BODY,
            headers={
                **auth(),
                "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            },
        ) as response,
    ):
        assert response.http_version == ("HTTP/2" if http2 else "HTTP/1.1")
        assert response.status_code == 200
        body = b"".join([chunk async for chunk in response.aiter_raw()])
    headers = response.headers
    assert headers["content-type"].startswith("text/event-stream")
    assert headers["cache-control"] == "no-cache"
    assert headers["x-accel-buffering"] == "no"
    assert headers["x-firstbyte-region"] == "test-1"
    assert len(headers["x-firstbyte-stream"]) == 22
    assert "queue;dur=" in headers["server-timing"]
    assert "route;dur=" in headers["server-timing"]
    assert headers["alt-svc"] == f'h3=":{sim_router.h3_port}"; ma=86400'
    assert headers["traceparent"].startswith("00-0af7651916cd43dd8448eb211c80319c-")
    text, ids = sse_text(body)
    assert text == expected
    assert ids == [str(i) for i in range(1, len(ids) + 1)]  # id: 1, 2, 3, ... [DONE] last


async def test_non_streaming_json_and_models(
    sim_router: RouterEndpoints, tls_files: dict[str, str]
) -> None:
    async with httpx.AsyncClient(verify=client_tls(tls_files), http2=True) as client:
        response = await client.post(
            sim_router.base_url + "/v1/chat/completions",
            json={**BODY, "stream": False},
            headers=auth(),
        )
        assert response.status_code == 200
        assert response.json()["object"] == "chat.completion"
        assert "upstream;dur=" in response.headers["server-timing"]
        models = await client.get(sim_router.base_url + "/v1/models", headers=auth())
        assert models.status_code == 200
        assert models.json()["data"][0]["id"] == "sim-instant"
        assert (await client.get(sim_router.base_url + "/healthz")).text == "ok\n"
        status = (await client.get(sim_router.base_url + "/v1/edge/status", headers=auth())).json()
        assert status["region"] == "test-1"
        assert status["healthy"] is True
        assert status["in_flight"] == 0
        # Without a key: what a client needs to find its regions, not the region's load.
        public = (await client.get(sim_router.base_url + "/v1/edge/status")).json()
        assert public["region"] == "test-1"
        assert public["healthy"] is True
        assert not {"in_flight", "backends", "streams", "warm"} & set(public)
        bad = await client.get(sim_router.base_url + "/metrics", headers=auth("sk-wrong-key-9"))
        assert bad.status_code == 401
        assert (await client.get(sim_router.base_url + "/metrics")).status_code == 401
        metrics = (await client.get(sim_router.base_url + "/metrics", headers=auth())).text
        assert 'firstbyte_router_requests_total{endpoint="chat",outcome="ok",model="sim-instant"} 1' in metrics
        assert "# TYPE firstbyte_router_ttft_seconds histogram" in metrics  # by model, once one streams


async def test_traceparent_is_forwarded_upstream(
    start_router: RouterFactory, upstream: Any, tls_files: dict[str, str]
) -> None:
    async with (
        start_router([upstream.url]) as endpoints,
        httpx.AsyncClient(verify=client_tls(tls_files)) as client,
    ):
        parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
        await client.post(
            endpoints.base_url + "/v1/chat/completions",
            json=BODY,
            headers={**auth(), "traceparent": parent},
        )
        forwarded = upstream.last_headers["traceparent"]
        assert forwarded.startswith("00-0af7651916cd43dd8448eb211c80319c-")
        assert forwarded != parent
        assert upstream.last_headers.get("authorization") is None  # client key never forwarded
        await client.post(endpoints.base_url + "/v1/chat/completions", json=BODY, headers=auth())
        assert len(upstream.last_headers["traceparent"].split("-")[1]) == 32  # started one


async def test_upstream_connection_is_reused_across_streams(
    start_router: RouterFactory, upstream: Any, tls_files: dict[str, str]
) -> None:
    """The router reads each upstream body to its end, so the pooled connection is reused."""
    async with (
        start_router([upstream.url]) as endpoints,
        httpx.AsyncClient(verify=client_tls(tls_files)) as client,
    ):
        for _ in range(5):
            response = await client.post(
                endpoints.base_url + "/v1/chat/completions", json=BODY, headers=auth()
            )
            assert response.status_code == 200
            assert response.text.endswith("data: [DONE]\n\n")
    assert upstream.completed >= 5
    # Five streams, at most two connections: the pool may also hold the one its background
    # metrics poll opened (a dropped connection per stream would show five ports).
    assert len(upstream.client_ports) <= 2


async def test_http3_matches_the_sim_and_resumes_with_0rtt(
    sim: SimServer, sim_router: RouterEndpoints, tls_files: dict[str, str]
) -> None:
    expected = await direct_text(sim)
    assert sim_router.h3_port == sim_router.port
    body = json.dumps(BODY).encode()
    headers = {**auth(), "content-type": "application/json"}
    tickets: list[Any] = []
    first = await h3_request(
        sim_router.h3_port,
        "POST",
        "/v1/chat/completions",
        cafile=tls_files["cafile"],
        headers=headers,
        body=body,
        tickets=tickets,
    )
    assert first.status == 200
    assert sse_text(first.body)[0] == expected
    assert first.headers["x-firstbyte-stream"]
    assert not first.session_resumed
    assert tickets, "the router issued no session ticket"
    second = await h3_request(
        sim_router.h3_port,
        "POST",
        "/v1/chat/completions",
        cafile=tls_files["cafile"],
        headers=headers,
        body=body,
        ticket=tickets[-1],
    )
    assert second.status == 200
    assert sse_text(second.body)[0] == expected
    assert second.session_resumed
    assert second.early_data_accepted  # the request went out as 0-RTT data


async def test_openai_sdk_streams_with_only_base_url_changed(
    sim: SimServer, sim_router: RouterEndpoints, tls_files: dict[str, str]
) -> None:
    expected = await direct_text(sim)
    http_client = httpx.AsyncClient(verify=client_tls(tls_files))
    client = openai.AsyncOpenAI(
        base_url=sim_router.openai_base_url, api_key=API_KEY, http_client=http_client
    )
    try:
        stream = await client.chat.completions.create(
            model="sim-instant",
            messages=[{"role": "user", "content": "Tell me about latency."}],
            stream=True,
            max_tokens=24,
            seed=7,
        )
        text = ""
        async for chunk in stream:
            for choice in chunk.choices:
                text += choice.delta.content or ""
        assert text == expected
        wrong = openai.AsyncOpenAI(
            base_url=sim_router.openai_base_url, api_key="sk-wrong-key-123", http_client=http_client
        )
        with pytest.raises(openai.AuthenticationError):
            await wrong.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "x"}], stream=True
            )
    finally:
        await client.close()
        await http_client.aclose()


async def test_curl_http2_streams(
    sim: SimServer, sim_router: RouterEndpoints, tls_files: dict[str, str]
) -> None:
    expected = await direct_text(sim)
    process = await asyncio.create_subprocess_exec(
        "/usr/bin/curl",
        "-sS",
        "-N",
        "--http2",
        "--cacert",
        tls_files["cafile"],
        "-H",
        f"Authorization: Bearer {API_KEY}",
        "-H",
        "Content-Type: application/json",
        "-w",
        "\n%{http_version}",
        "--data",
        json.dumps(BODY),
        sim_router.base_url + "/v1/chat/completions",
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode == 0, err
    body, _, version = out.rpartition(b"\n")
    assert version == b"2"
    assert sse_text(body + b"\n")[0] == expected


async def test_curl_http10_reads_the_events_unchunked(
    sim: SimServer, sim_router: RouterEndpoints, tls_files: dict[str, str]
) -> None:
    """Over the default server (``auto``: uvicorn's protocol for HTTP/1.x), with TLS."""
    expected = await direct_text(sim)
    url = sim_router.base_url + "/v1/chat/completions"
    options = ("--cacert", tls_files["cafile"], "-H", f"Authorization: Bearer {API_KEY}",
               "-H", "Content-Type: application/json")
    headers, body = await curl_http10(url, *options, "--data", json.dumps(BODY))
    assert headers["content-type"].startswith("text/event-stream")
    assert headers["connection"].lower() == "close"
    assert "transfer-encoding" not in headers
    assert "content-length" not in headers
    # The body is the events and nothing else: re-encoded, they give its bytes back.
    events = SSEDecoder().receive_data(body)
    assert body == b"".join(f"id: {e.id}\ndata: {e.data}\n\n".encode() for e in events)
    text, ids = sse_text(body)
    assert text == expected
    assert ids == [str(i) for i in range(1, len(ids) + 1)]
    assert events[-1].data == "[DONE]"

    # A whole answer keeps its length.
    headers, whole = await curl_http10(
        url, *options, "--data", json.dumps({**BODY, "stream": False})
    )
    assert headers["content-length"] == str(len(whole))
    assert json.loads(whole)["choices"][0]["message"]["content"] == expected


@pytest.mark.parametrize("http2", [False, True])
async def test_events_are_flushed_as_produced(
    start_router: RouterFactory, tls_files: dict[str, str], http2: bool
) -> None:
    from tests.router.upstream import running_upstream

    async with (
        running_upstream(delay_s=0.1) as slow,
        start_router([slow.url]) as endpoints,
        httpx.AsyncClient(verify=client_tls(tls_files), http2=http2) as client,
        client.stream(
            "POST",
            endpoints.base_url + "/v1/chat/completions",
            json={**BODY, "max_tokens": 5},
            headers=auth(),
        ) as response,
    ):
        decoder = SSEDecoder()
        arrivals: list[float] = []
        async for piece in response.aiter_raw():
            for event in decoder.receive_data(piece):
                if '"content": "' in event.data and '"content": ""' not in event.data:
                    arrivals.append(asyncio.get_running_loop().time())
    assert len(arrivals) == 5
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    # The upstream sends one token every 100 ms; buffering would bunch them up.
    assert min(gaps) > 0.03
    assert arrivals[-1] - arrivals[0] > 0.25


async def test_uvicorn_listener_serves_http11_over_tls(
    sim: SimServer, start_router: RouterFactory, tls_files: dict[str, str]
) -> None:
    expected = await direct_text(sim)
    async with (
        start_router([sim.url], listen={"server": "uvicorn", "http3": False}) as endpoints,
        httpx.AsyncClient(verify=client_tls(tls_files)) as client,
    ):
        assert endpoints.h3_port is None
        response = await client.post(
            endpoints.base_url + "/v1/chat/completions", json=BODY, headers=auth()
        )
        assert response.status_code == 200
        assert response.http_version == "HTTP/1.1"
        assert sse_text(response.content)[0] == expected
        assert "alt-svc" not in response.headers
