"""HTTP/1.1 over TLS, from raw sockets: what a client can hold and how it is let go, on each
server that can serve it (hypercorn, patched by ``router.hosting.hardening``; uvicorn, by
``router.hosting.uvicorn_limits``; ``auto``, uvicorn's protocol behind hypercorn's TLS)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import time
from pathlib import Path

import httpx

from tests.router.conftest import API_KEY, auth
from tests.router.geo_fixtures import TOKYO_CLIENT, write_city_mmdb
from tests.router.upstream import Upstream

from .conftest import (
    ON_EACH_PROTOCOL,
    ON_EACH_SERVER,
    STALLED_TOKENS,
    TIMER_SLACK_S,
    RouterStarter,
    canary_running,
    chat_body,
    open_tls,
    open_tls_small_window,
    read_until_closed,
)

CHAT = "/v1/chat/completions"
CLOSED_WITHIN_S = 20.0
"""How long the attacks that wait for the router to close a connection wait: ample on a
loaded machine. ``test_without_patches`` waits less, where the close never comes."""



def _head(*lines: str) -> bytes:
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _keyed_post(*lines: str) -> bytes:
    """The head of a completion request with the API key, plus ``lines``."""
    return _head(f"POST {CHAT} HTTP/1.1", "host: x", f"authorization: Bearer {API_KEY}", *lines)


@ON_EACH_PROTOCOL
async def test_slowloris_head_is_cut_at_the_header_timeout(
    start_router_process: RouterStarter,
) -> None:
    """Heads trickling in a byte a second are answered 408 and closed at
    ``client_header_timeout_s``, long before the keep-alive timeout (75 s)."""
    async with start_router_process(limits={"client_header_timeout_s": 2.0}) as router:
        async with canary_running(router):
            connections = [await open_tls(router) for _ in range(20)]
            started = time.monotonic()

            async def trickle(writer: asyncio.StreamWriter) -> None:
                writer.write(f"POST {CHAT} HTTP/1.1\r\nhost: x\r\n".encode())
                for _ in range(60):
                    await asyncio.sleep(0.5)
                    writer.write(b"x")

            tricklers = [asyncio.create_task(trickle(w)) for _, w in connections]
            answers = await asyncio.gather(
                *(read_until_closed(r, CLOSED_WITHIN_S) for r, _ in connections)
            )
            held_s = time.monotonic() - started
            for task in tricklers:
                task.cancel()
            await asyncio.gather(*tricklers, return_exceptions=True)
        assert all(a.startswith(b"HTTP/1.1 408") for a in answers), answers[:2]
        assert 2.0 - TIMER_SLACK_S <= held_s < CLOSED_WITHIN_S
    router.assert_clean_log()


@ON_EACH_PROTOCOL
async def test_a_client_that_stops_reading_is_reset_at_the_send_timeout(
    start_router_process: RouterStarter, upstream: Upstream,
) -> None:
    """A client that reads a stream's first bytes and then nothing more is reset once the
    router's writes have stayed paused for ``client_send_timeout_s``, with one log line;
    before the change it held its connection (and the stream's writer) until it went."""
    upstream.burst = 2000  # the stream at ~200,000 chunks a second, not the fixture's 100
    async with start_router_process(limits={"client_send_timeout_s": 1.0}) as router:
        async with canary_running(router):
            reader, writer = await open_tls_small_window(router, ["http/1.1"])
            body = json.dumps(chat_body(STALLED_TOKENS)).encode()
            writer.write(
                _keyed_post(f"content-length: {len(body)}", "content-type: application/json")
                + body
            )
            assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
            # Read nothing until the router has given up on this client...
            await router.logged("client stopped reading", CLOSED_WITHIN_S)
            # ... then all it had taken: cut short by a reset, never the stream's end.
            rest = b""
            with contextlib.suppress(TimeoutError):
                rest = await read_until_closed(reader, 10)
            writer.close()
        assert b"data: [DONE]" not in rest
        assert len(rest) < STALLED_TOKENS * 100, len(rest)
    assert router.log().count("client stopped reading") == 1, router.log()[-2000:]
    router.assert_clean_log()


@ON_EACH_PROTOCOL
async def test_held_body_without_key_is_refused_at_the_head(
    start_router_process: RouterStarter,
) -> None:
    """``Content-Length: 100``, no body, no key: 401 at once (the body timeout is 60 s, so
    an answer before it proves no body was waited for) and the connection closes."""
    async with start_router_process() as router:
        async with canary_running(router):
            connections = [await open_tls(router) for _ in range(50)]
            for _, writer in connections:
                writer.write(_head(f"POST {CHAT} HTTP/1.1", "host: x", "content-length: 100"))
            answers = await asyncio.gather(*(read_until_closed(r, 20) for r, _ in connections))
        assert all(a.startswith(b"HTTP/1.1 401") for a in answers), answers[:2]
        assert all(b"missing_api_key" in a for a in answers)
    router.assert_clean_log()


@ON_EACH_PROTOCOL
async def test_a_body_sent_after_its_answer_is_dropped_not_run(
    start_router_process: RouterStarter, router_server: str
) -> None:
    """No key, a 4 MiB body sent whole anyway: the 401 reaches the client (no reset for the
    unread body) and the body is never read as a request. hypercorn then closes the
    connection; uvicorn's protocol (``uvicorn``, ``auto``), like nginx, serves the next
    request on it."""
    body = b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n" * (4 << 20 >> 5)
    async with start_router_process() as router:
        reader, writer = await open_tls(router)
        writer.write(
            _head(f"POST {CHAT} HTTP/1.1", "host: x", f"content-length: {len(body)}") + body
        )
        await writer.drain()
        first = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 20)
        assert first.startswith(b"HTTP/1.1 401"), first
        length = int(first.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        await reader.readexactly(length)
        writer.write(_head("GET /healthz HTTP/1.1", "host: x"))
        rest = await read_until_closed(reader, 20) if router_server == "hypercorn" else (
            await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 20)
        )
        writer.close()
    # Not one of the keyless requests the body is made of got an answer.
    assert b"HTTP/1.1 401" not in rest, rest[:200]
    if router_server != "hypercorn":
        assert rest.startswith(b"HTTP/1.1 200"), rest
    router.assert_clean_log()


