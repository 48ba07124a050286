"""Bad input gets a clear 4xx (or a WebSocket close code with a reason), never a hang, and
the router keeps serving afterwards."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import httpx
import pytest
from websockets.asyncio.client import ClientConnection
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosedError, InvalidStatus

from firstbyte.router.serve import RouterEndpoints
from tests.router.conftest import OTHER_KEY, RouterFactory, auth, client_tls
from tests.router.upstream import Upstream

BODY = {
    "model": "m",
    "messages": [{"role": "user", "content": "hi"}],
    "stream": True,
    "max_tokens": 4,
}
MAX_BODY = 4096


@pytest.fixture
async def routed(start_router: RouterFactory, upstream: Upstream) -> AsyncIterator[RouterEndpoints]:
    async with start_router([upstream.url], limits={"max_body_bytes": MAX_BODY}) as endpoints:
        yield endpoints


@pytest.fixture
async def client(tls_files: dict[str, str]) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(verify=client_tls(tls_files), http2=True, timeout=10) as c:
        yield c


def error_of(response: httpx.Response) -> dict[str, str]:
    assert response.headers["content-type"].startswith("application/json")
    error: dict[str, str] = response.json()["error"]
    assert error["message"]
    return error


async def start_stream(client: httpx.AsyncClient, url: str) -> str:
    response = await client.post(url + "/v1/chat/completions", json=BODY, headers=auth())
    assert response.status_code == 200
    return response.headers["x-firstbyte-stream"]


async def still_serves(client: httpx.AsyncClient, url: str) -> None:
    response = await client.post(url + "/v1/chat/completions", json=BODY, headers=auth())
    assert response.status_code == 200
    assert response.text.endswith("data: [DONE]\n\n")


async def test_http_bad_input(routed: RouterEndpoints, client: httpx.AsyncClient) -> None:
    url = routed.base_url
    chat = url + "/v1/chat/completions"

    response = await client.post(chat, content=b"{not json", headers=auth())
    assert response.status_code == 400
    assert "not valid JSON" in error_of(response)["message"]

    response = await client.post(chat, json={"model": "m", "messages": "nope"}, headers=auth())
    assert response.status_code == 400
    assert error_of(response)["param"] == "messages"

    big = {**BODY, "messages": [{"role": "user", "content": "x" * (MAX_BODY + 1)}]}
    response = await client.post(chat, json=big, headers=auth())
    assert response.status_code == 413
    assert error_of(response)["code"] == "request_too_large"

    async def chunked() -> AsyncIterator[bytes]:  # no content-length: the limit still holds
        for _ in range(10):
            yield b"x" * 1024

    response = await client.post(chat, content=chunked(), headers=auth())
    assert response.status_code == 413

    for headers in ({}, {"authorization": "Bearer sk-wrong-key-000"}, {"authorization": "Token x"}):
        response = await client.post(chat, json=BODY, headers=headers)
        assert response.status_code == 401
        assert error_of(response)["type"] == "authentication_error"
    assert (await client.get(url + "/v1/models")).status_code == 401

    stream_id = await start_stream(client, url)
    unknown = "A" * 22
    for path in (f"/v1/streams/{unknown}", f"/v1/streams/{unknown}/poll?wait=0"):
        response = await client.get(url + path, headers=auth())
        assert response.status_code == 404
        assert error_of(response)["code"] == "stream_not_found"
    for path in (f"/v1/streams/{stream_id}", f"/v1/streams/{stream_id}/poll?wait=0"):
        foreign = await client.get(url + path, headers=auth(OTHER_KEY))
        assert foreign.status_code == 404  # another key's stream: same answer as unknown
        assert (
            foreign.json()
            == (await client.get(url + path.replace(stream_id, unknown), headers=auth())).json()
        )

    for headers, path in (
        ({"last-event-id": "abc"}, f"/v1/streams/{stream_id}"),
        ({"last-event-id": "-1"}, f"/v1/streams/{stream_id}"),
        ({}, f"/v1/streams/{stream_id}?after=1.5"),
        ({}, f"/v1/streams/{stream_id}/poll?after=x"),
        ({}, f"/v1/streams/{stream_id}/poll?after=1&wait=999"),
        ({}, f"/v1/streams/{stream_id}/poll?after=1&wait=soon"),
    ):
        response = await client.get(url + path, headers={**auth(), **headers})
        assert response.status_code == 400, path
        assert error_of(response)["param"] in ("after", "wait")

    streams_before = (await client.get(url + "/v1/edge/status", headers=auth())).json()["streams"]
    for wait in ("999", "soon", "-1", "nan", ""):
        response = await client.post(
            url + "/v1/streams", params={"wait": wait}, json=BODY, headers=auth()
        )
        assert response.status_code == 400, wait
        assert error_of(response)["param"] == "wait"
    # Rejected before a stream is created or a routing slot is taken.
    assert (await client.get(url + "/v1/edge/status", headers=auth())).json()["streams"] == streams_before

    assert (await client.get(url + "/v1/nothing", headers=auth())).status_code == 404
    assert (await client.get(chat, headers=auth())).status_code == 405
    await still_serves(client, url)


async def test_websocket_bad_input(
    routed: RouterEndpoints, client: httpx.AsyncClient, tls_files: dict[str, str]
) -> None:
    uri = routed.base_url.replace("https://", "wss://") + "/v1/ws"
    tls = client_tls(tls_files)

    with pytest.raises(InvalidStatus) as refused:
        async with ws_connect(uri, ssl=tls, proxy=None):
            pass
    assert refused.value.response.status_code == 401

    cases = [
        ("not json", 1007),
        (json.dumps({"type": "dance"}), 1007),
        (json.dumps({"type": "resume", "stream": "x", "after": -1}), 1007),
        (json.dumps({"type": "request", "body": {"model": "m"}}), 1007),
        (json.dumps({"type": "resume", "stream": "A" * 22, "after": 0}), 1008),
    ]
    for message, code in cases:
        async with ws_connect(uri, ssl=tls, additional_headers=auth(), proxy=None) as ws:
            await ws.send(message)
            reply = json.loads(await ws.recv())
            assert reply["type"] == "error"
            assert reply["error"]["message"]
            with pytest.raises(ConnectionClosedError) as closed:
                await ws.recv()
            assert closed.value.rcvd is not None
            assert closed.value.rcvd.code == code, message
            assert closed.value.rcvd.reason

    stream_id = await start_stream(client, routed.base_url)
    async with ws_connect(uri, ssl=tls, additional_headers=auth(OTHER_KEY), proxy=None) as ws:
        await ws.send(json.dumps({"type": "resume", "stream": stream_id, "after": 0}))
        assert json.loads(await ws.recv())["type"] == "error"
        with pytest.raises(ConnectionClosedError) as closed:
            await ws.recv()
        assert closed.value.rcvd is not None
        assert closed.value.rcvd.code == 1008
    await still_serves(client, routed.base_url)


@pytest.mark.parametrize("server", ["hypercorn", "uvicorn"])
async def test_websocket_message_over_the_body_limit_is_refused(
    start_router: RouterFactory, upstream: Upstream, tls_files: dict[str, str], server: str
) -> None:
    """A message far over ``max_body_bytes`` is cut off by the server (1009), not buffered."""
    listen = {"server": server, "http3": server == "hypercorn"}
    limits = {"max_body_bytes": MAX_BODY}
    async with start_router([upstream.url], listen=listen, limits=limits) as endpoints:
        uri = endpoints.base_url.replace("https://", "wss://") + "/v1/ws"
        tls = client_tls(tls_files)
        async with ws_connect(
            uri, ssl=tls, additional_headers=auth(), proxy=None, max_size=None
        ) as ws:
            await ws.send(json.dumps({"type": "request", "body": BODY, "pad": "x" * 64 * MAX_BODY}))
            with pytest.raises(ConnectionClosedError) as closed:
                await ws.recv()
            assert closed.value.rcvd is not None
            assert closed.value.rcvd.code == 1009
        # A request body at the limit still fits in one message.
        body = {**BODY, "user": "u" * (MAX_BODY - len(json.dumps(BODY)) - 20)}
        async with ws_connect(uri, ssl=tls, additional_headers=auth(), proxy=None) as ws:
            await ws.send(json.dumps({"type": "request", "body": body}))
            assert json.loads(await ws.recv())["type"] == "start"


async def test_websocket_streams_per_socket_are_bounded(
    routed: RouterEndpoints, upstream: Upstream, tls_files: dict[str, str]
) -> None:
    from firstbyte.router.ws import MAX_STREAMS_PER_SOCKET

    upstream.delay_s = 0.5  # the stream outlives the test: every follower stays attached
    uri = routed.base_url.replace("https://", "wss://") + "/v1/ws"
    async with ws_connect(
        uri, ssl=client_tls(tls_files), additional_headers=auth(), proxy=None
    ) as ws:
        await ws.send(json.dumps({"type": "request", "body": {**BODY, "max_tokens": 40}}))
        started = json.loads(await ws.recv())
        assert started["type"] == "start"
        resume = json.dumps({"type": "resume", "stream": started["stream"], "after": 0})
        for _ in range(MAX_STREAMS_PER_SOCKET - 1):
            await ws.send(resume)
        await ws.send(resume)  # one past the bound
        assert await error_codes_until_closed(ws) == (["too_many_streams"], 1008)


async def error_codes_until_closed(ws: ClientConnection) -> tuple[list[str], int | None]:
    """The error codes the router sends until it closes the socket, and its close code."""
    codes: list[str] = []
    try:
        while True:
            async with asyncio.timeout(10):  # fail, not hang, if the socket stays open
                reply = json.loads(await ws.recv())
            if reply["type"] == "error":
                codes.append(reply["error"]["code"])
    except ConnectionClosedError as closed:
        return codes, closed.rcvd.code if closed.rcvd is not None else None


async def test_upstream_errors_are_relayed(
    start_router: RouterFactory, tls_files: dict[str, str]
) -> None:
    from tests.router.upstream import running_upstream

    async with (
        running_upstream(fail_status=503) as failing,
        start_router([failing.url]) as endpoints,
        httpx.AsyncClient(verify=client_tls(tls_files)) as client,
    ):
        response = await client.post(
            endpoints.base_url + "/v1/chat/completions", json=BODY, headers=auth()
        )
        assert response.status_code == 503
        assert error_of(response)["code"] == "busy"
    async with (
        start_router(["http://127.0.0.1:9"]) as endpoints,  # nothing listens on port 9
        httpx.AsyncClient(verify=client_tls(tls_files)) as client,
    ):
        response = await client.post(
            endpoints.base_url + "/v1/chat/completions", json=BODY, headers=auth()
        )
        # 502 if the request got there first, 503 once health checks marked it down.
        assert response.status_code in (502, 503)
        assert error_of(response)["type"] == "server_error"


async def test_no_secrets_in_logs(
    routed: RouterEndpoints, client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    import logging

    from tests.router.conftest import API_KEY

    # Everything at INFO (what `firstbyte router -v` shows), our own and the servers' at DEBUG.
    # (hpack logs header values at DEBUG: never run a production router at DEBUG globally.)
    caplog.set_level(logging.INFO)
    for name in ("firstbyte", "router", "hypercorn", "uvicorn", "httpx", "httpcore"):
        caplog.set_level(logging.DEBUG, logger=name)
    wrong = "sk-wrong-secret-999"
    await client.post(routed.base_url + "/v1/chat/completions", json=BODY, headers=auth(wrong))
    await client.post(routed.base_url + "/v1/chat/completions", content=b"{", headers=auth())
    stream_id = await start_stream(client, routed.base_url)
    await client.get(f"{routed.base_url}/v1/streams/{stream_id}", headers=auth())
    text = "\n".join(record.getMessage() for record in caplog.records)
    assert API_KEY not in text
    assert wrong not in text
