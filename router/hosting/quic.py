"""HTTP/3 for hypercorn: its QUIC listener's session-ticket store (0-RTT) and its status.

:class:`Http3Status` says whether the QUIC server is serving now; ``Alt-Svc`` and the router's
``/healthz`` follow it, so clients are not sent to a UDP port nobody answers.

hypercorn (0.17/0.18) builds each aioquic ``QuicConnection`` without
``session_ticket_fetcher``/``session_ticket_handler``, so clients get no resumption tickets
and cannot send 0-RTT data. :func:`enable_session_tickets` swaps the ``QuicConnection``
name hypercorn's QUIC protocol module uses for a factory that adds a :class:`TicketStore`
when the hypercorn ``Config`` carries one (``config.firstbyte_ticket_store``), and passes
everything else through unchanged. :mod:`.patches` applies it once per process; it affects
only listeners whose config has a store.

0-RTT requests are replayable by an on-path attacker; chat completion requests are not
idempotent in cost, so deployments that care should keep tickets short-lived
(``TicketStore(max_tickets=..., lifetime_s=...)``) — the exposure is one extra completion.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Protocol

from aioquic.quic.connection import QuicConnection
from aioquic.tls import SessionTicket

__all__ = [
    "Http3Status",
    "SessionTicketStore",
    "TicketStore",
    "enable_session_tickets",
    "encode_initial_close",
]


class Http3Status:
    """Whether this process's HTTP/3 server is serving: up while its UDP server task runs,
    down from the moment it ends on an error until it is restarted. Whoever advertises HTTP/3
    watches it (:meth:`watch`)."""

    first_restart_delay_s = 1.0
    """The wait before the first restart; it doubles on each failure in a row, up to
    :attr:`max_restart_delay_s` (a server that fails at once must not spin a core)."""
    max_restart_delay_s = 30.0

    def __init__(self) -> None:
        self.up = False
        self.failures = 0
        """Times the server task has ended on an error in this process."""
        self._watchers: list[Callable[[bool], None]] = []

    def watch(self, watcher: Callable[[bool], None]) -> None:
        """Call ``watcher(up)`` on every change from now on."""
        self._watchers.append(watcher)

    def set(self, up: bool) -> None:
        if up == self.up:
            return
        self.up = up
        for watcher in self._watchers:
            watcher(up)

    def restart_delay_s(self, failures_in_a_row: int) -> float:
        """How long to wait before restarting after the ``failures_in_a_row``-th failure."""
        delay = self.first_restart_delay_s * 2 ** max(0, failures_in_a_row - 1)
        return float(min(delay, self.max_restart_delay_s))


class SessionTicketStore(Protocol):
    """What the QUIC listener needs of a ticket store. aioquic calls both from inside the TLS
    handshake, synchronously: ``add`` when it issues a ticket, ``pop`` when a client presents
    one (a ticket found is removed: single use, the anti-replay guard of 0-RTT)."""

    def add(self, ticket: SessionTicket) -> None: ...

    def pop(self, label: bytes) -> SessionTicket | None: ...


class TicketStore:
    """Session tickets issued by this process, by ticket id; bounded, oldest dropped first.

    ``pop`` removes a ticket on use, so each ticket admits one 0-RTT attempt (anti-replay
    within this process).
    """

    def __init__(self, max_tickets: int = 10_000, lifetime_s: float = 86_400.0) -> None:
        self.max_tickets = max_tickets
        self.lifetime_s = lifetime_s
        self._tickets: OrderedDict[bytes, tuple[float, SessionTicket]] = OrderedDict()
        self.issued = 0
        self.resumed = 0

    def add(self, ticket: SessionTicket) -> None:
        self._tickets[ticket.ticket] = (time.monotonic(), ticket)
        self.issued += 1
        while len(self._tickets) > self.max_tickets:
            self._tickets.popitem(last=False)

    def pop(self, label: bytes) -> SessionTicket | None:
        entry = self._tickets.pop(label, None)
        if entry is None or time.monotonic() - entry[0] > self.lifetime_s:
            return None
        self.resumed += 1
        return entry[1]

    def __len__(self) -> int:
        return len(self._tickets)


def enable_session_tickets() -> None:
    """Patch hypercorn's QUIC protocol module (once per process, by :mod:`.patches`; see
    the module docstring)."""
    from hypercorn.protocol import quic

    hypercorn_quic: Any = quic  # patched below: hypercorn's own annotations do not apply
    original_protocol = hypercorn_quic.QuicProtocol

    class TicketingQuicProtocol(original_protocol):  # type: ignore[misc, valid-type]
        """hypercorn's QuicProtocol, remembering the listener's ticket store (if any)."""

        def __init__(self, app: Any, config: Any, *args: Any, **kwargs: Any) -> None:
            super().__init__(app, config, *args, **kwargs)
            store = getattr(config, "firstbyte_ticket_store", None)
            self.quic_config.firstbyte_ticket_store = store

    def connection_factory(*, configuration: Any, **kwargs: Any) -> QuicConnection:
        store: SessionTicketStore | None = getattr(configuration, "firstbyte_ticket_store", None)
        if store is not None:
            kwargs.setdefault("session_ticket_fetcher", store.pop)
            kwargs.setdefault("session_ticket_handler", store.add)
        return QuicConnection(configuration=configuration, **kwargs)

    hypercorn_quic.QuicProtocol = TicketingQuicProtocol
    hypercorn_quic.QuicConnection = connection_factory


def encode_initial_close(
    *, version: int, source_cid: bytes, destination_cid: bytes, error_code: int
) -> bytes:
    """A server Initial packet closing a connection before any state exists for it
    (CONNECTION_CLOSE with ``error_code``, e.g. CONNECTION_REFUSED or INVALID_TOKEN), so the
    client learns at once instead of waiting out its handshake timeout.

    ``source_cid`` is the Destination Connection ID the client chose (the Initial keys derive
    from it), ``destination_cid`` the client's Source Connection ID; aioquic's server builds
    its INVALID_TOKEN close the same way (RFC 9000 sections 8.1.3 and 10.2.3).
    """
    from aioquic.quic.connection import TRANSPORT_CLOSE_FRAME_CAPACITY
    from aioquic.quic.crypto import CryptoPair
    from aioquic.quic.packet import QuicFrameType, QuicPacketType
    from aioquic.quic.packet_builder import QuicPacketBuilder

    crypto = CryptoPair()
    crypto.setup_initial(cid=source_cid, is_client=False, version=version)
    builder = QuicPacketBuilder(
        host_cid=source_cid,
        is_client=False,
        max_datagram_size=1200,
        peer_cid=destination_cid,
        version=version,
    )
    builder.start_packet(QuicPacketType.INITIAL, crypto)
    buf = builder.start_frame(
        QuicFrameType.TRANSPORT_CLOSE, capacity=TRANSPORT_CLOSE_FRAME_CAPACITY
    )
    buf.push_uint_var(error_code)
    buf.push_uint_var(QuicFrameType.PADDING)  # the frame that caused it: none in particular
    buf.push_uint_var(0)  # no reason phrase
    datagrams, _ = builder.flush()
    return datagrams[0]
