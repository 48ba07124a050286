"""Where QUIC session tickets are kept between connections, and between runs of the program.

A server's session ticket lets the next connection resume the TLS session and send its request
as 0-RTT early data: one round trip to the first byte instead of two. Tickets kept in memory
(:class:`MemoryTicketStore`, the default) die with the process, so a CLI, a serverless function
or a relaunched desktop app pays a full handshake on its first request. :class:`FileTicketStore`
keeps them in a file; an application with its own storage (a keychain, a database) implements
:class:`TicketStore`: two methods over opaque bytes.

Each ticket is used once: :meth:`TicketStore.take` removes it, and the server sends a fresh one
on every connection (RFC 8446 C.4: a reused ticket would link the connections, and the router
refuses a ticket it has already seen anyway).

Security (docs/sdk.md, "0-RTT across restarts"): a ticket file holds a resumption secret, so it
is written with mode 0600; anyone who can read it can resume sessions as this client (not
impersonate the server). Early data has no replay protection of its own: an attacker on the path
who captured it can send it to the server again. The router accepts each ticket once, which
bounds a replay to that one attempt, but a chat completion costs tokens when it runs, so keep
tickets short-lived, or leave the store in memory, where replays matter.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from pathlib import Path
from typing import Protocol, runtime_checkable

import msgspec

from firstbyte.client_sdk.errors import ConfigurationError

__all__ = ["FileTicketStore", "MemoryTicketStore", "TicketStore", "ticket_store"]

MAX_TICKET_BYTES = 16 << 10
"""A larger "ticket" is not stored (real ones are a few hundred bytes)."""


@runtime_checkable
class TicketStore(Protocol):
    """Session tickets by server (``host:port``), as opaque bytes with an expiry time."""

    def take(self, server: str) -> bytes | None:
        """Remove and return the ticket for ``server`` (None if none or it has expired)."""
        ...

    def put(self, server: str, ticket: bytes, expires_at: float) -> None:
        """Keep ``ticket`` for ``server`` until ``expires_at`` (seconds since the epoch),
        replacing any other. Must not raise: a ticket that cannot be kept costs a handshake."""
        ...


class _Entry(msgspec.Struct):
    ticket: bytes
    expires_at: float


def _fresh(entries: dict[str, _Entry], max_entries: int) -> dict[str, _Entry]:
    """Unexpired entries, at most ``max_entries``, those expiring last kept."""
    now = time.time()
    alive = sorted(((k, e) for k, e in entries.items() if e.expires_at > now),
                   key=lambda item: item[1].expires_at)
    return dict(alive[-max_entries:]) if max_entries > 0 else {}


class MemoryTicketStore:
    """Tickets in this process only (the default): lost when it exits."""

    def __init__(self, *, max_entries: int = 64) -> None:
        self.max_entries = max_entries
        self._entries: dict[str, _Entry] = {}

    def take(self, server: str) -> bytes | None:
        entry = _fresh(self._entries, self.max_entries).get(server)
        self._entries.pop(server, None)
        return None if entry is None else entry.ticket

    def put(self, server: str, ticket: bytes, expires_at: float) -> None:
        if len(ticket) <= MAX_TICKET_BYTES:
            self._entries[server] = _Entry(ticket, expires_at)
            self._entries = _fresh(self._entries, self.max_entries)

    def __contains__(self, server: object) -> bool:
        return server in _fresh(self._entries, self.max_entries)


class _File(msgspec.Struct):
    version: int = 1
    tickets: dict[str, _Entry] = {}


class FileTicketStore:
    """Tickets in one JSON file, so 0-RTT survives a restart of the program.

    Every change rewrites the file atomically (a temporary file in the same folder, mode 0600,
    renamed over it), so concurrent processes never read a torn file (the last writer wins).
    Expired tickets are dropped and at most ``max_entries`` kept. A missing, unreadable or
    corrupt file reads as empty: the store is a cache, it never fails a request.
    """

    def __init__(self, path: str | os.PathLike[str], *, max_entries: int = 64) -> None:
        self.path = Path(path)
        self.max_entries = max_entries
        if self.path.is_dir():
            raise ConfigurationError("ticket_store", f"{self.path}: is a directory, not a file")
        if not self.path.parent.is_dir():
            raise ConfigurationError("ticket_store", f"{self.path.parent}: no such directory")

    def _read(self) -> dict[str, _Entry]:
        limit = self.max_entries * MAX_TICKET_BYTES * 2 + 4096  # base64 and JSON overhead
        try:
            with self.path.open("rb") as f:
                data = f.read(limit + 1)
        except OSError:
            return {}
        if len(data) > limit:
            return {}
        try:
            return _fresh(msgspec.json.decode(data, type=_File).tickets, self.max_entries)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return {}

    def _write(self, entries: dict[str, _Entry]) -> None:
        data = msgspec.json.encode(_File(tickets=entries))
        try:
            fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", dir=self.path.parent)
        except OSError:
            return
        try:
            with os.fdopen(fd, "wb") as f:  # mkstemp creates it with mode 0600
                f.write(data)
            os.replace(tmp, self.path)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp)

    def take(self, server: str) -> bytes | None:
        entries = self._read()
        entry = entries.pop(server, None)
        if entry is not None:
            self._write(entries)
        return None if entry is None else entry.ticket

    def put(self, server: str, ticket: bytes, expires_at: float) -> None:
        if len(ticket) > MAX_TICKET_BYTES:
            return
        entries = self._read()
        entries[server] = _Entry(ticket, expires_at)
        self._write(_fresh(entries, self.max_entries))

    def __contains__(self, server: object) -> bool:
        return server in self._read()


def ticket_store(value: TicketStore | str | os.PathLike[str] | None) -> TicketStore:
    """The store for the client's ``ticket_store`` option: None is memory, a path a file."""
    if value is None:
        return MemoryTicketStore()
    if isinstance(value, str | os.PathLike):
        return FileTicketStore(value)
    if isinstance(value, TicketStore):
        return value
    raise TypeError("ticket_store must be None, a file path or a TicketStore, not "
                    f"{type(value).__name__}")
