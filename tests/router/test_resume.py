"""Resume: SSE ``Last-Event-ID``, long-poll ``after`` and WebSocket resume each deliver every
event after N exactly once, for a stream still in progress; and a client that leaves without
resuming has its upstream request cancelled after the grace period (seen in the sim's
``vllm:num_requests_running``)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from websockets.asyncio.client import connect as ws_connect

from firstbyte.protocol.sse import SSEDecoder
from firstbyte.router.serve import RouterEndpoints
from firstbyte.router.sim.server import SimServer, sim_server
from tests.router.conftest import RouterFactory, auth, client_tls
from tests.router.streamtext import chunk_text, sim_text

TOKENS = 60
BODY = {
    "model": "sim-llama-7b",
    "messages": [{"role": "user", "content": "Resume me."}],
    "stream": True,
    "max_tokens": TOKENS,
    "seed": 3,
}


@pytest.fixture
async def sim() -> AsyncIterator[SimServer]:
    # ~10 ms per token: a 60-token stream is still running while a reader reconnects.
    async with sim_server("h100-7b") as server:
        yield server


@pytest.fixture
async def routed(start_router: RouterFactory, sim: SimServer) -> AsyncIterator[RouterEndpoints]:
    async with start_router([sim.url], streams={"resume_grace_s": 5.0}) as endpoints:
        yield endpoints


async def read_first_events(
    client: httpx.AsyncClient, url: str, n: int, body: dict[str, Any] = BODY
) -> tuple[str, list[tuple[int, str]]]:
    """Start a stream, read its first ``n`` events, then drop the connection."""
    decoder = SSEDecoder()
    seen: list[tuple[int, str]] = []
    async with client.stream(
        "POST", url + "/v1/chat/completions", json=body, headers=auth()
    ) as response:
        assert response.status_code == 200
        stream_id = response.headers["x-firstbyte-stream"]
        async for piece in response.aiter_raw():
            for event in decoder.receive_data(piece):
                assert event.id is not None
                seen.append((int(event.id), event.data))
            if len(seen) >= n:
                break
    return stream_id, seen[:n]


async def in_flight(client: httpx.AsyncClient, url: str) -> int:
    status = (await client.get(url + "/v1/edge/status", headers=auth())).json()
    return int(status["in_flight"])


async def test_sse_last_event_id_resumes_exactly_once(
    sim: SimServer, routed: RouterEndpoints, tls_files: dict[str, str]
) -> None:
    expected = await sim_text(sim, BODY)
    async with httpx.AsyncClient(verify=client_tls(tls_files), http2=True) as client:
        stream_id, first = await read_first_events(client, routed.base_url, 5)
        assert [seq for seq, _ in first] == [1, 2, 3, 4, 5]
        assert await in_flight(client, routed.base_url) == 1  # still being produced
        decoder = SSEDecoder()
        rest: list[tuple[int, str]] = []
        async with client.stream(
            "GET",
            f"{routed.base_url}/v1/streams/{stream_id}",
            headers={**auth(), "last-event-id": "5"},
        ) as response:
            assert response.status_code == 200
            assert response.headers["x-firstbyte-stream"] == stream_id
            async for piece in response.aiter_raw():
                rest.extend((int(e.id or 0), e.data) for e in decoder.receive_data(piece))
    seqs = [seq for seq, _ in first + rest]
    assert seqs == list(range(1, len(seqs) + 1))  # every event exactly once, in order
    assert rest[-1][1] == "[DONE]"
    text = "".join(chunk_text(json.loads(d)) for _, d in first + rest if d != "[DONE]")
    assert text == expected


async def poll_to_done(
    client: httpx.AsyncClient, base_url: str, stream_id: str, after: int
) -> tuple[list[int], str, bool]:
    """Long-poll from ``after`` until ``done``: the sequences and text received, and whether a
    batch with events came while the stream was still running. Checks each batch's ``next``."""
    seqs: list[int] = []
    text, running_seen = "", False
    for _ in range(500):
        response = await client.get(
            f"{base_url}/v1/streams/{stream_id}/poll",
            params={"after": after, "wait": 5},
            headers=auth(),
        )
        assert response.status_code == 200
        batch = response.json()
        running_seen |= not batch["done"] and bool(batch["events"])
        seqs += [e["seq"] for e in batch["events"]]
        text += "".join(chunk_text(e["data"]) for e in batch["events"])
        assert batch["next"] == (batch["events"][-1]["seq"] if batch["events"] else after)
        if batch["done"]:
            return seqs, text, running_seen
        after = batch["next"]
    raise AssertionError("the stream did not finish within 500 polls")


