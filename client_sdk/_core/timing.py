"""The timing model, sans-IO: a recorder fed ``(event, now)`` pairs that builds a :class:`Timings`.

The IO layers never do arithmetic on clocks; they only report what happened and when, using
one monotonic clock (seconds, e.g. ``time.perf_counter()``) that the caller passes in. Events:

- ``<phase>.started`` / ``<phase>.complete`` for the connection phases ``dns``,
  ``tcp_connect``, ``tls_handshake``, ``quic_handshake``, ``ws_upgrade`` and ``pool_wait``;
  a phase that happens twice (a retried connect) is summed; phases reported after the first
  byte (a reconnect during a resume) are not part of this request's setup and are ignored;
- ``request_sent``: the last byte of the request was handed to the connection;
- ``first_byte``: the first byte of the response arrived (response headers, first WS message);
- ``token``: one content chunk arrived (first token, every inter-token gap, last token);
- ``render``: the application's first-token callback returned;
- ``resume``: the stream was resumed on a new connection.

httpcore's trace event names are translated by :func:`httpcore_event`.
"""

from __future__ import annotations

import time

from firstbyte.client_sdk.timings import Timings

__all__ = ["PHASES", "TimingRecorder", "httpcore_event", "parse_server_timing"]

PHASES = ("dns", "tcp_connect", "tls_handshake", "quic_handshake", "ws_upgrade", "pool_wait")

# httpcore trace name -> our event. httpcore's connect_tcp includes DNS when given a name; the
# SDK hands it an IP address it resolved itself, so connect_tcp is TCP only.
_HTTPCORE: dict[str, tuple[str, ...]] = {
    "connection.connect_tcp.started": ("pool_wait.complete", "tcp_connect.started"),
    "connection.connect_tcp.complete": ("tcp_connect.complete",),
    "connection.start_tls.started": ("tls_handshake.started",),
    "connection.start_tls.complete": ("tls_handshake.complete",),
    "http11.send_request_headers.started": ("pool_wait.complete",),
    "http2.send_request_headers.started": ("pool_wait.complete",),
    "http11.send_request_body.complete": ("request_sent",),
    "http2.send_request_body.complete": ("request_sent",),
    "http11.receive_response_headers.complete": ("first_byte",),
    "http2.receive_response_headers.complete": ("first_byte",),
}


def httpcore_event(name: str) -> tuple[str, ...]:
    """Our events for one of httpcore's trace events (empty if we don't time it).

    The pool wait ends when httpcore starts connecting or starts sending on a reused
    connection, whichever comes first.
    """
    return _HTTPCORE.get(name, ())


def parse_server_timing(value: str) -> dict[str, float]:
    """Parse a ``Server-Timing`` header into ``{name: dur_ms}`` (entries without dur are 0)."""
    result: dict[str, float] = {}
    for entry in value.split(","):
        parts = [p.strip() for p in entry.split(";")]
        name = parts[0]
        if not name:
            continue
        dur = 0.0
        for param in parts[1:]:
            key, _, raw = param.partition("=")
            if key.strip().lower() == "dur":
                try:
                    dur = float(raw.strip().strip('"'))
                except ValueError:
                    dur = 0.0
        result[name] = dur
    return result


class TimingRecorder:
    """Accumulates one request's events; :meth:`timings` returns the record at any point.

    ``start`` is the request start on the same monotonic clock as every later ``now``;
    ``wall`` is the wall-clock time of the start (only copied to ``started_at``).
    """

    def __init__(self, start: float, *, transport: str = "sse", wall: float | None = None) -> None:
        self._start = start
        self._open: dict[str, float] = {}
        self._durations: dict[str, float] = {}
        self._last_token: float | None = None
        self._record = Timings(transport=transport,
                               started_at=time.time() if wall is None else wall)

    def _offset(self, now: float) -> float:
        return (now - self._start) * 1000.0

    @property
    def record(self) -> Timings:
        """The live record; the IO layer sets non-clock fields (protocol, region, ids) on it."""
        return self._record

    def feed(self, event: str, now: float) -> None:
        """Record one event that happened at ``now`` (seconds on the recorder's clock)."""
        rec = self._record
        if event == "token":  # first: it comes once per content chunk, the rest once a request
            offset = (now - self._start) * 1000.0
            if rec.first_token_ms is None:
                rec.first_token_ms = offset
            elif self._last_token is not None:
                rec.inter_token_ms.append((now - self._last_token) * 1000.0)
            self._last_token = now
            rec.last_token_ms = offset
            rec.output_chunks += 1
            return
        phase, _, edge = event.partition(".")
        if edge:
            if phase not in PHASES:
                raise ValueError(f"unknown phase {phase!r}")
            if rec.first_byte_ms is not None:
                return
            if edge == "started":
                self._open[phase] = now
            elif edge == "complete":
                began = self._open.pop(phase, None)
                if began is not None and not (phase == "pool_wait" and phase in self._durations):
                    self._durations[phase] = self._durations.get(phase, 0.0) + (now - began)
                    setattr(rec, f"{phase}_ms", self._durations[phase] * 1000.0)
            else:
                raise ValueError(f"unknown event {event!r}")
        elif event == "request_sent":
            if rec.first_byte_ms is None:
                rec.request_sent_ms = self._offset(now)
        elif event == "first_byte":
            if rec.first_byte_ms is None:
                rec.first_byte_ms = self._offset(now)
        elif event == "render":
            if rec.render_ms is None:
                rec.render_ms = self._offset(now)
        elif event == "resume":
            rec.resumes += 1
        else:
            raise ValueError(f"unknown event {event!r}")

    def feed_httpcore(self, name: str, now: float) -> None:
        """Record one httpcore trace event (ignored if it is not one we time)."""
        for event in httpcore_event(name):
            self.feed(event, now)

    def timings(self) -> Timings:
        """The record so far; ``warm`` is true when no connection was opened for it."""
        rec = self._record
        rec.warm = rec.tcp_connect_ms is None and rec.quic_handshake_ms is None
        return rec