@ON_EACH_PROTOCOL
async def test_slow_body_is_cut_at_the_body_timeout(start_router_process: RouterStarter) -> None:
    async with start_router_process(limits={"client_body_timeout_s": 1.5}) as router:
        async with canary_running(router):
            reader, writer = await open_tls(router)
            writer.write(_keyed_post("content-length: 100") + b'{"model":')
            started = time.monotonic()
            answer = await read_until_closed(reader, 20)
            held_s = time.monotonic() - started
        assert answer.startswith(b"HTTP/1.1 408"), answer
        assert b"request_timeout" in answer
        assert 1.5 - TIMER_SLACK_S <= held_s < 20
    router.assert_clean_log()


@ON_EACH_PROTOCOL
async def test_idle_keep_alive_connection_is_closed(start_router_process: RouterStarter) -> None:
    async with start_router_process(listen={"keep_alive_timeout_s": 1.5}) as router:
        async with canary_running(router):
            reader, writer = await open_tls(router)
            writer.write(_head("GET /healthz HTTP/1.1", "host: x"))
            started = time.monotonic()
            answer = await read_until_closed(reader, 20)
            held_s = time.monotonic() - started
        assert answer.startswith(b"HTTP/1.1 200")
        assert 1.5 - TIMER_SLACK_S <= held_s < 20
    router.assert_clean_log()


@ON_EACH_SERVER
async def test_silent_connections_are_closed_at_the_keep_alive_timeout(
    start_router_process: RouterStarter,
) -> None:
    """Connections that finish the TLS handshake and send nothing are closed once the
    keep-alive timeout passes, as idle ones between requests are."""
    async with start_router_process(listen={"keep_alive_timeout_s": 1.5}) as router:
        async with canary_running(router):
            connections = [await open_tls(router) for _ in range(10)]
            started = time.monotonic()
            answers = await asyncio.gather(*(read_until_closed(r, 20) for r, _ in connections))
            held_s = time.monotonic() - started
            for _, writer in connections:
                writer.close()
        assert answers == [b""] * 10
        assert 1.5 - TIMER_SLACK_S <= held_s < 20
    router.assert_clean_log()


@ON_EACH_PROTOCOL
async def test_content_length_with_transfer_encoding_is_refused_and_closed(
    start_router_process: RouterStarter,
) -> None:
    """RFC 9112 section 6.1: the bytes after the chunked body must not run as a request."""
    smuggled = _head("GET /v1/models HTTP/1.1", "host: x", f"authorization: Bearer {API_KEY}")
    async with start_router_process() as router:
        async with canary_running(router):
            reader, writer = await open_tls(router)
            writer.write(
                _keyed_post(f"content-length: {5 + len(smuggled)}", "transfer-encoding: chunked")
                + b"0\r\n\r\n"
                + smuggled
            )
            answer = await read_until_closed(reader, CLOSED_WITHIN_S)
        assert answer.startswith(b"HTTP/1.1 400"), answer
        assert answer.count(b"HTTP/1.1 ") == 1, answer
    router.assert_clean_log()


