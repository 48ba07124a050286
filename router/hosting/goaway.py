"""Telling a running hypercorn server's clients that it is going away, before it stops.

hypercorn (0.17, 0.18) sends an HTTP/2 GOAWAY only once its shutdown has begun (when it no
longer accepts connections), and never an HTTP/3 one. A draining router tells its clients
first, while it still listens, and stops later. :class:`ConnectionRegistry` holds a server's
open HTTP/2 and HTTP/3 connections (registered by a patch on hypercorn's protocol classes, for a
server whose hypercorn ``Config`` carries it as ``firstbyte_connections_registry``), and
:meth:`ConnectionRegistry.goaway` tells them:

- HTTP/2: a connection with no stream open gets GOAWAY (NO_ERROR) at once; a busy one gets it
  as soon as its last stream ends. Not the two-step GOAWAY of RFC 9113 section 6.8 (first
  with last stream id 2^31-1 while streams run): the Python h2 library, under httpx and so
  under firstbyte's own SDK, fails every open stream when a GOAWAY arrives before their DATA
  (python-hyper/h2 issue 1199), so an early GOAWAY would break the streams a drain exists to
  finish. Meanwhile a new request on a busy connection is answered by the app (503
  ``draining``).
- HTTP/3: every connection gets GOAWAY at once with the largest client stream id (RFC 9114
  section 5.2: streams in flight go on, new requests go to a new connection); aioquic's
  client ignores it without harm.

An HTTP/2 connection that hypercorn closes at its keep-alive timeout goes away too
(:func:`goaway_at_idle_close`): hypercorn closed it without a GOAWAY, so a client whose
request crossed the close on the wire got a reset and could not tell whether the request had
been processed; GOAWAY(NO_ERROR) with the last stream the connection took (RFC 9113 section
6.8) tells it that the request was not, and that it must go to a new connection. HTTP/1.1's
idle close stays a plain close; HTTP/3 connections end at QUIC's own idle timeout.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from typing import Any

__all__ = ["ConnectionRegistry", "goaway_at_idle_close", "send_h2_goaway", "track_connections"]

log = logging.getLogger("firstbyte.hosting")

_H3_GRACEFUL_LAST_STREAM = (1 << 62) - 4
"""The largest client-initiated bidirectional stream id a QUIC varint can carry."""


class ConnectionRegistry:
    """The HTTP/2 and HTTP/3 connections one server has open (weakly held)."""

    def __init__(self) -> None:
        self.h2: weakref.WeakSet[Any] = weakref.WeakSet()
        self.h3: weakref.WeakSet[Any] = weakref.WeakSet()
        self.going_away = False
        """Set by :meth:`goaway`: every HTTP/2 connection gets GOAWAY once idle."""
        self._told: weakref.WeakSet[Any] = weakref.WeakSet()

    async def goaway(self) -> int:
        """Tell every open connection (see the module docstring); the number told now (busy
        HTTP/2 connections are told when their last stream ends).

        A connection its client has closed stays in :attr:`h2` or :attr:`h3` until the
        cyclic GC frees it (hypercorn's protocol objects sit in reference cycles, and the
        router runs the GC seldom): it is skipped, not written to (asyncio logs "SSL
        connection is closed" for writes to a closed TLS transport) nor counted."""
        self.going_away = True
        told = 0
        for protocol in list(self.h2):
            if protocol.closed:
                continue
            told += await self.h2_goaway_if_idle(protocol)
        for protocol in list(self.h3):
            if protocol.connection._quic._close_event is not None:  # closed, either side
                continue
            with contextlib.suppress(Exception):  # a connection closing meanwhile
                await _h3_goaway(protocol)
                told += 1
        return told

    async def h2_goaway_if_idle(self, protocol: Any) -> bool:
        """GOAWAY on ``protocol`` (an HTTP/2 connection) if no stream is open on it and it
        was not told yet; True if sent."""
        if protocol in self._told or any(not s.idle for s in protocol.streams.values()):
            return False
        self._told.add(protocol)
        with contextlib.suppress(Exception):  # a connection closing meanwhile
            protocol.connection.close_connection()
            await protocol._flush()
            return True
        return False


async def send_h2_goaway(protocol: Any, error_code: int = 0) -> None:
    """GOAWAY ``error_code`` (0: NO_ERROR) on ``protocol``, hypercorn's HTTP/2 connection,
    written to its transport before anything sent after it. Its last stream id is h2's
    ``highest_inbound_stream_id``: the last stream the client opened (0 if none; a stream
    refused past the concurrency limit counts, its REFUSED_STREAM having told its client)."""
    import h2.exceptions

    with contextlib.suppress(h2.exceptions.ProtocolError):
        protocol.connection.close_connection(error_code=error_code)
        await protocol._flush()


async def _h3_goaway(protocol: Any) -> None:
    from aioquic.buffer import encode_uint_var
    from aioquic.h3.connection import FrameType, encode_frame

    h3 = protocol.connection
    control = h3._local_control_stream_id
    if control is None:
        return
    h3._quic.send_stream_data(
        control, encode_frame(FrameType.GOAWAY, encode_uint_var(_H3_GRACEFUL_LAST_STREAM))
    )
    await protocol.send()


def track_connections() -> None:
    """Register every new HTTP/2 and HTTP/3 connection with its server's
    :class:`ConnectionRegistry`, when its config has one (once per process, by
    :mod:`.patches`)."""
    from hypercorn.protocol.h2 import H2Protocol
    from hypercorn.protocol.h3 import H3Protocol

    classes: tuple[tuple[Any, str], ...] = ((H2Protocol, "h2"), (H3Protocol, "h3"))
    for cls, kind in classes:
        original = cls.__init__

        def tracked(self: Any, *args: Any, _init: Any = original, _kind: str = kind,
                    **kwargs: Any) -> None:
            _init(self, *args, **kwargs)
            registry = getattr(self.config, "firstbyte_connections_registry", None)
            if isinstance(registry, ConnectionRegistry):
                getattr(registry, _kind).add(self)

        cls.__init__ = tracked
        if kind == "h2":
            _goaway_when_idle(cls)


def _goaway_when_idle(h2_protocol: Any) -> None:
    """After a stream of a draining server ends, GOAWAY on its connection if it is now idle."""
    from hypercorn.protocol.events import StreamClosed

    original = h2_protocol.stream_send

    async def stream_send(self: Any, event: Any) -> None:
        await original(self, event)
        registry = getattr(self.config, "firstbyte_connections_registry", None)
        if (
            isinstance(event, StreamClosed)
            and isinstance(registry, ConnectionRegistry)
            and registry.going_away
        ):
            await registry.h2_goaway_if_idle(self)

    h2_protocol.stream_send = stream_send


def goaway_at_idle_close() -> None:
    """Send GOAWAY(NO_ERROR) on an HTTP/2 connection before hypercorn closes it at its
    keep-alive timeout, unless a GOAWAY already went either way (a drain's, the client's);
    an HTTP/1.1 connection is closed as before (once per process, by :mod:`.patches`).

    hypercorn's per-connection server closes an idle connection from its idle timer
    (``TCPServer._idle_timeout`` -> ``_initiate_server_close``): the protocol handles
    ``Closed`` and the writer closes, and an HTTP/2 protocol then sends nothing. The GOAWAY
    is written through hypercorn's own send path first, so the transport sends it before its
    close (over TLS, before the ``close_notify``). A client that reads nothing cannot hold
    the close up: a write that stays paused is cut by the send timeout (:mod:`.send_timeout`).
    """
    from h2.connection import ConnectionState
    from hypercorn.asyncio import run
    from hypercorn.protocol.h2 import H2Protocol

    hypercorn_run: Any = run

    class GoawayAtIdleTCPServer(hypercorn_run.TCPServer):  # type: ignore[misc]
        async def _initiate_server_close(self) -> None:
            # ProtocolWrapper.protocol: the connection's HTTP/1.1 or HTTP/2 protocol (an
            # h2c upgrade replaces the first with the second).
            protocol = getattr(getattr(self, "protocol", None), "protocol", None)
            if (
                isinstance(protocol, H2Protocol)
                and not protocol.closed
                and protocol.connection.state_machine.state is not ConnectionState.CLOSED
            ):
                await send_h2_goaway(protocol)
            await super()._initiate_server_close()

    hypercorn_run.TCPServer = GoawayAtIdleTCPServer
