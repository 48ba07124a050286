"""Defences hypercorn's HTTP/3 server (0.17, 0.18, over aioquic) lacks, as patches on its QUIC
and HTTP/3 protocol classes; :mod:`.patches` applies them with the others,
and like them they act only on a server whose config carries ``firstbyte_limits``.

- :func:`drop_late_h3_data`: DATA (or trailers) for a stream already answered is dropped and
  the client asked to stop sending it, instead of a ``KeyError`` that ended the UDP server;
- :func:`guard_quic_connections`: a new QUIC connection is counted per client address with
  the TCP ones (:func:`~.limits.admit_quic`), closed once it has had no request for
  ``header_timeout_s`` (PINGs or not), and asked for a Retry while handshakes arrive faster
  than ``quic_retry_above_handshakes_per_s`` (:class:`~.limits.HandshakeRate`);
- :func:`release_quic_connections`: what a stopped QUIC server's connections counted, given
  back (:mod:`.servers` restarts a server task that ended).

Every refusal is one throttled log line (:func:`~.hardening.report`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from typing import Any

from .hardening import _limits, report
from .limits import ClientLimits, ConnectionCounter, HandshakeRate, admit_quic

__all__ = ["drop_late_h3_data", "guard_quic_connections", "release_quic_connections"]


def drop_late_h3_data() -> None:
    """Drop HTTP/3 DATA for a stream hypercorn has already forgotten.

    hypercorn's ``H3Protocol.handle`` looks every DATA frame's stream up with
    ``self.streams[stream_id]``, and forgets a stream once its app has answered. A POST
    answered before its body was read (401 to a long prompt without a key, 404 to a keyed
    POST to an unknown path) gets the rest of its body afterwards: ``KeyError``, raised into
    the UDP server's loop, which ended it: every later QUIC handshake timed out, for the life
    of the process. Such frames are now dropped, and the client is asked to stop sending the
    body (STOP_SENDING with H3_NO_ERROR, as RFC 9114 section 4.1 provides for a response
    sent before the request was complete).
    """
    from aioquic.h3.connection import ErrorCode
    from aioquic.h3.events import DataReceived, HeadersReceived
    from hypercorn.protocol.events import Body, EndBody
    from hypercorn.protocol.h3 import H3Protocol

    handle = H3Protocol.handle

    async def tolerant(self: Any, quic_event: Any) -> None:
        if _limits(self.config) is None:
            await handle(self, quic_event)
            return
        for event in self.connection.handle_event(quic_event):
            if isinstance(event, HeadersReceived):
                if self.context.terminated.is_set():
                    continue
                await self._create_stream(event)
                if event.stream_ended:
                    await _to_stream(self, event.stream_id, EndBody(stream_id=event.stream_id))
            elif isinstance(event, DataReceived):
                body = Body(stream_id=event.stream_id, data=event.data)
                if await _to_stream(self, event.stream_id, body) and event.stream_ended:
                    await _to_stream(self, event.stream_id, EndBody(stream_id=event.stream_id))

    async def _to_stream(self: Any, stream_id: int, event: Any) -> bool:
        """Hand ``event`` to its stream; False (and the rest of the body refused) if the
        stream is gone."""
        stream = self.streams.get(stream_id)
        if stream is not None:
            await stream.handle(event)
            return True
        # Once per stream: aioquic remembers the STOP_SENDING it was asked for. None: aioquic
        # has forgotten the stream too (its whole body was received), nothing left to stop.
        quic = self.connection._quic
        quic_stream = quic._streams.get(stream_id)
        if quic_stream is not None and getattr(quic_stream.receiver, "_stop_error_code", 0) is None:
            with contextlib.suppress(ValueError):
                quic.stop_stream(stream_id, ErrorCode.H3_NO_ERROR)
                await self.send()
        return False

    H3Protocol.handle = tolerant  # type: ignore[method-assign]


class _QuicGuard:
    """One QUIC listener's accounting: its handshake rate, Retry tokens, the connections it
    counted (to give back when they end) and their idle timers."""

    def __init__(self, limits: ClientLimits, counter: ConnectionCounter | None) -> None:
        from aioquic.quic.retry import QuicRetryTokenHandler

        self.limits = limits
        self.counter = counter
        threshold = limits.quic_retry_above_handshakes_per_s
        self.rate = HandshakeRate(threshold) if threshold is not None else None
        self.tokens = QuicRetryTokenHandler()
        self.counted: dict[int, tuple[Any, str]] = {}
        """id(connection) -> (connection, client address), until it ends."""
        self.closing: set[asyncio.Task[None]] = set()

    def release(self, connection: Any) -> None:
        entry = self.counted.pop(id(connection), None)
        timer: asyncio.TimerHandle | None = connection.__dict__.pop("_firstbyte_idle", None)
        if timer is not None:
            timer.cancel()
        if entry is not None and self.counter is not None:
            self.counter.close(entry[1])

    def release_all(self) -> None:
        for connection, _ in list(self.counted.values()):
            self.release(connection)


def release_quic_connections(protocol: Any) -> None:
    """Give back what the connections of a QUIC protocol that has stopped counted (its
    server task ended: its connections are gone without their ends being seen)."""
    guard: _QuicGuard | None = getattr(protocol, "_firstbyte_quic", None)
    if guard is not None:
        guard.release_all()


def _lowest_free_fd() -> int:
    """The descriptor the next socket would get (Linux hands out the lowest free one)."""
    try:
        fd = os.open(os.devnull, os.O_RDONLY)
    except OSError:
        return 1 << 30  # none free at all
    os.close(fd)
    return fd


def guard_quic_connections() -> None:
    """Count, time and (under a handshake flood) validate new QUIC connections.

    hypercorn's ``QuicProtocol.handle`` makes a connection of every Initial datagram of 1,200
    bytes or more: no per-address cap, no descriptor reserve, and a client that PINGs is
    never idle for aioquic, so 2,000 connections from one address with no request were all
    held for minutes (RSS 62 -> 250 MB); 20,000 Initials at 2,000/s took the process to 100%
    CPU and 710 MB. Here a new connection's Initial is handled as hypercorn does, with:

    - Retry first (RFC 9000 section 8.1) while handshakes arrive faster than
      ``quic_retry_above_handshakes_per_s``: the client must echo a token bound to its
      address before any connection state exists, so a spoofed flood costs one small
      packet each (a client that already holds a valid token is served whatever the rate);
    - the per-address cap and the descriptor reserve of :func:`~.limits.admit_quic`
      (refused: CONNECTION_CLOSE with CONNECTION_REFUSED, one throttled log line);
    - a timer that closes the connection once it has had no request in flight for
      ``header_timeout_s`` (since it began or its last request ended), whatever it sends.
    """
    from aioquic.buffer import Buffer  # type: ignore[attr-defined]
    from aioquic.h3.connection import ErrorCode
    from aioquic.quic.packet import (
        PACKET_TYPE_INITIAL,
        QuicErrorCode,
        encode_quic_retry,
        pull_quic_header,
    )
    from hypercorn.events import RawData
    from hypercorn.protocol import quic
    from hypercorn.protocol.events import StreamClosed
    from hypercorn.protocol.h3 import H3Protocol

    from .quic import encode_initial_close

    hypercorn_quic: Any = quic  # its QuicConnection may be .quic's ticketing factory
    protocol_class: Any = hypercorn_quic.QuicProtocol
    handle = protocol_class.handle
    handle_events = protocol_class._handle_events
    stream_send = H3Protocol.stream_send

    def guard_of(self: Any, limits: ClientLimits) -> _QuicGuard:
        guard: _QuicGuard | None = getattr(self, "_firstbyte_quic", None)
        if guard is None:
            counter = getattr(self.config, "firstbyte_connections", None)
            guard = self._firstbyte_quic = _QuicGuard(limits, counter)
        return guard

    async def guarded(self: Any, event: Any) -> None:
        limits = _limits(self.config)
        if limits is None or not isinstance(event, RawData):
            await handle(self, event)
            return
        try:
            header = pull_quic_header(Buffer(data=event.data), host_cid_length=8)
        except ValueError:
            return
        if (
            header.packet_type != PACKET_TYPE_INITIAL
            or len(event.data) < 1200
            or header.destination_cid in self.connections
            or self.context.terminated.is_set()
            or header.version not in self.quic_config.supported_versions
        ):
            await handle(self, event)  # not a new connection: hypercorn's own way
            return
        await _new_connection(self, event, header, guard_of(self, limits))

    async def _close_initial(self: Any, header: Any, address: Any, code: Any) -> None:
        """Answer an Initial with CONNECTION_CLOSE(``code``), keeping no state for it."""
        await self.send(RawData(data=encode_initial_close(
            version=header.version,
            source_cid=header.destination_cid,
            destination_cid=header.source_cid,
            error_code=code,
        ), address=address))

    async def _new_connection(self: Any, event: Any, header: Any, guard: _QuicGuard) -> None:
        now = self.context.time()
        retry = guard.rate is not None and guard.rate.observe(now)
        original_cid, retry_cid = header.destination_cid, None
        if header.token:
            try:
                original_cid = guard.tokens.validate_token(
                    address=event.address,
                    destination_cid=header.destination_cid,
                    token=header.token,
                    now=now,
                )
                retry_cid = header.destination_cid
            except ValueError:
                if retry:  # a token of ours expired or forged: RFC 9000 section 8.1.3
                    await _close_initial(self, header, event.address, QuicErrorCode.INVALID_TOKEN)
                    return
                # else: not one of ours (say, another server's NEW_TOKEN): as if none.
        elif retry:
            report(
                logging.WARNING,
                "QUIC handshakes above limits.quic_retry_above_handshakes_per_s: Retry",
                event.address[0],
                f"{guard.rate.rate(now):.0f}/s" if guard.rate is not None else "",
            )
            source_cid = os.urandom(8)
            token = guard.tokens.create_token(
                address=event.address,
                original_destination_connection_id=header.destination_cid,
                retry_source_connection_id=source_cid,
                now=now,
            )
            await self.send(RawData(data=encode_quic_retry(
                version=header.version,
                source_cid=source_cid,
                destination_cid=header.source_cid,
                original_destination_cid=header.destination_cid,
                retry_token=token,
            ), address=event.address))
            return
        client = str(event.address[0])
        if guard.counter is not None:
            refusal = admit_quic(guard.counter, client, _lowest_free_fd())
            if refusal is not None:
                report(logging.WARNING, "QUIC connection refused", client, refusal)
                await _close_initial(
                    self, header, event.address, QuicErrorCode.CONNECTION_REFUSED
                )
                return
        quic_connection = hypercorn_quic.QuicConnection(
            configuration=self.quic_config,
            original_destination_connection_id=original_cid,
            retry_source_connection_id=retry_cid,
        )
        connection: Any = hypercorn_quic._Connection(
            cids={header.destination_cid, quic_connection.host_cid},
            quic=quic_connection,
            task=self.context.single_task_class(),
        )
        self.connections[header.destination_cid] = connection
        self.connections[quic_connection.host_cid] = connection
        if guard.counter is not None:
            guard.counted[id(connection)] = (connection, client)
        connection._firstbyte_client = client
        connection._firstbyte_last_busy = time.monotonic()
        _arm_idle_timer(self, connection, guard, guard.limits.header_timeout_s)
        connection.quic.receive_datagram(event.data, event.address, now=self.context.time())
        await self._handle_events(connection, event.address)

    def _arm_idle_timer(self: Any, connection: Any, guard: _QuicGuard, delay_s: float) -> None:
        connection._firstbyte_idle = asyncio.get_running_loop().call_later(
            delay_s, _idle_check, self, connection, guard
        )

    def _idle_check(self: Any, connection: Any, guard: _QuicGuard) -> None:
        connection.__dict__.pop("_firstbyte_idle", None)
        if not connection.cids:  # ended meanwhile
            return
        timeout = guard.limits.header_timeout_s
        h3 = connection.h3
        now = time.monotonic()
        if h3 is not None and h3.streams:
            connection._firstbyte_last_busy = now
            _arm_idle_timer(self, connection, guard, timeout)
            return
        last = max(connection._firstbyte_last_busy, getattr(h3, "_firstbyte_last_busy", 0.0))
        if now - last < timeout:
            _arm_idle_timer(self, connection, guard, timeout - (now - last))
            return
        report(
            logging.INFO,
            "QUIC connection without a request: closed",
            connection._firstbyte_client,
            f"none for {timeout:g} s (limits.client_header_timeout_s)",
        )
        connection.quic.close(error_code=ErrorCode.H3_NO_ERROR, reason_phrase="idle")
        task = asyncio.ensure_future(self.send_all(connection))
        guard.closing.add(task)
        task.add_done_callback(guard.closing.discard)

    async def releasing(self: Any, connection: Any, client: Any = None) -> None:
        try:
            await handle_events(self, connection, client)
        finally:
            guard: _QuicGuard | None = getattr(self, "_firstbyte_quic", None)
            if not connection.cids and guard is not None:  # terminated: hypercorn forgot it
                guard.release(connection)

    async def noting_request_ends(self: Any, event: Any) -> None:
        if isinstance(event, StreamClosed):
            self._firstbyte_last_busy = time.monotonic()
        await stream_send(self, event)

    protocol_class.handle = guarded
    protocol_class._handle_events = releasing
    H3Protocol.stream_send = noting_request_ends  # type: ignore[method-assign]