async def test_json_nested_5000_deep_is_400(start_router_process: RouterStarter) -> None:
    deep = b"[" * 5000 + b"]" * 5000
    body = b'{"model":"m","messages":[{"role":"user","content":"x"}],"tools":[{"a":%s}]}' % deep
    async with start_router_process() as router:
        async with canary_running(router), httpx.AsyncClient(verify=router.client_tls()) as client:
            response = await client.post(router.base_url + CHAT, content=body, headers=auth())
        assert response.status_code == 400, response.text
        assert "nested too deeply" in response.json()["error"]["message"]
    router.assert_clean_log()


@ON_EACH_SERVER
async def test_connections_per_client_address_are_capped(
    start_router_process: RouterStarter,
) -> None:
    """The hard cap's worth of held connections from 127.0.0.1, then one more: 503 as the
    answer to its request, while the canary (127.0.0.2) streams on."""
    cap = 30
    async with start_router_process(limits={"hard_max_connections_per_client": cap}) as router:
        async with canary_running(router):
            held = [await open_tls(router) for _ in range(cap)]
            for reader, writer in held:
                writer.write(_head("GET /healthz HTTP/1.1", "host: x"))
                got = await reader.read(4096)
                assert got.startswith(b"HTTP/1.1 200"), got
            reader, writer = await open_tls(router)
            writer.write(_head("GET /healthz HTTP/1.1", "host: x"))
            answer = await read_until_closed(reader, 15)
            assert answer.startswith(b"HTTP/1.1 503"), answer
            assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "overloaded"
            for _, w in held:
                w.close()
        # Once they are gone, the address may connect again.
        await asyncio.sleep(0.5)
        async with httpx.AsyncClient(verify=router.client_tls()) as client:
            assert (await client.get(router.base_url + "/healthz")).status_code == 200
    assert "limits.hard_max_connections_per_client" in router.log()
    router.assert_clean_log()


@ON_EACH_SERVER
async def test_descriptors_short_new_connections_refused_streams_go_on(
    start_router_process: RouterStarter,
) -> None:
    """With 256 descriptors and 64 in reserve, an attacker holding connections gets the
    rest refused with 503 after each request's head (logged), and the canary's stream
    keeps flowing."""
    async with start_router_process(
        nofile=256, limits={"reserved_fds": 64, "max_connections_per_client": 1000}
    ) as router, canary_running(router):
        held = []
        refused = 0
        for _ in range(260):
            try:
                reader, writer = await open_tls(router)
            except OSError:
                break  # this test process's own limit
            writer.write(_head("GET /healthz HTTP/1.1", "host: x"))
            try:
                first = await asyncio.wait_for(reader.readuntil(b"\r\n"), 10)
            except (ConnectionError, asyncio.IncompleteReadError):
                first = b"HTTP/1.1 503 (the reset overtook it)"
            if first.startswith(b"HTTP/1.1 503"):
                refused += 1
                writer.close()
            else:
                assert first.startswith(b"HTTP/1.1 200"), first
                held.append(writer)
        assert refused > 0
        assert 256 - 64 - len(held) < 64  # held up to the reserve, not beyond
        for writer in held:
            writer.close()
    assert "file descriptors short" in router.log()
    router.assert_clean_log()


