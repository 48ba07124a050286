"""A draining router sends HTTP/1.1 clients away: on a kept-alive connection, every answer it
gives once the drain began (the 503 ``draining`` refusal, ``/healthz``'s 503, a refused
WebSocket upgrade) says ``connection: close`` and the server closes the socket after it, under
each in-process server (``auto``: uvicorn's HTTP/1.1, ``hypercorn``: h11, ``uvicorn``). A
balancer that pins a client connection to a process then opens the client's next request on
a new connection, which it sends to a healthy process. HTTP/2 has GOAWAY for that
(tests/router/operate/test_drain.py): there the header is forbidden and the connection stays.
``/healthz``'s 503 has the request refusal's ``Retry-After``. Real servers on loopback, a raw
socket read with h11."""

from __future__ import annotations

import asyncio
import json

import h11
import httpx
import pytest
from websockets.asyncio.client import connect as ws_connect

from firstbyte.protocol import error_codes
from firstbyte.router.multiregion import DRAINING_RETRY_AFTER_S
from firstbyte.router.serve import RouterEndpoints
from tests.router.conftest import API_KEY, RouterFactory, auth, client_tls
from tests.router.upstream import Upstream

BODY = {"model": "test-model", "messages": [{"role": "user", "content": "hi"}], "stream": True}


