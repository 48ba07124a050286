"""``listen.server = "auto"`` (the default): one port, HTTP/2 on hypercorn, HTTP/1.1 on uvicorn's
protocol, chosen by ALPN over TLS and by the first bytes without it; real sockets throughout."""

from __future__ import annotations

import asyncio
import json
import ssl
import time
from email.utils import parsedate_to_datetime
from typing import Any

import h2.config
import h2.connection
import h2.events
import httpx
import pytest

from firstbyte.router.hosting import ServerOptions, uvicorn_config
from firstbyte.router.hosting.http1_split import H2_PREFACE, Http1Handoff
from firstbyte.router.hosting.limits import ConnectionCounter
from firstbyte.router.serve import RouterEndpoints, describe
from tests.router.conftest import RouterFactory, auth, client_tls, router_config
from tests.router.upstream import Upstream

CHAT = "/v1/chat/completions"
STREAM = {
    "model": "m",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 5,
    "stream": True,
}


async def _versions_and_headers(
    url: str, verify: ssl.SSLContext | bool, **client: Any
) -> tuple[str, httpx.Headers, str]:
    async with (
        httpx.AsyncClient(verify=verify, timeout=20, **client) as c,
        c.stream("POST", url + CHAT, json=STREAM, headers=auth()) as response,
    ):
        body = "".join([part async for part in response.aiter_text()])
        return response.http_version, response.headers, body


async def test_tls_alpn_chooses_the_server_both_stream(
    router: RouterEndpoints, tls_files: dict[str, str]
) -> None:
    """ALPN ``h2`` is served by hypercorn, ``http/1.1`` by uvicorn's protocol: the same
    stream over each, with a ``Date`` and HTTP/3's ``Alt-Svc`` on both."""
    verify = client_tls(tls_files)
    h2_version, h2_headers, h2_body = await _versions_and_headers(
        router.base_url, verify, http2=True
    )
    h1_version, h1_headers, h1_body = await _versions_and_headers(router.base_url, verify)
    assert (h2_version, h1_version) == ("HTTP/2", "HTTP/1.1")
    assert h1_body.count("data: {") == h2_body.count("data: {") >= 5
    assert h1_body.rstrip().endswith("data: [DONE]")
    assert router.h3_port is not None
    for headers in (h1_headers, h2_headers):
        assert headers["alt-svc"] == f'h3=":{router.h3_port}"; ma=86400'
        assert abs(parsedate_to_datetime(headers["date"]).timestamp() - time.time()) < 5
        assert "server" not in headers


@pytest.mark.parametrize("server", ["auto", "hypercorn"])
async def test_alt_svc_advertises_the_published_port_when_it_differs(
    start_router: RouterFactory, upstream: Upstream, tls_files: dict[str, str], server: str
) -> None:
    """Behind ``-p 443:8443`` or a balancer the clients' port is not the router's:
    ``listen.http3_advertised_port`` is what ``alt-svc`` names, on HTTP/1.1 (uvicorn's
    protocol under ``auto``, hypercorn's under ``hypercorn``) and HTTP/2 alike."""
    verify = client_tls(tls_files)
    async with start_router([upstream.url], listen={"server": server,
                                                    "http3_advertised_port": 443}) as router:
        assert router.h3_port not in (None, 443)
        async with httpx.AsyncClient(verify=verify, http2=True) as h2, httpx.AsyncClient(
                verify=verify) as h1:
            answers = [await h2.get(router.base_url + "/healthz"),
                       await h1.get(router.base_url + "/healthz")]
    assert [a.http_version for a in answers] == ["HTTP/2", "HTTP/1.1"]
    assert [a.headers.get("alt-svc") for a in answers] == ['h3=":443"; ma=86400'] * 2
    config = router_config([upstream.url], tls_files, listen={"http3_advertised_port": 443})
    assert describe(config, router).endswith(
        f" and HTTP/3 on UDP {router.h3_port} (advertised as 443)")


async def test_plain_port_serves_http1_and_h2c_prior_knowledge(
    start_router: RouterFactory, upstream: Upstream
) -> None:
    async with start_router([upstream.url], tls=False) as router:
        h1 = await _versions_and_headers(router.base_url, False)
        h2c = await _versions_and_headers(router.base_url, False, http1=False, http2=True)
    assert (h1[0], h2c[0]) == ("HTTP/1.1", "HTTP/2")
    assert h1[2].count("data: {") == h2c[2].count("data: {") >= 5


async def test_h2c_preface_split_over_many_writes_still_reaches_hypercorn(
    start_router: RouterFactory, upstream: Upstream
) -> None:
    """The preface's 24 bytes arriving a few at a time are still recognised as HTTP/2."""
    async with start_router([upstream.url], tls=False) as router:
        reader, writer = await asyncio.open_connection("127.0.0.1", router.port)
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        conn.initiate_connection()
        opening = conn.data_to_send()
        assert opening.startswith(H2_PREFACE)
        for i in range(0, len(H2_PREFACE), 5):
            writer.write(opening[i : min(i + 5, len(H2_PREFACE))])
            await writer.drain()
            await asyncio.sleep(0.02)
        writer.write(opening[len(H2_PREFACE) :])
        conn.send_headers(
            1, [(":method", "GET"), (":path", "/healthz"), (":scheme", "http"),
                (":authority", "x")], end_stream=True,
        )
        writer.write(conn.data_to_send())
        status = None
        async with asyncio.timeout(10):
            while status is None:
                data = await reader.read(65536)
                assert data, "closed before a response"
                for event in conn.receive_data(data):
                    if isinstance(event, h2.events.ResponseReceived):
                        status = dict(event.headers)[b":status"]
                writer.write(conn.data_to_send())
        writer.close()
    assert status == b"200"


