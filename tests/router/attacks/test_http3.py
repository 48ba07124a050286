"""HTTP/3 over QUIC with aioquic as a client that misbehaves on purpose."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import time

from aioquic.asyncio.client import connect
from aioquic.h3.connection import H3_ALPN
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection

from tests.router.conftest import API_KEY
from tests.router.h3client import h3_request

from .conftest import RouterStarter, canary_running, open_tls

CHAT = "/v1/chat/completions"
H3 = {"listen": {"http3": True}}
CLOSED_WITHIN_S = 30.0
"""How long the ping-only QUIC connection may take to be closed: ample on a loaded machine.
``test_without_patches`` waits less, where the close never comes."""


async def test_early_answer_leaves_http3_serving(start_router_process: RouterStarter) -> None:
    """A POST answered before its body was read (no key, a large body; a keyed POST to an
    unknown path): the body's late DATA is dropped and HTTP/3 goes on serving."""
    async with start_router_process(**H3) as router, canary_running(router):
        body = b"x" * (64 * 1024)
        no_key = await h3_request(
            router.port, "POST", CHAT, cafile=router.cafile, body=body,
            headers={"content-type": "application/json"},
        )
        assert no_key.status == 401
        unknown = await h3_request(
            router.port, "POST", "/v1/nowhere", cafile=router.cafile, body=body,
            headers={"authorization": f"Bearer {API_KEY}"},
        )
        assert unknown.status == 404
        for _ in range(3):
            health = await h3_request(
                router.port, "GET", "/healthz", cafile=router.cafile, timeout_s=10
            )
            assert health.status == 200
        router.assert_clean_log()


def _client_configuration() -> QuicConfiguration:
    configuration = QuicConfiguration(
        alpn_protocols=H3_ALPN, is_client=True, server_name="localhost"
    )
    configuration.verify_mode = ssl.CERT_NONE  # the handshake is the point, not the peer
    return configuration


async def test_connection_that_only_pings_is_closed(start_router_process: RouterStarter) -> None:
    """A QUIC connection that never sends a request is closed after the header timeout,
    though its PINGs keep it alive for aioquic."""
    timeout_s = 2.0
    limits = {"limits": {"client_header_timeout_s": timeout_s}}
    async with start_router_process(**H3, **limits) as router, canary_running(router):
        async with connect(
            "127.0.0.1", router.port, configuration=_client_configuration()
        ) as client:
            opened = time.monotonic()
            closed = asyncio.ensure_future(client.wait_closed())
            async with asyncio.timeout(CLOSED_WITHIN_S):
                while not closed.done():
                    with contextlib.suppress(ConnectionError, TimeoutError):
                        await asyncio.wait_for(client.ping(), 0.5)
                    await asyncio.wait([closed], timeout=0.3)
            held_s = time.monotonic() - opened
        assert held_s >= timeout_s - 0.1  # never before the timeout
        assert "QUIC connection without a request: closed" in router.log()
        router.assert_clean_log()


async def test_connections_from_one_address_are_capped(
    start_router_process: RouterStarter,
) -> None:
    """QUIC connections count against the per-address cap (here the opt-in hard one, which
    bites without pressure; the default cap bites under pressure, as for TCP): past it a handshake
    is refused at once (CONNECTION_REFUSED), and a closed connection frees its place."""
    cap = 6
    async with start_router_process(
        **H3, limits={"hard_max_connections_per_client": cap}
    ) as router, canary_running(router):
        async with contextlib.AsyncExitStack() as held:
            admitted = refused = 0
            for _ in range(cap + 4):
                started = time.monotonic()
                try:
                    await held.enter_async_context(
                        connect("127.0.0.1", router.port, configuration=_client_configuration())
                    )
                    admitted += 1
                except ConnectionError:
                    refused += 1
                    assert time.monotonic() - started < 10  # at once, not a handshake timeout
            assert (admitted, refused) == (cap, 4)
        # The held connections closed (CONNECTION_CLOSE sent on exit): room again.
        await asyncio.sleep(0.5)
        health = await h3_request(router.port, "GET", "/healthz", cafile=router.cafile)
        assert health.status == 200
        assert "QUIC connection refused from 127.0.0.1: 6 connections open" in router.log()
        router.assert_clean_log()


def _initial(port: int) -> bytes:
    """The first datagram of a new client connection: an Initial padded to 1,200 bytes."""
    connection = QuicConnection(configuration=_client_configuration())
    connection.connect(("127.0.0.1", port), now=time.monotonic())
    datagram, _ = connection.datagrams_to_send(now=time.monotonic())[0]
    return datagram


def _is_retry(datagram: bytes) -> bool:
    """A QUIC v1 long-header packet of type Retry (RFC 9000 section 17.2.5)."""
    return bool(datagram) and datagram[0] & 0x80 != 0 and (datagram[0] & 0x30) >> 4 == 3


def _client_cid(datagram: bytes) -> bytes:
    """The Destination Connection ID of a server's long-header packet: the Source Connection
    ID its client chose, one per client connection (empty for a short header)."""
    if not datagram or not datagram[0] & 0x80:
        return b""
    length = datagram[5]
    return datagram[6 : 6 + length]