@ON_EACH_SERVER
async def test_sockets_silent_before_tls_count_and_put_their_address_under_the_cap(
    start_router_process: RouterStarter,
) -> None:
    """With 256 descriptors, 64 in reserve (pressure from descriptor 128 on) and a cap of 20:
    150 TCP sockets from 127.0.0.1 that never start TLS count for it, so once descriptors
    are near their budget its next request is answered 503 while 127.0.0.3, a light
    address, is served and the canary (127.0.0.2) streams on; the silent sockets are closed
    at the header timeout (3 s), and 127.0.0.1 is served again."""
    async with start_router_process(
        nofile=256,
        limits={"reserved_fds": 64, "max_connections_per_client": 20,
                "client_header_timeout_s": 3.0},
    ) as router, canary_running(router):
        started = time.monotonic()
        silent = [await asyncio.open_connection("127.0.0.1", router.port) for _ in range(150)]
        try:
            await asyncio.sleep(0.5)
            async with httpx.AsyncClient(verify=router.client_tls(), timeout=20) as client:
                heavy = await client.get(router.base_url + "/healthz")
            assert heavy.status_code == 503, heavy.text
            assert heavy.headers["retry-after"] == "1"
            light = httpx.AsyncHTTPTransport(verify=router.client_tls(), local_address="127.0.0.3")
            async with httpx.AsyncClient(transport=light, timeout=20) as client:
                assert (await client.get(router.base_url + "/healthz")).status_code == 200
            closed = await asyncio.gather(*(read_until_closed(r, 30) for r, _ in silent))
            assert closed == [b""] * len(silent)
            assert time.monotonic() - started >= 3.0 - 0.05  # the loop's timer may fire early
        finally:
            for _, writer in silent:
                writer.close()
        await asyncio.sleep(0.5)
        async with httpx.AsyncClient(verify=router.client_tls(), timeout=20) as client:
            assert (await client.get(router.base_url + "/healthz")).status_code == 200
    assert "limits.max_connections_per_client" in router.log()
    router.assert_clean_log()


@ON_EACH_SERVER
async def test_a_flood_of_silent_sockets_leaves_half_the_descriptor_reserve(
    start_router_process: RouterStarter,
) -> None:
    """400 TCP sockets that never send a byte, arriving together at a router with 256
    descriptors and 64 in reserve: refusals are answered only in the first half of the
    reserve, so the router never holds more than 256 - 32 descriptors (sampled every few
    milliseconds, through the burst) and the canary (127.0.0.2) streams on."""
    async with start_router_process(
        nofile=256, limits={"reserved_fds": 64, "client_header_timeout_s": 3.0}
    ) as router, canary_running(router):
        loop = asyncio.get_running_loop()
        socks = []
        peak = 0

        async def connect(sock: socket.socket) -> None:
            with contextlib.suppress(OSError):
                await asyncio.wait_for(loop.sock_connect(sock, ("127.0.0.1", router.port)), 5)

        async def sample_for(seconds: float) -> None:
            nonlocal peak
            until = loop.time() + seconds
            while loop.time() < until:
                peak = max(peak, len(os.listdir(f"/proc/{router.proc.pid}/fd")))
                await asyncio.sleep(0.005)

        try:
            for _ in range(400):
                sock = socket.socket()
                sock.setblocking(False)
                socks.append(sock)
            # All at once: they wait in the accept queue together, as a flood's do.
            sampling = asyncio.ensure_future(sample_for(3.0))
            await asyncio.gather(*(connect(sock) for sock in socks))
            await sampling
        finally:
            for sock in socks:
                sock.close()
    # The client sockets stop at 256 - 32; what the reserve is for may add a few: the canary's
    # upstream connection, the router's metrics scrapes, and a refused socket in the instant
    # between its accept and its close. Without the fix the router reached all 256; accepting
    # a batch of waiting connections before any was counted, 244.
    assert peak <= 256 - 32 + 4, peak
    assert "file descriptors short" in router.log()
    router.assert_clean_log()


@ON_EACH_PROTOCOL
async def test_forwarding_headers_from_an_untrusted_peer_are_ignored(
    start_router_process: RouterStarter, tmp_path: Path
) -> None:
    """A client on loopback, which ``geo.trusted_proxies`` does not list, cannot place itself
    in Tokyo with ``X-Forwarded-For`` (uvicorn, left to itself, believes the header from
    127.0.0.1 and rewrites the client's address before the router sees it)."""
    mmdb = write_city_mmdb(tmp_path / "cities.mmdb")
    geo = {"database": str(mmdb), "latitude": 50.11, "longitude": 8.68}
    async with start_router_process(geo=geo) as router:
        async with httpx.AsyncClient(verify=router.client_tls(), timeout=30) as client:
            for header in ("x-forwarded-for", "forwarded"):
                value = TOKYO_CLIENT if header == "x-forwarded-for" else f"for={TOKYO_CLIENT}"
                response = await client.post(
                    router.base_url + CHAT,
                    json={**chat_body(2, stream=False)},
                    headers={**auth(), header: value, "x-forwarded-proto": "http"},
                )
                assert response.status_code == 200, response.text
        # Every access line: the client is where its connection comes from (unknown), not Tokyo.
        await asyncio.sleep(0.2)
        lines = [line for line in router.log().splitlines() if '"client_country"' in line]
        assert len(lines) >= 2, router.log()[-2000:]
        placed = [line for line in lines if '"JP"' in line or "Tokyo" in line]
        assert placed == [], placed
    router.assert_clean_log()
