"""What one client may hold of a server, as sans-IO accounting the hosting layer feeds.

- :class:`ClientLimits`: the knobs (header and send timeouts, connections per address, descriptor
  reserve, HTTP/2 early resets), as :class:`~firstbyte.router.hosting.ServerOptions` carries them.
- :class:`ConnectionCounter`: admits or refuses a new connection, counted from its accept, by
  its client address and the descriptor its socket got; the per-address cap applies only
  under pressure, to the heaviest addresses.
- :func:`admit_quic`: the same for a QUIC connection, which has no descriptor of its own.
- :class:`HandshakeRate`: new QUIC handshakes per second, and when to ask for Retry.
- :class:`ResetFlood`: tells an HTTP/2 rapid-reset flood from a client that cancels now and then.
- :class:`HeaderBlockClock`: when an HTTP/2 header block left unfinished is due.
- :class:`Throttle`: at most one log line per reason per interval, so an attack cannot flood
  the log with the lines that report it.

Nothing here touches a socket or a clock; :mod:`firstbyte.router.hosting.hardening` does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

__all__ = [
    "ClientLimits",
    "ConnectionCounter",
    "HandshakeRate",
    "HeaderBlockClock",
    "ResetFlood",
    "Throttle",
    "admit_quic",
]


@dataclass(frozen=True, slots=True)
class ClientLimits:
    """Bounds on what client connections may hold (the router sets them from ``[limits]``;
    the defaults only time out, so a server without a config, the sim, caps nothing)."""

    header_timeout_s: float = 60.0
    """From a request's first byte to its complete head (HTTP/1.1), from an HTTP/2 stream's
    first HEADERS bytes to the end of its header block, and the TLS handshake from the
    connection's accept."""
    send_timeout_s: float = 60.0
    """A connection whose writes stay paused this long (its client stopped reading) is
    closed; an HTTP/2 stream that waits this long on a shut flow-control window, taking
    nothing, is reset (:mod:`.send_timeout`)."""
    max_connections_per_client: int | None = None
    """Under pressure (:meth:`ConnectionCounter.under_pressure`), a client address holding
    this many connections gets no more; None: no cap. Without pressure an address may hold
    any number (one app backend, or a carrier's NAT, is thousands of users)."""
    hard_max_connections_per_client: int | None = None
    """Opt-in: open connections from one client address, pressure or not; None: no cap."""
    reserved_fds: int = 0
    """Descriptors kept free: a connection whose socket would leave fewer is refused."""
    heads: HeadLimits | None = None
    """Bounds on a request head (:mod:`.heads`), on every protocol; None: the servers' own."""
    h2_max_early_resets: int | None = None
    """HTTP/2 streams one connection may reset before their response is done, at once (the
    budget of :class:`ResetFlood`); past it the connection gets GOAWAY; None: no bound."""
    h2_early_resets_per_s: float = 20.0
    """... and the rate at which that budget refills with time (nothing else refills it)."""
    quic_retry_above_handshakes_per_s: float | None = None
    """New QUIC handshakes per second above which each must first prove its address with a
    Retry (:class:`HandshakeRate`); None: never."""


