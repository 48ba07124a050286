"""PROXY protocol on real sockets: a real HAProxy (``send-proxy``, ``send-proxy-v2``) in front
of a router on loopback, TLS and plain, on each server; the client address its header carries
is the one per-address limits, GeoIP and forwarding-header trust see; a header from anyone
else, a malformed one, or a balancer's silence closes the connection with one log line.

Loopback addresses stand in for the hosts: clients connect from 127.0.0.2 and 127.0.0.3,
HAProxy connects to the router from 127.0.0.4 (the only listed balancer), and a client that
talks to the router directly comes from 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import ssl
import struct
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from firstbyte.router.hosting import hardening
from firstbyte.router.hosting.limits import Throttle
from firstbyte.router.hosting.proxy_protocol import V2_SIGNATURE
from tests.haproxy import running_haproxy
from tests.router.conftest import RouterFactory, auth, client_tls
from tests.router.geo_fixtures import FRANKFURT_CLIENT, TOKYO_CLIENT, write_city_mmdb
from tests.router.upstream import Upstream

BALANCER = "127.0.0.4"
CLIENT = "127.0.0.2"
OTHER_CLIENT = "127.0.0.3"


@contextlib.asynccontextmanager
async def haproxy_in_front(router_port: int, send: str, directory: Path) -> AsyncIterator[int]:
    """HAProxy (:func:`tests.haproxy.running_haproxy`) relaying to the router from
    :data:`BALANCER` with ``send`` (``send-proxy`` or ``send-proxy-v2``); yields the port
    clients connect to."""
    backend = (
        # Health checks every 200 ms: they carry a header too (v2: LOCAL; v1: HAProxy's own
        # addresses), and must be served, never logged as errors.
        f"backend router\n    server r 127.0.0.1:{router_port} {send} source {BALANCER}"
        " check inter 200ms\n"
    )
    async with running_haproxy(backend, directory, f"haproxy-{router_port}") as balancer:
        yield balancer.port


@pytest.fixture(autouse=True)
def fresh_log_throttle(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Each test sees its own refusals' lines (one per reason per 10 s, process-wide)."""
    monkeypatch.setattr(hardening, "_throttle", Throttle(10.0))
    caplog.set_level(logging.INFO)


def _client(tls_files: dict[str, str], local: str, http2: bool) -> httpx.AsyncClient:
    transport = httpx.AsyncHTTPTransport(
        verify=client_tls(tls_files), local_address=local, http2=http2
    )
    return httpx.AsyncClient(transport=transport, timeout=20)


def _listen(server: str, balancers: list[str]) -> dict[str, Any]:
    return {
        "server": server, "http3": False, "proxy_protocol": True,
        "proxy_protocol_from": balancers,
    }  # fmt: skip


