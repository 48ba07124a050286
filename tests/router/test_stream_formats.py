"""Starting a stream of any format over long-poll and WebSocket, through the real router.

``POST /v1/streams?endpoint=NAME`` and a WebSocket ``request`` message's ``endpoint`` name
the body's format (default chat): the router sends it to that format's path upstream, with
``stream`` forced on, and the stream reads like one started over SSE.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosedError

from firstbyte.benchmarks.redis_server import RedisServer
from firstbyte.protocol import error_codes
from firstbyte.protocol.sse import SSEDecoder
from firstbyte.router.serve import RouterEndpoints
from tests.router.conftest import RouterFactory, auth, client_tls
from tests.router.formats_upstream import FormatsUpstream, running_formats_upstream
from tests.router.redis_fixture import redis_server  # noqa: F401 (a fixture)
from tests.router.test_shared_state import running_pair

MESSAGES_BODY = {"model": "test-model", "max_tokens": 3,
                 "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
async def formats(
    start_router: RouterFactory,
) -> AsyncIterator[tuple[RouterEndpoints, FormatsUpstream]]:
    async with running_formats_upstream() as up, start_router([up.url]) as router:
        yield router, up


async def test_longpoll_starts_a_stream_in_the_named_format(
    formats: tuple[RouterEndpoints, FormatsUpstream], tls_files: dict[str, str]
) -> None:
    router, up = formats
    async with httpx.AsyncClient(verify=client_tls(tls_files), timeout=10) as client:
        started = await client.post(router.base_url + "/v1/streams?wait=5&endpoint=messages",
                                    json=MESSAGES_BODY, headers=auth())
        assert started.status_code == 201
        batch = started.json()
        events = list(batch["events"])
        while not batch["done"]:
            batch = (await client.get(
                f"{router.base_url}/v1/streams/{batch['stream']}/poll",
                params={"after": batch["next"], "wait": 5}, headers=auth())).json()
            events += batch["events"]
    kinds = [event["data"]["type"] for event in events]
    assert kinds[0] == "message_start"
    assert kinds[-1] == "message_stop"
    assert kinds.count("content_block_delta") == 3
    assert [event["seq"] for event in events] == list(range(1, len(events) + 1))
    path, _, body = up.received[-1]
    assert path == "/v1/messages"
    assert body["stream"] is True  # forced, as for chat


async def test_longpoll_refuses_an_unknown_endpoint_before_upstream(
    formats: tuple[RouterEndpoints, FormatsUpstream], tls_files: dict[str, str]
) -> None:
    router, up = formats
    async with httpx.AsyncClient(verify=client_tls(tls_files), timeout=10) as client:
        for name in ("embeddings", "bogus"):
            refused = await client.post(router.base_url + f"/v1/streams?endpoint={name}",
                                        json={"model": "test-model", "input": "x",
                                              "messages": [{"role": "user", "content": "x"}]},
                                        headers=auth())
            assert refused.status_code == 400
            error = refused.json()["error"]
            assert (error["param"], error["code"]) == ("endpoint", "invalid_request")
            assert "responses" in error["message"]
    assert up.received == []


async def test_longpoll_names_a_misspelt_endpoint_not_the_body(
    formats: tuple[RouterEndpoints, FormatsUpstream], tls_files: dict[str, str]
) -> None:
    """A Responses body started with a misspelt ``endpoint`` is refused for the name, not
    for lacking chat's ``messages`` (the body is not read as chat)."""
    router, up = formats
    async with httpx.AsyncClient(verify=client_tls(tls_files), timeout=10) as client:
        refused = await client.post(router.base_url + "/v1/streams?endpoint=response",
                                    json={"model": "test-model", "input": "hi"}, headers=auth())
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert (error["param"], error["code"]) == ("endpoint", "invalid_request")
    assert up.received == []


async def test_websocket_starts_a_stream_in_the_named_format(
    formats: tuple[RouterEndpoints, FormatsUpstream], tls_files: dict[str, str]
) -> None:
    router, up = formats
    uri = router.base_url.replace("https://", "wss://") + "/v1/ws"
    request = {"type": "request", "endpoint": "responses",
               "body": {"model": "test-model", "input": "hi", "max_output_tokens": 4}}
    async with ws_connect(uri, ssl=client_tls(tls_files), additional_headers=auth(),
                          proxy=None) as ws:
        await ws.send(json.dumps(request))
        messages = []
        while not messages or messages[-1]["type"] not in ("done", "error"):
            messages.append(json.loads(await ws.recv()))
        await ws.send(json.dumps({**request, "endpoint": "embeddings"}))
        refused = json.loads(await ws.recv())
        with pytest.raises(ConnectionClosedError) as closed:
            await ws.recv()
    assert messages[0]["type"] == "start"
    assert messages[-1]["type"] == "done"
    data = [m["data"] for m in messages if m["type"] == "event"]
    assert [d["sequence_number"] for d in data] == list(range(len(data)))
    assert data[-1]["type"] == "response.completed"
    assert "".join(d["delta"] for d in data if d["type"] == "response.output_text.delta") == (
        "w0 w1 w2 w3")
    assert [path for path, _, _ in up.received] == ["/v1/responses"]
    assert refused["type"] == "error"
    assert closed.value.rcvd is not None
    assert closed.value.rcvd.code == 1007


async def test_a_killed_producer_ends_a_longpoll_started_stream_in_its_format(
    redis_server: RedisServer, tls_files: dict[str, str], tmp_path: Path,  # noqa: F811
) -> None:
    """A Messages stream started with ``POST /v1/streams?endpoint=messages`` on router A,
    A killed mid-stream: a reader on B gets Anthropic's ``event: error`` with
    ``stream_lost``, as for a stream started on ``/v1/messages``."""
    async with running_formats_upstream(delay_s=0.05) as up, running_pair(
        tmp_path, tls_files, redis_server.url, up.url, key_prefix="fb-lost-longpoll:"
    ) as (a, b), httpx.AsyncClient(verify=client_tls(tls_files), timeout=30) as client:
        started = await client.post(a.url + "/v1/streams?endpoint=messages&wait=5",
                                    json={**MESSAGES_BODY, "max_tokens": 400}, headers=auth())
        assert started.status_code == 201
        stream_id = started.json()["stream"]
        os.killpg(a.process.pid, signal.SIGKILL)
        resumed = await client.get(f"{b.url}/v1/streams/{stream_id}", headers=auth())
    assert resumed.status_code == 200
    events = SSEDecoder().receive_data(resumed.content)
    assert events[-1].event == "error"
    assert json.loads(events[-1].data)["error"]["code"] == error_codes.STREAM_LOST
