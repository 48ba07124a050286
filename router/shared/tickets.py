"""QUIC session tickets shared by the region's processes: 0-RTT wherever a client lands.

A client resumes (and sends 0-RTT data) with a ticket the server issued on an earlier
connection; with several processes behind one address the next connection may reach another
process, which must find that ticket. :class:`RedisTicketStore` keeps each ticket under
``{prefix}t:{label}`` with the ticket's own lifetime and takes it with ``GETDEL``: a ticket is
accepted once, by one process, whichever it is (the anti-replay guard of 0-RTT holds across
processes, not just within one).

aioquic calls the store synchronously inside the TLS handshake, so this store uses redis-py's
blocking client with a short timeout: one loopback round trip (~0.1 ms) per handshake, next to
~30 ms of handshake CPU. If Redis does not answer, the handshake goes on without resumption (a
full handshake, no 0-RTT) rather than failing, and the store is not asked again for
:data:`PAUSE_S`: a frozen Redis would otherwise stall the event loop (every stream of the
process) for the timeout on every handshake.
"""

from __future__ import annotations

import datetime
import logging
import time
from typing import TYPE_CHECKING, Any

import msgspec
from aioquic.tls import CipherSuite, SessionTicket

from ..hosting.limits import Throttle
from .keys import Keys
from .target import RedisTarget

if TYPE_CHECKING:
    import redis

__all__ = ["PAUSE_S", "RedisTicketStore", "decode_ticket", "encode_ticket"]

log = logging.getLogger("firstbyte.router.shared")

PAUSE_S = 1.0
"""After a failed command the store answers "no ticket" without asking Redis for this long."""


class _StoredTicket(msgspec.Struct, array_like=True):
    """A :class:`SessionTicket` as stored (msgpack): every field, times as Unix seconds."""

    age_add: int
    cipher_suite: int
    not_valid_after: float
    not_valid_before: float
    resumption_secret: bytes
    server_name: str | None  # None in the tickets a server issues
    ticket: bytes
    max_early_data_size: int | None
    other_extensions: list[tuple[int, bytes]]


def encode_ticket(ticket: SessionTicket) -> bytes:
    return msgspec.msgpack.encode(
        _StoredTicket(
            ticket.age_add,
            int(ticket.cipher_suite),
            ticket.not_valid_after.timestamp(),
            ticket.not_valid_before.timestamp(),
            ticket.resumption_secret,
            ticket.server_name,
            ticket.ticket,
            ticket.max_early_data_size,
            list(ticket.other_extensions),
        )
    )


def decode_ticket(data: bytes) -> SessionTicket:
    stored = msgspec.msgpack.decode(data, type=_StoredTicket)
    utc = datetime.UTC
    return SessionTicket(
        age_add=stored.age_add,
        cipher_suite=CipherSuite(stored.cipher_suite),
        not_valid_after=datetime.datetime.fromtimestamp(stored.not_valid_after, utc),
        not_valid_before=datetime.datetime.fromtimestamp(stored.not_valid_before, utc),
        resumption_secret=stored.resumption_secret,
        server_name=stored.server_name,  # type: ignore[arg-type]
        ticket=stored.ticket,
        max_early_data_size=stored.max_early_data_size,
        other_extensions=list(stored.other_extensions),
    )


class RedisTicketStore:
    """The :class:`~firstbyte.router.hosting.quic.SessionTicketStore` of a region's processes
    (see the module docstring)."""

    def __init__(
        self, target: RedisTarget | str, keys: Keys, *, lifetime_s: float = 86_400.0,
        timeout_s: float = 0.25,
    ) -> None:
        import redis

        if isinstance(target, str):
            target = RedisTarget(target)
        self._redis: redis.Redis = redis.Redis.from_url(
            target.url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
            **target.options(),
        )
        self._keys = keys
        self.lifetime_s = lifetime_s
        self.issued = 0
        self.resumed = 0
        self.failures = 0
        self.skipped = 0
        """Commands not sent because Redis failed within the last :data:`PAUSE_S`."""
        self._paused_until = 0.0
        self._throttle = Throttle(10.0)

    def _paused(self) -> bool:
        if time.monotonic() < self._paused_until:
            self.skipped += 1
            return True
        return False

    def add(self, ticket: SessionTicket) -> None:
        remaining_s = ticket.not_valid_after.timestamp() - time.time()
        ttl_ms = int(min(self.lifetime_s, remaining_s) * 1000)
        if ttl_ms <= 0 or self._paused():
            return
        try:
            self._redis.set(self._keys.ticket(ticket.ticket), encode_ticket(ticket), px=ttl_ms)
            self.issued += 1
        except Exception as exc:  # the client then simply cannot resume with it
            self._failed("store", exc)

    def pop(self, label: bytes) -> SessionTicket | None:
        if self._paused():
            return None
        try:
            data: Any = self._redis.getdel(self._keys.ticket(label))
        except Exception as exc:
            self._failed("take", exc)
            return None
        if data is None:
            return None
        try:
            ticket = decode_ticket(data)
        except (msgspec.DecodeError, ValueError) as exc:
            self._failed("decode", exc)
            return None
        self.resumed += 1
        return ticket

    def _failed(self, what: str, exc: Exception) -> None:
        self.failures += 1
        if what != "decode":
            self._paused_until = time.monotonic() + PAUSE_S
        more = self._throttle.report(what, time.monotonic())
        if more is not None:
            log.warning("cannot %s a QUIC session ticket in Redis: %s%s", what, exc, more)

    def close(self) -> None:
        self._redis.close()