@pytest.mark.parametrize(
    ("server", "tls", "send"),
    [
        ("auto", True, "send-proxy-v2"),
        ("hypercorn", True, "send-proxy"),
        ("uvicorn", True, "send-proxy-v2"),
        ("auto", False, "send-proxy"),
        ("hypercorn", False, "send-proxy-v2"),
        ("uvicorn", False, "send-proxy"),
    ],
)
async def test_clients_behind_haproxy_are_counted_by_their_own_address(
    start_router: RouterFactory,
    upstream: Upstream,
    tls_files: dict[str, str],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    server: str,
    tls: bool,
    send: str,
) -> None:
    """With one connection per address allowed, a client holding its connection through
    HAProxy gets 503 on a second one, while another client behind the same HAProxy is
    served: each is counted for the address HAProxy's header reports, not HAProxy's. A
    client connecting directly, from an address not listed, is served as without PROXY
    protocol. HTTP/2 over TLS where the server has it (hypercorn), HTTP/1.1 otherwise."""
    async with start_router(
        [upstream.url], tls=tls, listen=_listen(server, [f"{BALANCER}/32"]),
        limits={"hard_max_connections_per_client": 1},
    ) as router:
        scheme = "https" if tls else "http"
        http2 = tls and server != "uvicorn"
        async with haproxy_in_front(router.port, send, tmp_path) as port:
            url = f"{scheme}://127.0.0.1:{port}/healthz"
            async with _client(tls_files, CLIENT, http2) as holder:
                held = await holder.get(url)
                assert held.status_code == 200, held.text
                assert held.http_version == ("HTTP/2" if http2 else "HTTP/1.1")
                async with _client(tls_files, CLIENT, http2) as second:
                    refused = await second.get(url)
                assert refused.status_code == 503, refused.text
                assert refused.json()["error"]["code"] == "overloaded"
                assert refused.headers["retry-after"] == "1"
                async with _client(tls_files, OTHER_CLIENT, http2) as other:
                    assert (await other.get(url)).status_code == 200
                async with _client(tls_files, "127.0.0.1", http2) as direct:
                    assert (await direct.get(f"{router.base_url}/healthz")).status_code == 200
                assert (await holder.get(url)).status_code == 200  # its connection kept
    refusals = [r.getMessage() for r in caplog.records if "connection refused" in r.getMessage()]
    # The client's refusal is logged, unless a health check's just before took the reason's
    # one line per 10 s (the 503 above is the client's own): HAProxy's v1 checks carry its
    # own address and v2's none ("?"), so on a loaded machine two overlapping checks may be
    # refused, counted as what the header says they are.
    health_checks = (f"from {BALANCER}:", "from ?:")
    assert [line for line in refusals if f"from {CLIENT}:" in line] or (
        refusals and any(check in refusals[0] for check in health_checks)
    ), refusals
    # Nobody else was refused.
    others = (OTHER_CLIENT, "127.0.0.1")
    assert not [line for line in refusals if any(f"from {a}:" in line for a in others)], refusals
    assert not [r.getMessage() for r in caplog.records if "PROXY" in r.getMessage()]


@pytest.mark.parametrize("server", ["auto", "hypercorn"])
async def test_a_websocket_behind_haproxy_counts_for_its_client_until_it_closes(
    start_router: RouterFactory,
    upstream: Upstream,
    tls_files: dict[str, str],
    tmp_path: Path,
    server: str,
) -> None:
    """A WebSocket through HAProxy (uvicorn's protocol after the upgrade under ``auto``,
    hypercorn's otherwise) holds its client's one allowed connection, not HAProxy's, and
    gives it back when it closes."""
    from websockets.asyncio.client import connect

    async with start_router(
        [upstream.url], listen=_listen(server, [f"{BALANCER}/32"]),
        limits={"hard_max_connections_per_client": 1},
    ) as router, haproxy_in_front(router.port, "send-proxy-v2", tmp_path) as port:
        url = f"https://127.0.0.1:{port}/healthz"
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        sock.bind((CLIENT, 0))
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
        async with connect(
            f"wss://127.0.0.1:{port}/v1/ws", sock=sock, ssl=client_tls(tls_files),
            server_hostname="127.0.0.1", additional_headers=auth(),
        ):
            async with _client(tls_files, CLIENT, False) as second:
                refused = await second.get(url)
            assert refused.status_code == 503, refused.text
            async with _client(tls_files, OTHER_CLIENT, False) as other:
                assert (await other.get(url)).status_code == 200
        await asyncio.sleep(0.3)  # the router sees the close
        async with _client(tls_files, CLIENT, False) as again:
            assert (await again.get(url)).status_code == 200


