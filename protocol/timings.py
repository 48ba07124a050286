"""The ``POST /v1/edge/timings`` document: what a client felt, reported after its streams ended.

A client that opts in (the Python SDK's ``report_timings=True``, the browser client) sends
the router it used a :class:`TimingsReport`: a batch of :class:`TimingsRecord`, one per
finished stream, each holding only that request's network phases and offsets in
milliseconds, how it was sent (transport, HTTP version, cold/warm/0-RTT), the region that
served and the stream id. Never the prompt, the output or any text: the decoders forbid
unknown fields, so a record carrying anything else is refused, not ignored.

The field meanings are those of the SDK's ``Timings`` (docs/sdk.md, "Timings"): *durations*
of the connection phases (``dns_ms`` ... ``pool_wait_ms``, ``None`` when the phase did not
happen) and *offsets* from the request start (``request_sent_ms`` ... ``render_ms``).
:func:`implausible` is the rule both sides apply: the SDK does not send a record it says is
implausible, the router refuses a report holding one (400, ``invalid_timings``).
"""

from __future__ import annotations

import itertools
import math

import msgspec

__all__ = [
    "HTTP_VERSIONS",
    "MAX_MS",
    "ORDER_SLACK_MS",
    "TRANSPORTS",
    "TimingsRecord",
    "TimingsReport",
    "connection_kind",
    "decode_report",
    "implausible",
]

TRANSPORTS = ("sse", "websocket", "longpoll")
"""``transport`` values: fetch-streamed or httpx SSE, WebSocket ``/v1/ws``, long-poll."""

HTTP_VERSIONS = ("HTTP/1.1", "HTTP/2", "HTTP/3")
"""``http_version`` values (a browser maps ``nextHopProtocol`` ``http/1.1``/``h2``/``h3``)."""

MAX_MS = 600_000.0
"""No phase or offset of a plausible record is longer than ten minutes."""

ORDER_SLACK_MS = 1.0
"""How far two figures may be out of order before the record is implausible: a browser's
Resource Timing values are coarsened, so a difference of rounding is not a lie."""


class TimingsRecord(msgspec.Struct, kw_only=True, forbid_unknown_fields=True,
                    omit_defaults=True):
    """One finished stream as its client felt it (all times in milliseconds)."""

    transport: str
    """One of :data:`TRANSPORTS`."""
    http_version: str
    """One of :data:`HTTP_VERSIONS`."""
    region: str
    """The region that served (the ``x-firstbyte-region`` response header)."""
    warm: bool = False
    """The request reused an open connection (no connect or handshake phase)."""
    zero_rtt: bool = False
    """A new HTTP/3 connection sent the request as 0-RTT early data."""
    prewarmed: bool = False
    """The connection was opened ahead of the request by a prewarm on the user's intent
    (the browser client's ``warmOnIntent``: focus of the prompt box, a keystroke; either
    SDK's ``prewarm()``), and this is the first stream after it."""
    stream_id: str | None = None
    """The ``x-firstbyte-stream`` id: the router joins the record with its own timings."""
    dns_ms: float | None = None
    tcp_connect_ms: float | None = None
    tls_handshake_ms: float | None = None
    quic_handshake_ms: float | None = None
    ws_upgrade_ms: float | None = None
    pool_wait_ms: float | None = None
    request_sent_ms: float | None = None
    first_byte_ms: float | None = None
    first_token_ms: float
    """Request start to the first content chunk: the TTFT the user felt. Required."""
    last_token_ms: float | None = None
    render_ms: float | None = None
    """The first token handed to the application (the browser: painted)."""
    resumes: int = 0


class TimingsReport(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The body of ``POST /v1/edge/timings``: ``{"records": [...]}``."""

    records: list[TimingsRecord]


_decoder = msgspec.json.Decoder(TimingsReport)


def decode_report(body: bytes) -> TimingsReport:
    """The report in ``body``; ``msgspec.DecodeError`` (``ValidationError`` included) if it is
    not one (not JSON, a wrong type, a missing ``first_token_ms``, an unknown field)."""
    return _decoder.decode(body)


_SETUP = ("dns_ms", "tcp_connect_ms", "tls_handshake_ms", "quic_handshake_ms", "ws_upgrade_ms",
          "pool_wait_ms")
_OFFSETS = ("request_sent_ms", "first_byte_ms", "first_token_ms", "last_token_ms")


def implausible(record: TimingsRecord) -> str | None:
    """Why no real client could have felt ``record`` (the reason is a metric label), or None.

    - ``unknown_transport`` / ``unknown_http_version``: not one of the known values;
    - ``out_of_range``: a figure below 0, above :data:`MAX_MS` or not a number; ``resumes``
      below 0;
    - ``unordered``: the figures contradict each other. Setup phases are serial and end
      before the request is sent (their sum is at most ``request_sent_ms``), and
      ``request_sent_ms <= first_byte_ms <= first_token_ms <= last_token_ms``, and
      ``first_token_ms <= render_ms`` (each within :data:`ORDER_SLACK_MS`; absent figures
      are skipped).
    """
    if record.transport not in TRANSPORTS:
        return "unknown_transport"
    if record.http_version not in HTTP_VERSIONS:
        return "unknown_http_version"
    setup = [v for v in (getattr(record, name) for name in _SETUP) if v is not None]
    offsets = [v for v in (getattr(record, name) for name in _OFFSETS) if v is not None]
    figures = [*setup, *offsets] + ([record.render_ms] if record.render_ms is not None else [])
    if record.resumes < 0 or any(not (0.0 <= v <= MAX_MS) for v in figures):
        return "out_of_range"  # NaN fails the comparison too
    if record.request_sent_ms is not None and math.fsum(setup) > (
        record.request_sent_ms + ORDER_SLACK_MS
    ):
        return "unordered"
    if any(later < earlier - ORDER_SLACK_MS for earlier, later in itertools.pairwise(offsets)):
        return "unordered"
    render = record.render_ms
    if render is not None and render < record.first_token_ms - ORDER_SLACK_MS:
        return "unordered"
    return None


def connection_kind(record: TimingsRecord) -> str:
    """``0rtt``, ``prewarmed``, ``warm`` or ``cold``: how the request's connection was had
    (``prewarmed``: warm because a prewarm on intent opened it, not an earlier request)."""
    if record.zero_rtt:
        return "0rtt"
    if record.prewarmed and record.warm:
        return "prewarmed"
    return "warm" if record.warm else "cold"
