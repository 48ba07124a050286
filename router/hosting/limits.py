"""What one client may hold of a server, as sans-IO accounting the hosting layer feeds.

- :class:`ClientLimits`: the knobs (header timeout, connections per address, descriptor
  reserve, HTTP/2 early resets), as :class:`~firstbyte.router.hosting.ServerOptions` carries them.
- :class:`ConnectionCounter`: admits or refuses a new connection by its client address and
  the descriptor its socket got.
- :class:`ResetFlood`: tells an HTTP/2 rapid-reset flood from a client that cancels now and then.
- :class:`Throttle`: at most one log line per reason per interval, so an attack cannot flood
  the log with the lines that report it.

Nothing here touches a socket or a clock; :mod:`firstbyte.router.hosting.hardening` does.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ClientLimits", "ConnectionCounter", "ResetFlood", "Throttle"]


@dataclass(frozen=True, slots=True)
class ClientLimits:
    """Bounds on what client connections may hold (the router sets them from ``[limits]``;
    the defaults only time out, so a server without a config, the sim, caps nothing)."""

    header_timeout_s: float = 60.0
    """From a request's first byte to its complete head (HTTP/1.1), and the TLS handshake."""
    max_connections_per_client: int | None = None
    """Open connections from one client address; None: no cap."""
    reserved_fds: int = 0
    """Descriptors kept free: a connection whose socket would leave fewer is refused."""
    heads: HeadLimits | None = None
    """Bounds on a request head (:mod:`.heads`), on every protocol; None: the servers' own."""
    h2_max_early_resets: int | None = None
    """HTTP/2 streams a client may reset before their response is done (more than half of
    all it opened) before the connection gets GOAWAY; None: no bound."""


class ConnectionCounter:
    """Open connections per client address, and the descriptor reserve.

    The descriptor test needs no scan of ``/proc``: Linux hands a new socket the lowest free
    descriptor number, so a socket numbered ``n`` proves descriptors ``0..n`` are all in use.
    """

    def __init__(self, limits: ClientLimits, fd_limit: int) -> None:
        self.limits = limits
        self.fd_limit = fd_limit
        self._open: dict[str, int] = {}

    def open(self, client: str, fd: int) -> str | None:
        """Count a new connection from ``client`` whose socket is descriptor ``fd``; returns
        the reason to refuse it, or None (then :meth:`close` must follow when it ends)."""
        reserve = self.limits.reserved_fds
        if reserve and fd >= self.fd_limit - reserve:
            return (
                f"file descriptors short: descriptor {fd} of {self.fd_limit},"
                f" {reserve} kept free for streams in flight (limits.reserved_fds)"
            )
        cap = self.limits.max_connections_per_client
        count = self._open.get(client, 0)
        if cap is not None and count >= cap:
            return f"{count} connections open from this address (limits.max_connections_per_client)"
        self._open[client] = count + 1
        return None

    def close(self, client: str) -> None:
        count = self._open.get(client, 0) - 1
        if count > 0:
            self._open[client] = count
        else:
            self._open.pop(client, None)

    def count(self, client: str) -> int:
        return self._open.get(client, 0)


class ResetFlood:
    """One HTTP/2 connection's streams opened and reset early (before their response was done).

    Cancelling is normal (a user stops a generation, an SDK fails over), so one reset means
    nothing; a connection on which most streams die young, many times over, is the 2023
    rapid-reset attack: each reset stream cost the server a request's work, the client nothing.
    """

    def __init__(self, max_early_resets: int) -> None:
        self.max_early_resets = max_early_resets
        self.opened = 0
        self.early_resets = 0

    def stream_opened(self) -> None:
        self.opened += 1

    def stream_reset_early(self) -> bool:
        """Count one early reset; True if the connection is now a flood (close it)."""
        self.early_resets += 1
        return self.early_resets >= self.max_early_resets and 2 * self.early_resets > self.opened


class Throttle:
    """Allows one event per key per ``interval_s`` and counts the ones it held back."""

    def __init__(self, interval_s: float = 10.0) -> None:
        self.interval_s = interval_s
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def allow(self, key: str, now: float) -> int | None:
        """None to stay quiet; else how many events of ``key`` were held back since the last
        one allowed (log this one and say so)."""
        last = self._last.get(key)
        if last is not None and now - last < self.interval_s:
            self._held[key] = self._held.get(key, 0) + 1
            return None
        self._last[key] = now
        return self._held.pop(key, 0)


@dataclass(frozen=True, slots=True)
class HeadLimits:
    """Bounds on a request head (:mod:`.heads` enforces them; the router sets them from
    ``[limits]``, see ``docs/limits.md``)."""

    max_request_line_bytes: int = 8192
    """The request line (method, target, version; without its line end); HTTP/2 and HTTP/3:
    the ``:path``."""
    max_header_line_bytes: int = 8192
    """One header field: its line without the line end, or name + ``": "`` + value."""
    max_header_bytes: int = 32768
    """All header fields together, counted as lines (without the request line)."""
    max_headers: int = 100
    """Header fields in one head."""