class ConnectionCounter:
    """Open connections per client address, and the descriptor reserve.

    The counting API, the same for every server and protocol (TCP at its accept, QUIC at
    its first Initial): :meth:`open` a connection for its address (it says whether to refuse
    it), :meth:`close` it when it ends; :meth:`refusal` asks without counting.

    The descriptor test needs no scan of ``/proc``: Linux hands a new socket the lowest free
    descriptor number, so a socket numbered ``n`` proves descriptors ``0..n`` are all in use.
    Descriptors are under pressure from ``fd_limit - reserved_fds - margin`` on, the margin
    an eighth of what is left above the reserve (at least ``reserved_fds``); memory is under
    pressure while ``memory_pressed()`` says so (the router's ``limits.max_rss_bytes``).
    """

    def __init__(
        self,
        limits: ClientLimits,
        fd_limit: int,
        memory_pressed: Callable[[], bool] | None = None,
    ) -> None:
        self.limits = limits
        self.fd_limit = fd_limit
        self.memory_pressed = memory_pressed
        self._open: dict[str, int] = {}

    @property
    def pressure_fd(self) -> int:
        """The lowest descriptor number at which descriptors count as near their budget."""
        reserve = self.limits.reserved_fds
        budget = self.fd_limit - reserve
        return budget - max(reserve, budget // 8)

    @property
    def reserve_fd(self) -> int:
        """The lowest descriptor number refused to keep the reserve free (``fd_limit`` with
        no reserve)."""
        return self.fd_limit - self.limits.reserved_fds

    def under_pressure(self, fd: int | None) -> bool:
        """Whether descriptors (the new socket's number ``fd``) or memory are near their
        budget: then the per-address cap applies."""
        if fd is not None and fd >= self.pressure_fd:
            return True
        return self.memory_pressed is not None and self.memory_pressed()

    def refusal(self, client: str, fd: int | None = None) -> str | None:
        """The reason to refuse a new connection from ``client`` (socket descriptor ``fd``;
        None for one that has none of its own, a QUIC connection), or None to admit it."""
        reserve = self.limits.reserved_fds
        if reserve and fd is not None and fd >= self.reserve_fd:
            return (
                f"file descriptors short: descriptor {fd} of {self.fd_limit},"
                f" {reserve} kept free for streams in flight (limits.reserved_fds)"
            )
        count = self._open.get(client, 0)
        hard = self.limits.hard_max_connections_per_client
        if hard is not None and count >= hard:
            return (
                f"{count} connections open from this address"
                " (limits.hard_max_connections_per_client)"
            )
        cap = self.limits.max_connections_per_client
        if cap is not None and count >= cap and self.under_pressure(fd):
            # The heaviest addresses first: only those over the cap are refused, so lighter
            # clients keep connecting while the pressure lasts.
            why = "descriptors" if fd is not None and fd >= self.pressure_fd else "memory"
            return (
                f"{count} connections open from this address with {why} near their budget"
                " (limits.max_connections_per_client)"
            )
        return None

    def open(self, client: str, fd: int | None = None) -> str | None:
        """Count a new connection from ``client`` whose socket is descriptor ``fd``; returns
        the reason to refuse it (then it is not counted), or None (then :meth:`close` must
        follow when it ends)."""
        refusal = self.refusal(client, fd)
        if refusal is None:
            self._open[client] = self._open.get(client, 0) + 1
        return refusal

    def close(self, client: str) -> None:
        count = self._open.get(client, 0) - 1
        if count > 0:
            self._open[client] = count
        else:
            self._open.pop(client, None)

    def count(self, client: str) -> int:
        return self._open.get(client, 0)


def admit_quic(counter: ConnectionCounter, client: str, lowest_free_fd: int) -> str | None:
    """Count a new QUIC connection from ``client`` as a TCP one is counted (same cap, same
    counter, so TCP and QUIC together are bounded per address); the reason to refuse it, or
    None (then ``counter.close(client)`` must follow when it ends).

    A QUIC connection has no descriptor of its own (all share the UDP socket), but its
    requests need upstream sockets, so the descriptor reserve applies to it as to a TCP
    connection whose socket would be ``lowest_free_fd``, the one the next socket gets.
    """
    return counter.open(client, lowest_free_fd)


class HandshakeRate:
    """New QUIC handshakes per second, and whether the next one must prove its address.

    The rate is a sliding estimate over two one-second windows (the last one's count, weighted
    by how much of it the sliding second still covers, plus this one's), so it needs two
    numbers, not a timestamp per handshake, however hard it is flooded.
    """

    def __init__(self, retry_above_per_s: float) -> None:
        self.retry_above_per_s = retry_above_per_s
        self._window = 0
        self._count = 0
        self._previous = 0

    def observe(self, now: float) -> bool:
        """Count one new handshake at ``now`` (seconds); True if it must be answered with a
        Retry (the rate, this one included, is above the threshold)."""
        window = int(now)
        if window != self._window:
            self._previous = self._count if window == self._window + 1 else 0
            self._window, self._count = window, 0
        self._count += 1
        return self.rate(now) > self.retry_above_per_s

    def rate(self, now: float) -> float:
        """Handshakes in the second before ``now`` (estimated)."""
        window = int(now)
        if window == self._window:
            return self._previous * (1.0 - (now - window)) + self._count
        if window == self._window + 1:
            return self._count * (1.0 - (now - window))
        return 0.0


class ResetFlood:
    """One HTTP/2 connection's budget of streams reset early (before their response was done).

    Cancelling is normal (a user stops a generation, an SDK fails over, a page closes with
    every stream it had open), so a client may reset ``burst`` streams at once and
    ``per_s`` a second for as long as it likes; a connection that resets faster than that is
    the 2023 rapid-reset attack: each reset stream cost the server a request's work, the
    client nothing. Only time refills the budget: requests that complete do not, so cheap
    ones sent between the resets (a ``GET /v1/edge/warm`` each) cannot dilute it, as they
    did the former rule (more than half of all streams reset). Sans-IO: ``now`` is the
    caller's clock, in seconds.
    """

    def __init__(self, burst: int, per_s: float) -> None:
        self.burst = burst
        self.per_s = per_s
        self.opened = 0
        self.early_resets = 0
        self._tokens = float(burst)
        self._at: float | None = None

    def stream_opened(self) -> None:
        self.opened += 1

    def stream_reset_early(self, now: float) -> bool:
        """Count one early reset at ``now``; True if it is past the budget (close the
        connection)."""
        self.early_resets += 1
        if self._at is not None:
            self._tokens = min(float(self.burst), self._tokens + (now - self._at) * self.per_s)
        self._at = now
        if self._tokens < 1.0:
            return True
        self._tokens -= 1.0
        return False


class HeaderBlockClock:
    """When one HTTP/2 connection's unfinished header block is due (nginx applies
    ``client_header_timeout`` to an HTTP/2 request's header so).

    A header block is a HEADERS frame and the CONTINUATION frames up to its END_HEADERS;
    until it ends the connection can carry nothing else. Its deadline counts from the read
    that brought its stream's first HEADERS bytes: more CONTINUATION bytes, a byte now and
    then, do not move it. A block that ends clears it, the next block (another stream) gets
    its own. Sans-IO: the caller says, after each read, which stream's block is pending.
    """

    UNKNOWN = -1
    """A pending block whose stream is not known yet (fewer than 9 bytes of its frame)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.stream: int | None = None
        """The stream whose block the deadline is for (None: no block pending)."""
        self.due: float | None = None

    def read(self, pending: int | None, now: float) -> float | None:
        """After a read at ``now`` that left ``pending`` (the stream whose header block is
        unfinished, :attr:`UNKNOWN`, or None); the deadline (None: nothing pending)."""
        if pending is None:
            self.stream = self.due = None
        elif self.due is None or (
            pending != self.UNKNOWN and self.stream != self.UNKNOWN and pending != self.stream
        ):
            self.stream, self.due = pending, now + self.timeout_s
        elif pending != self.UNKNOWN:
            self.stream = pending
        return self.due


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

    def report(self, key: str, now: float, held_what: str = "") -> str | None:
        """:meth:`allow` for a log line: None to stay quiet; else what to end the line with,
        ``" (N more [held_what ]since the last report)"``, or nothing if none was held."""
        held = self.allow(key, now)
        if held is None:
            return None
        if held == 0:
            return ""
        return f" ({held} more {held_what + ' ' if held_what else ''}since the last report)"


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