class KeptAlive:
    """One HTTP/1.1 connection, its requests sent and answers read one after the other."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.h11 = h11.Connection(h11.CLIENT)

    @classmethod
    async def open(cls, router: RouterEndpoints) -> KeptAlive:
        return cls(*await asyncio.open_connection("127.0.0.1", router.port))

    async def request(
        self, method: str, path: str, body: bytes = b"", key: str = API_KEY,
        extra: tuple[tuple[str, str], ...] = (),
    ) -> tuple[int, dict[str, str], bytes]:
        """Send a request, read its whole answer: status, headers (lower-cased), body."""
        if self.h11.our_state is h11.DONE:
            self.h11.start_next_cycle()
        headers = [("host", "127.0.0.1"), ("content-length", str(len(body))),
                   ("authorization", f"Bearer {key}"), ("content-type", "application/json"),
                   *extra]
        self.writer.write(self.h11.send(h11.Request(method=method, target=path, headers=headers))
                          + self.h11.send(h11.Data(data=body)) + self.h11.send(h11.EndOfMessage()))
        status, head, content = 0, {}, b""
        async with asyncio.timeout(20):
            while True:
                event = self.h11.next_event()
                if event is h11.NEED_DATA:
                    self.h11.receive_data(await self.reader.read(65536))
                elif isinstance(event, h11.Response | h11.InformationalResponse):
                    status = event.status_code
                    head = {k.decode(): v.decode() for k, v in event.headers}
                elif event is h11.PAUSED:  # a 101: the connection is a WebSocket's now
                    return status, head, content
                elif isinstance(event, h11.Data):
                    content += event.data
                elif isinstance(event, h11.EndOfMessage):
                    return status, head, content

    async def closed_by_server(self) -> bool:
        """Does the server close the connection (EOF) without a request more?"""
        async with asyncio.timeout(10):
            return await self.reader.read(65536) == b""

    def close(self) -> None:
        self.writer.close()


@pytest.mark.parametrize("server", ["auto", "hypercorn", "uvicorn"])
async def test_a_draining_router_closes_kept_alive_http1_connections_after_its_answer(
    start_router: RouterFactory, upstream: Upstream, server: str
) -> None:
    async with start_router([upstream.url], tls=False,
                            listen={"server": server, "http3": False}) as router:
        refusal, health = await KeptAlive.open(router), await KeptAlive.open(router)
        try:
            # Before the drain both connections are kept alive...
            status, head, _ = await refusal.request("GET", "/healthz")
            assert (status, head.get("connection")) == (200, None)
            status, head, _ = await health.request("GET", "/healthz")
            assert (status, head.get("connection")) == (200, None)
            router.app.state.start_draining()
            # ... and after it, the next answer on each closes its connection.
            status, head, content = await refusal.request(
                "POST", "/v1/chat/completions", json.dumps(BODY).encode())
            assert (status, json.loads(content)["error"]["code"]) == (503, error_codes.DRAINING)
            assert head["retry-after"] == "1"
            assert head["connection"] == "close"
            assert await refusal.closed_by_server()
            status, head, content = await health.request("GET", "/healthz")
            assert (status, content.strip().decode()) == (503, error_codes.DRAINING)
            assert head["retry-after"] == "1"  # the refusal's figure
            assert head["connection"] == "close"
            assert await health.closed_by_server()
        finally:
            refusal.close()
            health.close()
    assert upstream.started == 0


UPGRADE = (("upgrade", "websocket"), ("connection", "Upgrade"),
           ("sec-websocket-key", "dGhlIHNhbXBsZSBub25jZQ=="), ("sec-websocket-version", "13"))


@pytest.mark.parametrize("server", ["auto", "hypercorn", "uvicorn"])
async def test_a_draining_routers_refused_websocket_upgrade_closes_its_http1_connection(
    start_router: RouterFactory, upstream: Upstream, server: str
) -> None:
    """A WebSocket upgrade the router refuses with an HTTP answer (``websocket.http.response``:
    a wrong key's 401 here, a short-of-memory 503) is an HTTP/1.1 answer like the others: while
    draining it says ``connection: close`` too, and the connection closes after it."""
    async with start_router([upstream.url], tls=False,
                            listen={"server": server, "http3": False}) as router:
        router.app.state.start_draining()
        upgrade = await KeptAlive.open(router)
        try:
            status, head, content = await upgrade.request(
                "GET", "/v1/ws", key="sk-not-a-key-0000", extra=UPGRADE)
            assert (status, json.loads(content)["error"]["code"]) == (401, "invalid_api_key")
            assert head.get("connection") == "close"
            assert await upgrade.closed_by_server()
        finally:
            upgrade.close()


@pytest.mark.parametrize("server", ["auto", "hypercorn", "uvicorn"])
async def test_a_draining_router_refuses_a_new_websocket_but_serves_an_open_one(
    start_router: RouterFactory, upstream: Upstream, server: str
) -> None:
    """A new upgrade gets the HTTP request's refusal (503 ``draining``, its ``Retry-After``,
    ``connection: close``), not a 101 to a socket that would stay on this process and
    refuse each request sent on it; a socket opened before the drain still gets the rest of
    the stream it carries (the upstream holds it after its first word meanwhile)."""
    upstream.pause = asyncio.Event()
    async with start_router([upstream.url], tls=False,
                            listen={"server": server, "http3": False}) as router:
        url = router.base_url.replace("http://", "ws://") + "/v1/ws"
        async with ws_connect(url, additional_headers=auth(), proxy=None) as ws, \
                asyncio.timeout(30):
            await ws.send(json.dumps({"type": "request", "body": {**BODY, "max_tokens": 3}}))
            messages = [json.loads(await ws.recv())]
            while "w0" not in json.dumps(messages[-1]):
                messages.append(json.loads(await ws.recv()))
            router.app.state.start_draining()
            upgrade = await KeptAlive.open(router)
            try:
                status, head, content = await upgrade.request("GET", "/v1/ws", extra=UPGRADE)
                assert await upgrade.closed_by_server()
            finally:
                upgrade.close()
                upstream.pause.set()  # else the stream holds the router's exit
            while messages[-1]["type"] not in ("done", "error"):
                messages.append(json.loads(await ws.recv()))
    assert (status, json.loads(content)["error"]["code"]) == (503, error_codes.DRAINING)
    assert head["retry-after"] == str(DRAINING_RETRY_AFTER_S)
    assert head["connection"] == "close"
    assert router.app.state.metrics.requests[("ws", "draining", "")] == 1
    assert messages[0]["type"] == "start"
    assert messages[-1]["type"] == "done"
    text = "".join(json.dumps(m) for m in messages)
    assert all(word in text for word in ("w0", "w1", "w2"))
    assert upstream.completed == 1


@pytest.mark.parametrize("server", ["auto", "hypercorn"])
async def test_http2_answers_of_a_draining_router_keep_their_connection(
    start_router: RouterFactory, upstream: Upstream, tls_files: dict[str, str], server: str
) -> None:
    """No ``connection`` header on HTTP/2 (forbidden there: GOAWAY does its job), and the
    connection carries the next request."""
    async with start_router([upstream.url], listen={"server": server, "http3": False}) as router, \
            httpx.AsyncClient(verify=client_tls(tls_files), http2=True) as http:
        router.app.state.start_draining()
        answers = [
            await http.post(f"{router.base_url}/v1/chat/completions", json=BODY,
                            headers={"authorization": f"Bearer {API_KEY}"}),
            await http.get(f"{router.base_url}/healthz"),
        ]
        addresses = {a.extensions["network_stream"].get_extra_info("client_addr")
                     for a in answers}
    assert len(addresses) == 1  # one connection carried both
    for answer in answers:
        assert (answer.status_code, answer.http_version) == (503, "HTTP/2")
        assert "connection" not in answer.headers
        assert answer.headers["retry-after"] == "1"
