"""Test proxies that cut a connection mid-stream, placed between the SDK and the router.
(With ``cuts=0`` and ``record=True`` the TCP one is a relay that keeps what clients sent.)

:class:`TcpCutProxy` forwards TCP and, on the first ``cuts`` connections whose downstream
(server -> client) byte count reaches ``cut_after``, forwards exactly that many bytes and then
aborts both sides (an RST, as a NAT timeout or a crashed middlebox would). :class:`UdpCutProxy`
does the QUIC equivalent: the first flow that reaches ``cut_after`` downstream bytes is
blackholed in both directions (QUIC cannot be reset by a middlebox; it just goes silent).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, cast


class TcpCutProxy:
    def __init__(self, target_port: int, *, cut_after: int, cuts: int = 1,
                 record: bool = False) -> None:
        self.target_port = target_port
        self.record = record
        self.upstream_bytes = bytearray()
        """With ``record``: every byte clients sent to the server, in arrival order."""
        self.cut_after = cut_after
        self.cuts_left = cuts
        self.cuts_done = 0
        self.connections = 0
        self.port = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> TcpCutProxy:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.transport.abort()
            return
        task_up = asyncio.ensure_future(self._pump(reader, up_writer, writer, count=False))
        task_down = asyncio.ensure_future(self._pump(up_reader, writer, up_writer, count=True))
        for task in (task_up, task_down):
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        await asyncio.wait({task_up, task_down}, return_when=asyncio.FIRST_COMPLETED)
        for task in (task_up, task_down):
            task.cancel()
        writer.transport.abort()
        up_writer.transport.abort()

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter,
                    other: asyncio.StreamWriter, *, count: bool) -> None:
        sent = 0
        eligible = count and self.cuts_left > 0
        while True:
            data = await src.read(65536)
            if not data:
                with contextlib.suppress(OSError):
                    dst.write_eof()
                return
            if eligible and self.cuts_left > 0 and sent + len(data) >= self.cut_after:
                dst.write(data[: self.cut_after - sent])
                with contextlib.suppress(OSError):
                    await dst.drain()
                self.cuts_left -= 1
                self.cuts_done += 1
                dst.transport.abort()
                other.transport.abort()
                return
            sent += len(data)
            if self.record and not count:
                self.upstream_bytes += data
            dst.write(data)
            await dst.drain()


class _Upstream(asyncio.DatagramProtocol):
    def __init__(self, proxy: UdpCutProxy, client: tuple[str, int]) -> None:
        self.proxy = proxy
        self.client = client
        self.transport: asyncio.DatagramTransport | None = None
        self.down_bytes = 0
        self.blackholed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: Any) -> None:
        if self.blackholed:
            return
        proxy = self.proxy
        if proxy.cuts_left > 0 and self.down_bytes + len(data) >= proxy.cut_after:
            proxy.cuts_left -= 1
            proxy.cuts_done += 1
            self.blackholed = True
            return
        self.down_bytes += len(data)
        assert proxy.transport is not None
        proxy.transport.sendto(data, self.client)


class UdpCutProxy(asyncio.DatagramProtocol):
    def __init__(self, target_port: int, *, cut_after: int, cuts: int = 1) -> None:
        self.target_port = target_port
        self.cut_after = cut_after
        self.cuts_left = cuts
        self.cuts_done = 0
        self.port = 0
        self.transport: asyncio.DatagramTransport | None = None
        self._flows: dict[tuple[str, int], _Upstream] = {}
        self._pending: dict[tuple[str, int], list[bytes]] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> UdpCutProxy:
        loop = asyncio.get_running_loop()
        await loop.create_datagram_endpoint(lambda: self, local_addr=("127.0.0.1", 0))
        assert self.transport is not None
        self.port = self.transport.get_extra_info("sockname")[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        for flow in self._flows.values():
            if flow.transport is not None:
                flow.transport.close()
        if self.transport is not None:
            self.transport.close()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: Any) -> None:
        client = (addr[0], addr[1])
        flow = self._flows.get(client)
        if flow is None:
            if client in self._pending:
                self._pending[client].append(data)
                return
            self._pending[client] = [data]
            task = asyncio.ensure_future(self._open(client))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            return
        if flow.blackholed or flow.transport is None:
            return
        flow.transport.sendto(data)

    async def _open(self, client: tuple[str, int]) -> None:
        loop = asyncio.get_running_loop()
        _, flow = await loop.create_datagram_endpoint(
            lambda: _Upstream(self, client), remote_addr=("127.0.0.1", self.target_port))
        self._flows[client] = flow
        assert flow.transport is not None
        for data in self._pending.pop(client, []):
            flow.transport.sendto(data)
