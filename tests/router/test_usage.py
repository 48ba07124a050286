"""Usage per key, over sockets: a router in front of the sim (which honours
``stream_options.include_usage`` as vLLM does).

The router asks the upstream for the usage chunk when the client did not, counts its tokens
for the key (``firstbyte_key_*_total``, under the key's ``usage_label`` or ``other``) and in
the access line, and drops the chunk from what that client reads; a client that asked gets it.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from firstbyte.router.observability.logs import key_id, subject_id
from firstbyte.router.observability.usage import UsageMeter, with_usage_option
from firstbyte.router.serve import RouterEndpoints
from firstbyte.router.sim.server import SimServer, sim_server
from firstbyte.router.streams import owner_of
from tests.router.conftest import API_KEY, RouterFactory, auth

TEAM_KEY = "sk-team-a-usage-0001"
BODY: dict[str, Any] = {
    "model": "sim-llama-7b",
    "messages": [{"role": "user", "content": "Count me in."}],
    "max_tokens": 4,
    "seed": 1,
}


def test_with_usage_option_puts_the_member_first_and_keeps_the_rest() -> None:
    body = b' {"model":"m","stream":true}'
    changed = with_usage_option(body)
    assert changed == b' {"stream_options":{"include_usage":true},"model":"m","stream":true}'
    assert json.loads(changed)["stream_options"] == {"include_usage": True}


def test_meter_labels_only_the_configured_keys() -> None:
    meter = UsageMeter({owner_of(TEAM_KEY): "team-a"})
    meter.record(owner_of(TEAM_KEY), 10, 4)
    meter.record(owner_of(API_KEY), None, 3)
    meter.record(owner_of("sk-someone-else-01"), 2, 1)
    lines = meter.render()
    assert 'firstbyte_key_requests_total{key="team-a"} 1' in lines
    assert 'firstbyte_key_requests_total{key="other"} 2' in lines
    assert 'firstbyte_key_tokens_total{key="team-a",direction="input"} 10' in lines
    assert 'firstbyte_key_tokens_total{key="other",direction="input"} 2' in lines
    assert 'firstbyte_key_tokens_total{key="other",direction="output"} 4' in lines


@pytest.fixture
async def sim() -> AsyncIterator[SimServer]:
    async with sim_server(served_model_names=["sim-llama-7b"]) as server:
        yield server


@pytest.fixture
async def router(start_router: RouterFactory, sim: SimServer) -> AsyncIterator[RouterEndpoints]:
    keys = {"keys": [{"key": TEAM_KEY, "usage_label": "team-a"}]}
    async with start_router([sim.url], tls=False, auth=keys) as endpoints:
        yield endpoints


def _payloads(sse: str) -> list[dict[str, Any]]:
    out = []
    for line in sse.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[6:]))
    return out


async def _metrics(client: httpx.AsyncClient) -> dict[str, float]:
    text = (await client.get("/metrics", headers=auth())).text
    return {
        line.split(" ")[0]: float(line.split(" ")[1])
        for line in text.splitlines()
        if line.startswith("firstbyte_key_")
    }


async def test_streamed_usage_is_counted_per_key_and_dropped_unless_asked(
    router: RouterEndpoints, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="firstbyte.access")
    async with httpx.AsyncClient(base_url=router.base_url, timeout=20) as client:
        plain = await client.post(
            "/v1/chat/completions", headers={**auth(TEAM_KEY), "x-firstbyte-subject": "user-7"},
            json={**BODY, "stream": True},
        )
        asked = await client.post(
            "/v1/chat/completions", headers=auth(),
            json={**BODY, "stream": True, "stream_options": {"include_usage": True}},
        )
        whole = await client.post("/v1/chat/completions", headers=auth(), json=BODY)
        assert (plain.status_code, asked.status_code, whole.status_code) == (200, 200, 200)
        # The client that did not ask reads content only; the one that asked, the usage chunk.
        assert all(p["choices"] for p in _payloads(plain.text))
        usage = _payloads(asked.text)[-1]
        assert usage["choices"] == []
        assert usage["usage"]["prompt_tokens"] > 0
        prompt = usage["usage"]["prompt_tokens"]
        for _ in range(100):  # access lines are written when the streams end
            if len([r for r in caplog.records if r.getMessage().startswith("POST")]) >= 3:
                break
            await asyncio.sleep(0.05)
        metrics = await _metrics(client)
    lines = [r.fields for r in caplog.records]  # type: ignore[attr-defined]
    streamed = [f for f in lines if f["path"] == "/v1/chat/completions" and f["stream"]]
    assert len(streamed) >= 2
    for fields in streamed:  # input tokens known whether the client asked or not
        assert fields["input_tokens"] == prompt
        assert fields["output_tokens"] == 4
    by_key = {f["usage_key"]: f for f in streamed}
    assert by_key["team-a"]["subject_id"] == subject_id("user-7")
    assert by_key["team-a"]["key_id"] == key_id(TEAM_KEY)
    assert "subject_id" not in by_key["other"]
    assert metrics['firstbyte_key_requests_total{key="team-a"}'] == 1
    assert metrics['firstbyte_key_tokens_total{key="team-a",direction="input"}'] == prompt
    assert metrics['firstbyte_key_tokens_total{key="team-a",direction="output"}'] == 4
    assert metrics['firstbyte_key_requests_total{key="other"}'] == 2  # streamed and JSON
    assert metrics['firstbyte_key_tokens_total{key="other",direction="input"}'] == 2 * prompt
    assert metrics['firstbyte_key_tokens_total{key="other",direction="output"}'] == 8


async def test_long_poll_streams_get_no_usage_chunk_they_did_not_ask_for(
    router: RouterEndpoints,
) -> None:
    """``POST /v1/streams`` (stream forced on by the router): the events read back have no
    usage-only chunk, and the key's tokens are counted."""
    async with httpx.AsyncClient(base_url=router.base_url, timeout=20) as client:
        started = await client.post("/v1/streams", headers=auth(TEAM_KEY), json=BODY)
        assert started.status_code < 300, started.text
        stream_id = started.json()["stream"]
        read = await client.get(f"/v1/streams/{stream_id}", headers=auth(TEAM_KEY))
        assert read.status_code == 200
        assert all(p["choices"] for p in _payloads(read.text))
        metrics = await _metrics(client)
    assert metrics['firstbyte_key_tokens_total{key="team-a",direction="input"}'] > 0


