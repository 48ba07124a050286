"""Shutdown with kept-alive TLS clients that read nothing more: at the end of the graceful
timeout each connection is cut at once, quietly (patch ``cut-connections-at-graceful-timeout``,
``router/hosting/graceful_cut.py``)."""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import time
from typing import Any

import pytest

from firstbyte.router.hosting import ServerOptions, bind, patches, running
from tests.router.conftest import client_tls

GRACEFUL_S = 1.0


async def _ok(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """An app that answers every HTTP request ``200 ok`` (and the lifespan's events)."""
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


def _answered(context: ssl.SSLContext, port: int) -> ssl.SSLSocket:
    """A blocking TLS client, answered once (HTTP/1.1: a request; h2: the server's SETTINGS),
    that then reads nothing: it never sees, or answers, the server's ``close_notify``."""
    tls = context.wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=10),
                              server_hostname="127.0.0.1")
    if tls.selected_alpn_protocol() == "h2":
        tls.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes(9))  # preface, empty SETTINGS
    else:
        tls.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
    assert tls.recv(65536)
    return tls


async def _stop_around_silent_clients(
    server: str, alpn: str, tls_files: dict[str, str]
) -> tuple[float, BaseException | None]:
    """Serve, connect three silent clients, stop: (seconds the stop took, what it raised)."""
    context = client_tls(tls_files)
    context.set_alpn_protocols([alpn])
    options = ServerOptions(server=server, certfile=tls_files["certfile"],
                            keyfile=tls_files["keyfile"], graceful_timeout_s=GRACEFUL_S)
    listeners = bind("127.0.0.1", 0, udp=False)
    clients: list[ssl.SSLSocket] = []
    raised: BaseException | None = None
    try:
        async with running(_ok, listeners, options):
            for _ in range(3):
                # In a thread: the handshake blocks, and the server runs in this loop.
                clients.append(await asyncio.to_thread(_answered, context, listeners.port))
            stopping = time.monotonic()
    except Exception as exc:  # the outcome under test
        raised = exc
    finally:
        took = time.monotonic() - stopping
        for client in clients:
            client.close()
    return took, raised


@pytest.mark.parametrize("server", ["auto", "hypercorn"])
@pytest.mark.parametrize("alpn", ["http/1.1", "h2"])
async def test_silent_kept_alive_clients_are_cut_at_the_graceful_timeout(
    tls_files: dict[str, str], caplog: pytest.LogCaptureFixture, server: str, alpn: str
) -> None:
    """Each connection ends at the graceful timeout, not the TLS shutdown's 30 s; the stop
    raises nothing and no traceback is logged (Python 3.11.7 logs one per connection task
    that ends cancelled)."""
    caplog.set_level(logging.WARNING)
    took, raised = await _stop_around_silent_clients(server, alpn, tls_files)
    assert raised is None
    assert GRACEFUL_S - 0.05 <= took < GRACEFUL_S + 3.0  # a loop's timer may fire early
    tracebacks = [r for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()]
    assert tracebacks == [], [f"{r.name}: {r.getMessage()}" for r in tracebacks[:3]]


async def test_without_the_patch_a_silent_client_outlives_the_stop(
    tls_files: dict[str, str]
) -> None:
    """hypercorn alone: the cancelled connection waits for a TLS goodbye that never comes,
    past the router's own deadline (graceful timeout + 5 s), whose cancel then makes
    hypercorn's ``serve`` raise ``InvalidStateError``. When hypercorn ends a cancelled
    connection at once, this fails: the patch can go (docs/libraries.md)."""
    with patches.applied_except("cut-connections-at-graceful-timeout"):
        took, raised = await _stop_around_silent_clients("hypercorn", "h2", tls_files)
    assert took >= GRACEFUL_S + 5.0 - 0.05
    assert isinstance(raised, asyncio.InvalidStateError), raised


class _UnansweredGoodbye:
    """The stream writer (and its transport) of a TLS connection whose client holds it open and
    reads nothing: the loop's wait for its TLS goodbye ends as asyncio's does, in
    ``TimeoutError``."""

    def __init__(self) -> None:
        self.transport = self
        self.aborted = False

    def write_eof(self) -> None:
        raise RuntimeError("a TLS transport cannot half-close")  # hypercorn passes over it

    def close(self) -> None:
        pass

    async def wait_closed(self) -> None:
        raise TimeoutError("SSL shutdown timed out")

    def abort(self) -> None:
        self.aborted = True


async def test_a_tls_goodbye_never_answered_is_cut_not_raised() -> None:
    """At a keep-alive timeout, not only in a drain, hypercorn closes a connection and waits
    for the client's TLS goodbye; a client that holds the connection open and reads nothing
    never sends it, and the wait ended in ``TimeoutError`` after the loop's 30 s, which ended
    the connection's task with a traceback in the log. The connection is cut instead."""
    from hypercorn.asyncio import run, tcp_server

    patches.apply_all()
    server = run.TCPServer.__new__(run.TCPServer)  # the patched server, without a connection
    writer = _UnansweredGoodbye()
    server.writer = writer
    server.idle_task = tcp_server.AsyncioSingleTask()
    await server._close()
    assert writer.aborted
