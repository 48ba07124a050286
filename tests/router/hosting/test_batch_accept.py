"""The router's loop accepts many waiting connections each turn (libuv's own server, under
uvloop, accepts one a turn): counted in loop turns, not seconds, so the machine's speed
does not enter."""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import time
from collections.abc import Callable
from typing import cast

import pytest
import uvloop

from firstbyte.router.hosting import batch_accept, loop_factory
from firstbyte.router.hosting.batch_accept import (
    ACCEPT_RETRY_S,
    ACCEPTS_PER_TURN,
    BatchAcceptServer,
)
from firstbyte.router.hosting.limits import Throttle

WAITING = 200


def _listening(backlog: int = 1024) -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(backlog)
    return sock


class _Counted(asyncio.Protocol):
    made: list[asyncio.Transport]

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.made.append(cast(asyncio.Transport, transport))

    def data_received(self, data: bytes) -> None:
        self.made[0].write(data)


def _turns_to_accept(new_loop: Callable[[], asyncio.AbstractEventLoop]) -> int:
    """Loop turns from the moment ``WAITING`` connections wait in the accept queue until
    every one has reached its protocol."""
    made: list[asyncio.Transport] = []
    protocol = type("P", (_Counted,), {"made": made})
    clients: list[socket.socket] = []

    async def main() -> int:
        loop = asyncio.get_running_loop()
        sock = _listening()
        server = await loop.create_server(protocol, sock=sock, backlog=1024)
        try:
            port = sock.getsockname()[1]
            # The loop does not run while the clients connect: all of them wait in the
            # kernel's accept queue (connect() returns once a connection is queued).
            for _ in range(WAITING):
                client = socket.create_connection(("127.0.0.1", port))
                clients.append(client)
            turns = 0
            while len(made) < WAITING and turns < 10 * WAITING:
                await asyncio.sleep(0)  # one turn of the loop, its I/O polled
                turns += 1
            assert len(made) == WAITING, f"{len(made)} of {WAITING} accepted"
            return turns
        finally:
            server.close()
            await server.wait_closed()
            for transport in made:
                transport.close()
            for client in clients:
                client.close()

    with asyncio.Runner(loop_factory=new_loop) as runner:
        return runner.run(main())