async def _answers(sock: socket.socket, seconds: float) -> list[bytes]:
    loop = asyncio.get_running_loop()
    got: list[bytes] = []
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            while True:
                got.append(await loop.sock_recv(sock, 65536))
    return got


async def test_handshake_flood_gets_retry(start_router_process: RouterStarter) -> None:
    """Above ``quic_retry_above_handshakes_per_s`` new handshakes get a Retry (no connection
    state until the client proves its address); a real client still connects; once the
    flood is over a new handshake is answered directly again (1-RTT)."""
    threshold = 10
    flood = 60
    async with start_router_process(
        **H3, limits={"quic_retry_above_handshakes_per_s": threshold}
    ) as router, canary_running(router):
        initials = [_initial(router.port) for _ in range(flood)]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.setblocking(False)
            sock.bind(("127.0.0.1", 0))
            started = time.monotonic()
            received = asyncio.ensure_future(_answers(sock, 5.0))
            for datagram in initials:
                # Paced: hypercorn queues 10 datagrams and drops the rest of a burst.
                sock.sendto(datagram, ("127.0.0.1", router.port))
                await asyncio.sleep(0.01)
            sent_s = time.monotonic() - started
            answers = await received
        retried = {_client_cid(a) for a in answers if _is_retry(a)}
        direct = {_client_cid(a) for a in answers if not _is_retry(a)} - {b""}
        assert sent_s < flood / (2 * threshold)  # at least twice the threshold's rate
        # Handshakes past the threshold got a Retry and no connection state; those answered
        # directly are bounded by the rate (``threshold`` a second; two windows overlap).
        # (hypercorn drops datagrams past its queue of 10 when busy: not all are answered.)
        assert retried, (len(direct), len(answers), sent_s)
        assert len(direct) <= threshold * (sent_s + 2), (len(direct), len(retried), sent_s)
        # A real client follows the Retry and is served.
        health = await h3_request(router.port, "GET", "/healthz", cafile=router.cafile)
        assert health.status == 200

        await asyncio.sleep(2.5)  # the rate decays to nothing in two seconds
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.setblocking(False)
            sock.bind(("127.0.0.1", 0))
            sock.sendto(_initial(router.port), ("127.0.0.1", router.port))
            answers = await _answers(sock, 2.0)
        assert answers
        assert not any(_is_retry(a) for a in answers)
        assert "QUIC handshakes above limits.quic_retry_above_handshakes_per_s" in router.log()
        router.assert_clean_log()


async def _connects(port: int) -> bool:
    try:
        async with connect("127.0.0.1", port, configuration=_client_configuration()):
            return True
    except ConnectionError:
        return False


async def test_half_open_handshakes_hold_their_places_only_for_the_timeout(
    start_router_process: RouterStarter,
) -> None:
    """Initials whose handshakes are never finished fill the address's places; they are
    closed after ``client_header_timeout_s`` and their places given back."""
    cap, timeout_s = 5, 2.0
    limits = {"hard_max_connections_per_client": cap, "client_header_timeout_s": timeout_s}
    async with start_router_process(**H3, limits=limits) as router, canary_running(router):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.bind(("127.0.0.1", 0))
            for _ in range(cap):
                sock.sendto(_initial(router.port), ("127.0.0.1", router.port))
                await asyncio.sleep(0.02)
            filled = time.monotonic()
            assert not await _connects(router.port)  # the places are taken
            admitted = False
            async with asyncio.timeout(20):  # aioquic alone would hold them 60 s
                while not admitted:
                    await asyncio.sleep(0.5)
                    admitted = await _connects(router.port)
            assert time.monotonic() - filled >= timeout_s - 0.1
        assert "QUIC connection without a request: closed" in router.log()
        router.assert_clean_log()


async def test_descriptor_reserve_refuses_quic_connections_too(
    start_router_process: RouterStarter,
) -> None:
    """With TCP connections holding descriptors up to the reserve, a QUIC handshake is refused
    as a TCP connection is (its requests would need upstream sockets); once they close, it is
    admitted."""
    limits = {"reserved_fds": 64, "max_connections_per_client": 1000}
    async with start_router_process(
        **H3, nofile=256, limits=limits
    ) as router, canary_running(router):
        held = []
        try:
            for _ in range(260):
                reader, writer = await open_tls(router, local="127.0.0.3")
                writer.write(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
                try:
                    first = await asyncio.wait_for(reader.readuntil(b"\r\n"), 10)
                except (ConnectionError, asyncio.IncompleteReadError):
                    first = b"HTTP/1.1 503 (the reset overtook it)"
                if first.startswith(b"HTTP/1.1 503"):
                    writer.close()
                    break  # the reserve is reached
                held.append(writer)
            else:
                raise AssertionError("no TCP connection was refused")
            assert not await _connects(router.port)
        finally:
            for writer in held:
                writer.close()
        admitted = False
        async with asyncio.timeout(20):
            while not admitted:
                await asyncio.sleep(0.2)
                admitted = await _connects(router.port)
        assert "QUIC connection refused from 127.0.0.1: file descriptors short" in router.log()
        router.assert_clean_log()