async def test_a_stream_cancelled_when_its_reader_left_is_counted_with_its_output(
    start_router: RouterFactory,
) -> None:
    """A reader that leaves after a few chunks and no resume within the grace: the upstream
    request is cancelled before its usage chunk, and the completion still counts, with the
    content chunks that came before the cancel as output tokens and no input tokens."""
    async with sim_server("h100-7b") as sim, start_router(
        [sim.url], tls=False, streams={"resume_grace_s": 0.2}
    ) as router, httpx.AsyncClient(base_url=router.base_url, timeout=20) as client:
        async with client.stream("POST", "/v1/chat/completions", headers=auth(),
                                 json={**BODY, "stream": True, "max_tokens": 400}) as r:
            seen = 0
            async for line in r.aiter_lines():
                seen += line.startswith("data: ")
                if seen >= 4:
                    break
        for _ in range(100):  # the grace, then the cancel
            metrics = await _metrics(client)
            if metrics.get('firstbyte_key_requests_total{key="other"}'):
                break
            await asyncio.sleep(0.05)
    assert metrics['firstbyte_key_requests_total{key="other"}'] == 1
    output = metrics['firstbyte_key_tokens_total{key="other",direction="output"}']
    assert 3 <= output < 400
    assert 'firstbyte_key_tokens_total{key="other",direction="input"}' not in metrics


FORMATS: dict[str, dict[str, Any]] = {
    "/v1/completions": {"model": "sim-llama-7b", "prompt": "Count me in.", "max_tokens": 4},
    "/v1/responses": {"model": "sim-llama-7b", "input": "Count me in.", "max_output_tokens": 4},
    "/v1/messages": {"model": "sim-llama-7b", "max_tokens": 4,
                     "messages": [{"role": "user", "content": "Count me in."}]},
}


@pytest.mark.parametrize("path", sorted(FORMATS))
async def test_every_streamed_format_counts_its_usage_for_the_key(
    router: RouterEndpoints, path: str
) -> None:
    """Completions (its usage chunk, asked for by the router and dropped), Responses (usage in
    ``response.completed``) and Messages (input in ``message_start``, output in
    ``message_delta``): each stream's tokens reach the key's counters, and nothing the router
    put in reaches the client."""
    async with httpx.AsyncClient(base_url=router.base_url, timeout=20) as client:
        answer = await client.post(path, headers=auth(TEAM_KEY),
                                   json={**FORMATS[path], "stream": True})
        assert answer.status_code == 200, answer.text
        if path == "/v1/completions":  # the usage chunk the router asked for is not read
            assert all(p["choices"] for p in _payloads(answer.text))
        else:
            assert "stream_options" not in answer.text
        metrics: dict[str, float] = {}
        for _ in range(100):  # counted when the stream ends
            metrics = await _metrics(client)
            if metrics.get('firstbyte_key_requests_total{key="team-a"}'):
                break
            await asyncio.sleep(0.05)
    assert metrics['firstbyte_key_requests_total{key="team-a"}'] == 1
    assert metrics['firstbyte_key_tokens_total{key="team-a",direction="input"}'] > 0
    assert metrics['firstbyte_key_tokens_total{key="team-a",direction="output"}'] == 4
