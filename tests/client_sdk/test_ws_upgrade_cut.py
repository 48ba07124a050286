"""A WebSocket whose upgrade is cut (the connection reset after TLS, before the answer) is
sent again, as an SSE or long-poll request cut there is: a cut, not an unreachable server."""

from __future__ import annotations

import asyncio
import socket
import ssl

from firstbyte.client_sdk.client import AsyncClient
from tests.client_sdk.conftest import ROUTER_KEY, start_stack
from tests.client_sdk.cutproxy import TcpCutProxy
from tests.client_sdk.test_client import stream_once


def _tls_bytes_from_server(port: int, ca_file: str) -> int:
    """The bytes a server sends on a new TLS connection before any request: its handshake
    flight and the session tickets after it (counted on the wire, through memory BIOs)."""
    context = ssl.create_default_context(cafile=ca_file)
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = context.wrap_bio(incoming, outgoing, server_hostname="localhost")
    received = 0
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        while True:
            try:
                tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                sock.sendall(outgoing.read())
                data = sock.recv(65536)
                received += len(data)
                incoming.write(data)
        sock.sendall(outgoing.read())
        sock.settimeout(0.5)  # the tickets follow the handshake; nothing else comes unasked
        try:
            while data := sock.recv(65536):
                received += len(data)
        except TimeoutError:
            pass
    return received


async def test_a_cut_websocket_upgrade_is_sent_again(tls_files: tuple[str, str, str]) -> None:
    async with start_stack(tls_files) as stack:
        before_answer = await asyncio.to_thread(_tls_bytes_from_server, stack.port,
                                                stack.ca_file)
        # Cut inside the upgrade's answer: after the TLS bytes, before the 101 is whole.
        async with TcpCutProxy(stack.port, cut_after=before_answer + 20) as proxy, AsyncClient(
            stack.url_via(proxy.port), ROUTER_KEY, transport="websocket", http="1.1",
            ca_file=stack.ca_file,
        ) as client:
            text, timings, _ = await stream_once(client, max_tokens=3)
    assert proxy.cuts_done == 1
    assert proxy.connections == 2  # the cut upgrade, then the one sent again
    assert text
    assert timings.resumes == 0  # nothing had started: sent again, not resumed