def test_the_routers_loop_accepts_waiting_connections_many_a_turn() -> None:
    new_loop = loop_factory()
    assert new_loop is not None
    turns = _turns_to_accept(new_loop)
    # A turn accepts ACCEPTS_PER_TURN of them; connect_accepted_socket then takes a turn or
    # two each, side by side. uvloop's own server took one turn a connection (the control).
    batches = -(-WAITING // ACCEPTS_PER_TURN)
    assert turns <= batches + 4, f"{turns} turns for {WAITING} waiting connections"


def test_uvloops_own_server_takes_a_turn_a_connection() -> None:
    """The control: what the router's loop changes (if libuv ever accepts in a loop again,
    this fails and :mod:`firstbyte.router.hosting.batch_accept` can go)."""
    assert _turns_to_accept(uvloop.new_event_loop) >= WAITING // 2


def test_a_server_on_an_address_is_uvloops_own() -> None:
    new_loop = loop_factory()
    assert new_loop is not None

    async def main() -> None:
        loop = asyncio.get_running_loop()
        on_address = await loop.create_server(asyncio.Protocol, "127.0.0.1", 0)
        on_socket = await loop.create_server(asyncio.Protocol, sock=_listening())
        try:
            assert not isinstance(on_address, BatchAcceptServer)
            assert isinstance(on_socket, BatchAcceptServer)
        finally:
            for server in (on_address, on_socket):
                server.close()
                await server.wait_closed()

    with asyncio.Runner(loop_factory=new_loop) as runner:
        runner.run(main())


class _FailingOnce(socket.socket):
    """A listening socket whose first ``accept()`` fails as a process out of descriptors."""

    failed = False

    def accept(self) -> tuple[socket.socket, object]:
        if not self.failed:
            self.failed = True
            raise OSError(errno.EMFILE, "Too many open files")
        return super().accept()


@pytest.mark.asyncio(loop_scope="function")
async def test_out_of_descriptors_it_logs_a_line_waits_and_accepts_again(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the log is throttled per process: this test's line must not be held back by another's
    monkeypatch.setattr(batch_accept, "_throttle", Throttle(10.0))
    loop = asyncio.get_running_loop()
    made: list[asyncio.Transport] = []
    protocol = type("P", (_Counted,), {"made": made})
    sock = _FailingOnce()
    sock.bind(("127.0.0.1", 0))
    server = BatchAcceptServer(loop, protocol, sock, backlog=16)
    server.start()
    port = sock.getsockname()[1]
    caplog.set_level(logging.ERROR, logger="firstbyte.hosting")
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        started = time.monotonic()
        async with asyncio.timeout(10):
            while not made:  # noqa: ASYNC110 (the protocol's connection_made appends)
                await asyncio.sleep(0.005)
        waited = time.monotonic() - started
        writer.write(b"ping")
        assert await reader.readexactly(4) == b"ping"
        assert sock.failed
        assert waited >= ACCEPT_RETRY_S * 0.9, "it retried at once (a busy loop)"
        lines = [r.getMessage() for r in caplog.records if "accept() failed" in r.getMessage()]
        assert len(lines) == 1, lines
        assert "Too many open files" in lines[0]
        writer.close()
    finally:
        server.close()
        await server.wait_closed()
        for transport in made:
            transport.close()


@pytest.mark.asyncio(loop_scope="function")
async def test_a_closed_server_closes_its_socket_and_refuses_connections() -> None:
    loop = asyncio.get_running_loop()
    sock = _listening()
    port = sock.getsockname()[1]
    server = BatchAcceptServer(loop, asyncio.Protocol, sock, backlog=16)
    server.start()
    assert server.is_serving()
    assert len(server.sockets) == 1
    server.close()
    async with asyncio.timeout(5):
        await server.wait_closed()
    assert not server.is_serving()
    assert not server.sockets
    assert sock.fileno() == -1
    with pytest.raises(ConnectionRefusedError):
        await asyncio.open_connection("127.0.0.1", port)


class _ClosedAtOnce(asyncio.Protocol):
    """Closes its connection in ``connection_made``, as the router's counter does with one
    in the last half of its descriptor reserve; records the descriptor number it had."""

    descriptors: list[int]

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.descriptors.append(transport.get_extra_info("socket").fileno())
        transport.close()


def test_from_the_reserve_on_one_connection_is_accepted_at_a_time() -> None:
    """From the descriptor :func:`batch_accept.one_at_a_time_from` names, each connection
    reaches its protocol (which may close it) before the next is accepted: a batch would
    spend up to ``ACCEPTS_PER_TURN`` descriptors past it before any protocol ran."""
    new_loop = loop_factory()
    assert new_loop is not None
    descriptors: list[int] = []
    protocol = type("P", (_ClosedAtOnce,), {"descriptors": descriptors})
    waiting = 2 * ACCEPTS_PER_TURN
    clients: list[socket.socket] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        sock = _listening()
        with socket.socket() as probe:
            reserve_from = probe.fileno() + 8  # the lowest free descriptor, and 8 above it
        with batch_accept.one_at_a_time_from(lambda: reserve_from):
            server = await loop.create_server(protocol, sock=sock, backlog=1024)
        try:
            assert isinstance(server, BatchAcceptServer)
            port = sock.getsockname()[1]
            for _ in range(waiting):
                clients.append(socket.create_connection(("127.0.0.1", port)))
            async with asyncio.timeout(10):
                while len(descriptors) < waiting:  # noqa: ASYNC110 (connection_made appends)
                    await asyncio.sleep(0)
        finally:
            server.close()
            await server.wait_closed()
            for client in clients:
                client.close()
        # The clients' sockets took descriptors too, so the server's start above the mark.
        assert max(descriptors) <= max(reserve_from, min(descriptors)) + 1, descriptors

    with asyncio.Runner(loop_factory=new_loop) as runner:
        runner.run(main())