async def test_silent_plain_connection_counts_and_is_closed(
    start_router: RouterFactory, upstream: Upstream
) -> None:
    """Without TLS the first bytes decide the server; while they are awaited, the connection
    counts for its client (over the hard cap: 503 after the request's head) and is closed at
    the keep-alive timeout if nothing comes."""
    async with start_router(
        [upstream.url], tls=False,
        listen={"keep_alive_timeout_s": 1.0}, limits={"hard_max_connections_per_client": 2},
    ) as router:
        started = time.monotonic()
        held = [await asyncio.open_connection("127.0.0.1", router.port) for _ in range(2)]
        await asyncio.sleep(0.2)
        reader, writer = await asyncio.open_connection("127.0.0.1", router.port)
        writer.write(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
        refused = await asyncio.wait_for(reader.read(), 5)
        writer.close()
        assert refused.startswith(b"HTTP/1.1 503"), refused
        # Closed (a hang fails the wait), and not before the keep-alive timeout.
        closed = await asyncio.gather(*(asyncio.wait_for(r.read(), 20) for r, _ in held))
        assert closed == [b"", b""]
        assert time.monotonic() - started >= 1.0 - 0.05  # the loop's timer may fire early
        for _, w in held:
            w.close()
        # Their count was given back: the address connects and is served again.
        async with httpx.AsyncClient() as c:
            assert (await c.get(router.base_url + "/healthz")).status_code == 200


async def test_bytes_buffered_before_the_hand_over_come_first() -> None:
    """A request that arrived before hypercorn's connection task ran (with the TLS handshake,
    typically) sits in hypercorn's stream reader: uvicorn must get it first, then the rest,
    in order. Here the connection task waits until two pipelined requests are buffered."""
    seen: list[str] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        seen.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": scope["path"].encode()})

    options = ServerOptions(server="auto", lifespan=False)
    counter = ConnectionCounter(options.limits, 1024)
    config = uvicorn_config(app, options, counter, tls=False)
    config.load()
    handoff = Http1Handoff(config, counter)
    handoff.start()
    terminated = asyncio.Event()
    served: list[asyncio.Task[None]] = []

    async def connected(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(0.3)  # the client's bytes are in ``reader`` by now
        served.append(asyncio.current_task())  # type: ignore[arg-type]
        await handoff.serve(reader, writer, terminated, {})

    server = await asyncio.start_server(connected, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /one HTTP/1.1\r\nhost: x\r\n\r\nGET /two HTTP/1")
        await asyncio.sleep(0.5)
        writer.write(b".1\r\nhost: x\r\n\r\n")  # after the hand-over: straight to uvicorn
        data = b""
        async with asyncio.timeout(10):
            while data.count(b"HTTP/1.1 200") < 2 or not data.endswith(b"0\r\n\r\n"):
                chunk = await reader.read(65536)
                assert chunk, data
                data += chunk
        terminated.set()  # the drain: uvicorn closes the idle connection
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()
    finally:
        server.close()
        handoff.stop()
    assert seen == ["/one", "/two"]
    assert data.index(b"/one") < data.index(b"/two")
    assert served
    assert served[0].done()


@pytest.mark.parametrize("tls", [True, False], ids=["tls", "plain"])
async def test_drain_lets_an_http1_stream_finish(
    start_router: RouterFactory, upstream: Upstream, tls_files: dict[str, str], tls: bool
) -> None:
    """At shutdown an HTTP/1.1 stream in flight on uvicorn's protocol runs to its end, next to
    an idle kept-alive connection; nothing is cut."""
    upstream.delay_s = 0.05
    verify: ssl.SSLContext | bool = client_tls(tls_files) if tls else False
    body = {**STREAM, "max_tokens": 30}  # ~1.5 s
    async with httpx.AsyncClient(verify=verify, timeout=20) as streaming, \
            httpx.AsyncClient(verify=verify, timeout=20) as idle:
        async with start_router([upstream.url], tls=tls) as router:
            assert (await idle.get(router.base_url + "/healthz")).status_code == 200
            response = await streaming.send(
                streaming.build_request("POST", router.base_url + CHAT, json=body, headers=auth()),
                stream=True,
            )
            lines = response.aiter_lines()
            assert (await anext(lines)).startswith("id: ")
        # The router has stopped; the stream must have ended whole.
        rest = [line async for line in lines]
        await response.aclose()
    data = [line[len("data: ") :] for line in rest if line.startswith("data: ")]
    assert data[-1] == "[DONE]", rest[-4:]
    chunks = [json.loads(d)["choices"][0]["delta"].get("content") or "" for d in data[:-1]]
    # Every token after the first line read: w1 to w29 (w0 may have come with that line).
    assert "".join(chunks).split()[-29:] == [f"w{i}" for i in range(1, 30)]
