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

HTTP/2 has a second way to stop reading: per stream. A client that reads its connection (its
window given back, PINGs answered) but never opens one stream's flow-control window (or sets
``SETTINGS_INITIAL_WINDOW_SIZE`` to 0 and never opens any) leaves the TCP connection flowing,
so :class:`SendTimer` never starts, while that stream's sender waits on its window for ever:
its ASGI ``send`` never returns, and the stream holds its task, its upstream request and its
key's slot. :func:`time_h2_stream_windows` (a patch of hypercorn's ``H2Protocol``, applied by
:mod:`.patches`) gives each stream a clock of its own (:class:`StreamWindowTimers`): it runs
while the stream has data waiting and no window to send it in, any byte the stream sends
stops it, and at ``limits.client_send_timeout_s`` the stream is reset with ``CANCEL`` and its
app told the client is gone; the connection's other streams go on.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
import struct
from collections.abc import Callable
from typing import Any, cast

from .hardening import _limits, report

__all__ = ["SendTimer", "StreamWindowTimers", "time_h2_stream_windows"]


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


class StreamWindowTimers:
    """The send timeouts of one HTTP/2 connection's streams: a stream's runs while it has data
    waiting and no flow-control window (its own or the connection's) to send it in; any byte
    it sends stops it. At ``timeout_s`` in a row, ``expire(stream_id)``."""

    __slots__ = ("_expire", "_loop", "_timeout_s", "_timers")

    def __init__(
        self, loop: asyncio.AbstractEventLoop, timeout_s: float, expire: Callable[[int], None]
    ) -> None:
        self._loop = loop
        self._timeout_s = timeout_s
        self._expire = expire
        self._timers: dict[int, asyncio.TimerHandle] = {}

    def visited(self, stream_id: int, taken: int, waiting: int, window: int) -> None:
        """The sender visited ``stream_id``: it sent ``taken`` bytes of it, ``waiting`` bytes
        are left to send, and flow control allows ``window`` more now."""
        timer = self._timers.get(stream_id)
        if timer is not None and (taken or not waiting):
            timer.cancel()  # it took something, or all there was: not stopped
            del self._timers[stream_id]
            timer = None
        if timer is None and waiting and window <= 0:
            self._timers[stream_id] = self._loop.call_later(
                self._timeout_s, self._expired, stream_id
            )

    def stop(self, stream_id: int) -> None:
        """The stream ended (or its connection did): no timeout."""
        timer = self._timers.pop(stream_id, None)
        if timer is not None:
            timer.cancel()

    def running(self) -> frozenset[int]:
        """The streams whose clock runs."""
        return frozenset(self._timers)

    def _expired(self, stream_id: int) -> None:
        del self._timers[stream_id]
        self._expire(stream_id)


_resetting: set[asyncio.Task[None]] = set()


def time_h2_stream_windows() -> None:
    """Reset an HTTP/2 stream whose flow-control window stays shut.

    hypercorn's sender (``H2Protocol.send_task``) sends each stream what its window allows;
    a stream with none is set aside until a WINDOW_UPDATE or a SETTINGS change, and its app's
    ``send`` waits (in the stream's ``StreamBuffer``) until then, with no clock: a client that
    never opens the window held the stream, its app and what the app holds for good. Each
    visit of the sender (``_send_data``) now tells the stream's clock what it sent and what is
    left (:class:`StreamWindowTimers`); at ``limits.client_send_timeout_s`` the stream is
    reset with ``CANCEL`` (RFC 9113 section 7: the stream is no longer needed; not
    ``FLOW_CONTROL_ERROR``, which says the peer broke flow control, nor ``PROTOCOL_ERROR``,
    nginx's for a timed-out stream: a shut window is the client's right), its buffer closed
    so its app's ``send`` returns (later ones are dropped), and its app told the client is
    gone (``http.disconnect``). One throttled log line.
    """
    import h2.exceptions
    from hypercorn.protocol.h2 import H2Protocol

    send_data = H2Protocol._send_data

    async def timed(self: Any, stream_id: int) -> None:
        limits = _limits(self.config)
        buffer = self.stream_buffers.get(stream_id)
        if limits is None or buffer is None:
            await send_data(self, stream_id)
            return
        connection = self.connection
        try:
            window = connection.local_flow_control_window(stream_id)
        except h2.exceptions.ProtocolError:  # closed: hypercorn's send drops it
            window = 0
        # What hypercorn's visit takes: its chunk, cut from the buffer before its first await.
        taken = min(len(buffer.buffer), max(0, min(window, connection.max_outbound_frame_size)))
        await send_data(self, stream_id)
        timers: StreamWindowTimers | None = self.__dict__.get("_firstbyte_window_timers")
        if timers is None:
            timers = self._firstbyte_window_timers = StreamWindowTimers(
                asyncio.get_running_loop(),
                limits.send_timeout_s,
                functools.partial(_window_shut, self, limits.send_timeout_s),
            )
        buffer = self.stream_buffers.get(stream_id)
        waiting = 0 if buffer is None or self.closed else len(buffer.buffer)
        if not waiting:  # caught up (a live stream's usual visit), sent whole, or dropped
            timers.stop(stream_id)
            return
        try:
            window = connection.local_flow_control_window(stream_id)
        except h2.exceptions.ProtocolError:
            timers.stop(stream_id)
            return
        timers.visited(stream_id, taken, waiting, window)

    H2Protocol._send_data = timed  # type: ignore[method-assign]


def _window_shut(protocol: Any, timeout_s: float, stream_id: int) -> None:
    if protocol.closed or stream_id not in protocol.stream_buffers:
        return
    report(
        logging.INFO,
        "client stopped reading an HTTP/2 stream: RST_STREAM CANCEL",
        protocol.client,
        f"stream {stream_id}'s flow-control window shut, nothing taken for {timeout_s:g} s"
        " (limits.client_send_timeout_s)",
    )
    task = asyncio.ensure_future(_cancel_stream(protocol, stream_id))
    _resetting.add(task)
    task.add_done_callback(_resetting.discard)


async def _cancel_stream(protocol: Any, stream_id: int) -> None:
    """Reset ``stream_id`` of hypercorn's ``protocol`` with CANCEL, release its app's
    ``send`` and tell its app the client is gone."""
    import h2.errors
    import h2.exceptions

    if protocol.closed:
        return  # a flush to a closed connection fails (see servers._reset_unfinished_h2_streams)
    with contextlib.suppress(h2.exceptions.ProtocolError):
        protocol.connection.reset_stream(stream_id, h2.errors.ErrorCodes.CANCEL)
        await protocol._flush()
    buffer = protocol.stream_buffers.get(stream_id)
    if buffer is not None:
        await buffer.close()  # complete and empty: hypercorn's sender then drops it
    with contextlib.suppress(Exception):  # priority.MissingStreamError: dropped already
        protocol.priority.unblock(stream_id)
    await protocol.has_data.set()
    await protocol._close_stream(stream_id)  # the app's next receive(): http.disconnect