async def _open(
    port: int, tls_files: dict[str, str] | None, header: bytes, local: str = "127.0.0.1"
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection to the router from ``local`` that sends ``header`` first (the raw bytes
    a balancer would), then speaks TLS over it with ``tls_files``."""
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setblocking(False)
    sock.bind((local, 0))
    await loop.sock_connect(sock, ("127.0.0.1", port))
    if header:
        await loop.sock_sendall(sock, header)
    if tls_files is None:
        return await asyncio.open_connection(sock=sock)
    return await asyncio.open_connection(
        sock=sock, ssl=client_tls(tls_files), server_hostname="127.0.0.1"
    )


async def _ask(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes) -> bytes:
    writer.write(request)
    await writer.drain()
    data = b""
    async with asyncio.timeout(20):
        while True:
            try:
                chunk = await reader.read(65536)
            except (ConnectionError, ssl.SSLError):
                break
            if not chunk:
                break
            data += chunk
    writer.close()
    return data


def _chat(forwarded_for: str | None = None) -> bytes:
    body = json.dumps({
        "model": "test-model", "max_tokens": 2, "stream": False,
        "messages": [{"role": "user", "content": "hi"}],
    }).encode()  # fmt: skip
    headers = [
        "POST /v1/chat/completions HTTP/1.1", "host: router", "connection: close",
        f"authorization: {auth()['authorization']}", "content-type: application/json",
        f"content-length: {len(body)}",
    ]  # fmt: skip
    if forwarded_for is not None:
        headers.append(f"x-forwarded-for: {forwarded_for}")
    return "\r\n".join(headers).encode() + b"\r\n\r\n" + body


def _v2(source: str, sport: int, command: int = 1) -> bytes:
    block = socket.inet_aton(source) + socket.inet_aton("127.0.0.1") + struct.pack("!HH", sport, 1)
    return V2_SIGNATURE + bytes([0x20 | command, 0x11]) + struct.pack("!H", len(block)) + block


@pytest.mark.parametrize(("server", "tls"), [("auto", True), ("uvicorn", False)])
async def test_geoip_and_forwarding_trust_see_the_headers_client(
    start_router: RouterFactory,
    upstream: Upstream,
    tls_files: dict[str, str],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    server: str,
    tls: bool,
) -> None:
    """The access log places a client by its header's address (Tokyo), believes
    ``x-forwarded-for`` from a header's address that ``geo.trusted_proxies`` lists (an
    internal proxy behind the balancer, whose client is in Frankfurt), and for a ``LOCAL``
    header (the balancer's health check) keeps the connection's own address (loopback:
    nowhere)."""
    mmdb = write_city_mmdb(tmp_path / "cities.mmdb")
    geo = {"database": str(mmdb), "trusted_proxies": ["10.0.0.0/8"],
           "latitude": 50.11, "longitude": 8.68}  # fmt: skip
    files = tls_files if tls else None
    async with start_router(
        [upstream.url], tls=tls, listen=_listen(server, ["127.0.0.1"]), geo=geo
    ) as router:
        v1 = f"PROXY TCP4 {TOKYO_CLIENT} 127.0.0.1 40000 {router.port}\r\n".encode()
        tokyo = await _ask(*await _open(router.port, files, v1), _chat())
        assert tokyo.startswith(b"HTTP/1.1 200"), tokyo[:300]
        internal = await _ask(
            *await _open(router.port, files, _v2("10.1.2.3", 40001)), _chat(FRANKFURT_CLIENT)
        )
        assert internal.startswith(b"HTTP/1.1 200"), internal[:300]
        local = await _ask(*await _open(router.port, files, _v2("10.1.2.3", 1, 0)), _chat())
        assert local.startswith(b"HTTP/1.1 200"), local[:300]
        await asyncio.sleep(0.3)  # the access line follows the response
    countries = [
        getattr(r, "fields", {}).get("client_country")
        for r in caplog.records if r.name == "firstbyte.access"
    ]
    assert countries == ["JP", "DE", None], countries


@pytest.mark.parametrize(("server", "tls"), [("auto", True), ("auto", False), ("uvicorn", True)])
async def test_headers_the_router_cannot_trust_close_the_connection(
    start_router: RouterFactory,
    upstream: Upstream,
    tls_files: dict[str, str],
    caplog: pytest.LogCaptureFixture,
    server: str,
    tls: bool,
) -> None:
    """A PROXY header from an address not listed (a client naming its own address), a
    listed balancer's connection without one or with a malformed one, and a balancer silent
    past ``client_header_timeout_s``: each is closed without a byte of HTTP, and logged in
    one line naming the connection's own address."""
    files = tls_files if tls else None
    request = b"GET /healthz HTTP/1.1\r\nhost: r\r\nconnection: close\r\n\r\n"
    async with start_router(
        [upstream.url], tls=tls, listen=_listen(server, [f"{BALANCER}/32"]),
        limits={"client_header_timeout_s": 1.0},
    ) as router:
        spoof = f"PROXY TCP4 {TOKYO_CLIENT} 127.0.0.1 1 2\r\n".encode()
        for header, local in (
            (spoof, "127.0.0.1"),
            (_v2(TOKYO_CLIENT, 1), "127.0.0.1"),
            (b"PROXY TCP4 1.2.3.4 5.6.7.8 1\r\n", BALANCER),  # a port missing
        ):
            closed = await _closed_unanswered(router.port, header + request, local)
            assert closed == b"", closed
        # A balancer's connection that starts with a request, not a header.
        assert await _closed_unanswered(router.port, request, BALANCER) == b""
        # Served as before from an address not listed.
        plain = await _ask(*await _open(router.port, files, b""), request)
        assert plain.startswith(b"HTTP/1.1 200"), plain[:200]
        # A balancer that sends nothing is closed at the header timeout.
        loop = asyncio.get_running_loop()
        started = loop.time()
        assert await _closed_unanswered(router.port, b"", BALANCER) == b""
        assert loop.time() - started >= 1.0 - 0.05
    lines = [r.getMessage() for r in caplog.records if "PROXY" in r.getMessage()]
    assert any(line.startswith("PROXY protocol error from 127.0.0.1: PROXY header from an"
                               " address not in listen.proxy_protocol_from") for line in lines)
    assert any(line.startswith(f"PROXY header timed out from {BALANCER}") for line in lines)
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"


async def _closed_unanswered(port: int, data: bytes, local: str) -> bytes:
    """What the router sends back on a raw connection from ``local`` that sends ``data``
    (before any TLS) until it closes it."""
    loop = asyncio.get_running_loop()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setblocking(False)
        sock.bind((local, 0))
        await loop.sock_connect(sock, ("127.0.0.1", port))
        if data:
            await loop.sock_sendall(sock, data)
        received = b""
        async with asyncio.timeout(20):
            while True:
                try:
                    chunk = await loop.sock_recv(sock, 65536)
                except ConnectionError:
                    return received
                if not chunk:
                    return received
                received += chunk


def _v2_tcp6(source: str, sport: int) -> bytes:
    block = (
        socket.inet_pton(socket.AF_INET6, source) + socket.inet_pton(socket.AF_INET6, "::1")
        + struct.pack("!HH", sport, 1)
    )
    return V2_SIGNATURE + bytes([0x21, 0x21]) + struct.pack("!H", len(block)) + block


@pytest.mark.parametrize("server", ["auto", "uvicorn"])
async def test_ipv6_balancer_and_clients(
    start_router: RouterFactory,
    upstream: Upstream,
    caplog: pytest.LogCaptureFixture,
    server: str,
) -> None:
    """A router on ``::1`` behind a balancer on ``::1``: an IPv6 client (v2 ``TCP6``) holding
    its one allowed connection is refused a second, and an IPv4 client (v1 ``TCP4``) through
    the same balancer is served: each counted for its own address."""
    listen = {**_listen(server, ["::1/128"]), "host": "::1"}
    request = b"GET /healthz HTTP/1.1\r\nhost: r\r\n\r\n"
    loop = asyncio.get_running_loop()
    async with start_router(
        [upstream.url], tls=False, listen=listen, limits={"hard_max_connections_per_client": 1}
    ) as router:

        async def connection(header: bytes) -> socket.socket:
            sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
            sock.setblocking(False)
            await loop.sock_connect(sock, ("::1", router.port))
            await loop.sock_sendall(sock, header + request)
            return sock

        async def status(sock: socket.socket) -> bytes:
            async with asyncio.timeout(20):
                return (await loop.sock_recv(sock, 65536))[:12]

        held = await connection(_v2_tcp6("2001:db8::7", 40000))
        try:
            assert await status(held) == b"HTTP/1.1 200"
            with await connection(_v2_tcp6("2001:db8::7", 40001)) as second:
                assert await status(second) == b"HTTP/1.1 503"
            v4 = f"PROXY TCP4 {TOKYO_CLIENT} 127.0.0.1 40002 1\r\n".encode()
            with await connection(v4) as other:
                assert await status(other) == b"HTTP/1.1 200"
        finally:
            held.close()
    refusals = [r.getMessage() for r in caplog.records if "connection refused" in r.getMessage()]
    assert refusals
    assert all(line.startswith("connection refused from 2001:db8::7:") for line in refusals)
