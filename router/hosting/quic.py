"""HTTP/3 0-RTT for hypercorn: give its QUIC listener a session-ticket store.

hypercorn (0.17/0.18) builds each aioquic ``QuicConnection`` without
``session_ticket_fetcher``/``session_ticket_handler``, so clients get no resumption tickets
and cannot send 0-RTT data. :func:`enable_session_tickets` swaps the ``QuicConnection``
name hypercorn's QUIC protocol module uses for a factory that adds a :class:`TicketStore`
when the hypercorn ``Config`` carries one (``config.firstbyte_ticket_store``), and passes
everything else through unchanged. It is idempotent and affects only listeners whose config
has a store.

0-RTT requests are replayable by an on-path attacker; chat completion requests are not
idempotent in cost, so deployments that care should keep tickets short-lived
(``TicketStore(max_tickets=..., lifetime_s=...)``) — the exposure is one extra completion.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any, Protocol

from aioquic.quic.connection import QuicConnection
from aioquic.tls import SessionTicket

__all__ = ["SessionTicketStore", "TicketStore", "enable_session_tickets"]


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


_PATCHED_ATTR = "_firstbyte_ticket_factory"


def enable_session_tickets() -> None:
    """Patch hypercorn's QUIC protocol module once (see the module docstring)."""
    from hypercorn.protocol import quic

    hypercorn_quic: Any = quic  # patched below: hypercorn's own annotations do not apply
    if getattr(hypercorn_quic, _PATCHED_ATTR, False):
        return
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
    setattr(hypercorn_quic, _PATCHED_ATTR, True)