async def test_long_poll_after_n_exactly_once(
    sim: SimServer, routed: RouterEndpoints, tls_files: dict[str, str]
) -> None:
    expected = await sim_text(sim, BODY)
    async with httpx.AsyncClient(verify=client_tls(tls_files), http2=True) as client:
        started = await client.post(
            routed.base_url + "/v1/streams", json={**BODY, "stream": False}, headers=auth()
        )
        assert started.status_code == 201
        stream_id = started.json()["stream"]
        assert started.headers["x-firstbyte-stream"] == stream_id
        seqs, text, running_seen = await poll_to_done(client, routed.base_url, stream_id, 0)
        assert running_seen  # at least one batch came while the stream was in progress
        assert seqs == list(range(1, len(seqs) + 1))
        assert text == expected
        replay = await client.get(
            f"{routed.base_url}/v1/streams/{stream_id}/poll",
            params={"after": 3, "wait": 0},
            headers=auth(),
        )
        assert [e["seq"] for e in replay.json()["events"]] == seqs[3:]
        assert replay.json()["done"] is True


async def test_long_poll_post_with_wait_carries_the_first_batch(
    sim: SimServer, routed: RouterEndpoints, tls_files: dict[str, str]
) -> None:
    """``POST /v1/streams?wait=S`` answers with the first events (one round trip to the first
    token); polling from its ``next`` yields the rest exactly once."""
    expected = await sim_text(sim, BODY)
    async with httpx.AsyncClient(verify=client_tls(tls_files), http2=True, timeout=10) as client:
        started = await client.post(
            routed.base_url + "/v1/streams", params={"wait": 5}, json=BODY, headers=auth()
        )
        assert started.status_code == 201
        first = started.json()
        stream_id = first["stream"]
        assert started.headers["x-firstbyte-stream"] == stream_id
        assert set(first) == {"stream", "events", "done", "next"}
        assert first["events"], first  # answered once events existed, not after the wait
        assert not first["done"]  # a 60-token stream at ~10 ms a token is still running
        assert first["next"] == first["events"][-1]["seq"]
        rest, rest_text, _ = await poll_to_done(client, routed.base_url, stream_id, first["next"])
        seqs = [e["seq"] for e in first["events"]] + rest
        text = "".join(chunk_text(e["data"]) for e in first["events"]) + rest_text
        assert seqs == list(range(1, len(seqs) + 1))  # every event exactly once, in order
        assert text == expected
        # Without wait (or wait=0) the answer stays the bare id, at once.
        bare = await client.post(routed.base_url + "/v1/streams", json=BODY, headers=auth())
        assert bare.status_code == 201
        assert set(bare.json()) == {"stream"}


async def ws_messages(ws: Any, until: int | None = None) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    async for raw in ws:
        message = json.loads(raw)
        messages.append(message)
        if message["type"] in ("done", "error"):
            break
        if until is not None and message.get("seq") == until:
            break
    return messages


