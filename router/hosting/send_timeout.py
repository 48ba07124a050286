"""Disconnect a client that stops reading what the router sends it (nginx's ``send_timeout``).

A client that stops reading fills its socket's buffers, then the transport's: past its high
water the transport calls the protocol's ``pause_writing``, and the router's writers wait.
Nothing else ever ends that wait: TCP keeps probing the zero window for as long as the peer
acknowledges the probes, and a response in progress is outside the keep-alive and header
clocks. The connection, its descriptor and its stream would be held until the client chose
to go. :class:`SendTimer` closes it once its writes have stayed paused for
``limits.client_send_timeout_s`` in a row: the client took nothing the router had for it
(at least the transport's high-water mark less its low-water mark) in that time.

Each protocol that serves clients (hypercorn's stream protocol, :mod:`.accept`; uvicorn's
HTTP/1.1 and WebSocket protocols, :mod:`.uvicorn_limits`) calls :meth:`SendTimer.paused`,
:meth:`SendTimer.resumed` and, when the connection ends, :meth:`SendTimer.stop` from its own
flow-control callbacks (``pause_writing``, ``resume_writing``, ``connection_lost``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
import struct
from collections.abc import Callable
from typing import cast

from .hardening import report

__all__ = ["SendTimer"]


class SendTimer:
    """The send timeout of one connection: armed while its writes are paused."""

    __slots__ = ("_client", "_close", "_timeout_s", "_timer")

    def __init__(self, timeout_s: float, close: Callable[[], None], client: object) -> None:
        """``close`` resets the connection (a client that does not read cannot take a
        graceful goodbye either); ``client`` names it in the log line."""
        self._timeout_s = timeout_s
        self._close = close
        self._client = client
        self._timer: asyncio.TimerHandle | None = None

    @classmethod
    def paused(
        cls, timer: SendTimer | None, loop: asyncio.AbstractEventLoop, timeout_s: float,
        transport: asyncio.BaseTransport, client: object,
    ) -> SendTimer:
        """The transport's buffer went past its high water: start counting (``timer``: the
        connection's, None the first time), closing ``transport`` at the end. Returns the
        connection's timer."""
        if timer is None:
            timer = cls(timeout_s, functools.partial(_reset, transport), client)
        if timer._timer is None:
            timer._timer = loop.call_later(timer._timeout_s, timer._expired)
        return timer

    def resumed(self) -> None:
        """The client took enough to bring the buffer under its low water."""
        self.stop()

    def stop(self) -> None:
        """The connection ended (or resumed): no timeout."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expired(self) -> None:
        self._timer = None
        report(
            logging.INFO, "client stopped reading: connection closed", self._client,
            f"nothing taken for {self._timeout_s:g} s (limits.client_send_timeout_s)",
        )
        self._close()


_LINGER_RESET = struct.pack("ii", 1, 0)
"""``SO_LINGER`` on, 0 s: ``close`` resets the connection and drops what is unsent."""


def _reset(transport: asyncio.BaseTransport) -> None:
    """Abort ``transport`` with a TCP reset. A plain close would queue the FIN behind the
    bytes the client never took: the kernel would keep them (megabytes on a fast link) and
    the orphaned socket, retrying for minutes."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
    cast(asyncio.Transport, transport).abort()