async def test_websocket_resume_exactly_once(
    sim: SimServer, routed: RouterEndpoints, tls_files: dict[str, str]
) -> None:
    expected = await sim_text(sim, BODY)
    uri = routed.base_url.replace("https://", "wss://") + "/v1/ws"
    tls = client_tls(tls_files)
    async with ws_connect(uri, ssl=tls, additional_headers=auth(), proxy=None) as ws:
        await ws.send(json.dumps({"type": "request", "body": BODY}))
        first = await ws_messages(ws, until=5)
    assert first[0]["type"] == "start"
    stream_id = first[0]["stream"]
    assert [m["seq"] for m in first[1:]] == [1, 2, 3, 4, 5]
    async with ws_connect(uri, ssl=tls, additional_headers=auth(), proxy=None) as ws:
        await ws.send(json.dumps({"type": "resume", "stream": stream_id, "after": 5}))
        rest = await ws_messages(ws)
    assert rest[0] == {"type": "start", "stream": stream_id}
    events = [m for m in first[1:] + rest[1:] if m["type"] == "event"]
    assert rest[-1]["type"] == "done"
    assert [m["seq"] for m in events] == list(range(1, len(events) + 1))
    assert rest[-1]["seq"] == len(events) + 1
    text = "".join(chunk_text(m["data"]) for m in events)
    assert text == expected


async def sim_running(client: httpx.AsyncClient, sim: SimServer) -> float:
    text = (await client.get(sim.url + "/metrics")).text
    for line in text.splitlines():
        if line.startswith("vllm:num_requests_running"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no vllm:num_requests_running")


async def test_disconnect_cancels_upstream_after_grace(
    start_router: RouterFactory, tls_files: dict[str, str]
) -> None:
    grace = 1.0
    async with (
        sim_server("consumer-7b") as sim,
        start_router([sim.url], streams={"resume_grace_s": grace}) as endpoints,
        httpx.AsyncClient() as plain,
        httpx.AsyncClient(verify=client_tls(tls_files)) as client,
    ):
        # Seed 61 makes the sim say 256 tokens; at ~22 ms each that keeps it busy ~5.6 s.
        long = {**BODY, "max_tokens": 3000, "seed": 61}
        stream_id, first = await read_first_events(client, endpoints.base_url, 3, long)
        left_at = time.monotonic()
        assert len(first) == 3
        await asyncio.sleep(grace / 4)
        assert await sim_running(plain, sim) == 1  # inside the grace period: still running
        while await sim_running(plain, sim) != 0:
            assert time.monotonic() - left_at < grace + 10, "upstream request never cancelled"
            await asyncio.sleep(0.05)
        assert time.monotonic() - left_at >= grace * 0.9
        assert endpoints.app.state.cancelled_unattended == 1
        status = (await client.get(endpoints.base_url + "/v1/edge/status", headers=auth())).json()
        assert status["in_flight"] == 0
        # A late reader still gets what was produced, then a cancellation error and [DONE].
        late = await client.get(
            f"{endpoints.base_url}/v1/streams/{stream_id}?after=3", headers=auth()
        )
        events = SSEDecoder().receive_data(late.content)
        assert events[-1].data == "[DONE]"
        assert json.loads(events[-2].data)["error"]["code"] == "cancelled"


async def test_a_resume_before_the_first_token_sends_no_empty_server_timing(
    start_router: RouterFactory,
) -> None:
    """Nothing is timed yet (no first token): no ``Server-Timing`` at all (it was sent
    empty)."""
    async with sim_server("instant", faults=["stall:after=0"]) as stalled, start_router(
        [stalled.url], tls=False
    ) as router, httpx.AsyncClient(timeout=10) as client:
        body = {"model": "sim-instant", "messages": [{"role": "user", "content": "x"}],
                "max_tokens": 4}
        started = await client.post(router.base_url + "/v1/streams", json=body, headers=auth())
        stream_id = started.json()["stream"]
        async with client.stream("GET", router.base_url + f"/v1/streams/{stream_id}",
                                 headers=auth()) as resumed:
            assert resumed.status_code == 200
            assert "server-timing" not in resumed.headers
